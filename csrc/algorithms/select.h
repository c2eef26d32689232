// Cost estimates that choose between exchanges. A cost is the bytes a rank puts on the wire plus
// kRoundBytes for every round of messages it waits through: a round's latency expressed as the
// bytes a link moves meanwhile. Uncalibrated: the same constant for every transport.
#pragma once

#include <cstddef>

#include "algorithms/sparse_decode.h"
#include "transport/transport.h"

namespace ringcomm {

constexpr double kRoundBytes = 64 << 10;

// A dense all-reduce of `bytes` over n ranks by `algo` (ring, tree or recursive doubling).
double all_reduce_cost(Algorithm algo, int n, double bytes);

// The sparse all-reduce's ways after its step 0 (every rank's pair count and packed size known).
struct SparseCosts {
  double gather;  // all-gather every rank's packed pairs
  double ranges;  // range-partitioned reduce-scatter of pairs, then all-gather of the sums
  double dense;   // scatter the pairs, ring all-reduce
};
SparseCosts sparse_costs(const SparseSizes& s);

// Bytes per index of zigzag-varint deltas for ascending indices spread evenly at this density.
double varint_delta_bytes(double density);

// Before anything is exchanged, for a caller choosing whether to send a vector of `numel`
// elements densely or as its top k: the sparse all-reduce with k pairs on every rank (step 0's
// count exchange included, the cheapest way after it), and the dense all-reduce of the vector.
struct CompressionCosts {
  double sparse, dense;
};
CompressionCosts compression_costs(int n, size_t numel, size_t k, size_t value_size,
                                   size_t out_size, Algorithm dense_algo);

}  // namespace ringcomm
