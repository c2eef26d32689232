#include "algorithms/select.h"

#include <algorithm>
#include <cmath>

namespace ringcomm {

double all_reduce_cost(Algorithm algo, int n, double bytes) {
  if (n <= 1) return 0;
  const double steps = std::ceil(std::log2(double(n)));
  switch (algo) {
    case Algorithm::kRecursiveDoubling:  // log2(n) exchanges of the whole vector
      return steps * (bytes + kRoundBytes);
    case Algorithm::kTree:  // reduce up and broadcast down: each link carries it once each way
      return 2 * steps * kRoundBytes + 2 * bytes;
    default:  // ring: reduce-scatter and all-gather, n-1 steps each, 1/n of it per step
      return 2 * (n - 1) * (kRoundBytes + bytes / n);
  }
}

SparseCosts sparse_costs(const SparseSizes& s) {
  const double n = s.n;
  double total = 0, none_hit = 1, packed_total = 0;
  for (size_t k : s.k) {
    total += double(k);
    none_hit *= 1.0 - double(k) / double(std::max<size_t>(1, s.numel));
  }
  for (size_t b : s.packed) packed_total += double(b);
  const double pair = 4.0 + double(s.value_size);
  const double expected_union = double(s.numel) * (1.0 - none_hit);
  const double piece = std::min(expected_union * (4.0 + s.out_size), double(s.numel) * s.out_size);
  SparseCosts c;
  c.gather = (packed_total - packed_total / n) + (n - 1) * kRoundBytes;
  c.ranges = total / n * (n - 1) / n * pair + piece * (n - 1) / n + (n + 1) * kRoundBytes;
  c.dense = all_reduce_cost(Algorithm::kRing, s.n, double(s.numel) * s.out_size);
  return c;
}

double varint_delta_bytes(double density) {
  // A zigzag delta d takes 1 + floor(log2(2d) / 7) bytes; deltas between evenly spread ascending
  // indices are about geometric with mean 1/density, so P(d >= x) ~ exp(-density x).
  double bytes = 1;
  for (double limit = 128; limit < 1e19; limit *= 128) {
    double p = std::exp(-density * limit / 2);
    bytes += p;
    if (p < 1e-6) break;
  }
  return bytes;
}

CompressionCosts compression_costs(int n, size_t numel, size_t k, size_t value_size,
                                   size_t out_size, Algorithm dense_algo) {
  CompressionCosts c;
  c.dense = all_reduce_cost(dense_algo, n, double(numel) * out_size);
  if (n <= 1) {
    c.sparse = 0;
    return c;
  }
  SparseSizes s(n, 0, numel, DType::kFloat32, DType::kFloat32);
  s.value_size = value_size;
  s.out_size = out_size;
  k = std::min(k, numel);
  const double density = numel ? double(k) / double(numel) : 1.0;
  s.k.assign(n, k);
  s.packed.assign(n, size_t(double(k) * (varint_delta_bytes(density) + double(value_size))));
  SparseCosts ways = sparse_costs(s);
  const double counts = (n - 1) * kRoundBytes;  // step 0: the all-gather of counts and sizes
  c.sparse = counts + std::min({ways.gather, ways.ranges, ways.dense});
  return c;
}

}  // namespace ringcomm
