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
    case Prim::kSend:
      return "send";
    case Prim::kRecv:
      return "recv";
    case Prim::kRecvSend:
      return "recv-send";
    case Prim::kRecvReduce:
      return "recv-reduce";
    case Prim::kRecvReduceSend:
      return "recv-reduce-send";
    case Prim::kExchangeReduce:
      return "exchange-reduce";
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
      : ctx_(ctx),
        steps_(schedule.steps),
        blocks_(blocks),
        buffers_(buffers),
        dtype_(dtype),
        op_(op),
        elem_(dtype_size(dtype)),
        slice_(std::max<size_t>(1, slice)) {
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
        for (size_t j = first; j < last; ++j)
          req[j] = ctx_.recv(s.from, dst(j), count_of(j) * elem_);
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
      case Place::kIn:
        return const_cast<char*>(buffers_.in) + blocks_.offset(block) * elem_;
      case Place::kWork:
        return buffers_.work + blocks_.offset(block) * elem_;
      case Place::kResult:
        return buffers_.result;
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

std::string Step::describe() const {
  std::ostringstream out;
  out << prim_name(prim) << " b" << block;
  if (receives(prim) && prim != Prim::kExchangeReduce) out << " <" << from;
  if (to >= 0) out << (prim == Prim::kExchangeReduce ? " <>" : " >") << to;
  if (reduces(prim) && incoming_first) out << " (incoming first)";
  if (completes) out << " (complete)";
  if (lag) out << " (lag " << lag << ")";
  return out.str();
}

std::string Schedule::describe() const {
  std::string out;
  for (size_t i = 0; i < steps.size(); ++i) out += (i ? "; " : "") + steps[i].describe();
  return out;
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
    case Algorithm::kRing:
      return Segments(count, n);
    case Algorithm::kTree:
      return tree_halves(count);
    case Algorithm::kRecursiveDoubling:
      return Segments(count, 1);
    case Algorithm::kHalvingDoubling:
      return Segments(count, butterfly_size(n));
    default:
      RC_INVALID("all_reduce by ", algorithm_name(algo), " has no step list");
  }
}

AllReduceSchedule all_reduce_schedule(Algorithm algo, int n, int rank, size_t count, size_t elem) {
  Segments blocks = all_reduce_blocks(algo, n, count);
  switch (algo) {
    case Algorithm::kRing:
      return {ring_all_reduce_schedule(n, rank), blocks, ring_slice(elem, n)};
    case Algorithm::kTree:
      return {double_tree_all_reduce_schedule(n, rank), blocks, tree_slice(elem)};
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

std::string ScheduleFault::describe(const std::vector<Schedule>& schedules) const {
  const std::vector<Step>& steps = schedules[size_t(rank)].steps;
  return str_cat("rank ", rank, " step ", step, " (",
                 step < steps.size() ? steps[step].describe() : std::string("end of its list"),
                 "): ", what);
}

namespace {

// The symbolic run of run_symbolically, one rank's step at a time.
class SymbolicRunner {
 public:
  SymbolicRunner(const std::vector<Schedule>& schedules, int blocks,
                 const std::vector<std::vector<int>>& initial, Expressions& expr, bool check_writes,
                 const StepName& name)
      : schedules_(schedules),
        n_(int(schedules.size())),
        blocks_(blocks),
        expr_(expr),
        check_writes_(check_writes),
        name_(name),
        wire_(size_t(n_ * n_)),
        unsettled_(size_t(n_)),
        pos_(size_t(n_), 0),
        stage_(size_t(n_), 0),
        incoming_(size_t(n_), -1) {
    run_.value = initial;
    run_.set_by.assign(size_t(n_), std::vector<int>(size_t(blocks), -1));
    for (const Schedule& s : schedules) run_.after.emplace_back(s.steps.size(), -1);
    if (check_writes_) clock_.assign(size_t(n_), std::vector<int>(size_t(n_), 0));
  }

  SymbolicRun run() {
    // Until a pass over the ranks moves nothing: an exchange's send and receive count, before
    // its step is done.
    for (moved_ = true; moved_ && run_.faults.empty();) {
      moved_ = false;
      for (int r = 0; r < n_ && run_.faults.empty(); ++r)
        while (pos_[size_t(r)] < steps(r).size() && advance(r)) {
        }
    }
    if (run_.faults.empty()) find_stuck();
    if (run_.faults.empty()) find_unreceived();
    return std::move(run_);
  }

 private:
  struct Message {
    int block, node;
    size_t step;             // the sender's
    size_t id;               // its index in receipts_
    std::vector<int> clock;  // the sender's when it sent (check_writes)
  };
  struct Receipt {
    int rank = -1;  // the receiver, once received
    int event = 0;  // its clock's own count then
  };
  struct Sent {
    int block, to;
    size_t step, id;
  };

  const std::vector<Step>& steps(int r) const { return schedules_[size_t(r)].steps; }
  std::deque<Message>& link(int from, int to) { return wire_[size_t(from * n_ + to)]; }
  void fault(int r, size_t i, std::string what) { run_.faults.push_back({r, i, std::move(what)}); }
  bool received(size_t id) const { return receipts_[id].rank >= 0; }
  // Whether rank r's clock has seen message `id` received.
  bool knows(int r, size_t id) const {
    const Receipt& t = receipts_[id];
    return t.rank >= 0 && clock_[size_t(r)][size_t(t.rank)] >= t.event;
  }
  int tick(int r) { return check_writes_ ? ++clock_[size_t(r)][size_t(r)] : 0; }

  void send(int r, size_t i, int to, int block, int node) {
    moved_ = true;
    tick(r);
    const size_t id = receipts_.size();
    receipts_.emplace_back();
    link(r, to).push_back(
        {block, node, i, id, check_writes_ ? clock_[size_t(r)] : std::vector<int>()});
    unsettled_[size_t(r)].push_back({block, to, i, id});
  }

  // Whether the peer's step names a rank of the run other than r.
  bool peer_ok(int r, size_t i, int peer, const char* verb) {
    if (peer >= 0 && peer < n_ && peer != r) return true;
    fault(r, i,
          peer == r ? str_cat(verb, " its own rank")
                    : str_cat(verb, " rank ", peer, ", not one of the ", n_, " ranks"));
    return false;
  }

  // Runs rank r's next step as far as it can; true once the step is done.
  bool advance(int r) {
    const size_t i = pos_[size_t(r)];
    const Step& s = steps(r)[i];
    int& stage = stage_[size_t(r)];  // 0: nothing done, 1: its first send out, 2: received
    if (s.block < 0 || s.block >= blocks_) {
      fault(r, i,
            str_cat("names block ", s.block, "; the buffer has ", blocks_, " (0 .. ", blocks_ - 1,
                    ")"));
      return false;
    }
    const bool exchange = s.prim == Prim::kExchangeReduce;
    const int from = exchange ? s.to : s.from;
    if ((s.prim == Prim::kSend || exchange || forwards(s.prim)) && !peer_ok(r, i, s.to, "sends to"))
      return false;
    if (receives(s.prim) && !exchange && !peer_ok(r, i, from, "receives from")) return false;
    int& mine = run_.value[size_t(r)][size_t(s.block)];
    if ((s.prim == Prim::kSend || exchange) && stage == 0) {
      send(r, i, s.to, s.block, mine);
      stage = 1;
    }
    if (receives(s.prim) && stage < 2) {
      std::deque<Message>& queue = link(from, r);
      if (queue.empty()) return false;  // waits for the peer
      if (queue.front().block != s.block) {
        const Message& m = queue.front();
        fault(r, i,
              str_cat("receives block ", m.block, " from rank ", from, " (its ",
                      name_(from, m.step), "), not block ", s.block));
        return false;
      }
      Message m = std::move(queue.front());
      queue.pop_front();
      if (check_writes_)
        for (int q = 0; q < n_; ++q)
          clock_[size_t(r)][size_t(q)] = std::max(clock_[size_t(r)][size_t(q)], m.clock[size_t(q)]);
      receipts_[m.id] = {r, tick(r)};
      moved_ = true;
      incoming_[size_t(r)] = m.node;
      stage = 2;
    }
    std::vector<Sent>& mine_sent = unsettled_[size_t(r)];
    if (exchange) {
      // The executor waits for every send of this rank before it writes the block.
      for (const Sent& out : mine_sent)
        if (!received(out.id)) return false;
      mine_sent.clear();
    } else if (receives(s.prim) && check_writes_ && !may_write(r, i, s.block)) {
      return false;
    }
    if (receives(s.prim)) {
      const int incoming = incoming_[size_t(r)];
      if (reduces(s.prim))
        mine = s.incoming_first ? expr_.combine(incoming, mine) : expr_.combine(mine, incoming);
      else
        mine = incoming;
      run_.set_by[size_t(r)][size_t(s.block)] = int(i);
    }
    if (forwards(s.prim)) send(r, i, s.to, s.block, mine);
    run_.after[size_t(r)][i] = mine;
    stage = 0;
    ++pos_[size_t(r)];
    moved_ = true;
    return true;
  }

  // Before rank r's step i writes `block`: every earlier send of it must be known received.
  bool may_write(int r, size_t i, int block) {
    std::vector<Sent>& sent = unsettled_[size_t(r)];
    for (const Sent& out : sent)
      if (out.block == block && !knows(r, out.id)) {
        fault(r, i,
              str_cat("writes block ", block, " while rank ", out.to,
                      " may still be reading it from ", name_(r, out.step), ": no message rank ", r,
                      " has received comes after rank ", out.to, " received it"));
        return false;
      }
    sent.erase(
        std::remove_if(sent.begin(), sent.end(), [&](const Sent& out) { return knows(r, out.id); }),
        sent.end());
    return true;
  }

  // What stuck rank r waits for, and the rank that would have to act.
  std::pair<std::string, int> waits_for(int r) const {
    const Step& s = steps(r)[pos_[size_t(r)]];
    if (stage_[size_t(r)] == 2)  // an exchange, waiting for its sends to be received
      for (const Sent& out : unsettled_[size_t(r)])
        if (!received(out.id))
          return {str_cat("for rank ", out.to, " to receive block ", out.block, " sent at ",
                          name_(r, out.step)),
                  out.to};
    const int from = s.prim == Prim::kExchangeReduce ? s.to : s.from;
    return {str_cat("for a message from rank ", from), from};
  }

  // Ranks that cannot go on: the lowest one, and the chain of ranks it waits on.
  void find_stuck() {
    int first = -1;
    for (int r = 0; r < n_ && first < 0; ++r)
      if (pos_[size_t(r)] < steps(r).size()) first = r;
    if (first < 0) return;
    std::vector<bool> seen(size_t(n_), false);
    std::string chain = "waits forever";
    for (int r = first;;) {
      seen[size_t(r)] = true;
      auto [what, on] = waits_for(r);
      chain += str_cat(" ", what);
      if (pos_[size_t(on)] >= steps(on).size()) {
        chain += str_cat(", which has finished its list");
        break;
      }
      if (seen[size_t(on)]) {
        chain += ": a deadlock";
        break;
      }
      const size_t j = pos_[size_t(on)];
      chain += str_cat(", which at ", name_(on, j), " waits");
      r = on;
    }
    fault(first, pos_[size_t(first)], chain);
  }

  void find_unreceived() {
    for (int from = 0; from < n_; ++from)
      for (int to = 0; to < n_; ++to)
        if (!link(from, to).empty()) {
          const Message& m = link(from, to).front();
          fault(from, m.step,
                str_cat("sends block ", m.block, " to rank ", to, ", which never receives it"));
          return;
        }
  }

  const std::vector<Schedule>& schedules_;
  const int n_, blocks_;
  Expressions& expr_;
  const bool check_writes_;
  const StepName& name_;
  SymbolicRun run_;
  std::vector<std::deque<Message>> wire_;     // from * n + to
  std::vector<Receipt> receipts_;             // by message
  std::vector<std::vector<Sent>> unsettled_;  // by rank: sends not yet known received
  std::vector<std::vector<int>> clock_;       // by rank: events of each rank it has heard of
  std::vector<size_t> pos_;
  std::vector<int> stage_;
  std::vector<int> incoming_;  // by rank: the node its current step received
  bool moved_ = false;         // something happened in this pass over the ranks
};

}  // namespace

SymbolicRun run_symbolically(const std::vector<Schedule>& schedules, int blocks,
                             const std::vector<std::vector<int>>& initial, Expressions& expr,
                             bool check_writes, const StepName& name) {
  if (name) return SymbolicRunner(schedules, blocks, initial, expr, check_writes, name).run();
  const StepName by_index = [&](int rank, size_t step) {
    return str_cat("step ", step, " (", schedules[size_t(rank)].steps[step].describe(), ")");
  };
  return SymbolicRunner(schedules, blocks, initial, expr, check_writes, by_index).run();
}

std::vector<int> simulate_schedules(const std::vector<Schedule>& schedules, int blocks,
                                    const std::vector<int>& initial, Expressions& expr) {
  const int n = int(schedules.size());
  auto fail = [&](const ScheduleFault& f) {
    RC_THROW("internal error: schedules do not fit together: ", f.describe(schedules));
  };
  std::vector<std::vector<int>> start;
  for (int node : initial) start.emplace_back(size_t(blocks), node);
  const SymbolicRun run = run_symbolically(schedules, blocks, start, expr, false, nullptr);
  if (!run.faults.empty()) fail(run.faults[0]);
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
  std::vector<int> result(size_t(blocks), -1);
  for (int r = 0; r < n; ++r) {
    const std::vector<Step>& steps = schedules[size_t(r)].steps;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (!steps[i].completes) continue;
      const int node = run.after[size_t(r)][i];
      if (!is_complete(node)) fail({r, i, "completes a block that misses contributions"});
      int& known = result[size_t(steps[i].block)];
      if (known >= 0 && known != node) fail({r, i, "completes a block differently"});
      known = node;
    }
  }
  for (int b = 0; b < blocks; ++b) {
    if (result[size_t(b)] < 0) fail({0, 0, str_cat("block ", b, " never completes")});
    // A rank that ends with all of a block (all-reduce) has the completed value: the same bits.
    for (int r = 0; r < n; ++r) {
      const int v = run.value[size_t(r)][size_t(b)];
      if (v != result[size_t(b)] && is_complete(v))
        fail({r, schedules[size_t(r)].steps.size(),
              str_cat("ends with block ", b, " combined differently")});
    }
  }
  return result;
}

}  // namespace ringcomm
