#include "algorithms/schedule.h"

#include <algorithm>
#include <deque>
#include <sstream>

#include "algorithms/algorithms.h"
#include "kernels/cpu/reduce.h"

namespace ringcomm {
namespace {

const char* prim_name(Prim p) {
  switch (p) {
    case Prim::kSend: return "send";
    case Prim::kRecv: return "recv";
    case Prim::kRecvSend: return "recv-send";
    case Prim::kRecvReduce: return "recv-reduce";
    case Prim::kRecvReduceSend: return "recv-reduce-send";
    case Prim::kExchangeReduce: return "exchange-reduce";
  }
  return "?";
}

bool receives(Prim p) { return p != Prim::kSend; }
bool reduces(Prim p) {
  return p == Prim::kRecvReduce || p == Prim::kRecvReduceSend || p == Prim::kExchangeReduce;
}
bool forwards(Prim p) { return p == Prim::kRecvSend || p == Prim::kRecvReduceSend; }

// Executes steps of a schedule over slices of their blocks.
class Executor {
 public:
  Executor(Context& ctx, const Schedule& schedule, const Segments& blocks,
           const ScheduleBuffers& buffers, DType dtype, ReduceOp op, size_t slice)
      : ctx_(ctx), steps_(schedule.steps), blocks_(blocks), buffers_(buffers), dtype_(dtype),
        op_(op), elem_(dtype_size(dtype)), slice_(std::max<size_t>(1, slice)) {
    // Known from the order of the steps alone: a slice-pipelined schedule runs them on
    // different slices at different times.
    source_ = reinterpret_cast<Place*>(ctx.scratch(steps_.size()));
    target_ = reinterpret_cast<Place*>(ctx.scratch(steps_.size()));
    step_places(schedule, blocks.size(), buffers.result != nullptr, source_, target_,
                reinterpret_cast<Place*>(ctx.scratch(size_t(blocks.size()))));
    size_t most_slices = 1;
    for (const Step& s : steps_)
      most_slices = std::max(most_slices, piece_count(blocks.count(s.block), slice_));
    const size_t per_call = schedule.pipeline == Pipeline::kByStep ? most_slices : 1;
    requests_ = reinterpret_cast<Request*>(ctx.scratch(per_call * sizeof(Request)));
    staging_ = ctx.scratch(std::min(blocks.max_count(), per_call * slice_) * elem_);
  }

  // Step i over slices [first, last) of its block: every receive posted, then each slice
  // combined and forwarded as it arrives.
  void run(size_t i, size_t first, size_t last) {
    const Step& s = steps_[i];
    const size_t block_count = blocks_.count(s.block);
    auto begin_of = [&](size_t j) { return j * slice_; };
    auto count_of = [&](size_t j) {
      return std::min(slice_, block_count - std::min(block_count, begin_of(j)));
    };
    auto src = [&](size_t j) { return at(source_[i], s.block) + begin_of(j) * elem_; };
    auto dst = [&](size_t j) { return at(target_[i], s.block) + begin_of(j) * elem_; };
    auto staging = [&](size_t j) { return staging_ + (j - first) * slice_ * elem_; };
    Request* req = requests_ - first;  // indexed by slice
    switch (s.prim) {
      case Prim::kSend:
        for (size_t j = first; j < last; ++j) ctx_.send(s.to, src(j), count_of(j) * elem_);
        return;
      case Prim::kRecv:
      case Prim::kRecvSend:
        for (size_t j = first; j < last; ++j) req[j] = ctx_.recv(s.from, dst(j), count_of(j) * elem_);
        break;
      case Prim::kRecvReduce:
      case Prim::kRecvReduceSend:
        for (size_t j = first; j < last; ++j)
          req[j] = ctx_.recv_reduce(s.from, dst(j), src(j), staging(j), count_of(j), dtype_, op_,
                                    s.incoming_first);
        break;
      case Prim::kExchangeReduce:
        for (size_t j = first; j < last; ++j)
          req[j] = ctx_.recv(s.to, staging(j), count_of(j) * elem_);
        for (size_t j = first; j < last; ++j) ctx_.send(s.to, src(j), count_of(j) * elem_);
        for (size_t j = first; j < last; ++j) ctx_.wait(req[j]);
        ctx_.finish();  // the block is about to change: the sends must be out of it first
        for (size_t j = first; j < last; ++j) {
          trace::Span span("reduce", count_of(j) * elem_, s.to);
          const char *mine = src(j), *incoming = staging(j);
          cpu::reduce(dtype_, op_, dst(j), s.incoming_first ? incoming : mine,
                      s.incoming_first ? mine : incoming, count_of(j));
          complete(s, dst(j), count_of(j));
        }
        return;
    }
    for (size_t j = first; j < last; ++j) {
      ctx_.wait(req[j]);
      complete(s, dst(j), count_of(j));
      if (forwards(s.prim)) ctx_.send(s.to, dst(j), count_of(j) * elem_);
    }
  }

 private:
  char* at(Place p, int block) const {
    switch (p) {
      case Place::kIn: return const_cast<char*>(buffers_.in) + blocks_.offset(block) * elem_;
      case Place::kWork: return buffers_.work + blocks_.offset(block) * elem_;
      case Place::kResult: return buffers_.result;
    }
    return nullptr;
  }
  void complete(const Step& s, char* data, size_t count) {
    if (s.completes && op_ == ReduceOp::kAvg && reduces(s.prim))
      cpu::divide(dtype_, data, count, ctx_.size());
  }

  Context& ctx_;
  const std::vector<Step>& steps_;
  const Segments& blocks_;
  const ScheduleBuffers& buffers_;
  DType dtype_;
  ReduceOp op_;
  size_t elem_, slice_;
  Place* source_;
  Place* target_;
  Request* requests_;
  char* staging_;
};

}  // namespace

void step_places(const Schedule& schedule, int blocks, bool has_result, Place* source,
                 Place* target, Place* current) {
  std::fill(current, current + blocks, Place::kIn);
  for (size_t i = 0; i < schedule.steps.size(); ++i) {
    const Step& s = schedule.steps[i];
    RC_CHECK_ARG(s.block >= 0 && s.block < blocks, "schedule step ", i, " names block ", s.block,
                 " of ", blocks);
    source[i] = current[s.block];
    target[i] = s.completes && has_result ? Place::kResult : Place::kWork;
    if (receives(s.prim)) current[s.block] = target[i];
  }
}

std::string Schedule::describe() const {
  std::ostringstream out;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    if (i) out << "; ";
    out << prim_name(s.prim) << " b" << s.block;
    if (receives(s.prim) && s.prim != Prim::kExchangeReduce) out << " <" << s.from;
    if (s.to >= 0) out << (s.prim == Prim::kExchangeReduce ? " <>" : " >") << s.to;
    if (reduces(s.prim) && s.incoming_first) out << " (incoming first)";
    if (s.completes) out << " (complete)";
    if (s.lag) out << " (lag " << s.lag << ")";
  }
  return out.str();
}

void run_schedule(Context& ctx, const Schedule& schedule, const Segments& blocks,
                  const ScheduleBuffers& buffers, DType dtype, ReduceOp op, size_t slice) {
  ScratchFrame frame(ctx);
  Executor exec(ctx, schedule, blocks, buffers, dtype, op, slice);
  walk_schedule(schedule, blocks, std::max<size_t>(1, slice),
                [&](size_t i, size_t first, size_t last) { exec.run(i, first, last); });
}

Segments all_reduce_blocks(Algorithm algo, int n, size_t count) {
  switch (algo) {
    case Algorithm::kRing: return Segments(count, n);
    case Algorithm::kTree: return tree_halves(count);
    case Algorithm::kRecursiveDoubling: return Segments(count, 1);
    case Algorithm::kHalvingDoubling: return Segments(count, butterfly_size(n));
    default: RC_INVALID("all_reduce by ", algorithm_name(algo), " has no step list");
  }
}

AllReduceSchedule all_reduce_schedule(Algorithm algo, int n, int rank, size_t count, size_t elem) {
  Segments blocks = all_reduce_blocks(algo, n, count);
  switch (algo) {
    case Algorithm::kRing: return {ring_all_reduce_schedule(n, rank), blocks, ring_slice(elem, n)};
    case Algorithm::kTree: return {double_tree_all_reduce_schedule(n, rank), blocks, tree_slice(elem)};
    case Algorithm::kHalvingDoubling:
      return {halving_doubling_schedule(n, rank), blocks, ring_slice(elem, n)};
    default:
      // Recursive doubling: one message per exchange, however large: it is for small ones.
      return {recursive_doubling_schedule(n, rank), blocks, std::max<size_t>(1, count)};
  }
}

void scheduled_all_reduce(Context& ctx, Algorithm algo, void* buf, size_t count, DType dtype,
                          ReduceOp op) {
  if (ctx.size() == 1) return;
  char* data = static_cast<char*>(buf);
  const AllReduceSchedule s =
      all_reduce_schedule(algo, ctx.size(), ctx.rank(), count, dtype_size(dtype));
  run_schedule(ctx, s.schedule, s.blocks, {data, data}, dtype, op, s.slice);
  ctx.finish();
}

void all_reduce_by(Context& ctx, Algorithm algo, const HostLayout& layout, void* buf, size_t count,
                   DType dtype, ReduceOp op) {
  if (algo == Algorithm::kHierarchical)
    hierarchical_all_reduce(ctx, layout, buf, count, dtype, op);
  else if (algo == Algorithm::kSharedBuffer)
    shared_buffer_all_reduce(ctx, buf, count, dtype, op);
  else
    scheduled_all_reduce(ctx, algo, buf, count, dtype, op);
}

int Expressions::leaf(int operand) {
  auto [it, added] = made_.emplace(std::make_pair(-1, operand), int(nodes.size()));
  if (added) nodes.push_back({-1, -1, operand});
  return it->second;
}

int Expressions::combine(int a, int b) {
  auto [it, added] = made_.emplace(std::make_pair(a, b), int(nodes.size()));
  if (added) nodes.push_back({a, b, -1});
  return it->second;
}

std::vector<int> Expressions::leaves(int node) const {
  std::vector<int> out, stack{node};
  while (!stack.empty()) {
    const Node& n = nodes[size_t(stack.back())];
    stack.pop_back();
    if (n.leaf >= 0) {
      out.push_back(n.leaf);
    } else {
      stack.push_back(n.b);
      stack.push_back(n.a);
    }
  }
  return out;
}

std::vector<int> simulate_schedules(const std::vector<Schedule>& schedules, int blocks,
                                    const std::vector<int>& initial, Expressions& expr) {
  const int n = int(schedules.size());
  auto fail = [&](int rank, size_t i, const std::string& what) {
    RC_THROW("internal error: schedules do not fit together: rank ", rank, " step ", i, " (",
             i < schedules[size_t(rank)].steps.size()
                 ? prim_name(schedules[size_t(rank)].steps[i].prim)
                 : "end",
             "): ", what);
  };
  std::vector<int> all;  // every contribution's operands, sorted: a complete block's leaves
  for (int node : initial) {
    std::vector<int> l = expr.leaves(node);
    all.insert(all.end(), l.begin(), l.end());
  }
  std::sort(all.begin(), all.end());
  auto is_complete = [&](int node) {
    std::vector<int> l = expr.leaves(node);
    std::sort(l.begin(), l.end());
    return l == all;
  };

  std::vector<std::vector<int>> value;  // by rank, by block
  for (int r = 0; r < n; ++r) value.emplace_back(size_t(blocks), initial[size_t(r)]);
  std::vector<std::deque<std::pair<int, int>>> wire(size_t(n * n));  // (block, node), from * n + to
  std::vector<size_t> pos(size_t(n), 0);
  std::vector<bool> sent(size_t(n), false);  // an exchange's send is out, its receive pending
  std::vector<int> result(size_t(blocks), -1);
  auto link = [&](int from, int to) -> std::deque<std::pair<int, int>>& {
    return wire[size_t(from * n + to)];
  };

  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < n; ++r) {
      const std::vector<Step>& steps = schedules[size_t(r)].steps;
      while (pos[size_t(r)] < steps.size()) {
        const size_t i = pos[size_t(r)];
        const Step& s = steps[i];
        if (s.block < 0 || s.block >= blocks) fail(r, i, "no such block");
        int& mine = value[size_t(r)][size_t(s.block)];
        const int from = s.prim == Prim::kExchangeReduce ? s.to : s.from;
        if (s.prim == Prim::kSend || (s.prim == Prim::kExchangeReduce && !sent[size_t(r)])) {
          if (s.to < 0 || s.to >= n || s.to == r) fail(r, i, "bad peer");
          link(r, s.to).emplace_back(s.block, mine);
          sent[size_t(r)] = true;
        }
        if (receives(s.prim)) {
          if (from < 0 || from >= n || from == r) fail(r, i, "bad peer");
          auto& queue = link(from, r);
          if (queue.empty()) break;  // waits for the peer
          auto [block, incoming] = queue.front();
          queue.pop_front();
          if (block != s.block)
            fail(r, i, str_cat("expected block ", s.block, " from rank ", from, ", got ", block));
          if (reduces(s.prim))
            mine = s.incoming_first ? expr.combine(incoming, mine) : expr.combine(mine, incoming);
          else
            mine = incoming;
          if (forwards(s.prim)) link(r, s.to).emplace_back(s.block, mine);
        }
        if (s.completes) {
          if (!is_complete(mine)) fail(r, i, "completes a block that misses contributions");
          int& known = result[size_t(s.block)];
          if (known >= 0 && known != mine) fail(r, i, "completes a block differently");
          known = mine;
        }
        sent[size_t(r)] = false;
        ++pos[size_t(r)];
        progress = true;
      }
    }
  }
  for (int r = 0; r < n; ++r)
    if (pos[size_t(r)] < schedules[size_t(r)].steps.size()) fail(r, pos[size_t(r)], "deadlock");
  for (int from = 0; from < n; ++from)
    for (int to = 0; to < n; ++to)
      if (!link(from, to).empty()) fail(to, schedules[size_t(to)].steps.size(), "message left unreceived");
  for (int b = 0; b < blocks; ++b) {
    if (result[size_t(b)] < 0) fail(0, 0, str_cat("block ", b, " never completes"));
    // A rank that ends with all of a block (all-reduce) has the completed value: the same bits.
    for (int r = 0; r < n; ++r) {
      const int v = value[size_t(r)][size_t(b)];
      if (v != result[size_t(b)] && is_complete(v))
        fail(r, schedules[size_t(r)].steps.size(), str_cat("ends with block ", b, " combined differently"));
    }
  }
  return result;
}

}  // namespace ringcomm
