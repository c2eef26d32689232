// The sparse all-reduce's checks and decoding of what peers sent (sparse_decode.h). Sizes from
// peers are checked against what this call allows before any is used to size a buffer or a loop,
// and indices before any is used to address `out`: a buggy or mismatched peer gets a clear error,
// not an overflow.
#include "algorithms/sparse_decode.h"

#include <cstring>

#include "common/error.h"
#include "kernels/cpu/index_codec.h"
#include "kernels/cpu/reduce.h"
#include "kernels/reduce_math.h"

namespace ringcomm {
namespace {

// Adds pairs first, first + 1, ... of `p` into `out` until one's index reaches `stop` (ascending
// pairs: the end of the chunk being reduced); returns the first pair not added.
template <typename V, typename O>
size_t scatter_add_typed(O* out, const SparsePairs& p, size_t first, int64_t stop) {
  size_t i = first;
  for (; i < p.count; ++i) {
    const int32_t index = p.index_at(i);
    if (index >= stop) break;
    V v;
    std::memcpy(&v, p.value + i * sizeof(V), sizeof(V));
    O& dst = out[index];
    dst = math::Compute<O>::store(math::Compute<O>::load(dst) + float(math::Compute<V>::load(v)));
  }
  return i;
}

template <typename O>
size_t scatter_add_out(DType value_dtype, O* out, const SparsePairs& p, size_t first,
                       int64_t stop) {
  switch (value_dtype) {
    case DType::kFloat32:
      return scatter_add_typed<float, O>(out, p, first, stop);
    case DType::kFloat16:
      return scatter_add_typed<math::Half, O>(out, p, first, stop);
    default:
      return scatter_add_typed<math::BFloat16, O>(out, p, first, stop);
  }
}

size_t scatter_add_below(DType value_dtype, DType out_dtype, void* out, const SparsePairs& p,
                         size_t first, int64_t stop) {
  switch (out_dtype) {
    case DType::kFloat32:
      return scatter_add_out(value_dtype, static_cast<float*>(out), p, first, stop);
    case DType::kFloat16:
      return scatter_add_out(value_dtype, static_cast<math::Half*>(out), p, first, stop);
    default:
      return scatter_add_out(value_dtype, static_cast<math::BFloat16*>(out), p, first, stop);
  }
}

[[noreturn]] void bad_size(int from, const char* what, uint64_t value, const char* limit) {
  RC_THROW_AS(kProtocol, "sparse_all_reduce: rank ", from, " sent ", what, " ", value, ", ", limit);
}

// reduce_decoded's chunk of `out`: it and the pairs being added stay in a core's L2.
constexpr size_t kChunkBytes = 256 << 10;

// Unordered pairs: dividing one sent position (a cache line of its own, found through the bitmap,
// behind a branch that mispredicts) costs about as much as this many positions of one streaming
// pass over the whole vector, which is taken instead when there are that many pairs.
constexpr size_t kDenseDivideRatio = 32;

}  // namespace

void scatter_add(DType value_dtype, DType out_dtype, void* out, const SparsePairs& p) {
  scatter_add_below(value_dtype, out_dtype, out, p, 0, INT64_MAX);
}

void check_indices(const SparsePairs& p, size_t begin, size_t end, int from) {
  for (size_t i = 0; i < p.count; ++i)
    if (p.index_at(i) < int64_t(begin) || p.index_at(i) >= int64_t(end))
      RC_THROW_AS(kProtocol, "sparse_all_reduce: rank ", from, " sent index ", p.index_at(i),
                  " outside [", begin, ", ", end, ")");
}

void check_peer_size(const SparseSizes& s, int q, size_t k_q, size_t packed_q) {
  // At most 2^31 - 1 pairs (checked locally too), so k * (5 + value size) cannot overflow.
  if (k_q > size_t(INT32_MAX)) bad_size(q, "a pair count of", k_q, "more than 2^31 - 1");
  // Its indices take 1 to 5 bytes each. (With fewer than k, and k > 0, the index bytes could
  // be 0, which is also what decode_indices returns on failure.)
  size_t values_bytes = k_q * s.value_size;
  if (packed_q < values_bytes || packed_q - values_bytes < k_q ||
      packed_q - values_bytes > cpu::max_encoded_bytes(k_q))
    bad_size(q, "a packed size of", packed_q, "impossible for its pair count");
}

SparsePairs decode_block(const SparseSizes& s, int q, const char* block, int32_t* decoded,
                         bool* ascending) {
  const size_t index_bytes = s.packed[q] - s.k[q] * s.value_size;
  // decode_indices returns 0 on failure: with k > 0 that is never a success, or the decode
  // scratch's stale indices (another rank's) would be added as this rank's.
  cpu::DecodedIndices range;
  const size_t used = cpu::decode_indices(reinterpret_cast<const uint8_t*>(block), index_bytes,
                                          s.k[q], decoded, &range);
  if (used != index_bytes || (s.k[q] > 0 && used == 0))
    RC_THROW_AS(kProtocol, "sparse_all_reduce: malformed index encoding from rank ", q);
  const SparsePairs pairs{reinterpret_cast<const char*>(decoded), block + index_bytes, s.k[q]};
  if (s.k[q] > 0 && (range.least < 0 || size_t(range.greatest) >= s.numel))
    check_indices(pairs, 0, s.numel, q);  // throws, naming the index
  *ascending = *ascending && range.ascending;
  return pairs;
}

void reduce_decoded(const SparseSizes& s, const std::vector<SparsePairs>& pairs, bool ascending,
                    uint64_t* seen, void* out, ReduceOp op) {
  char* const bytes = static_cast<char*>(out);
  if (ascending) {
    const size_t chunk = std::max<size_t>(1, kChunkBytes / s.out_size);
    std::vector<size_t> next(size_t(s.n), 0);  // each rank's first pair not added yet
    for (size_t begin = 0; begin < s.numel; begin += chunk) {
      const size_t end = std::min(s.numel, begin + chunk);
      std::memset(bytes + begin * s.out_size, 0, (end - begin) * s.out_size);
      for (int q = 0; q < s.n; ++q)
        next[size_t(q)] = scatter_add_below(s.value_dtype, s.out_dtype, out, pairs[size_t(q)],
                                            next[size_t(q)], end);
      if (op == ReduceOp::kAvg)
        cpu::divide(s.out_dtype, bytes + begin * s.out_size, end - begin, s.n);
    }
    return;
  }
  // (An empty `out` may be null, which not even a memset of 0 bytes may be given.)
  if (s.numel > 0) std::memset(out, 0, s.numel * s.out_size);
  size_t total = 0;
  for (const SparsePairs& p : pairs) {
    scatter_add(s.value_dtype, s.out_dtype, out, p);
    total += p.count;
  }
  if (op != ReduceOp::kAvg) return;
  if (total >= s.numel / kDenseDivideRatio) return cpu::divide(s.out_dtype, out, s.numel, s.n);
  std::memset(seen, 0, (s.numel + 63) / 64 * sizeof(uint64_t));
  auto divide_at = [&](auto* typed) {
    for (const SparsePairs& p : pairs)
      for (size_t i = 0; i < p.count; ++i) {
        const uint32_t index = uint32_t(p.index_at(i));  // checked above
        uint64_t& word = seen[index / 64];
        const uint64_t bit = uint64_t(1) << (index % 64);
        if (word & bit) continue;
        word |= bit;
        typed[index] = math::divide_one(typed[index], s.n);
      }
  };
  switch (s.out_dtype) {
    case DType::kFloat32:
      return divide_at(static_cast<float*>(out));
    case DType::kFloat16:
      return divide_at(static_cast<math::Half*>(out));
    default:
      return divide_at(static_cast<math::BFloat16*>(out));
  }
}

void check_owner_counts(const SparseSizes& s, const std::vector<size_t>& from) {
  for (int q = 0; q < s.n; ++q)
    if (q != s.rank && from[q] > s.k[q])
      bad_size(q, "a count of", from[q], "more pairs than it announced");
}

size_t add_owned_pairs(const SparseSizes& s, const char* incoming, const std::vector<size_t>& from,
                       void* out, uint8_t* touched) {
  const size_t begin = s.range_begin(s.rank), len = s.range_count(s.rank);
  if (len > 0) std::memset(static_cast<char*>(out) + begin * s.out_size, 0, len * s.out_size);
  size_t n_touched = 0;
  for (int q = 0; q < s.n; ++q) {
    SparsePairs p = unpack_pairs(incoming, from[q]);
    incoming += packed_bytes(from[q], s.value_size);
    check_indices(p, begin, begin + len, q);
    scatter_add(s.value_dtype, s.out_dtype, out, p);
    for (size_t i = 0; i < p.count; ++i) {
      uint8_t& t = touched[p.index_at(i) - begin];
      n_touched += !t;
      t = 1;
    }
  }
  return n_touched;
}

void check_piece_sizes(const SparseSizes& s, const std::vector<size_t>& piece_sizes) {
  for (int q = 0; q < s.n; ++q) {
    size_t dense = s.range_count(q) * s.out_size, pair = packed_bytes(1, s.out_size);
    if (piece_sizes[q] != dense && (piece_sizes[q] >= dense || piece_sizes[q] % pair != 0))
      bad_size(q, "a piece of", piece_sizes[q],
               "neither its whole range nor whole pairs within it");
  }
}

void place_pieces(const SparseSizes& s, const char* pieces, const std::vector<size_t>& piece_sizes,
                  void* out) {
  char* out_bytes = static_cast<char*>(out);
  for (int q = 0; q < s.n; ++q) {
    const char* block = pieces;
    pieces += piece_sizes[q];
    if (q == s.rank) continue;
    char* dst = out_bytes + s.range_begin(q) * s.out_size;
    size_t qlen = s.range_count(q);
    if (qlen == 0) continue;  // its piece is empty (check_piece_sizes); `out` may be null
    // Sparse pieces are strictly smaller than the range, so the size alone tells the form.
    if (piece_sizes[q] == qlen * s.out_size) {
      std::memcpy(dst, block, piece_sizes[q]);
      continue;
    }
    size_t m = piece_sizes[q] / packed_bytes(1, s.out_size);
    SparsePairs p = unpack_pairs(block, m);
    check_indices(p, s.range_begin(q), s.range_begin(q) + qlen, q);
    std::memset(dst, 0, qlen * s.out_size);
    for (size_t i = 0; i < m; ++i)
      std::memcpy(out_bytes + size_t(p.index_at(i)) * s.out_size, p.value + i * s.out_size,
                  s.out_size);
  }
}

}  // namespace ringcomm
