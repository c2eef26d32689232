#include "algorithms/reduction_order.h"

#include <algorithm>
#include <functional>

#include "algorithms/context.h"
#include "kernels/cpu/reduce.h"

namespace ringcomm {

int ReductionProgram::add(int a, int b) {
  steps_.push_back({a, b});
  return n_ + int(steps_.size()) - 1;
}

void ReductionProgram::finish() {
  std::vector<int> free_temps;
  temp_of_.assign(steps_.size(), -1);
  for (size_t j = 0; j < steps_.size(); ++j) {
    // Every result is used once, by a later step: its temporary is free from then on (a step may
    // write over its own operand, element by element).
    for (int v : {steps_[j].a, steps_[j].b})
      if (v >= n_) free_temps.push_back(temp_of_[size_t(v - n_)]);
    if (free_temps.empty()) {
      temp_of_[j] = temps_++;
    } else {
      temp_of_[j] = free_temps.back();
      free_temps.pop_back();
    }
  }
}

void ReductionProgram::run(DType dtype, ReduceOp op, const char* const* inputs, char* out,
                           size_t count, char* scratch) const {
  if (steps_.size() == 1) {  // two ranks, or any single combination: no temporaries, one pass
    cpu::reduce(dtype, op, out, inputs[steps_[0].a], inputs[steps_[0].b], count);
    return;
  }
  const size_t e = dtype_size(dtype);
  for (size_t off = 0; off < count; off += kBlock) {
    const size_t len = std::min(kBlock, count - off);
    auto temp = [&](size_t step) { return scratch + size_t(temp_of_[step]) * kBlock * e; };
    auto operand = [&](int v) -> const char* {
      return v < n_ ? inputs[v] + off * e : temp(size_t(v - n_));
    };
    for (size_t j = 0; j < steps_.size(); ++j) {
      char* dst = j + 1 == steps_.size() ? out + off * e : temp(j);
      cpu::reduce(dtype, op, dst, operand(steps_[j].a), operand(steps_[j].b), len);
    }
  }
}

void ReductionOrders::ranges(Algorithm algo, size_t count, size_t base,
                             std::vector<OrderedRange>& out) {
  auto append = [&](size_t begin, size_t n, int program) {
    if (n == 0) return;
    if (!out.empty() && out.back().program == program &&
        out.back().begin + out.back().count == base + begin) {
      out.back().count += n;  // e.g. many small buffers, all by recursive doubling
      return;
    }
    out.push_back({base + begin, n, program});
  };
  switch (algo) {
    case Algorithm::kRecursiveDoubling: append(0, count, program_id(algo, 0)); return;
    case Algorithm::kRing: {
      Segments seg(count, n_);
      for (int k = 0; k < n_; ++k) append(seg.offset(k), seg.count(k), program_id(algo, k));
      return;
    }
    case Algorithm::kTree:
      append(0, count / 2, program_id(algo, 0));
      append(count / 2, count - count / 2, program_id(algo, 1));
      return;
    case Algorithm::kHierarchical: {
      const int k = int(layout_.hosts.at(0).size()), h = int(layout_.hosts.size());
      Segments local(count, k);
      for (int j = 0; j < k; ++j) {
        Segments across(local.count(j), h);
        for (int i = 0; i < h; ++i)
          append(local.offset(j) + across.offset(i), across.count(i), program_id(algo, j * h + i));
      }
      return;
    }
    default: RC_INVALID("no reduction order for algorithm ", algorithm_name(algo));
  }
}

int ReductionOrders::program_id(Algorithm algo, int piece) {
  auto key = std::make_pair(algo, piece);
  auto it = std::find(keys_.begin(), keys_.end(), key);
  if (it != keys_.end()) return int(it - keys_.begin());
  keys_.push_back(key);
  programs_.push_back(build(algo, piece));
  return int(programs_.size()) - 1;
}

// `piece`: the ring segment, the tree half (1: the mirrored tree), or for the hierarchical
// algorithm j * hosts + h (host segment j, piece h of it).
ReductionProgram ReductionOrders::build(Algorithm algo, int piece) const {
  const int n = n_;
  RC_CHECK_ARG(n >= 2, "reduction orders need at least two ranks");
  ReductionProgram prog(n);
  // Segment k of a ring over `ranks` (operands) starts at index k+1 and travels around; each
  // combines (its own value) op (what arrived).
  auto ring = [&](const std::vector<int>& ranks, int k) {
    const int m = int(ranks.size());
    int acc = ranks[size_t((k + 1) % m)];
    for (int j = 2; j <= m; ++j) acc = prog.add(ranks[size_t((k + j) % m)], acc);
    return acc;
  };
  if (algo == Algorithm::kRecursiveDoubling) {
    int p = 1;
    while (p * 2 <= n) p *= 2;
    const int rem = n - p;
    // Butterfly index i starts from ranks 2i, 2i+1 folded (i < rem) or from rank i + rem; each
    // exchange combines (lower index's value) op (higher index's value).
    auto leaf = [&](int i) { return i < rem ? prog.add(2 * i, 2 * i + 1) : i + rem; };
    std::function<int(int, int)> span = [&](int lo, int len) {
      return len == 1 ? leaf(lo) : prog.add(span(lo, len / 2), span(lo + len / 2, len / 2));
    };
    span(0, p);
  } else if (algo == Algorithm::kRing) {
    std::vector<int> all(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) all[size_t(r)] = r;
    ring(all, piece);
  } else if (algo == Algorithm::kHierarchical) {
    const int hosts = int(layout_.hosts.size());
    std::vector<int> sums;  // each host's sum of segment piece / hosts, by ring over its ranks
    for (const std::vector<int>& host : layout_.hosts) sums.push_back(ring(host, piece / hosts));
    ring(sums, piece % hosts);
  } else {
    const bool mirrored = piece == 1;
    auto rank_at = [&](int pos) { return mirrored ? n - 1 - pos : pos; };
    std::function<int(int)> node = [&](int pos) {
      int acc = rank_at(pos);
      for (int child : {2 * pos + 1, 2 * pos + 2})
        if (child < n) acc = prog.add(acc, node(child));
      return acc;
    };
    node(0);
  }
  prog.finish();
  return prog;
}

}  // namespace ringcomm
