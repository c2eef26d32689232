#include "common/signature.h"

#include <map>
#include <memory>
#include <mutex>

#include "common/error.h"

namespace ringcomm {
namespace {

std::mutex names_mu;
std::map<uint64_t, std::unique_ptr<const std::string>>& registered_names() {
  static std::map<uint64_t, std::unique_ptr<const std::string>> names;
  return names;
}

}  // namespace

void name_registered_lists(uint64_t id, const std::string& name) {
  std::lock_guard<std::mutex> lk(names_mu);
  auto& names = registered_names();
  if (!names.count(id)) names[id] = std::make_unique<const std::string>(name);
}

const char* algorithm_name(const Signature& sig) {
  if (sig.algo != Algorithm::kRegistered) return algorithm_name(sig.algo);
  std::lock_guard<std::mutex> lk(names_mu);
  auto& names = registered_names();
  auto it = names.find(sig.aux);
  return it == names.end() ? "registered" : it->second->c_str();
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kAllGatherV:
      return "all_gatherv";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kReduce:
      return "reduce";
    case Collective::kBarrier:
      return "barrier";
    case Collective::kSendRecv:
      return "send/recv";
    case Collective::kSparseAllReduce:
      return "sparse_all_reduce";
    case Collective::kAllReduceCoalesced:
      return "all_reduce_coalesced";
    case Collective::kBroadcastCoalesced:
      return "broadcast_coalesced";
    case Collective::kAllGatherCoalesced:
      return "all_gather_coalesced";
    case Collective::kGather:
      return "gather";
    case Collective::kScatter:
      return "scatter";
    case Collective::kAllToAll:
      return "all_to_all";
    case Collective::kProbe:
      return "link probe";
  }
  return "unknown-collective";
}

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto:
      return "auto";
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kTree:
      return "tree";
    case Algorithm::kRecursiveDoubling:
      return "recursive_doubling";
    case Algorithm::kChain:
      return "chain";
    case Algorithm::kBinomial:
      return "binomial";
    case Algorithm::kDissemination:
      return "dissemination";
    case Algorithm::kDirect:
      return "direct";
    case Algorithm::kSparseGather:
      return "sparse_gather";
    case Algorithm::kSparseRanges:
      return "sparse_ranges";
    case Algorithm::kHierarchical:
      return "hierarchical";
    case Algorithm::kNccl:
      return "nccl";
    case Algorithm::kHalvingDoubling:
      return "halving_doubling";
    case Algorithm::kSharedBuffer:
      return "shared_buffer";
    case Algorithm::kOneShot:
      return "one_shot";
    case Algorithm::kRegistered:
      return "registered";
  }
  return "unknown-algorithm";
}

bool Signature::operator==(const Signature& o) const {
  return coll == o.coll && dtype == o.dtype && op == o.op && algo == o.algo && p2p == o.p2p &&
         root == o.root && seq == o.seq && count == o.count && aux == o.aux;
}

uint64_t hash_counts(const size_t* counts, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t k = 0; k < n; ++k)
    for (int i = 0; i < 8; ++i) h = (h ^ ((counts[k] >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
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
  if (algo == Algorithm::kRegistered)
    return s + str_cat(", algorithm=", algorithm_name(*this), " (lists ", std::hex, aux, "))");
  return s + str_cat(", algorithm=", algorithm_name(algo), ")");
}

}  // namespace ringcomm
