// Hierarchical all-reduce, for ranks on several hosts with K > 1 of them on each (HostLayout):
// the buffer crosses the hosts' links once per host instead of the ring's 2(n-1)/n times.
//
// With H hosts of K ranks, this rank the j-th of its host:
//   1. inside the host (a view of its K ranks): ring reduce-scatter in place; segment j
//      (Segments(count, K)) now holds the host's sum of it.
//   2. across hosts (a view of the H ranks that are j-th on theirs): ring all-reduce of segment j;
//      every local index works on its own segment at once, so all K ranks' links carry traffic.
//   3. inside the host: ring all-gather of the K segments.
// Bytes on the wire per rank: 2(K-1)/K S inside the host (shared memory, usually) and
// 2(H-1)/H S/K across hosts; per host, 2(H-1)/H S leave through its link, against the flat
// ring's 2(n-1)/n S when the ring crosses each host link once each way. An element of segment j,
// piece h of it (Segments(count_j, H)), is summed in ring order over its host's ranks (piece j),
// then in ring order over the hosts' sums (piece h); reduction_order.cc replays that. avg divides
// the final sum by n once, after step 2.
#include "algorithms/algorithms.h"
#include "kernels/cpu/reduce.h"

namespace ringcomm {

HostLayout HostLayout::of(const std::vector<int>& host_of) {
  HostLayout layout;
  std::vector<int> first;  // each host's lowest rank
  for (size_t r = 0; r < host_of.size(); ++r) {
    size_t h = size_t(std::find(first.begin(), first.end(), host_of[r]) - first.begin());
    if (h == first.size()) {
      first.push_back(host_of[r]);
      layout.hosts.emplace_back();
    }
    layout.hosts[h].push_back(int(r));
  }
  return layout;
}

bool HostLayout::uniform() const {
  if (hosts.size() < 2 || hosts[0].size() < 2) return false;
  for (const auto& h : hosts)
    if (h.size() != hosts[0].size()) return false;
  return true;
}

const std::vector<int>& HostLayout::local(int rank) const {
  for (const auto& h : hosts)
    if (std::find(h.begin(), h.end(), rank) != h.end()) return h;
  RC_INVALID("rank ", rank, " is on no host");
}

std::vector<int> HostLayout::across(int rank) const {
  const std::vector<int>& mine = local(rank);
  const size_t j = size_t(std::find(mine.begin(), mine.end(), rank) - mine.begin());
  std::vector<int> ranks;
  for (const auto& h : hosts) ranks.push_back(h[j]);
  return ranks;
}

void hierarchical_all_reduce(Context& ctx, const HostLayout& layout, void* buf, size_t count,
                             DType dtype, ReduceOp op) {
  const int me = ctx.rank();
  Context host = ctx.view(layout.local(me));
  const ReduceOp sum = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  ring_reduce_scatter_in_place(host, buf, count, dtype, sum);
  const Segments seg(count, host.size());
  char* own = static_cast<char*>(buf) + seg.offset(host.rank()) * dtype_size(dtype);
  Context hosts = ctx.view(layout.across(me));
  ring_all_reduce(hosts, own, seg.count(host.rank()), dtype, sum);
  if (op == ReduceOp::kAvg) cpu::divide(dtype, own, seg.count(host.rank()), ctx.size());
  std::vector<size_t> counts;
  for (int k = 0; k < host.size(); ++k) counts.push_back(seg.count(k));
  ring_all_gather(host, buf, counts, dtype);
  ctx.finish();
}

}  // namespace ringcomm
