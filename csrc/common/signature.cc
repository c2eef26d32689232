#include "common/signature.h"

#include "common/error.h"

namespace ringcomm {

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "all_gather";
    case Collective::kAllGatherV: return "all_gatherv";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReduce: return "reduce";
    case Collective::kBarrier: return "barrier";
    case Collective::kSendRecv: return "send/recv";
    case Collective::kSparseAllReduce: return "sparse_all_reduce";
    case Collective::kAllReduceCoalesced: return "all_reduce_coalesced";
    case Collective::kBroadcastCoalesced: return "broadcast_coalesced";
    case Collective::kAllGatherCoalesced: return "all_gather_coalesced";
    case Collective::kGather: return "gather";
    case Collective::kScatter: return "scatter";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kProbe: return "link probe";
  }
  return "unknown-collective";
}

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kRecursiveDoubling: return "recursive_doubling";
    case Algorithm::kChain: return "chain";
    case Algorithm::kBinomial: return "binomial";
    case Algorithm::kDissemination: return "dissemination";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kSparseGather: return "sparse_gather";
    case Algorithm::kSparseRanges: return "sparse_ranges";
    case Algorithm::kHierarchical: return "hierarchical";
    case Algorithm::kNccl: return "nccl";
    case Algorithm::kHalvingDoubling: return "halving_doubling";
    case Algorithm::kSharedBuffer: return "shared_buffer";
    case Algorithm::kOneShot: return "one_shot";
  }
  return "unknown-algorithm";
}

bool Signature::operator==(const Signature& o) const {
  return coll == o.coll && dtype == o.dtype && op == o.op && algo == o.algo && p2p == o.p2p &&
         root == o.root && seq == o.seq && count == o.count && aux == o.aux;
}

std::string Signature::describe() const {
  std::string s = str_cat(collective_name(coll), "(", p2p ? "p2p seq=" : "seq=", seq,
                          ", count=", count, ", ", dtype_name(dtype));
  if (coll == Collective::kAllReduce || coll == Collective::kReduceScatter ||
      coll == Collective::kReduce || coll == Collective::kSparseAllReduce ||
      coll == Collective::kAllReduceCoalesced)
    s += str_cat(", op=", op_name(op));
  if (root >= 0) s += str_cat(", root=", root);
  if (coll == Collective::kAllGatherV) s += str_cat(", counts hash=", aux);
  if (coll == Collective::kSendRecv && aux != 0) s += str_cat(", tag=", aux);
  if (coll == Collective::kAllReduceCoalesced || coll == Collective::kBroadcastCoalesced ||
      coll == Collective::kAllGatherCoalesced)
    s += str_cat(", layout hash=", aux);
  return s + str_cat(", algorithm=", algorithm_name(algo), ")");
}

}  // namespace ringcomm
