// Collectives as step lists over a few primitives, the way NCCL's src/device/all_reduce.h writes
// its ring: an algorithm file builds, for one rank, the list of steps it takes over the blocks of
// a buffer (ring.cc: segments; tree.cc: the two halves, or the whole buffer; recursive_doubling.cc:
// the whole buffer). Two things run those lists:
//   run_schedule executes one rank's list over a Context, cutting every block into slices so
//     that neighbouring ranks work on different slices of a block at once;
//   simulate_schedules runs every rank's list symbolically, pairing each receive with its
//     peer's send. It checks that the lists fit together (each receive finds the block it
//     expects; every completed block combines every rank's contribution exactly once) and
//     yields, per block, the order in which the contributions were combined, which is what
//     reduction_order.cc replays. So the order replayed is the order executed, by construction.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "algorithms/context.h"

namespace ringcomm {

enum class Prim : uint8_t {
  kSend,            // send the block's current value to `to`
  kRecv,            // receive the block from `from`, into place
  kRecvSend,        // receive it into place from `from`, forward it to `to`
  kRecvReduce,      // receive from `from` and combine with the block's current value
  kRecvReduceSend,  // the same, then forward the result to `to`
  kExchangeReduce,  // send the block's value to `to` and receive `to`'s, then combine them
};

struct Step {
  Prim prim;
  int block;
  int from = -1, to = -1;       // peers: ranks of the Context the schedule runs on
  bool incoming_first = false;  // combine as incoming (op) mine; otherwise mine (op) incoming
  // After this step the block holds its reduction over all ranks: avg divides it here, and it is
  // written to the result buffer.
  bool completes = false;
  int lag = 0;  // kBySlice: this step works on slice (round - lag) in round `round`
  // "recv-reduce-send b2 <3 >1 (complete)"
  std::string describe() const;
};

enum class Pipeline : uint8_t {
  // Steps in order, each over all of its block's slices: the receives of every slice of the step
  // are posted together and each slice is forwarded as soon as it is combined (the ring: a step
  // depends only on the neighbour's previous step).
  kByStep,
  // Rounds of every step over one slice each (with `lag`): a tree, whose parent can combine slice
  // j while its children are already sending slice j+1.
  kBySlice,
};

struct Schedule {
  Pipeline pipeline = Pipeline::kByStep;
  std::vector<Step> steps;
  // "send b3 ->1; recv-reduce-send b2 <-3 ->1 ..." (RINGCOMM_DEBUG, tests, docs).
  std::string describe() const;
};

// Where a schedule's data lives. A block's value starts in `in` and, once something is
// received into it or combined, lives in `work` (which may be `in`); a completing step writes
// the block to `result` (if set, holding just that block) instead.
struct ScheduleBuffers {
  const char* in;
  char* work;
  char* result = nullptr;
};

// Where each step of `schedule` finds its block's value (source) and where a receiving step
// writes it (target), from the order of the steps alone: a block's value is in `in` until
// something is received into it, then in `work`, or `result` after a completing step when the
// buffers have one. `current` is room for `blocks` entries.
enum class Place : uint8_t { kIn, kWork, kResult };
void step_places(const Schedule& schedule, int blocks, bool has_result, Place* source,
                 Place* target, Place* current);

// Calls fn(step index, first slice, end slice) in the order a rank works through `schedule`
// over `blocks` in slices of at most `slice` elements: kByStep, each step over all of its
// slices; kBySlice, in rounds. Every rank runs the same order, so the messages between two
// ranks are posted in the same order on both sides.
template <typename Fn>
void walk_schedule(const Schedule& schedule, const Segments& blocks, size_t slice, Fn fn) {
  const std::vector<Step>& steps = schedule.steps;
  auto slices = [&](const Step& s) { return piece_count(blocks.count(s.block), slice); };
  if (schedule.pipeline == Pipeline::kByStep) {
    for (size_t i = 0; i < steps.size(); ++i) fn(i, size_t(0), slices(steps[i]));
    return;
  }
  size_t rounds = 0;
  for (const Step& s : steps) rounds = std::max(rounds, slices(s) + size_t(s.lag));
  for (size_t round = 0; round < rounds; ++round)
    for (size_t i = 0; i < steps.size(); ++i) {
      if (round < size_t(steps[i].lag)) continue;
      const size_t j = round - size_t(steps[i].lag);
      if (j < slices(steps[i])) fn(i, j, j + 1);
    }
}

// Runs `schedule` (this rank's) over `blocks` of the buffers: elements of `dtype`, combined with
// `op` (avg sums, then divides each completed block by the Context's size), in slices of at
// most `slice` elements. Sends may still be in flight when it returns (Context::finish).
void run_schedule(Context& ctx, const Schedule& schedule, const Segments& blocks,
                  const ScheduleBuffers& buffers, DType dtype, ReduceOp op, size_t slice);

// Expressions over the ranks' contributions, built by simulate_schedules: a leaf is one
// contribution (an operand index), an inner node `a op b`.
struct Expressions {
  struct Node {
    int a = -1, b = -1;  // operands (nodes) of an inner node
    int leaf = -1;       // the operand index of a leaf
  };
  std::vector<Node> nodes;
  // The node of that contribution or combination, made once: the same expression is the same
  // node wherever it is computed (recursive doubling: both partners compute it), so final values
  // compare by node.
  int leaf(int operand);
  int combine(int a, int b);
  // The operand indices under `node`, in order, one per leaf.
  std::vector<int> leaves(int node) const;

 private:
  std::map<std::pair<int, int>, int> made_;  // (a, b) or (-1, operand) -> node
};

// A step that cannot run as the lists say: rank `rank`'s step `step` (steps.size(): the end of
// its list), and what is wrong.
struct ScheduleFault {
  int rank = -1;
  size_t step = 0;
  std::string what;
  // "rank 2 step 3 (recv-reduce b1 <0): <what>"
  std::string describe(const std::vector<Schedule>& schedules) const;
};

// What running every rank's list symbolically found: the node each block of each rank holds
// after each step, and where the lists do not fit, the first fault. Sends are taken to complete
// once their receiver has received them, as they do when a transport's buffers are full.
struct SymbolicRun {
  std::vector<std::vector<int>> value;   // by rank, by block: the node it ends with
  std::vector<std::vector<int>> after;   // by rank, by step: the node of its block after it
  std::vector<std::vector<int>> set_by;  // by rank, by block: the step that last wrote it, or -1
  std::vector<ScheduleFault> faults;     // empty where the lists fit; else one
};

// Runs every rank's list (schedules[r] for rank r, all over `blocks` blocks), rank r's block b
// starting as node initial[r][b]. The lists fit where every step names a block and a peer other
// than its own rank; each receive takes the block its peer sends next; no step waits forever (for
// a message, or in exchange-reduce for its earlier sends to be received); every message is
// received; and no step writes a block while a send of it may still be read: the receiver's
// receipt must reach the writer (through the messages it receives) first.
// That last rule is checked with `check_writes` alone: it keeps a clock of n counters per rank
// and per message, n^3 work for a ring, which the built-in lists, checked by their tests, skip.
// Faults name the steps they involve by `name(rank, step)`, or as "step 3 (send b1 >2)".
using StepName = std::function<std::string(int rank, size_t step)>;
SymbolicRun run_symbolically(const std::vector<Schedule>& schedules, int blocks,
                             const std::vector<std::vector<int>>& initial, Expressions& expr,
                             bool check_writes, const StepName& name);

// Runs every rank's schedule (schedules[r] for rank r, all over `blocks` blocks) with rank r's
// value of every block starting as node initial[r], and returns each block's final node: for
// all-reduce schedules the value every rank ends with; otherwise the value where its completing
// step ran. Throws (an internal error) if the schedules do not fit together.
std::vector<int> simulate_schedules(const std::vector<Schedule>& schedules, int blocks,
                                    const std::vector<int>& initial, Expressions& expr);

}  // namespace ringcomm
