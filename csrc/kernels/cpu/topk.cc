// Top-k selection: a sampled threshold, one pass over the data, and an exact fix-up.
//
// 1. Sample: estimate from a fixed pseudo-random sample of keys a threshold t that a little more
//    than k elements reach (over-selecting on purpose).
// 2. Scan (the only full pass): collect every index whose key is >= t. In the error-feedback
//    variant the same pass computes acc = grad + residual and stores it.
// 3. If fewer than k were collected, the estimate was too high: lower t and scan again (rare;
//    this is what makes the result exact, not probabilistic). t stays at least 1: where fewer
//    than k elements are non-zero, the zeros of lowest index complete the selection.
// 4. Among the candidates, which contain every element of the true top-k whenever there are at
//    least k of them, find the k-th by (key descending, index ascending) and keep every candidate
//    that ranks up to it, in index order.
// Memory traffic: one read of the input (plus one read and one write of the residual), against
// torch.topk's heap or sort over the whole tensor.
#include "kernels/cpu/topk.h"
#include "kernels/cpu/multiversion.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

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

struct Candidate {
  Key key;
  uint32_t index;
};

// Threshold key that about `want` of n elements reach, estimated from a sample of keys: short
// contiguous runs at pseudo-random offsets, which costs a few cache misses per run instead of
// one per sampled element.
template <typename KeyAt>
Key estimate_threshold(size_t n, size_t want, KeyAt key_at) {
  constexpr size_t kRun = 64;
  std::vector<Key> sample;
  sample.reserve(kSampleSize);
  uint64_t state = 0x9e3779b97f4a7c15ull ^ n;  // fixed seed: deterministic
  while (sample.size() < kSampleSize) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    size_t start = size_t((state >> 33) % (n - kRun));
    for (size_t i = start; i < start + kRun; ++i) sample.push_back(key_at(i));
  }
  double expected = double(want) * kSampleSize / double(n);
  // Aim 20% plus four standard deviations above the expected count, so one scan nearly always
  // suffices.
  size_t rank = size_t(std::min<double>(kSampleSize - 1, expected * 1.2 + 4 * std::sqrt(expected) + 8));
  std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<Key>());
  return sample[rank];
}

// Appends (key, index) for every element of [0, n) with key >= t. Blocks of 16 are tested with a
// branch-free (vectorisable) "any" first: almost all blocks hold no candidate.
template <typename KeyAt>
RC_TOPK_INLINE void collect_at_least(size_t n, Key t, KeyAt key_at, std::vector<Candidate>& out) {
  constexpr size_t kBlock = 16;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    bool any = false;
    for (size_t j = 0; j < kBlock; ++j) any |= key_at(i + j) >= t;
    if (!any) continue;
    for (size_t j = i; j < i + kBlock; ++j)
      if (key_at(j) >= t) out.push_back({key_at(j), uint32_t(j)});
  }
  for (; i < n; ++i)
    if (key_at(i) >= t) out.push_back({key_at(i), uint32_t(i)});
}

#ifdef RC_TOPK_X86
// float32 with AVX2, 8 elements a step: with `residual`, acc = grad + residual is stored back
// into it (one IEEE add, as topk::accumulate) and keyed; without, grad is. Keys (sign cleared)
// are below 2^31, so a signed compare with t - 1 is key >= t. A step with no key >= t, nearly
// every step at 1% density, costs the add, the store, an and, a compare and a movemask: no
// branch per element, unlike the scalar loop, whose push_back branch the compiler cannot
// vectorise around. noinline: the callers are flattened into target_clones, and inlining an
// AVX2 function into the baseline clone is refused.
__attribute__((target("avx2"), noinline)) void collect_float32_avx2(const float* grad,
                                                                   float* residual, size_t n, Key t,
                                                                   std::vector<Candidate>& out) {
  const __m256i sign_off = _mm256_set1_epi32(0x7fffffff);
  const __m256i below = _mm256_set1_epi32(int32_t(t) - 1);
  alignas(32) uint32_t keys[8];
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(grad + i);
    if (residual) {
      x = _mm256_add_ps(x, _mm256_loadu_ps(residual + i));
      _mm256_storeu_ps(residual + i, x);
    }
    const __m256i key = _mm256_and_si256(_mm256_castps_si256(x), sign_off);
    unsigned hits = unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, below))));
    if (!hits) continue;
    _mm256_store_si256(reinterpret_cast<__m256i*>(keys), key);
    for (; hits; hits &= hits - 1) {
      const unsigned j = unsigned(__builtin_ctz(hits));
      out.push_back({keys[j], uint32_t(i + j)});
    }
  }
  for (; i < n; ++i) {
    float x = grad[i];
    if (residual) residual[i] = x = topk::accumulate(x, residual[i]);
    const Key key = magnitude_key(x);
    if (key >= t) out.push_back({key, uint32_t(i)});
  }
}

bool avx2_available() {
  static const bool available = __builtin_cpu_supports("avx2");
  return available;
}
#endif

// `cands` are in ascending index order (the scan's). Finds the k-th in selection order by the
// radix passes of kernels/topk_math.h (the CUDA kernel's own steps), then keeps every candidate
// up to it in one more walk: the winners come out sorted by index without a sort.
void select_exact(const std::vector<Candidate>& cands, size_t k, int key_bits, int32_t* indices) {
  if (k == 0) return;
  topk::RadixState state = topk::radix_start(uint32_t(k));
  std::vector<uint32_t> count(topk::kRadixBins);
  for (int pass = 0; pass < topk::radix_passes(key_bits); ++pass) {
    const topk::RadixPass p = topk::radix_pass(key_bits, pass);
    std::fill(count.begin(), count.end(), 0u);
    for (const Candidate& c : cands)
      if (topk::radix_matches(c.key, state)) ++count[topk::radix_digit(c.key, p)];
    uint32_t above = 0;
    for (unsigned digit = 1u << p.bits; digit-- > 0; above += count[digit]) {
      if (topk::radix_is_pick(above, count[digit], state.remaining)) {
        topk::radix_advance(state, p, digit, above);
        break;
      }
    }
  }
  uint32_t greater_before = 0, equal_before = 0;
  for (const Candidate& c : cands) {
    if (topk::radix_keeps(c.key, equal_before, state))
      indices[topk::radix_slot(greater_before, equal_before, state)] = int32_t(c.index);
    greater_before += c.key > state.prefix;
    equal_before += c.key == state.prefix;
  }
}

// `cands` holds every non-zero element, fewer than k: merges in, in index order, the `missing`
// zero elements of lowest index (ties go to the lower index), which complete the top k.
template <typename KeyAt>
void add_first_zeros(size_t n, size_t missing, KeyAt key_at, std::vector<Candidate>& cands) {
  std::vector<Candidate> merged;
  merged.reserve(cands.size() + missing);
  size_t next = 0;  // next non-zero candidate
  for (size_t i = 0; i < n && missing > 0; ++i) {
    if (next < cands.size() && cands[next].index == i) {
      merged.push_back(cands[next++]);
    } else if (key_at(i) == 0) {
      merged.push_back({0, uint32_t(i)});
      --missing;
    }
  }
  merged.insert(merged.end(), cands.begin() + long(next), cands.end());
  cands.swap(merged);
}

// The shared selection driver. `scan(t, out)` appends every (key, index) with key >= t, for the
// whole input, and may be called again with a lower t.
template <typename T, typename KeyAt, typename Scan>
void select(size_t n, size_t k, int32_t* indices, KeyAt key_at, Scan scan) {
  std::vector<Candidate> cands;
  if (n < kDirectBelow || k * 4 >= n) {
    scan(Key(0), cands);
  } else {
    // Never below 1: zeros (the least key) are not collected wholesale when fewer than k
    // elements are non-zero (a sparse gradient), only as many as k needs, below.
    Key t = std::max<Key>(1, estimate_threshold(n, k, key_at));
    cands.reserve(k * 2);
    scan(t, cands);
    while (cands.size() < k && t > 1) {  // too few reached t: lower it and look again
      t = t / 2;
      cands.clear();
      scan(t, cands);
    }
    if (cands.size() < k) add_first_zeros(n, k - cands.size(), key_at, cands);
  }
  select_exact(cands, k, topk::key_bits<T>(), indices);
}

// The scan over float32 data (AVX2 where there is one), else the portable loop.
template <typename T, typename KeyAt>
void collect(const T* data, size_t n, Key t, KeyAt key_at, std::vector<Candidate>& out) {
#ifdef RC_TOPK_X86
  if constexpr (std::is_same_v<T, float>) {
    if (avx2_available()) return collect_float32_avx2(data, nullptr, n, t, out);
  }
#endif
  collect_at_least(n, t, key_at, out);
}

template <typename T>
void topk_typed(const T* data, size_t n, size_t k, int32_t* indices, T* values) {
  auto key_at = [&](size_t i) { return magnitude_key(data[i]); };
  select<T>(n, k, indices, key_at,
         [&](Key t, std::vector<Candidate>& out) { collect(data, n, t, key_at, out); });
  for (size_t i = 0; i < k; ++i) values[i] = data[indices[i]];
}

template <typename T>
void topk_with_residual_typed(const T* grad, T* residual, size_t n, size_t k, int32_t* indices,
                              T* values) {
  bool accumulated = false;
  auto key_at = [&](size_t i) {
    return magnitude_key(accumulated ? residual[i] : topk::accumulate(grad[i], residual[i]));
  };
  select<T>(n, k, indices, key_at, [&](Key t, std::vector<Candidate>& out) {
    if (!accumulated) {  // first scan: accumulate and collect in one pass
      accumulated = true;
#ifdef RC_TOPK_X86
      if constexpr (std::is_same_v<T, float>) {
        if (avx2_available()) return collect_float32_avx2(grad, residual, n, t, out);
      }
#endif
      for (size_t i = 0; i < n; ++i) {
        T acc = topk::accumulate(grad[i], residual[i]);
        residual[i] = acc;
        Key key = magnitude_key(acc);
        if (key >= t) out.push_back({key, uint32_t(i)});
      }
    } else {
      collect(residual, n, t, [&](size_t i) { return magnitude_key(residual[i]); }, out);
    }
  });
  for (size_t i = 0; i < k; ++i) {
    values[i] = residual[indices[i]];
    residual[indices[i]] = T{};
  }
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
  switch (dtype) {
    case DType::kFloat32:
      return topk_typed(static_cast<const float*>(data), n, k, indices, static_cast<float*>(values));
    case DType::kFloat16:
      return topk_typed(static_cast<const math::Half*>(data), n, k, indices,
                        static_cast<math::Half*>(values));
    default:
      return topk_typed(static_cast<const math::BFloat16*>(data), n, k, indices,
                        static_cast<math::BFloat16*>(values));
  }
}

RC_MULTIVERSION
void topk_with_residual(DType dtype, const void* grad, void* residual, size_t n, size_t k,
                        int32_t* indices, void* values) {
  check(dtype, n, k);
  switch (dtype) {
    case DType::kFloat32:
      return topk_with_residual_typed(static_cast<const float*>(grad), static_cast<float*>(residual),
                                      n, k, indices, static_cast<float*>(values));
    case DType::kFloat16:
      return topk_with_residual_typed(static_cast<const math::Half*>(grad),
                                      static_cast<math::Half*>(residual), n, k, indices,
                                      static_cast<math::Half*>(values));
    default:
      return topk_with_residual_typed(static_cast<const math::BFloat16*>(grad),
                                      static_cast<math::BFloat16*>(residual), n, k, indices,
                                      static_cast<math::BFloat16*>(values));
  }
}

}  // namespace cpu
}  // namespace ringcomm
