#include "algorithms/reduction_order.h"

#include <algorithm>

#include "algorithms/algorithms.h"
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

std::string ReductionProgram::describe() const {
  std::vector<std::string> value;  // of each step
  auto operand = [&](int v) { return v < n_ ? std::to_string(v) : value[size_t(v - n_)]; };
  for (const Step& s : steps_) value.push_back("(" + operand(s.a) + " " + operand(s.b) + ")");
  return value.empty() ? std::string() : value.back();
}

void ReductionOrders::ranges(Algorithm algo, size_t count, size_t base,
                             std::vector<OrderedRange>& out) const {
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
    case Algorithm::kRecursiveDoubling:
    case Algorithm::kHalvingDoubling:
    case Algorithm::kRing:
    case Algorithm::kTree: {
      const Segments blocks = all_reduce_blocks(algo, n_, count);
      for (int b = 0; b < blocks.size(); ++b)
        append(blocks.offset(b), blocks.count(b), program_id(algo, b));
      return;
    }
    case Algorithm::kSharedBuffer:
      append(0, count, program_id(algo, 0));
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
    default:
      RC_INVALID("no reduction order for algorithm ", algorithm_name(algo));
  }
}

int ReductionOrders::program_id(Algorithm algo, int piece) const {
  auto it = std::find_if(keys_.begin(), keys_.end(),
                         [&](const Key& k) { return k.algo == algo && k.piece == piece; });
  RC_CHECK_ARG(it != keys_.end(), "no reduction order for piece ", piece, " of ",
               algorithm_name(algo));
  return it->program;
}

bool ReductionOrders::has(Algorithm algo) const {
  return std::any_of(keys_.begin(), keys_.end(), [&](const Key& k) { return k.algo == algo; });
}

namespace {

// The program that computes `node`'s expression from the ranks' contributions.
int emit(ReductionProgram& prog, const Expressions& expr, int node) {
  const Expressions::Node& x = expr.nodes[size_t(node)];
  if (x.leaf >= 0) return x.leaf;
  const int a = emit(prog, expr, x.a);
  return prog.add(a, emit(prog, expr, x.b));
}

// Each block's final expression when every rank runs `schedule_of(m, rank)` with rank i's
// value starting as initial[i].
template <typename ScheduleOf>
std::vector<int> run_all(ScheduleOf schedule_of, int blocks, const std::vector<int>& initial,
                         Expressions& expr) {
  const int m = int(initial.size());
  std::vector<Schedule> schedules;
  for (int r = 0; r < m; ++r) schedules.push_back(schedule_of(m, r));
  return simulate_schedules(schedules, blocks, initial, expr);
}

}  // namespace

// Pieces: the ring's segments, the tree's halves, recursive doubling's and the shared buffer's
// one, halving-doubling's p blocks, or for the
// hierarchical algorithm j * hosts + h (host segment j, piece h of it).
void ReductionOrders::require(Algorithm algo) {
  if (has(algo)) return;
  const int n = n_;
  RC_CHECK_ARG(n >= 2, "reduction orders need at least two ranks");
  Expressions expr;
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(expr.leaf(r));
  std::vector<int> pieces;  // each piece's final expression
  switch (algo) {
    case Algorithm::kRecursiveDoubling:
      pieces = run_all(recursive_doubling_schedule, 1, ranks, expr);
      break;
    case Algorithm::kRing:
      pieces = run_all(ring_all_reduce_schedule, n, ranks, expr);
      break;
    case Algorithm::kTree:
      pieces = run_all(double_tree_all_reduce_schedule, 2, ranks, expr);
      break;
    case Algorithm::kHalvingDoubling:
      pieces = run_all(halving_doubling_schedule, butterfly_size(n), ranks, expr);
      break;
    case Algorithm::kSharedBuffer: {  // one expression for every element: rank order
      int node = ranks[0];
      for (int r = 1; r < n; ++r) node = expr.combine(node, ranks[size_t(r)]);
      pieces.push_back(node);
      break;
    }
    case Algorithm::kHierarchical: {
      // Inside each host, a ring reduce-scatter over its ranks; then, for each host segment j,
      // a ring all-reduce over the hosts' sums of it.
      const int k = int(layout_.hosts.at(0).size());
      std::vector<std::vector<int>> host_sums;
      for (const std::vector<int>& host : layout_.hosts) {
        std::vector<int> initial;
        for (int r : host) initial.push_back(ranks[size_t(r)]);
        host_sums.push_back(run_all(ring_reduce_scatter_schedule, k, initial, expr));
      }
      for (int j = 0; j < k; ++j) {
        std::vector<int> initial;
        for (const std::vector<int>& sums : host_sums) initial.push_back(sums[size_t(j)]);
        for (int node : run_all(ring_all_reduce_schedule, int(initial.size()), initial, expr))
          pieces.push_back(node);
      }
      break;
    }
    default:
      RC_INVALID("no reduction order for algorithm ", algorithm_name(algo));
  }
  for (size_t p = 0; p < pieces.size(); ++p) {
    ReductionProgram prog(n);
    emit(prog, expr, pieces[p]);
    prog.finish();
    auto same = std::find(programs_.begin(), programs_.end(), prog);
    keys_.push_back({algo, int(p), int(same - programs_.begin())});
    if (same == programs_.end()) programs_.push_back(std::move(prog));
  }
}

}  // namespace ringcomm
