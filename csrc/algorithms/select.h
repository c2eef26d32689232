// Choosing an algorithm by its cost: an alpha-beta model of the links a collective crosses
// (alpha: seconds per round of messages a rank waits through; beta: payload bytes per second of
// one link; gamma: bytes per second one rank reduces), calibrated when a communicator connects
// (algorithms/probe.cc) and the same on every rank, so that every rank picks the same algorithm.
// Two classes of links: those a flat collective waits on (between hosts, when the ranks span
// several), and those inside a host (the hierarchical all-reduce's first and last steps).
// Costs are in seconds.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "algorithms/sparse_decode.h"
#include "transport/transport.h"

namespace ringcomm {

// The sizes at which the probe times the all-reduce algorithms, where all ranks, 3 or more, share
// one host, and those algorithms, in the order of LinkModel::factors' columns.
constexpr std::array<size_t, 6> kMeasuredBytes = {4 << 10, 64 << 10, 256 << 10,
                                                  1 << 20, 4 << 20,  16 << 20};
constexpr std::array<Algorithm, 5> kMeasuredAlgorithms = {
    Algorithm::kRing, Algorithm::kRecursiveDoubling, Algorithm::kTree, Algorithm::kHalvingDoubling,
    Algorithm::kSharedBuffer};

struct LinkModel {
  double alpha_s = 16e-6;  // defaults: TCP loopback on a small machine
  double bytes_per_s = 4e9;
  double reduce_bytes_per_s = 4e9;
  // Inside a host; probed apart where the ranks span several hosts with several on each (the
  // hierarchical all-reduce's layout), else the same as above.
  double local_alpha_s = 16e-6;
  double local_bytes_per_s = 4e9;
  // Local ranks move large messages by single copy (transport/shm): kept where measured faster
  // than the slots (the probe applies only while RINGCOMM_SHM_SINGLE_COPY_BYTES is left to its
  // default); once agreed, false if any rank with local peers has it off.
  bool single_copy = true;
  // Where all ranks, 3 or more, share one host, the probe times the all-reduce algorithms at a few
  // sizes (probe_algorithms): what each took over its estimate by the figures above, at each of
  // kMeasuredBytes, for each of kMeasuredAlgorithms. Estimates are scaled by it (Selector). Empty
  // where not measured: every factor is then 1.
  std::vector<std::array<double, kMeasuredAlgorithms.size()>> factors;
  // The factor for `algo` at `bytes`: the nearest size's beyond the sizes measured, between two
  // of them linear in log2(bytes); 1 for the hierarchical all-reduce and where not measured.
  double factor(Algorithm algo, double bytes) const;
  // Bytes a link moves in one round's latency: what a round is worth against bytes.
  double round_bytes() const { return alpha_s * bytes_per_s; }
  std::string describe() const;
};

class Selector {
 public:
  // `hosts`: the hosts the ranks span (from 2, flat collectives cross TCP links); `per_host`
  // ranks on each when the hierarchical all-reduce can run on the ranks (HostLayout::uniform),
  // else 0. `board_bytes`: the size of the boards when the shared-buffer all-reduce can
  // (Context::has_boards), else 0.
  Selector(int n, LinkModel model, int hosts = 0, int per_host = 0, size_t board_bytes = 0)
      : n_(n), model_(model), hosts_(hosts), per_host_(per_host), board_bytes_(board_bytes) {}
  int ranks() const { return n_; }
  const LinkModel& model() const { return model_; }
  // The same ranks and layout priced by another model.
  Selector with_model(const LinkModel& model) const {
    Selector s = *this;
    s.model_ = model;
    return s;
  }

  // A dense all-reduce of `bytes` by ring, tree, recursive doubling, halving-doubling or (when
  // the ranks allow) shared buffer or hierarchical: the estimate below, scaled by the measured
  // factor.
  double all_reduce_cost(Algorithm algo, double bytes) const;
  // The same by the alpha-beta figures alone.
  double estimate(Algorithm algo, double bytes) const;
  // The cheapest of them.
  Algorithm all_reduce(size_t bytes) const;
  // The cheapest, then the others that the alpha-beta figures alone (estimate) put within
  // `within` times the least estimate, by their cost: at most `most` (the candidates auto times
  // as it runs, algorithms/retune.h).
  std::vector<Algorithm> all_reduce_candidates(size_t bytes, double within, size_t most) const;
  // Broadcast and reduce: a binomial tree or a pipelined chain (chunks of `chunk_bytes`).
  double rooted_cost(Algorithm shape, double bytes, double chunk_bytes) const;
  Algorithm rooted(size_t bytes, size_t chunk_bytes) const;

 private:
  int n_;
  LinkModel model_;
  int hosts_, per_host_;
  size_t board_bytes_;
};

// The sparse all-reduce's ways after its step 0 (every rank's pair count and packed size known).
struct SparseCosts {
  double gather;  // all-gather every rank's packed pairs
  double ranges;  // range-partitioned reduce-scatter of pairs, then all-gather of the sums
  double dense;   // scatter the pairs, ring all-reduce
};
SparseCosts sparse_costs(const Selector& select, const SparseSizes& s);
// The cheapest of them: kRing (dense), kSparseGather or kSparseRanges; ties to dense, then gather.
Algorithm cheapest_way(const SparseCosts& c);

// Bytes per index of zigzag-varint deltas for ascending indices spread evenly at this density.
double varint_delta_bytes(double density);

// Before anything is exchanged, for a caller choosing whether to send a vector of `numel`
// elements densely or as its top k: the sparse all-reduce with k pairs on every rank (step 0's
// count exchange included, the cheapest way after it, `way`), and the dense all-reduce of the
// vector by `dense_algo`.
struct CompressionCosts {
  double sparse, dense;
  Algorithm way = Algorithm::kSparseGather;
};
CompressionCosts compression_costs(const Selector& select, size_t numel, size_t k,
                                   size_t value_size, size_t out_size, Algorithm dense_algo);

}  // namespace ringcomm
