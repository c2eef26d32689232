#include "algorithms/select.h"

#include <algorithm>
#include <cmath>

#include "algorithms/context.h"
#include "common/error.h"

namespace ringcomm {

std::string LinkModel::describe() const {
  std::string text = str_cat(
      "alpha ", alpha_s * 1e6, " us per round, beta ", bytes_per_s / 1e9, " GB/s per link, reduce ",
      reduce_bytes_per_s / 1e9, " GB/s (a round = ", size_t(round_bytes()),
      " bytes); inside a host: alpha ", local_alpha_s * 1e6, " us, beta ", local_bytes_per_s / 1e9,
      " GB/s, single copy ", single_copy ? "on" : "off");
  if (factors.empty()) return text + "; times not measured";
  text += "; measured / estimate at";
  for (size_t point = 0; point < kMeasuredBytes.size(); ++point) {
    text += str_cat(point ? "," : "", " ", kMeasuredBytes[point], " bytes:");
    for (size_t a = 0; a < kMeasuredAlgorithms.size(); ++a)
      text += str_cat(" ", algorithm_name(kMeasuredAlgorithms[a]), " ", factors[point][a]);
  }
  return text;
}

constexpr bool powers_of_two(const std::array<size_t, kMeasuredBytes.size()>& sizes) {
  for (size_t b : sizes)
    if (b == 0 || (b & (b - 1)) != 0) return false;
  return true;
}
static_assert(powers_of_two(kMeasuredBytes), "LinkModel::factor reads their log2 off their bits");

// Runs on every auto all-reduce (Selector::all_reduce prices each algorithm): one log2, the
// measured sizes' own logarithms read off their bits (they are powers of two).
double LinkModel::factor(Algorithm algo, double bytes) const {
  if (factors.empty()) return 1;
  const auto column = std::find(kMeasuredAlgorithms.begin(), kMeasuredAlgorithms.end(), algo);
  if (column == kMeasuredAlgorithms.end()) return 1;
  const size_t a = size_t(column - kMeasuredAlgorithms.begin()), last = kMeasuredBytes.size() - 1;
  if (bytes <= double(kMeasuredBytes[0])) return factors[0][a];
  if (bytes >= double(kMeasuredBytes[last])) return factors[last][a];
  size_t hi = 1;
  while (double(kMeasuredBytes[hi]) < bytes) ++hi;
  const double lo_log = __builtin_ctzll(kMeasuredBytes[hi - 1]);
  const double at = (std::log2(bytes) - lo_log) / (__builtin_ctzll(kMeasuredBytes[hi]) - lo_log);
  return factors[hi - 1][a] + at * (factors[hi][a] - factors[hi - 1][a]);
}

namespace {

// A ring reduce-scatter or all-gather over `n` ranks of `bytes`: n-1 steps of 1/n of it.
double ring_half(double n, double bytes, double alpha, double beta) {
  return (n - 1) * (alpha + bytes / n / beta);
}

}  // namespace

double Selector::all_reduce_cost(Algorithm algo, double bytes) const {
  return estimate(algo, bytes) * model_.factor(algo, bytes);
}

// Between hosts (TCP), each round of recursive doubling and halving-doubling starts a bulk
// transfer on a connection idle since the call before, which TCP restarts from a small window,
// where the ring keeps its two connections streaming (docs/algorithms.md has the measurement).
// Where a host holds several ranks, rounds between them pay it too: an approximation on the
// side of the ring. Their calls also stall now and then, which no estimate holds: auto's spans
// measure that (retune.h).
constexpr double kExchangeOverTcp = 1.08;

double Selector::estimate(Algorithm algo, double bytes) const {
  const double n = n_;
  if (n_ <= 1) return 0;
  const double a = model_.alpha_s, b = model_.bytes_per_s, g = model_.reduce_bytes_per_s;
  const double exchange_b = hosts_ >= 2 ? b / kExchangeOverTcp : b;
  const int p = butterfly_size(n_);  // recursive doubling's and halving-doubling's
  const double rounds = std::log2(double(p));
  switch (algo) {
    case Algorithm::kRecursiveDoubling: {
      // log2(p) exchanges of the whole vector, each reduced; a fold and an unfold around them
      // when n is not a power of two.
      const double fold = p < n_ ? 2 : 0;
      return (rounds + fold) * (a + bytes / exchange_b) + (rounds + fold / 2) * bytes / g;
    }
    case Algorithm::kHalvingDoubling: {
      // a reduce-scatter by recursive halving and an all-gather by recursive doubling: the ring's
      // bytes in 2 log2(p) rounds; around them a fold and an unfold of the whole vector when n is
      // not a power of two
      const double share = double(p - 1) / p * bytes;
      const double fold = p < n_ ? 2 * (a + bytes / exchange_b) + bytes / g : 0;
      return 2 * rounds * a + 2 * share / exchange_b + share / g + fold;
    }
    case Algorithm::kTree: {
      // reduce up and broadcast down a binary tree, pipelined in chunks: each link carries the
      // vector once each way, and the depth's latency twice
      const double depth = std::ceil(std::log2(n));
      return 2 * depth * a + 2 * bytes / b + 2 * bytes / g;
    }
    case Algorithm::kSharedBuffer: {
      // each rank copies the others' slices onto its board and their results off theirs, and
      // reduces its slice from all n boards; two rounds of messages per board-full
      if (board_bytes_ == 0) return INFINITY;
      const double rounds = std::max(1.0, std::ceil(bytes / double(board_bytes_)));
      return 2 * rounds * a + 2 * (n - 1) / n * bytes / b + bytes / g;
    }
    case Algorithm::kHierarchical: {
      // ring reduce-scatter and all-gather inside the host over its links, and between them a
      // ring all-reduce of this rank's 1/K of the vector across the H hosts
      if (hosts_ < 2 || per_host_ < 2) return INFINITY;
      const double k = per_host_, h = hosts_, slice = bytes / k;
      const double la = model_.local_alpha_s, lb = model_.local_bytes_per_s;
      return 2 * ring_half(k, bytes, la, lb) + (k - 1) / k * bytes / g +
             2 * ring_half(h, slice, a, b) + (h - 1) / h * slice / g;
    }
    default:  // ring: reduce-scatter and all-gather, n-1 steps each with 1/n of the vector
      return 2 * ring_half(n, bytes, a, b) + (n - 1) / n * bytes / g;
  }
}

namespace {

// Costs equal but for rounding keep the earlier algorithm: halving-doubling on 2 ranks is the
// ring, and on 2 hosts of 2 with the same figures for both classes of links it costs what the
// hierarchical all-reduce does (the same shape, which knows the hosts).
constexpr Algorithm kAllReduceOrder[] = {
    Algorithm::kRing,         Algorithm::kRecursiveDoubling, Algorithm::kTree,
    Algorithm::kHierarchical, Algorithm::kHalvingDoubling,   Algorithm::kSharedBuffer};

}  // namespace

Algorithm Selector::all_reduce(size_t bytes) const {
  Algorithm best = kAllReduceOrder[0];
  double best_cost = all_reduce_cost(best, double(bytes));
  for (Algorithm a : kAllReduceOrder) {
    const double cost = all_reduce_cost(a, double(bytes));
    if (cost < best_cost * (1 - 1e-9)) best = a, best_cost = cost;
  }
  return best;
}

std::vector<Algorithm> Selector::all_reduce_candidates(size_t bytes, double within,
                                                       size_t most) const {
  const Algorithm chosen = all_reduce(bytes);
  double least = INFINITY;
  for (Algorithm a : kAllReduceOrder) least = std::min(least, estimate(a, double(bytes)));
  std::vector<Algorithm> others;
  for (Algorithm a : kAllReduceOrder)
    if (a != chosen && estimate(a, double(bytes)) <= within * least) others.push_back(a);
  std::stable_sort(others.begin(), others.end(), [&](Algorithm x, Algorithm y) {
    return all_reduce_cost(x, double(bytes)) < all_reduce_cost(y, double(bytes));
  });
  std::vector<Algorithm> out{chosen};
  for (Algorithm a : others)
    if (out.size() < most) out.push_back(a);
  return out;
}

double Selector::rooted_cost(Algorithm shape, double bytes, double chunk_bytes) const {
  if (n_ <= 1) return 0;
  const double a = model_.alpha_s, b = model_.bytes_per_s;
  if (shape == Algorithm::kChain) {
    // n-1 hops, pipelined: the first chunk crosses all of them, the rest follow one hop behind
    const double chunk = std::min(bytes, chunk_bytes);
    const double chunks = chunk > 0 ? std::ceil(bytes / chunk) : 1;
    return (n_ - 2 + chunks) * (a + chunk / b);
  }
  return std::ceil(std::log2(double(n_))) * (a + bytes / b);  // binomial: whole vector per level
}

Algorithm Selector::rooted(size_t bytes, size_t chunk_bytes) const {
  return rooted_cost(Algorithm::kChain, double(bytes), double(chunk_bytes)) <
                 rooted_cost(Algorithm::kBinomial, double(bytes), double(chunk_bytes))
             ? Algorithm::kChain
             : Algorithm::kBinomial;
}

SparseCosts sparse_costs(const Selector& select, const SparseSizes& s) {
  const double n = s.n;
  const LinkModel& m = select.model();
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
  // gather: every rank adds every other rank's pairs; ranges: the owner adds the pairs of its
  // range (scattered adds cost at least what a dense sum of the values would)
  c.gather = (packed_total - packed_total / n) / m.bytes_per_s + (n - 1) * m.alpha_s +
             (total - total / n) * s.out_size / m.reduce_bytes_per_s;
  c.ranges = (total / n * (n - 1) / n * pair + piece * (n - 1) / n) / m.bytes_per_s +
             (n + 1) * m.alpha_s + total / n * s.out_size / m.reduce_bytes_per_s;
  c.dense = select.all_reduce_cost(Algorithm::kRing, double(s.numel) * s.out_size);
  return c;
}

Algorithm cheapest_way(const SparseCosts& c) {
  if (c.dense <= c.gather && c.dense <= c.ranges) return Algorithm::kRing;
  return c.gather <= c.ranges ? Algorithm::kSparseGather : Algorithm::kSparseRanges;
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

CompressionCosts compression_costs(const Selector& select, size_t numel, size_t k,
                                   size_t value_size, size_t out_size, Algorithm dense_algo) {
  CompressionCosts c;
  c.dense = select.all_reduce_cost(dense_algo, double(numel) * out_size);
  const int n = select.ranks();
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
  SparseCosts ways = sparse_costs(select, s);
  const double counts = (n - 1) * select.model().alpha_s;  // step 0: the all-gather of counts
  c.sparse = counts + std::min({ways.gather, ways.ranges, ways.dense});
  c.way = cheapest_way(ways);
  return c;
}

}  // namespace ringcomm
