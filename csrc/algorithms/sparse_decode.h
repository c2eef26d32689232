// The sparse all-reduce's handling of what peers sent (sparse.cc's opening comment has the steps
// and the bytes on the wire). Functions of the received bytes and the local call only, with no
// Context: sparse.cc calls them between its exchanges, and fuzz/sparse.cc calls them with
// arbitrary bytes as what a peer sent. Whatever the bytes, each one either returns or throws
// ringcomm::Error naming the rank; none reads or writes outside the buffers it is given.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype.h"

namespace ringcomm {

// `count` (index, value) pairs: int32 indices, then the values of the value dtype. Either may sit
// at any address (a peer's block starts where the previous one ended, 6 bytes a pair for
// half values), so they are read by memcpy, never through a typed pointer.
struct SparsePairs {
  const char* index;
  const char* value;
  size_t count;
  int32_t index_at(size_t i) const {
    int32_t v;
    std::memcpy(&v, index + i * sizeof(int32_t), sizeof(int32_t));
    return v;
  }
};

// Packed form of n pairs (ranges' exchanges): n int32 indices, then n values of `value_size`.
inline size_t packed_bytes(size_t n, size_t value_size) {
  return n * (sizeof(int32_t) + value_size);
}
inline SparsePairs unpack_pairs(const char* packed, size_t n) {
  return SparsePairs{packed, packed + n * sizeof(int32_t), n};
}

// The local call (the same on every rank), and every rank's step-0 sizes once checked.
struct SparseSizes {
  int n, rank;
  size_t numel;
  DType value_dtype, out_dtype;
  size_t value_size, out_size;
  std::vector<size_t> k;       // pairs per rank
  std::vector<size_t> packed;  // gather's packed bytes per rank

  SparseSizes(int n, int rank, size_t numel, DType value_dtype, DType out_dtype)
      : n(n),
        rank(rank),
        numel(numel),
        value_dtype(value_dtype),
        out_dtype(out_dtype),
        value_size(dtype_size(value_dtype)),
        out_size(dtype_size(out_dtype)) {}

  // ranges: rank q owns index range q of n balanced ranges (the first numel % n have one element
  // more), [range_begin(q), range_begin(q) + range_count(q)).
  size_t range_begin(int q) const {
    return size_t(q) * (numel / n) + std::min(size_t(q), numel % size_t(n));
  }
  size_t range_count(int q) const { return range_begin(q + 1) - range_begin(q); }
  // The owner of an index in [0, numel).
  int owner(int32_t index) const {
    size_t small = numel / n, big_count = numel % n, big_end = big_count * (small + 1);
    return size_t(index) < big_end ? int(index / (small + 1))
                                   : int(big_count + (index - big_end) / small);
  }
};

// Throws unless every index of p is in [begin, end); `from` is the rank that sent them.
void check_indices(const SparsePairs& p, size_t begin, size_t end, int from);
// out[index] += value for every pair (in order), converting through float; indices checked first.
void scatter_add(DType value_dtype, DType out_dtype, void* out, const SparsePairs& p);

// Step 0: throws unless rank q's pair count and packed size are possible together.
void check_peer_size(const SparseSizes& s, int q, size_t k_q, size_t packed_q);

// gather, one rank's part: decodes the indices of rank q's packed pairs `block` (s.packed[q]
// bytes) into `decoded` (room for s.k[q]), checks them, and returns the pairs; clears
// `*ascending` unless the indices ascend. A rank decodes each block as it arrives.
SparsePairs decode_block(const SparseSizes& s, int q, const char* block, int32_t* decoded,
                         bool* ascending);

// gather, once every rank's block is decoded (`pairs[q]`, rank order; `ascending`: whether all
// of them ascend): writes into `out` (numel elements) the sum of every rank's pairs, added at each
// position in rank order onto +0; AVG then divides every position by s.n. `seen` has room for
// numel bits.
//
// Where every rank's indices ascend (top-k's do), `out` is made in cache-sized chunks: each is
// zeroed, gets its pairs of every rank, and is divided while it is in cache, so `out` is written
// once, in order. Otherwise every rank's pairs are scatter-added over the whole of `out`, and AVG
// divides only the positions sent (found through `seen`): every other one holds +0, which the
// division leaves as it is. The bits are the same either way.
void reduce_decoded(const SparseSizes& s, const std::vector<SparsePairs>& pairs, bool ascending,
                    uint64_t* seen, void* out, ReduceOp op);

// ranges step 1: `from[q]` is the number of pairs rank q sends this owner; at most its count.
void check_owner_counts(const SparseSizes& s, const std::vector<size_t>& from);
// ranges step 2: `incoming` holds every rank's pairs for this owner, packed, back to back
// (from[q] pairs each). Zeroes this rank's range of `out` and scatter-adds them into it, in rank
// order; marks the positions touched in `touched` (the range's length, zeroed) and returns how
// many there are.
size_t add_owned_pairs(const SparseSizes& s, const char* incoming, const std::vector<size_t>& from,
                       void* out, uint8_t* touched);
// ranges step 3: every rank's piece size is its whole range, or whole pairs and smaller.
void check_piece_sizes(const SparseSizes& s, const std::vector<size_t>& piece_sizes);
// ranges step 3: `pieces` holds every rank's piece back to back (sizes checked by
// check_piece_sizes); writes every other rank's range of `out` from its piece.
void place_pieces(const SparseSizes& s, const char* pieces, const std::vector<size_t>& piece_sizes,
                  void* out);

}  // namespace ringcomm
