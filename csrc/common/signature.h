// What a message belongs to: the tag every message carries (transport/transport.h), naming the
// collective, its sequence number, dtype, count and the rest that two ranks must agree on. The
// numeric values are part of the wire header, so they never change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace ringcomm {

enum class Collective : uint8_t {
  kAllReduce = 1,
  kReduceScatter = 2,
  kAllGather = 3,
  kAllGatherV = 4,
  kBroadcast = 5,
  kReduce = 6,
  kBarrier = 7,
  kSendRecv = 8,
  kSparseAllReduce = 9,
  // One bucket of a coalesced call each (algorithms/coalesced.cc).
  kAllReduceCoalesced = 10,
  kBroadcastCoalesced = 11,
  kAllGatherCoalesced = 12,
  kGather = 13,
  kScatter = 14,
  kAllToAll = 15,
  // The link probe and its agreements, while a communicator connects (algorithms/probe.cc).
  kProbe = 16,
};
const char* collective_name(Collective c);

enum class Algorithm : uint8_t {
  kAuto = 0,
  kRing = 1,
  kTree = 2,
  kRecursiveDoubling = 3,
  kChain = 4,
  kBinomial = 5,
  kDissemination = 6,
  kDirect = 7,
  kSparseGather = 8,
  kSparseRanges = 9,
  kHierarchical = 10,
  kNccl = 11,  // NCCL's own ncclAllReduce, beside ringcomm's schedules over NCCL
  kHalvingDoubling = 12,
  kSharedBuffer = 13,
  kOneShot = 14,  // every rank folds every rank's whole buffer (device windows)
  // Step lists registered by name (algorithms/registered.h); the signature's aux holds their id.
  kRegistered = 15,
};
const char* algorithm_name(Algorithm a);
// The algorithms all_reduce can be asked for by name (algorithm=, RINGCOMM_ALGO), auto aside.
constexpr Algorithm kAllReduceAlgorithms[] = {Algorithm::kRing,
                                              Algorithm::kTree,
                                              Algorithm::kRecursiveDoubling,
                                              Algorithm::kHalvingDoubling,
                                              Algorithm::kSharedBuffer,
                                              Algorithm::kHierarchical};
// The same for sparse_all_reduce (kRing: scatter locally, then the dense ring all-reduce).
constexpr Algorithm kSparseAllReduceAlgorithms[] = {Algorithm::kRing, Algorithm::kSparseGather,
                                                    Algorithm::kSparseRanges};
// Whether `list` (one of the two above) holds `a`.
template <size_t N>
constexpr bool listed(const Algorithm (&list)[N], Algorithm a) {
  for (Algorithm x : list)
    if (x == a) return true;
  return false;
}

// Two ranks agree on an operation iff their signatures are equal.
struct Signature {
  Collective coll = Collective::kBarrier;
  DType dtype = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  Algorithm algo = Algorithm::kAuto;
  bool p2p = false;   // send/recv: sequence numbers count per peer pair, not per communicator
  int32_t root = -1;  // src/dst of rooted collectives, -1 otherwise
  uint64_t seq = 0;
  uint64_t count = 0;  // elements
  uint64_t aux = 0;    // all_gatherv: a hash of the per-rank counts; send/recv: the tag

  bool operator==(const Signature& o) const;
  bool operator!=(const Signature& o) const { return !(*this == o); }
  std::string describe() const;
};

// A hash of per-rank counts (FNV-1a over their bytes): the aux of an all_gatherv's signature.
uint64_t hash_counts(const size_t* counts, size_t n);

// The names of registered step lists by their id, for describe() and the reports of what ran
// (the timeline, Work stats): kept for the life of the process.
void name_registered_lists(uint64_t id, const std::string& name);
// algorithm_name(sig.algo), or for kRegistered the name its lists were registered under here
// ("registered" where they were not).
const char* algorithm_name(const Signature& sig);

}  // namespace ringcomm
