// The order in which all_reduce combines the ranks' contributions to an element, for each of its
// algorithms, as a program of binary steps that can be replayed on any buffer.
//
// One all_reduce per buffer picks its algorithm by the buffer's size, and the order of the
// combinations (which matters for floating-point sums and products) follows from the algorithm,
// the number of ranks and the block of the buffer the element sits in. The programs are not
// written out here: they are what simulate_schedules (schedule.h) finds when it runs every
// rank's step list of the algorithm, the same lists the algorithm executes:
//   recursive doubling (recursive_doubling.cc): one block, the whole buffer;
//   ring (ring.cc): segment k, Segments(count, n), for k = 0 .. n-1;
//   halving-doubling (halving_doubling.cc): block k, Segments(count, p), p the largest power of
//     two <= n;
//   double binary tree (tree.cc): the two halves, tree_halves(count);
//   shared buffer (shared_buffer.cc): the whole buffer, in rank order (not a step list: every
//     element is reduced at one rank over all contributions at once);
//   hierarchical (hierarchical.cc): host segment j, piece h of it: the ring reduce-scatter's
//     segment j over each host's ranks, then the ring all-reduce's segment h over the hosts'.
// A coalesced all-reduce (coalesced.cc) reduces each element at one rank that has every rank's
// contribution, so it can use any order: it replays the one all_reduce would have used, which
// makes its results bitwise equal to one all_reduce per buffer. tests/test_fusion.py checks the
// two against each other for every algorithm; a change to an algorithm's order must change the
// program built here too.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "algorithms/host_layout.h"
#include "common/dtype.h"
#include "transport/transport.h"

namespace ringcomm {

class ReductionProgram {
 public:
  // Operands 0 .. n-1 are the ranks' contributions; n + j is the result of step j. The last
  // step's result is the reduced value.
  struct Step {
    int a, b;  // result = a op b
  };
  explicit ReductionProgram(int n) : n_(n) {}
  int add(int a, int b);
  // Assigns temporaries (a step's result lives until the step that uses it); call once, after
  // the last add().
  void finish();

  // Elements processed per pass when temporaries are needed.
  static constexpr size_t kBlock = 4096;
  size_t scratch_bytes(DType dtype) const { return size_t(temps_) * kBlock * dtype_size(dtype); }
  // out[i] = the program over inputs[0][i] .. inputs[n-1][i], for `count` elements. `out` may be
  // one of the inputs; `scratch` holds scratch_bytes(dtype).
  void run(DType dtype, ReduceOp op, const char* const* inputs, char* out, size_t count,
           char* scratch) const;
  // The program as an expression over rank numbers, "((0 1) 2)" for (x0 op x1) op x2.
  std::string describe() const;
  // The same steps: the same bits from the same inputs.
  bool operator==(const ReductionProgram& other) const {
    return n_ == other.n_ && steps_.size() == other.steps_.size() &&
           std::equal(steps_.begin(), steps_.end(), other.steps_.begin(),
                      [](const Step& x, const Step& y) { return x.a == y.a && x.b == y.b; });
  }

 private:
  int n_;
  std::vector<Step> steps_;
  std::vector<int> temp_of_;  // per step: its temporary
  int temps_ = 0;
};

// A range of a buffer whose elements share one reduction order.
struct OrderedRange {
  size_t begin, count;
  int program;
};

// The programs of all_reduce's algorithms for n ranks, each algorithm's built by require().
class ReductionOrders {
 public:
  // `layout`: the hosts, for the hierarchical algorithm's order.
  explicit ReductionOrders(int n, HostLayout layout = {}) : n_(n), layout_(std::move(layout)) {}
  bool has(Algorithm algo) const;
  // Builds the programs of every piece of `algo` (derived from its step lists, schedule.h)
  // unless they are there.
  void require(Algorithm algo);
  // Appends the ranges of a `count`-element buffer that all_reduce with `algo` (ring, tree,
  // recursive doubling, halving-doubling, shared buffer or hierarchical; required first)
  // reduces in one order each, shifted by `base`.
  void ranges(Algorithm algo, size_t count, size_t base, std::vector<OrderedRange>& out) const;
  const ReductionProgram& program(int id) const { return programs_[size_t(id)]; }
  // Scratch that any of the programs built so far needs.
  size_t scratch_bytes(DType dtype) const {
    size_t bytes = 0;
    for (const ReductionProgram& p : programs_) bytes = std::max(bytes, p.scratch_bytes(dtype));
    return bytes;
  }

 private:
  int program_id(Algorithm algo, int piece) const;

  int n_;
  HostLayout layout_;
  // Each distinct program once: pieces of different algorithms that reduce in the same order
  // (at two ranks, most of them) share one, so that the ranges of buffers of different sizes,
  // hence algorithms, join (ranges()) and a coalesced call reduces them in one pass.
  std::vector<ReductionProgram> programs_;
  struct Key {  // a piece of an algorithm, and its program
    Algorithm algo;
    int piece;
    int program;  // its index in programs_
  };
  std::vector<Key> keys_;
};

}  // namespace ringcomm
