// Top-k selection: a sampled threshold, one pass over the data, and an exact fix-up.
//
// 1. Sample: estimate from a fixed pseudo-random sample of keys a threshold t that a little more
//    than k elements reach (over-selecting on purpose).
// 2. Scan (the only full pass): collect every element whose key is >= t, its bits and index. In
//    the error-feedback variant the same pass computes acc = grad + residual and stores it, each
//    candidate replaced by what rounding it to the wire type would lose (zero when the wire type
//    is the element type); the candidates not selected in step 4 are written back.
// 3. If fewer than k were collected, the estimate was too high: lower t and scan again (rare;
//    this is what makes the result exact, not probabilistic). t stays at least 1: where fewer
//    than k elements are non-zero, the zeros of lowest index complete the selection.
// 4. Among the candidates, which contain every element of the true top-k whenever there are at
//    least k of them, find the k-th by (key descending, index ascending) and keep every candidate
//    that ranks up to it, in index order, its value taken from the candidate's bits.
// Memory traffic: one read of the input (plus one read and one write of the residual), against
// torch.topk's heap or sort over the whole tensor; then the candidates, not the input. The radix
// passes after the first count only the candidates still in the running. So the cost grows little
// with k: a 6.25% warm-up step's selection against a 1% one.
#include "kernels/cpu/topk.h"
#include "kernels/cpu/multiversion.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels/dispatch.h"
#include "kernels/topk_math.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RC_TOPK_X86 1
#endif

#define RC_TOPK_INLINE inline __attribute__((always_inline))

namespace ringcomm {
namespace cpu {
namespace {

using topk::Key;
using topk::magnitude_key;

constexpr size_t kSampleSize = 1 << 16;
// Small inputs, or k a large fraction of n: select directly over every element.
constexpr size_t kDirectBelow = 1 << 17;

// An element's bit pattern, widened to 32 bits, and back: the key is these bits with the sign
// cleared (magnitude_key), and the value is rebuilt from them.
RC_TOPK_INLINE uint32_t raw_bits(float x) { return math::float_bits(x); }
RC_TOPK_INLINE uint32_t raw_bits(math::Half x) { return x.bits; }
RC_TOPK_INLINE uint32_t raw_bits(math::BFloat16 x) { return x.bits; }

template <typename T>
RC_TOPK_INLINE T from_bits(uint32_t bits) {
  if constexpr (std::is_same_v<T, float>)
    return math::bits_float(bits);
  else
    return T{uint16_t(bits)};
}

template <typename T>
constexpr Key key_mask() {
  return (Key(1) << topk::key_bits<T>()) - 1;
}

// An element of type T as a value of the wire type W (nearest even).
template <typename W, typename T>
RC_TOPK_INLINE W to_wire(T x) {
  if constexpr (std::is_same_v<W, T>)
    return x;
  else
    return math::Compute<W>::store(math::Compute<T>::load(x));
}

// What sending acc as a W loses, in T: acc - T(W(acc)), computed in float and rounded to T, as
// torch computes `values - values.to(W).to(T)`; +0 when W is T. This is what error feedback owes
// at a selected position, where the residual would otherwise be zeroed.
template <typename T, typename W>
RC_TOPK_INLINE T owed_by_rounding(T acc) {
  if constexpr (std::is_same_v<W, T>) {
    return T{};
  } else {
    using C = math::Compute<T>;
    const T sent = C::store(math::Compute<W>::load(to_wire<W>(acc)));
    return C::store(C::load(acc) - C::load(sent));
  }
}

// Elements at or above a threshold, in ascending index order: each one's bits and index, in two
// arrays so that the AVX2 scan stores eight of each at once. Uninitialised storage: a vector's
// zero fill would write a warm-up step's megabytes for nothing.
class Candidates {
 public:
  size_t size() const { return size_; }
  uint32_t bits(size_t j) const { return bits_[j]; }
  uint32_t index(size_t j) const { return index_[j]; }
  void set(size_t j, uint32_t bits, uint32_t index) {
    bits_[j] = bits;
    index_[j] = index;
  }
  void clear() { size_ = 0; }
  size_t capacity() const { return capacity_; }
  void release() { *this = Candidates(); }
  void reserve(size_t capacity) {
    if (capacity <= capacity_) return;
    std::unique_ptr<uint32_t[]> bits(new uint32_t[capacity]), index(new uint32_t[capacity]);
    std::copy(bits_.get(), bits_.get() + size_, bits.get());
    std::copy(index_.get(), index_.get() + size_, index.get());
    bits_.swap(bits);
    index_.swap(index);
    capacity_ = capacity;
  }
  void push(uint32_t bits, uint32_t index) {
    if (size_ == capacity_) reserve(2 * capacity_ + 64);
    bits_[size_] = bits;
    index_[size_++] = index;
  }
  // Writing past the end directly: entries [size(), size() + room()) may be written through
  // end_bits() and end_index(), and grow_to(the bits' new end) counts them in.
  size_t room() const { return capacity_ - size_; }
  uint32_t* end_bits() { return bits_.get() + size_; }
  uint32_t* end_index() { return index_.get() + size_; }
  void grow_to(const uint32_t* bits_end) { size_ = size_t(bits_end - bits_.get()); }

 private:
  std::unique_ptr<uint32_t[]> bits_, index_;
  size_t size_ = 0, capacity_ = 0;
};

// What a selection needs besides its output, kept per thread from call to call. Allocated per
// call, these hundreds of kilobytes moved glibc's heap around the gradient torch allocates and
// frees every step, which then came back as fresh pages every few steps, each page a fault on
// the training step's time. Candidate storage above kKeptCandidates is freed after the call,
// though: a direct selection (k >= n/4) over a large input would otherwise hold 8 bytes per
// element for the thread's life.
constexpr size_t kKeptCandidates = size_t(8) << 20;  // 64 MiB

struct Scratch {
  std::vector<Key> sample, running;
  std::vector<uint32_t> count;
  Candidates cands;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// The radix passes of kernels/topk_math.h (the CUDA kernel's own steps) over n keys, k <= n: the
// first pass counts key_at(j) for every j, the later ones only the keys still in the running,
// copied out as each pass ends. Afterwards state.prefix is the k-th largest key, and
// state.remaining how many keys equal to it rank up to the k-th. Counting and copying are
// branch-free; a comparison sort's branches on keys would be coin tosses.
template <int kKeyBits, typename KeyAt>
topk::RadixState radix_select(size_t n, size_t k, KeyAt key_at) {
  topk::RadixState state = topk::radix_start(uint32_t(k));
  if (k == 0) return state;
  std::vector<uint32_t>& count = scratch().count;
  count.resize(topk::kRadixBins);
  std::vector<Key>& running = scratch().running;
  size_t in_running = 0;
  for (int pass = 0; pass < topk::radix_passes(kKeyBits); ++pass) {
    const topk::RadixPass p = topk::radix_pass(kKeyBits, pass);
    std::fill(count.begin(), count.end(), 0u);
    if (pass == 0) {
      for (size_t j = 0; j < n; ++j) ++count[topk::radix_digit(key_at(j), p)];
    } else {
      for (size_t j = 0; j < in_running; ++j) ++count[topk::radix_digit(running[j], p)];
    }
    uint32_t above = 0;
    for (unsigned digit = 1u << p.bits; digit-- > 0; above += count[digit]) {
      if (topk::radix_is_pick(above, count[digit], state.remaining)) {
        topk::radix_advance(state, p, digit, above);
        break;
      }
    }
    if (pass + 1 == topk::radix_passes(kKeyBits)) break;
    size_t kept = 0;
    if (pass == 0) {
      running.resize(count[topk::radix_digit(state.prefix, p)] + 1);  // + 1: the last store
      for (size_t j = 0; j < n; ++j) {
        running[kept] = key_at(j);
        kept += topk::radix_matches(running[kept], state);
      }
    } else {
      for (size_t j = 0; j < in_running; ++j) {
        running[kept] = running[j];
        kept += topk::radix_matches(running[kept], state);
      }
    }
    in_running = kept;
  }
  return state;
}

// Threshold key that about `want` of n elements of acc = data (+ add) reach, estimated from a
// sample of keys: short contiguous runs at pseudo-random offsets, which costs a few cache misses
// per run instead of one per sampled element. The runs' memory is fetched a few runs ahead, so
// that their misses overlap rather than follow one another. The sample's key of the wanted rank
// comes from radix_select: std::nth_element's partitioning branched on every key, about half of
// them mispredicted, which made it most of the estimate.
template <typename T>
Key estimate_threshold(const T* data, const T* add, size_t n, size_t want) {
  constexpr size_t kRun = 64, kRuns = kSampleSize / kRun, kAhead = 8;
  size_t starts[kRuns];
  uint64_t state = 0x9e3779b97f4a7c15ull ^ n;  // fixed seed: deterministic
  for (size_t& start : starts) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    start = size_t((state >> 33) % (n - kRun));
  }
  auto fetch = [&](const T* p) {
    const char* bytes = reinterpret_cast<const char*>(p);
    // every cache line the run touches, its last one included
    for (size_t offset = 0; offset < kRun * sizeof(T) + 64; offset += 64)
      __builtin_prefetch(bytes + offset);
  };
  std::vector<Key>& sample = scratch().sample;
  sample.resize(kSampleSize);
  for (size_t r = 0; r < kRuns; ++r) {
    if (r + kAhead < kRuns) {
      fetch(data + starts[r + kAhead]);
      if (add) fetch(add + starts[r + kAhead]);
    }
    Key* out = sample.data() + r * kRun;
    const size_t start = starts[r];
    for (size_t i = 0; i < kRun; ++i) {
      const size_t at = start + i;
      out[i] = magnitude_key(add ? topk::accumulate(data[at], add[at]) : data[at]);
    }
  }
  double expected = double(want) * kSampleSize / double(n);
  // Aim 20% plus four standard deviations above the expected count, so one scan nearly always
  // suffices.
  size_t rank =
      size_t(std::min<double>(kSampleSize - 1, expected * 1.2 + 4 * std::sqrt(expected) + 8));
  return radix_select<topk::key_bits<T>()>(kSampleSize, rank + 1,
                                           [&](size_t j) { return sample[j]; })
      .prefix;
}

// The scans (step 2) read an input `in` with, for error feedback, the residual `add` added to
// it: acc = in + add, one IEEE add as topk::accumulate. They append every element whose acc has
// key >= t to `out` and, where `keep` is given, store acc into it with each candidate replaced by
// owed_by_rounding<T, W>: a candidate's value lives on in the candidate list, and the few that
// are not selected are written back afterwards (select's `restore`), which touches far fewer
// cache lines than visiting the selected ones would (at 6.25% density nearly every line of the
// residual holds one).

// The portable scan. Blocks of 16 are tested with a branch-free (vectorisable) "any" first when
// nothing is stored: almost all blocks hold no candidate.
template <typename T, typename W>
RC_TOPK_INLINE void collect_at_least(const T* in, const T* add, T* keep, size_t begin, size_t n,
                                     Key t, Candidates& out) {
  auto acc_at = [&](size_t i) { return add ? topk::accumulate(in[i], add[i]) : in[i]; };
  auto take = [&](size_t i) {
    const T acc = acc_at(i);
    const bool hit = magnitude_key(acc) >= t;
    if (hit) out.push(raw_bits(acc), uint32_t(i));
    if (keep) keep[i] = hit ? owed_by_rounding<T, W>(acc) : acc;
  };
  size_t i = begin;
  if (!keep) {
    constexpr size_t kBlock = 16;
    for (; i + kBlock <= n; i += kBlock) {
      bool any = false;
      for (size_t j = 0; j < kBlock; ++j) any |= magnitude_key(acc_at(i + j)) >= t;
      if (!any) continue;
      for (size_t j = i; j < i + kBlock; ++j) take(j);
    }
  }
  for (; i < n; ++i) take(i);
}

#ifdef RC_TOPK_X86
// kLanes[m]: the lanes set in the 8-bit mask m, lowest first, one per byte (the rest 0): the
// permutation that packs a vector's selected lanes to its front.
struct LaneTable {
  uint64_t lanes[256];
  constexpr LaneTable() : lanes() {
    for (unsigned m = 0; m < 256; ++m)
      for (unsigned lane = 0, out = 0; lane < 8; ++lane)
        if (m & (1u << lane)) lanes[m] |= uint64_t(lane) << (8 * out++);
  }
};
constexpr LaneTable kLanes;

// owed_by_rounding<float, W> of eight lanes: x - W(x), exact in float. bfloat16 rounds to
// nearest even on the bits, as math::float_to_bf16 does (a NaN x stays NaN: x - anything is);
// float16 through F16C's conversions.
template <typename W>
__attribute__((target("avx2,f16c"))) inline __m256 owed_float32_avx2(__m256 x) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_setzero_ps();
  } else if constexpr (std::is_same_v<W, math::BFloat16>) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
                         _mm256_set1_epi32(int32_t(0xffff0000u)));
    return _mm256_sub_ps(x, _mm256_castsi256_ps(rounded));
  } else {
    static_assert(std::is_same_v<W, math::Half>);
    return _mm256_sub_ps(
        x, _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  }
}

// The scan over float32 with AVX2, 8 elements a step. Keys (sign cleared) are below 2^31, so a
// signed compare with t - 1 is key >= t. A step packs its selected lanes to the front (kLanes)
// and stores all eight, bits and indices, the end advancing by how many were selected: no
// branch per hit. Where hits are rare (not kFrequentHits), a step with none skips that after
// the add, an and, a compare, a movemask and the store; where they are frequent, every step
// packs, as a branch on "any hit" would then be a coin toss. noinline: the callers are
// flattened into target_clones, and inlining an AVX2 function into the baseline clone is
// refused.
template <typename W, bool kFrequentHits>
__attribute__((target("avx2,f16c"), noinline)) void collect_float32_avx2(const float* in,
                                                                         const float* add,
                                                                         float* keep, size_t n,
                                                                         Key t, Candidates& out) {
  const __m256i sign_off = _mm256_set1_epi32(0x7fffffff);
  const __m256i below = _mm256_set1_epi32(int32_t(t) - 1);
  // The output's end and room in locals: its members, reached through the vector stores (which
  // may alias anything), would be reloaded every step.
  uint32_t *bits_out = out.end_bits(), *index_out = out.end_index();
  size_t room = out.room();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(in + i);
    if (add) x = _mm256_add_ps(x, _mm256_loadu_ps(add + i));
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i hit = _mm256_cmpgt_epi32(_mm256_and_si256(bits, sign_off), below);
    const unsigned hits = unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(hit)));
    if (!kFrequentHits && !hits) {
      if (keep) _mm256_storeu_ps(keep + i, x);
      continue;
    }
    if (keep)
      _mm256_storeu_ps(keep + i,
                       _mm256_blendv_ps(x, owed_float32_avx2<W>(x), _mm256_castsi256_ps(hit)));
    if (room < 8) {
      out.grow_to(bits_out);
      out.reserve(2 * out.size() + 64);
      bits_out = out.end_bits();
      index_out = out.end_index();
      room = out.room();
    }
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(kLanes.lanes[hits])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits_out),
                        _mm256_permutevar8x32_epi32(bits, lanes));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(index_out),
                        _mm256_add_epi32(_mm256_set1_epi32(int32_t(i)), lanes));
    const unsigned selected = unsigned(__builtin_popcount(hits));
    bits_out += selected;
    index_out += selected;
    room -= selected;
  }
  out.grow_to(bits_out);
  collect_at_least<float, W>(in, add, keep, i, n, t, out);
}

bool avx2_available() {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return available;
}
#endif

template <typename T, typename W>
void collect(const T* in, const T* add, T* keep, size_t n, Key t, bool frequent_hits,
             Candidates& out) {
#ifdef RC_TOPK_X86
  if constexpr (std::is_same_v<T, float>) {
    if (avx2_available()) {
      if (frequent_hits) return collect_float32_avx2<W, true>(in, add, keep, n, t, out);
      return collect_float32_avx2<W, false>(in, add, keep, n, t, out);
    }
  }
#endif
  collect_at_least<T, W>(in, add, keep, 0, n, t, out);
}

// Finds the k-th in selection order among `cands` (ascending index order) by radix_select, then
// walks the candidates once more: the selected ones go to `indices` and `values`, sorted by index
// without a sort, the others to the front of `cands`; returns how many those are. The walk is
// branch-free (a store and a conditional advance), as a hit's branch would be a coin toss. The
// values are written as W.
template <typename T, typename W>
size_t select_exact(Candidates& cands, size_t k, int32_t* indices, W* values) {
  constexpr Key mask = key_mask<T>();
  const topk::RadixState state = radix_select<topk::key_bits<T>()>(
      cands.size(), k, [&](size_t j) { return cands.bits(j) & mask; });
  // The selected come in index order, so each goes to the next slot; one not selected writes
  // there too, before a later selected one overwrites it, and is moved to the front of `cands`.
  uint32_t equal_before = 0;
  size_t j = 0, selected = 0, dropped = 0;
  for (; j < cands.size() && selected < k; ++j) {
    const uint32_t bits = cands.bits(j), index = cands.index(j);
    const Key key = bits & mask;
    const bool keeps = topk::radix_keeps(key, equal_before, state);
    indices[selected] = int32_t(index);
    values[selected] = to_wire<W>(from_bits<T>(bits));
    cands.set(dropped, bits, index);
    selected += keeps;
    dropped += !keeps;
    equal_before += key == state.prefix;
  }
  for (; j < cands.size(); ++j) cands.set(dropped++, cands.bits(j), cands.index(j));
  return dropped;
}

// `cands` holds every non-zero element, fewer than k: merges in, in index order, the `missing`
// zero elements of lowest index (ties go to the lower index), which complete the top k. `acc`:
// the scanned values of the elements that are not candidates; `keep`, where given, gets the
// added ones zeroed as the scan zeroes candidates (-0 becomes +0).
template <typename T>
void add_first_zeros(size_t n, size_t missing, const T* acc, T* keep, Candidates& cands) {
  Candidates merged;
  merged.reserve(cands.size() + missing);
  size_t next = 0;  // next non-zero candidate
  for (size_t i = 0; i < n && missing > 0; ++i) {
    if (next < cands.size() && cands.index(next) == i) {
      merged.push(cands.bits(next), cands.index(next));
      ++next;
    } else if (magnitude_key(acc[i]) == 0) {
      merged.push(raw_bits(acc[i]), uint32_t(i));
      if (keep) keep[i] = T{};
      --missing;
    }
  }
  for (; next < cands.size(); ++next) merged.push(cands.bits(next), cands.index(next));
  std::swap(cands, merged);
}

// The selection: top-k of acc = data (+ add), as W values, writing acc back into `keep` where it
// is given (error feedback: data = grad, add = keep = residual), each selected element replaced
// by what its rounding to W lost.
template <typename T, typename W>
void select(const T* data, const T* add, T* keep, size_t n, size_t k, int32_t* indices, W* values) {
  Candidates& cands = scratch().cands;
  cands.clear();
  // The first `count` candidates' bits back into `keep`, where collect replaced them.
  auto restore = [&](size_t count) {
    if (keep)
      for (size_t j = 0; j < count; ++j) keep[cands.index(j)] = from_bits<T>(cands.bits(j));
  };
  if (n < kDirectBelow || k * 4 >= n) {
    cands.reserve(n);
    collect<T, W>(data, add, keep, n, Key(0), true, cands);
  } else {
    // Never below 1: zeros (the least key) are not collected wholesale when fewer than k
    // elements are non-zero (a sparse gradient), only as many as k needs, below.
    Key t = std::max<Key>(1, estimate_threshold(data, add, n, k));
    cands.reserve(k * 2);
    // Above about 1 in 128 elements, about one 8-lane step in ten holds a candidate, and the
    // scan's branch on "any hit" costs more in mispredictions than it saves; below, it saves.
    const bool frequent_hits = k * 128 >= n;
    collect<T, W>(data, add, keep, n, t, frequent_hits, cands);
    if (keep) data = keep, add = nullptr;  // acc is in `keep` now (candidates aside)
    while (cands.size() < k && t > 1) {    // too few reached t: lower it and look again
      restore(cands.size());
      t = t / 2;
      cands.clear();
      collect<T, W>(data, add, keep, n, t, frequent_hits, cands);
    }
    if (cands.size() < k) add_first_zeros(n, k - cands.size(), data, keep, cands);
  }
  restore(select_exact<T, W>(cands, k, indices, values));
  if (cands.capacity() > kKeptCandidates) cands.release();
}

void check(DType dtype, size_t n, size_t k) {
  RC_CHECK_ARG(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16,
               "top-k supports float32, float16 and bfloat16, got ", dtype_name(dtype));
  RC_CHECK_ARG(k <= n, "k = ", k, " is larger than the number of elements ", n);
  RC_CHECK_ARG(n <= size_t(INT32_MAX), "top-k indices are int32: at most 2^31-1 elements, got ", n);
}

}  // namespace

RC_MULTIVERSION
void topk(DType dtype, const void* data, size_t n, size_t k, int32_t* indices, void* values) {
  check(dtype, n, k);
  if (k == 0) return;
  kernels::visit_topk(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    select<T, T>(static_cast<const T*>(data), nullptr, nullptr, n, k, indices,
                 static_cast<T*>(values));
  });
}

RC_MULTIVERSION
void topk_with_residual(DType dtype, const void* grad, void* residual, size_t n, size_t k,
                        int32_t* indices, void* values, DType value_dtype) {
  check(dtype, n, k);
  kernels::visit_topk(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    kernels::visit_topk(value_dtype, [&](auto wire) {
      using W = typename decltype(wire)::type;
      T* r = static_cast<T*>(residual);
      select<T, W>(static_cast<const T*>(grad), r, r, n, k, indices, static_cast<W*>(values));
    });
  });
}

}  // namespace cpu
}  // namespace ringcomm
