// Which ranks share a host (Mesh::host_of), for the hierarchical all-reduce and its reduction
// order.
#pragma once

#include <vector>

namespace ringcomm {

// Ranks grouped by host, for the hierarchical all-reduce.
struct HostLayout {
  std::vector<std::vector<int>> hosts;  // each host's ranks, ascending; hosts by their lowest rank
  // From each rank's host (Mesh::host_of).
  static HostLayout of(const std::vector<int>& host_of);
  // More than one host, and the same number (more than one) of ranks on each.
  bool uniform() const;
  // `rank`'s host, and the ranks at its place (its index on its host) on every host, in host order.
  const std::vector<int>& local(int rank) const;
  std::vector<int> across(int rank) const;
};

}  // namespace ringcomm
