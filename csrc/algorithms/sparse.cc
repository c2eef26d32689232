// Sparse all-reduce: every rank holds k_r (index, value) pairs of a vector of `numel` elements;
// every rank gets the dense sum (or average) of all of them.
//
// Step 0 (always): all-gather each rank's pair count k_r and packed size, so every rank makes the
// same choice below. Then, by the cheapest estimate (bytes on the wire per rank, plus 64 KiB per
// message round):
//   gather:  all-gather every rank's packed pairs (ring); scatter-add them all, in rank order.
//            Packed: indices as zigzag-varint deltas (about 1.3 bytes each for ascending top-k
//            indices at 1% density, kernels/cpu/index_codec.h), then the values.
//            Bytes received per rank: the others' packed sizes.
//   ranges:  (Ok-Topk's shape) rank q owns index range q of n balanced ranges.
//            1. each rank sends each owner the pairs in its range (counts first): about
//               k (n-1)/n (4 + value size) bytes;
//            2. each owner adds what it received, in rank order, into its range: the "piece" is
//               the touched positions as (index, sum), or the whole range when that is smaller;
//            3. all-gather the pieces (sizes first): about U (n-1)/n (4 + out size) bytes for a
//               union of U touched indices.
//   dense:   scatter the local pairs into `out` and ring all-reduce it: 2 (n-1)/n numel x out size.
// Every index is summed in rank order (and pair order within a rank) from zero, so gather and
// ranges give the same bits on every rank; dense gives ring order, equally deterministic.
#include <algorithm>
#include <cstring>

#include "algorithms/algorithms.h"
#include "kernels/cpu/index_codec.h"
#include "kernels/cpu/reduce.h"
#include "kernels/reduce_math.h"

namespace ringcomm {
namespace {

// Slots of the communicator's scratch used here (0 is the ring's, for the dense fallback).
enum Slot { kCounts = 4, kPacked = 5, kIncoming = 6, kPieces = 7, kGathered = 8, kDecoded = 9 };

struct Pairs {
  const int32_t* index;
  const char* value;  // count values of the value dtype
  size_t count;
};

template <typename V, typename O>
void scatter_add_typed(O* out, const Pairs& p) {
  const V* v = reinterpret_cast<const V*>(p.value);
  for (size_t i = 0; i < p.count; ++i) {
    O& dst = out[p.index[i]];
    dst = math::Compute<O>::store(math::Compute<O>::load(dst) + float(math::Compute<V>::load(v[i])));
  }
}

template <typename O>
void scatter_add_out(DType value_dtype, O* out, const Pairs& p) {
  switch (value_dtype) {
    case DType::kFloat32: return scatter_add_typed<float, O>(out, p);
    case DType::kFloat16: return scatter_add_typed<math::Half, O>(out, p);
    default: return scatter_add_typed<math::BFloat16, O>(out, p);
  }
}

// out[index] += value for every pair (in order), converting through float.
void scatter_add(DType value_dtype, DType out_dtype, void* out, const Pairs& p) {
  switch (out_dtype) {
    case DType::kFloat32: return scatter_add_out(value_dtype, static_cast<float*>(out), p);
    case DType::kFloat16: return scatter_add_out(value_dtype, static_cast<math::Half*>(out), p);
    default: return scatter_add_out(value_dtype, static_cast<math::BFloat16*>(out), p);
  }
}

void check_indices(const Pairs& p, size_t begin, size_t end, int from) {
  for (size_t i = 0; i < p.count; ++i)
    if (p.index[i] < int64_t(begin) || p.index[i] >= int64_t(end))
      RC_THROW("sparse_all_reduce: rank ", from, " sent index ", p.index[i], " outside [", begin,
               ", ", end, ")");
}

// Sizes from peers are checked against what this call allows before any is used to size a
// buffer or a loop: a buggy or mismatched peer gets a clear error, not an overflow.
[[noreturn]] void bad_size(int from, const char* what, uint64_t value, const char* limit) {
  RC_THROW("sparse_all_reduce: rank ", from, " sent ", what, " ", value, ", ", limit);
}

// Packed form of n pairs: n int32 indices, then n values.
size_t packed_bytes(size_t n, size_t value_size) { return n * (sizeof(int32_t) + value_size); }
Pairs unpack(const char* packed, size_t n) {
  return Pairs{reinterpret_cast<const int32_t*>(packed), packed + n * sizeof(int32_t), n};
}

struct Sizes {
  int n, rank;
  size_t numel, value_size, out_size;
  std::vector<size_t> k;       // pairs per rank
  std::vector<size_t> packed;  // gather's packed bytes per rank
};

// Every rank's `words` 8-byte values, via a ring all-gather: result[q * words + i].
std::vector<size_t> gather_words(Context& ctx, const uint64_t* mine, int words) {
  const int n = ctx.size();
  auto* all = reinterpret_cast<uint64_t*>(ctx.scratch(kCounts, 8 * words * n));
  std::memcpy(all + ctx.rank() * words, mine, 8 * words);
  if (n > 1) ring_all_gather(ctx, all, std::vector<size_t>(n, 8 * words), DType::kUInt8);
  return std::vector<size_t>(all, all + words * n);
}

// All-gather of variable byte blocks; block q lands at offset sum(bytes[0..q)) of the result.
char* gather_blocks(Context& ctx, int slot, const void* mine, const std::vector<size_t>& bytes) {
  size_t total = 0, offset = 0;
  for (int q = 0; q < int(bytes.size()); ++q) {
    if (q == ctx.rank()) offset = total;
    total += bytes[q];
  }
  char* all = ctx.scratch(slot, std::max<size_t>(1, total));
  if (bytes[ctx.rank()]) std::memcpy(all + offset, mine, bytes[ctx.rank()]);
  ring_all_gather(ctx, all, bytes, DType::kUInt8);
  return all;
}

Algorithm choose(const Sizes& s) {
  const double n = s.n, round = 64 << 10;
  double total = 0, none_hit = 1;
  for (size_t k : s.k) {
    total += double(k);
    none_hit *= 1.0 - double(k) / double(std::max<size_t>(1, s.numel));
  }
  const double pair = 4.0 + double(s.value_size);
  double packed_total = 0;
  for (size_t b : s.packed) packed_total += double(b);
  double gather = (packed_total - packed_total / n) + (n - 1) * round;
  double expected_union = double(s.numel) * (1.0 - none_hit);
  double piece = std::min(expected_union * (4.0 + s.out_size), double(s.numel) * s.out_size);
  double ranges = total / n * (n - 1) / n * pair + piece * (n - 1) / n + (n + 1) * round;
  double dense = 2 * (n - 1) / n * double(s.numel) * s.out_size + 2 * (n - 1) * round;
  if (dense <= gather && dense <= ranges) return Algorithm::kRing;
  return gather <= ranges ? Algorithm::kSparseGather : Algorithm::kSparseRanges;
}

// Packs my pairs for gather: encoded indices, then values. Returns the packed size.
size_t pack_for_gather(Context& ctx, const Pairs& mine, size_t value_size, char** packed) {
  *packed = ctx.scratch(kPacked, std::max<size_t>(1, cpu::max_encoded_bytes(mine.count) +
                                                        mine.count * value_size));
  size_t index_bytes = cpu::encode_indices(mine.index, mine.count, reinterpret_cast<uint8_t*>(*packed));
  std::memcpy(*packed + index_bytes, mine.value, mine.count * value_size);
  return index_bytes + mine.count * value_size;
}

void gather_all_reduce(Context& ctx, const Sizes& s, const char* packed, DType vt, DType ot,
                       void* out) {
  const char* all = gather_blocks(ctx, kGathered, packed, s.packed);
  size_t most = *std::max_element(s.k.begin(), s.k.end());
  auto* decoded = reinterpret_cast<int32_t*>(ctx.scratch(kDecoded, std::max<size_t>(1, most * 4)));
  std::memset(out, 0, s.numel * s.out_size);
  for (int q = 0; q < s.n; ++q) {
    size_t index_bytes = s.packed[q] - s.k[q] * s.value_size;
    if (cpu::decode_indices(reinterpret_cast<const uint8_t*>(all), index_bytes, s.k[q], decoded) !=
        index_bytes)
      RC_THROW("sparse_all_reduce: malformed index encoding from rank ", q);
    Pairs p{decoded, all + index_bytes, s.k[q]};
    all += s.packed[q];
    check_indices(p, 0, s.numel, q);
    scatter_add(vt, ot, out, p);
  }
}

void ranges_all_reduce(Context& ctx, const Sizes& s, const Pairs& mine, DType vt, DType ot, void* out) {
  const int n = s.n, me = s.rank;
  Segments range(s.numel, n);
  auto owner = [&](int32_t index) {
    // Balanced ranges: the first numel % n have one element more.
    size_t small = s.numel / n, big_count = s.numel % n, big_end = big_count * (small + 1);
    return size_t(index) < big_end ? int(index / (small + 1)) : int(big_count + (index - big_end) / small);
  };

  // 1. Partition my pairs by owner (stable: pair order within a rank is kept) and exchange.
  check_indices(mine, 0, s.numel, me);
  std::vector<size_t> to(n, 0), from(n, 0);
  for (size_t i = 0; i < mine.count; ++i) ++to[owner(mine.index[i])];
  std::vector<size_t> start(n + 1, 0);
  for (int q = 0; q < n; ++q) start[q + 1] = start[q] + packed_bytes(to[q], s.value_size);
  char* outgoing = ctx.scratch(kPacked, std::max<size_t>(1, start[n]));
  std::vector<size_t> filled(n, 0);
  for (size_t i = 0; i < mine.count; ++i) {
    int q = owner(mine.index[i]);
    char* block = outgoing + start[q];
    reinterpret_cast<int32_t*>(block)[filled[q]] = mine.index[i];
    std::memcpy(block + to[q] * sizeof(int32_t) + filled[q] * s.value_size,
                mine.value + i * s.value_size, s.value_size);
    ++filled[q];
  }
  std::vector<Request> count_recvs;
  for (int q = 0; q < n; ++q)
    if (q != me) count_recvs.push_back(ctx.recv(q, &from[q], sizeof(size_t)));
  for (int q = 0; q < n; ++q)
    if (q != me) ctx.send(q, &to[q], sizeof(size_t));
  for (Request r : count_recvs) ctx.wait(r);
  for (int q = 0; q < n; ++q)
    if (q != me && from[q] > s.k[q])
      bad_size(q, "a count of", from[q], "more pairs than it announced");
  from[me] = to[me];
  std::vector<size_t> in_start(n + 1, 0);
  for (int q = 0; q < n; ++q) in_start[q + 1] = in_start[q] + packed_bytes(from[q], s.value_size);
  char* incoming = ctx.scratch(kIncoming, std::max<size_t>(1, in_start[n]));
  std::vector<Request> pair_recvs;
  for (int q = 0; q < n; ++q)
    if (q != me) pair_recvs.push_back(ctx.recv(q, incoming + in_start[q], in_start[q + 1] - in_start[q]));
  for (int q = 0; q < n; ++q)
    if (q != me) ctx.send(q, outgoing + start[q], start[q + 1] - start[q]);
  std::memcpy(incoming + in_start[me], outgoing + start[me], start[me + 1] - start[me]);
  for (Request r : pair_recvs) ctx.wait(r);

  // 2. Reduce my range, in rank order, and note which positions were touched.
  const size_t begin = range.offset(me), len = range.count(me);
  char* out_bytes = static_cast<char*>(out);
  std::memset(out_bytes + begin * s.out_size, 0, len * s.out_size);
  std::vector<uint8_t> touched(len, 0);
  size_t n_touched = 0;
  for (int q = 0; q < n; ++q) {
    Pairs p = unpack(incoming + in_start[q], from[q]);
    check_indices(p, begin, begin + len, q);
    scatter_add(vt, ot, out, p);
    for (size_t i = 0; i < p.count; ++i) {
      uint8_t& t = touched[p.index[i] - begin];
      n_touched += !t;
      t = 1;
    }
  }
  bool sparse_piece = packed_bytes(n_touched, s.out_size) < len * s.out_size;
  uint64_t piece_bytes = sparse_piece ? packed_bytes(n_touched, s.out_size) : len * s.out_size;
  char* piece = ctx.scratch(kPieces, std::max<size_t>(1, piece_bytes));
  if (sparse_piece) {
    auto* idx = reinterpret_cast<int32_t*>(piece);
    char* val = piece + n_touched * sizeof(int32_t);
    size_t j = 0;
    for (size_t i = 0; i < len; ++i)
      if (touched[i]) {
        idx[j] = int32_t(begin + i);
        std::memcpy(val + j * s.out_size, out_bytes + (begin + i) * s.out_size, s.out_size);
        ++j;
      }
  } else {
    std::memcpy(piece, out_bytes + begin * s.out_size, len * s.out_size);
  }

  // 3. All-gather the pieces; a piece is dense iff its size is the whole range's.
  std::vector<size_t> piece_sizes = gather_words(ctx, &piece_bytes, 1);
  for (int q = 0; q < n; ++q) {
    size_t dense = range.count(q) * s.out_size, pair = packed_bytes(1, s.out_size);
    if (piece_sizes[q] != dense && (piece_sizes[q] >= dense || piece_sizes[q] % pair != 0))
      bad_size(q, "a piece of", piece_sizes[q], "neither its whole range nor whole pairs within it");
  }
  const char* all = gather_blocks(ctx, kGathered, piece, piece_sizes);
  for (int q = 0; q < n; ++q) {
    const char* block = all;
    all += piece_sizes[q];
    if (q == me) continue;
    char* dst = out_bytes + range.offset(q) * s.out_size;
    size_t qlen = range.count(q);
    // Sparse pieces are strictly smaller than the range, so the size alone tells the form.
    if (piece_sizes[q] == qlen * s.out_size) {
      std::memcpy(dst, block, piece_sizes[q]);
      continue;
    }
    size_t m = piece_sizes[q] / packed_bytes(1, s.out_size);
    Pairs p = unpack(block, m);
    check_indices(p, range.offset(q), range.offset(q) + qlen, q);
    std::memset(dst, 0, qlen * s.out_size);
    for (size_t i = 0; i < m; ++i)
      std::memcpy(out_bytes + size_t(p.index[i]) * s.out_size, p.value + i * s.out_size, s.out_size);
  }
}

}  // namespace

Algorithm sparse_all_reduce_steps(Context& ctx, const int32_t* indices, const void* values, size_t k,
                            DType value_dtype, void* out, size_t numel, DType out_dtype,
                            ReduceOp op, Algorithm algo) {
  Sizes s{ctx.size(), ctx.rank(), numel, dtype_size(value_dtype), dtype_size(out_dtype), {}, {}};
  Pairs mine{indices, static_cast<const char*>(values), k};
  char* packed = nullptr;
  uint64_t sizes[2] = {k, pack_for_gather(ctx, mine, s.value_size, &packed)};
  std::vector<size_t> words = gather_words(ctx, sizes, 2);
  for (int q = 0; q < s.n; ++q) {
    // At most 2^31 - 1 pairs (checked locally too), so k * (5 + value size) cannot overflow.
    size_t k_q = words[2 * q], packed_q = words[2 * q + 1];
    if (k_q > size_t(INT32_MAX)) bad_size(q, "a pair count of", k_q, "more than 2^31 - 1");
    size_t values_bytes = k_q * s.value_size;
    if (packed_q < values_bytes || packed_q - values_bytes > cpu::max_encoded_bytes(k_q))
      bad_size(q, "a packed size of", packed_q, "impossible for its pair count");
    s.k.push_back(k_q);
    s.packed.push_back(packed_q);
  }
  if (algo == Algorithm::kAuto) algo = choose(s);
  switch (algo) {
    case Algorithm::kSparseRanges:
      ranges_all_reduce(ctx, s, mine, value_dtype, out_dtype, out);
      break;
    case Algorithm::kRing:
      check_indices(mine, 0, numel, s.rank);
      std::memset(out, 0, numel * s.out_size);
      scatter_add(value_dtype, out_dtype, out, mine);
      ring_all_reduce(ctx, out, numel, out_dtype, ReduceOp::kSum);
      break;
    default:
      gather_all_reduce(ctx, s, packed, value_dtype, out_dtype, out);
  }
  if (op == ReduceOp::kAvg) cpu::divide(out_dtype, out, numel, s.n);
  ctx.finish();
  return algo;
}

}  // namespace ringcomm
