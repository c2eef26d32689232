#include "algorithms/registered.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "algorithms/algorithms.h"
#include "common/knobs.h"

namespace ringcomm {
namespace {

bool reduces(Prim p) {
  return p == Prim::kRecvReduce || p == Prim::kRecvReduceSend || p == Prim::kExchangeReduce;
}
bool sends(Prim p) {
  return p == Prim::kSend || p == Prim::kRecvSend || p == Prim::kRecvReduceSend ||
         p == Prim::kExchangeReduce;
}
bool receives_from(Prim p) { return p != Prim::kSend && p != Prim::kExchangeReduce; }

bool moves_only(Collective c) { return c == Collective::kAllGather || c == Collective::kBroadcast; }
bool in_shares(Collective c) {
  return c == Collective::kReduceScatter || c == Collective::kAllGather;
}

// Checks one algorithm's lists, over whole blocks and, pipelined by slice, over their slices.
class ListsCheck {
 public:
  explicit ListsCheck(AlgorithmLists& lists)
      : lists_(lists), n_(int(lists.schedules.size())), blocks_(lists.blocks) {}

  std::vector<std::string> run() {
    RC_CHECK_ARG(std::find(std::begin(kRegisteredCollectives), std::end(kRegisteredCollectives),
                           lists_.coll) != std::end(kRegisteredCollectives),
                 "algorithm '", lists_.name, "': no registered algorithm runs ",
                 collective_name(lists_.coll));
    if (blocks_ < 1) refuse(str_cat("its lists run over ", blocks_, " blocks; at least 1"));
    if (in_shares(lists_.coll) && blocks_ % n_ != 0)
      refuse(str_cat("its ", blocks_, " blocks are not the same number per rank's share"));
    check_steps();
    // Whole blocks first: the completing steps and the orders come from this run.
    std::vector<std::vector<int>> whole = pattern_run(std::vector<size_t>(size_t(blocks_), 1));
    mark_completing();
    if (lists_.pipeline == Pipeline::kBySlice) {
      // The executor walks the steps in rounds, one slice each: the order of the messages
      // between two ranks depends on how many slices each block has.
      std::vector<std::vector<size_t>> patterns = {std::vector<size_t>(size_t(blocks_), 2),
                                                   std::vector<size_t>(size_t(blocks_), 3)};
      for (int longer : {1, blocks_ / 2, blocks_ - 1})  // Segments: the first blocks are longer
        if (longer > 0 && longer < blocks_) {
          std::vector<size_t> uneven(size_t(blocks_), 1);
          std::fill(uneven.begin(), uneven.begin() + longer, 2);
          patterns.push_back(uneven);
        }
      for (const std::vector<size_t>& slices : patterns) {
        std::vector<std::vector<int>> cut = pattern_run(slices);
        for (int b = 0; b < blocks_; ++b)
          for (size_t j = 0; j < slices[size_t(b)]; ++j)
            for (int r = 0; r < n_; ++r)
              if (ends_at(r, b) && cut[size_t(r)][unit(b, j)] != whole[size_t(r)][size_t(b)])
                refuse(str_cat("rank ", r, " ends with slice ", j, " of block ", b, " as ",
                               text(cut[size_t(r)][unit(b, j)]), " but with the whole block as ",
                               text(whole[size_t(r)][size_t(b)])));
      }
    }
    lists_.id = hash();
    std::vector<std::string> orders;
    if (!moves_only(lists_.coll))
      for (int b = 0; b < blocks_; ++b) orders.push_back(text(whole[size_t(owner(b))][size_t(b)]));
    return orders;
  }

 private:
  [[noreturn]] void refuse(const std::string& what) const {
    const size_t c = lists_.size_class;
    RC_INVALID("algorithm '", lists_.name, "' (", collective_name(lists_.coll), " over ", n_,
               " ranks",
               lists_.sized ? str_cat(", messages of ", c, "..", c ? 2 * c - 1 : 0, " bytes") : "",
               legend_, "): ", what);
  }
  const std::vector<Step>& steps(int r) const { return lists_.schedules[size_t(r)].steps; }
  std::string at(int r, size_t i) const { return str_cat("rank ", r, " ", step_text(r, i)); }
  std::string step_text(int r, size_t i) const {
    return str_cat("step ", i, " (",
                   i < steps(r).size() ? steps(r)[i].describe() : std::string("end of its list"),
                   ")");
  }

  // The rank that owns block b's result: its share's (reduce_scatter, all_gather), the root's
  // (reduce, broadcast), rank 0's where every rank ends with it (all_reduce).
  int owner(int b) const { return in_shares(lists_.coll) ? b / (blocks_ / n_) : 0; }
  // Whether rank r must end with block b's result.
  bool ends_at(int r, int b) const {
    return lists_.coll == Collective::kAllReduce || moves_only(lists_.coll) ||
           (lists_.coll == Collective::kReduceScatter ? owner(b) == r : r == 0);
  }

  // What every step names, before anything runs.
  void check_steps() {
    for (int r = 0; r < n_; ++r)
      for (size_t i = 0; i < steps(r).size(); ++i) {
        const Step& s = steps(r)[i];
        auto fault = [&](const std::string& what) { refuse(str_cat(at(r, i), ": ", what)); };
        if (s.block < 0 || s.block >= blocks_)
          fault(str_cat("names block ", s.block, "; the buffer has ", blocks_, " (0 .. ",
                        blocks_ - 1, ")"));
        auto peer = [&](int p, const char* verb) {
          if (p == r) fault(str_cat(verb, " its own rank"));
          if (p < 0 || p >= n_)
            fault(str_cat(verb, " rank ", p, ", not one of the ", n_, " ranks"));
        };
        if (sends(s.prim)) peer(s.to, "sends to");
        if (receives_from(s.prim)) peer(s.from, "receives from");
        if (moves_only(lists_.coll) && reduces(s.prim))
          fault(str_cat("reduces, but ", collective_name(lists_.coll), " only moves blocks"));
        if (s.lag < 0) fault(str_cat("lag ", s.lag, " is negative"));
        if (s.lag > 0 && lists_.pipeline == Pipeline::kByStep)
          fault(str_cat("lag ", s.lag,
                        " in lists pipelined by step: lags order the rounds of "
                        "lists pipelined by slice"));
      }
  }

  size_t unit(int b, size_t j) const { return size_t(b) * most_slices_ + j; }
  int leaf_of(int r) { return expr_.leaf(r); }
  int nothing_of(int r) { return expr_.leaf(n_ + r); }  // a block before anything lands in it

  // Runs the lists with block b cut into slices[b] slices (slice j of block b is block
  // unit(b, j) of the lists the executor's walk makes of them); returns each rank's final node
  // of every unit, once the collective's contract holds for all of them.
  std::vector<std::vector<int>> pattern_run(const std::vector<size_t>& slices) {
    most_slices_ = *std::max_element(slices.begin(), slices.end());
    legend_ = most_slices_ == 1
                  ? std::string()
                  : str_cat(", its blocks cut into ", describe_slices(slices),
                            " slices; slice j of block b as block ", most_slices_, "b+j");
    const int units = blocks_ * int(most_slices_);
    std::vector<Schedule> walked(static_cast<size_t>(n_));
    origin_.assign(size_t(n_), {});
    for (int r = 0; r < n_; ++r)
      walk_schedule(lists_.schedules[size_t(r)], Segments(slices), 1,
                    [&](size_t i, size_t first, size_t last) {
                      for (size_t j = first; j < last; ++j) {
                        Step s = steps(r)[i];
                        s.block = int(unit(s.block, j));
                        s.lag = 0;
                        walked[size_t(r)].steps.push_back(s);
                        origin_[size_t(r)].push_back({i, j});
                      }
                    });
    std::vector<std::vector<int>> initial(static_cast<size_t>(n_),
                                          std::vector<int>(static_cast<size_t>(units)));
    for (int r = 0; r < n_; ++r)
      for (int u = 0; u < units; ++u) {
        const int b = u / int(most_slices_);
        const bool has = lists_.coll == Collective::kAllGather   ? owner(b) == r
                         : lists_.coll == Collective::kBroadcast ? r == 0
                                                                 : true;
        initial[size_t(r)][size_t(u)] = has ? leaf_of(r) : nothing_of(r);
      }
    SymbolicRun run = run_symbolically(walked, units, initial, expr_, true,
                                       [&](int r, size_t k) { return walked_text(r, k); });
    if (!run.faults.empty()) {
      const ScheduleFault& f = run.faults[0];
      refuse(str_cat(where(f.rank, f.step), ": ", f.what));
    }
    after_ = run.after;
    for (int b = 0; b < blocks_; ++b)
      for (size_t j = 0; j < slices[size_t(b)]; ++j) check_end(walked, run, b, j);
    return run.value;
  }

  static std::string describe_slices(const std::vector<size_t>& slices) {
    std::string text;
    for (size_t s : slices) text += str_cat(text.empty() ? "" : ",", s);
    return "[" + text + "]";
  }

  // A step of the walked lists, by the step of the rank's list it walks.
  std::string where(int r, size_t k) const { return str_cat("rank ", r, " ", walked_text(r, k)); }
  std::string walked_text(int r, size_t k) const {
    if (k >= origin_[size_t(r)].size()) return step_text(r, steps(r).size());
    const auto [i, j] = origin_[size_t(r)][k];
    return most_slices_ == 1 ? step_text(r, i) : str_cat(step_text(r, i), " on slice ", j);
  }

  // Each rank's contribution enters a block once: the first reduction that would add one a
  // second time, at the step where both operands were still sound (asked once a block ends
  // wrong: n^3 work for a ring).
  void check_contributions(const std::vector<Schedule>& walked, const SymbolicRun& run) {
    for (int r = 0; r < n_; ++r)
      for (size_t k = 0; k < walked[size_t(r)].steps.size(); ++k) {
        const Step& s = walked[size_t(r)].steps[k];
        if (!reduces(s.prim)) continue;
        const Expressions::Node& node = expr_.nodes[size_t(run.after[size_t(r)][k])];
        if (twice(node.a) >= 0 || twice(node.b) >= 0) continue;
        const int leaf = shared(node.a, node.b);
        if (leaf >= 0)
          refuse(str_cat(where(r, k), ": block ", s.block / int(most_slices_), " would hold rank ",
                         leaf, "'s contribution twice: ", text(node.a), " combined with ",
                         text(node.b)));
      }
  }

  // The first contribution `node` holds twice, or -1; remembered by node (a ring's blocks have n
  // steps of n leaves each, and every step's operands are earlier steps' nodes).
  int twice(int node) {
    if (twice_.size() < expr_.nodes.size()) twice_.resize(expr_.nodes.size(), -2);
    if (twice_[size_t(node)] != -2) return twice_[size_t(node)];
    const Expressions::Node x = expr_.nodes[size_t(node)];
    int found = -1;
    if (x.leaf < 0) {
      found = twice(x.a);
      if (found < 0) found = twice(x.b);
      if (found < 0) found = shared(x.a, x.b);
    }
    return twice_[size_t(node)] = found;
  }

  // The contributions `node` holds, counted with repeats, and the sum of their keys (a random
  // 64-bit number per contribution, the same on every rank); remembered by node.
  std::pair<int, uint64_t> tally(int node) {
    if (tally_.size() < expr_.nodes.size()) tally_.resize(expr_.nodes.size(), {-1, 0});
    if (tally_[size_t(node)].first >= 0) return tally_[size_t(node)];
    const Expressions::Node x = expr_.nodes[size_t(node)];
    std::pair<int, uint64_t> t{1, key(x.leaf)};
    if (x.leaf < 0) {
      const auto a = tally(x.a), b = tally(x.b);
      t = {a.first + b.first, a.second + b.second};
    }
    return tally_[size_t(node)] = t;
  }
  static uint64_t key(int leaf) {  // splitmix64
    uint64_t z = uint64_t(leaf) + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // Whether `node` holds every rank's contribution once: n of them whose keys sum to all ranks'
  // (one held twice in place of another would need two keys' difference to vanish).
  bool complete(int node) {
    uint64_t all = 0;
    for (int r = 0; r < n_; ++r) all += key(r);
    const auto t = tally(node);
    return t.first == n_ && t.second == all;
  }

  // A contribution both `a` and `b` hold, or -1.
  int shared(int a, int b) {
    mark(a);
    for (int leaf : expr_.leaves(b))
      if (marked_[size_t(leaf)] == stamp_) return leaf;
    return -1;
  }

  // Stamps `node`'s contributions in marked_ (a fresh stamp each time: nothing to clear).
  void mark(int node) {
    marked_.resize(size_t(2 * n_), 0);
    ++stamp_;
    for (int leaf : expr_.leaves(node)) marked_[size_t(leaf)] = stamp_;
  }

  // The contributions `node` misses (every rank's contribution, in a collective that reduces).
  std::vector<int> missing(int node) {
    mark(node);
    std::vector<int> out;
    for (int r = 0; r < n_; ++r)
      if (marked_[size_t(r)] != stamp_) out.push_back(r);
    return out;
  }

  std::string text(int node) const {
    const Expressions::Node& x = expr_.nodes[size_t(node)];
    if (x.leaf >= n_) return "nothing";
    if (x.leaf >= 0) return std::to_string(x.leaf);
    std::string t = "(" + text(x.a) + " " + text(x.b) + ")";
    return t.size() > 160 ? t.substr(0, 150) + "...)" : t;
  }

  std::string since(const SymbolicRun& run, int r, size_t u) const {
    const int k = run.set_by[size_t(r)][u];
    return k < 0 ? std::string("nothing received into it")
                 : str_cat("its value since ", where(r, size_t(k)));
  }

  void check_end(const std::vector<Schedule>& walked, const SymbolicRun& run, int b, size_t j) {
    const size_t u = unit(b, j);
    const std::string block =
        most_slices_ == 1 ? str_cat("block ", b) : str_cat("slice ", j, " of block ", b);
    if (moves_only(lists_.coll)) {
      const int want = lists_.coll == Collective::kBroadcast ? 0 : owner(b);
      for (int r = 0; r < n_; ++r) {
        const int v = run.value[size_t(r)][u];
        if (v == leaf_of(want)) continue;
        const int got = expr_.nodes[size_t(v)].leaf;
        refuse(str_cat("rank ", r, " ends with ", block,
                       got >= n_ ? " holding nothing" : str_cat(" holding rank ", got, "'s"),
                       " where rank ", want, "'s belongs (", since(run, r, u), ")"));
      }
      return;
    }
    int first = -1;  // the first rank that ends with the result
    for (int r = 0; r < n_; ++r) {
      if (!ends_at(r, b)) continue;
      const int v = run.value[size_t(r)][u];
      if (!complete(v)) {
        check_contributions(walked, run);  // where one was taken twice, if one was
        const std::vector<int> absent = missing(v);
        std::string ranks;
        for (int a : absent) ranks += str_cat(ranks.empty() ? "" : ", ", a);
        refuse(str_cat("rank ", r, " ends with ", block, " missing the contribution",
                       absent.size() > 1 ? "s" : "", " of rank", absent.size() > 1 ? "s " : " ",
                       ranks, " (", since(run, r, u), ": ", text(v), ")"));
      }
      if (first < 0) {
        first = r;
      } else if (v != run.value[size_t(first)][u]) {
        refuse(str_cat("ranks ", first, " and ", r, " end with ", block,
                       " combined in different orders, ", text(run.value[size_t(first)][u]), " (",
                       since(run, first, u), ") and ", text(v), " (", since(run, r, u),
                       "): their results would differ in the last bits"));
      }
    }
  }

  // The steps that leave a block complete by reducing it (avg divides there), from the run over
  // whole blocks.
  void mark_completing() {
    if (moves_only(lists_.coll)) return;
    for (int r = 0; r < n_; ++r)
      for (size_t k = 0; k < after_[size_t(r)].size(); ++k) {
        Step& s = lists_.schedules[size_t(r)].steps[origin_[size_t(r)][k].first];
        s.completes = reduces(s.prim) && complete(after_[size_t(r)][k]);
      }
  }

  uint64_t hash() const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    auto add = [&](uint64_t v) {
      for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
    };
    for (char c : lists_.name) add(uint64_t(uint8_t(c)));
    add(uint64_t(lists_.coll));
    add(uint64_t(n_));
    add(uint64_t(blocks_));
    add(uint64_t(lists_.pipeline));
    add(uint64_t(lists_.slice_bytes));
    add(lists_.sized ? uint64_t(lists_.size_class) : ~uint64_t(0));
    for (const Schedule& s : lists_.schedules) {
      add(s.steps.size());
      for (const Step& st : s.steps) {
        add(uint64_t(st.prim));
        add(uint64_t(int64_t(st.block)));
        add(uint64_t(int64_t(st.from)));
        add(uint64_t(int64_t(st.to)));
        add(uint64_t(st.incoming_first) | uint64_t(st.completes) << 1);
        add(uint64_t(st.lag));
      }
    }
    return h;
  }

  AlgorithmLists& lists_;
  const int n_, blocks_;
  Expressions expr_;  // one for every run: the same expression is the same node in all of them
  size_t most_slices_ = 1;
  std::string legend_;
  // By rank, by walked step: the step of the rank's list it walks, and the slice.
  std::vector<std::vector<std::pair<size_t, size_t>>> origin_;
  std::vector<std::vector<int>> after_;
  std::vector<int> twice_;                       // by node: twice()'s answer, -2 before it is asked
  std::vector<std::pair<int, uint64_t>> tally_;  // by node: tally()'s answer, -1 before asked
  std::vector<uint64_t> marked_;  // by contribution: the stamp of the last mark() that found it
  uint64_t stamp_ = 0;
};

// The pieces of a reduce-scatter's or all-gather's buffer: each rank's share of `count`
// elements in blocks / n balanced blocks.
Segments shares(size_t count, int n, int blocks) {
  const Segments piece(count, blocks / n);
  std::vector<size_t> counts;
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < piece.size(); ++j) counts.push_back(piece.count(j));
  return Segments(counts);
}

size_t slice_of(const AlgorithmLists& lists, size_t elem, int n, const Segments& blocks) {
  if (lists.slice_bytes == 0) return std::max<size_t>(1, blocks.max_count());
  if (lists.slice_bytes > 0) return std::max<size_t>(1, size_t(lists.slice_bytes) / elem);
  return lists.pipeline == Pipeline::kByStep ? ring_slice(elem, n) : tree_slice(elem);
}

const Schedule& own(const Context& ctx, const AlgorithmLists& lists) {
  RC_CHECK_ARG(int(lists.schedules.size()) == ctx.size(), "algorithm '", lists.name,
               "': lists for ", lists.schedules.size(), " ranks run on ", ctx.size());
  return lists.schedules[size_t(ctx.rank())];
}

// This rank's list of lists written for root 0, with every rank renumbered from `root`.
Schedule from_root(const Context& ctx, const AlgorithmLists& lists, int root) {
  const int n = ctx.size();
  own(ctx, lists);
  Schedule s = lists.schedules[size_t(mod(ctx.rank() - root, n))];
  for (Step& step : s.steps) {
    if (step.from >= 0) step.from = mod(step.from + root, n);
    if (step.to >= 0) step.to = mod(step.to + root, n);
  }
  return s;
}

struct Registry {
  std::mutex mu;
  ListsSource source;
  // By name, collective, world size and size class (kAnySize for lists that serve every size).
  std::map<std::tuple<std::string, Collective, int, size_t>, std::shared_ptr<const AlgorithmLists>>
      lists;
  uint64_t generation = 0;  // forget_lists: lists made before it are not kept
};
Registry& registry() {
  static Registry r;
  return r;
}

constexpr size_t kAnySize = ~size_t(0);

uint64_t fnv(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (char c : text) h = (h ^ uint8_t(c)) * 1099511628211ull;
  return h;
}

// RINGCOMM_ALGO takes the names the source knows, from the moment the core is loaded.
const bool kAlgoTakesRegistered = [] {
  extend_enum("RINGCOMM_ALGO", lists_known, "an algorithm registered by ringcomm.algorithms");
  return true;
}();

}  // namespace

std::vector<std::string> check_lists(AlgorithmLists& lists) {
  RC_CHECK_ARG(!lists.schedules.empty(), "algorithm '", lists.name, "': lists for no rank");
  return ListsCheck(lists).run();
}

void set_lists_source(ListsSource source) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lk(reg.mu);
  reg.source = std::move(source);
  reg.lists.clear();
  ++reg.generation;
}

size_t size_class_of(size_t bytes) {
  size_t c = bytes ? 1 : 0;
  while (c && c <= bytes / 2) c *= 2;
  return c;
}

// The source runs without the lock: it may call back (Python registering, or forgetting).
std::shared_ptr<const AlgorithmLists> registered_lists(const std::string& name, Collective coll,
                                                       int world_size, size_t bytes) {
  Registry& reg = registry();
  const size_t size_class = size_class_of(bytes);
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lk(reg.mu);
    for (size_t key : {kAnySize, size_class}) {
      auto it = reg.lists.find(std::make_tuple(name, coll, world_size, key));
      if (it != reg.lists.end()) return it->second;
    }
    generation = reg.generation;
  }
  std::optional<AlgorithmLists> made;
  if (world_size == 1) {
    if (!lists_known(name)) return nullptr;
    made.emplace();
    made->coll = coll;
    made->schedules.resize(1);
    made->id = fnv(name);
  } else {
    ListsSource source;
    {
      std::lock_guard<std::mutex> lk(reg.mu);
      source = reg.source;
    }
    if (source) made = source(name, world_size, size_class);
    if (!made) return nullptr;
    RC_CHECK_ARG(int(made->schedules.size()) == world_size, "algorithm '", name, "': lists for ",
                 made->schedules.size(), " ranks where ", world_size, " were asked for");
    RC_CHECK_ARG(made->coll == coll, "algorithm '", name, "' is ", collective_name(made->coll),
                 "'s, not ", collective_name(coll), "'s");
    made->name = name;
    made->size_class = made->sized ? size_class : 0;
    check_lists(*made);
  }
  made->name = name;
  name_registered_lists(made->id, name);
  const auto key = std::make_tuple(name, coll, world_size, made->sized ? size_class : kAnySize);
  auto checked = std::make_shared<const AlgorithmLists>(std::move(*made));
  std::lock_guard<std::mutex> lk(reg.mu);
  if (reg.generation != generation) return checked;
  return reg.lists.emplace(key, checked).first->second;
}

bool lists_known(const std::string& name) {
  ListsSource source;
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    source = reg.source;
  }
  return source && source(name, 0, 0).has_value();
}

void forget_lists(const std::string& name) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lk(reg.mu);
  for (auto it = reg.lists.begin(); it != reg.lists.end();)
    it = std::get<0>(it->first) == name ? reg.lists.erase(it) : std::next(it);
  ++reg.generation;
}

void registered_all_reduce(Context& ctx, const AlgorithmLists& lists, void* buf, size_t count,
                           DType dtype, ReduceOp op) {
  const Schedule& mine = own(ctx, lists);
  if (ctx.size() == 1) return;
  char* data = static_cast<char*>(buf);
  const Segments blocks(count, lists.blocks);
  run_schedule(ctx, mine, blocks, {data, data}, dtype, op,
               slice_of(lists, dtype_size(dtype), ctx.size(), blocks));
  ctx.finish();
}

void registered_reduce_scatter(Context& ctx, const AlgorithmLists& lists, const void* in, void* out,
                               size_t count, DType dtype, ReduceOp op) {
  const Schedule& mine = own(ctx, lists);
  const int n = ctx.size();
  const size_t e = dtype_size(dtype);
  if (n == 1) {
    if (out != in) std::memmove(out, in, count * e);
    return;
  }
  ScratchFrame frame(ctx);  // closes after finish(): no send reads `work` any more
  // Partial results of other ranks' shares are kept until sent, so they need their own space;
  // this rank's share ends there too (a complete block has received something).
  char* work = ctx.scratch(count * size_t(n) * e);
  const Segments blocks = shares(count, n, lists.blocks);
  run_schedule(ctx, mine, blocks, {static_cast<const char*>(in), work}, dtype, op,
               slice_of(lists, e, n, blocks));
  ctx.finish();
  std::memcpy(out, work + count * size_t(ctx.rank()) * e, count * e);
}

void registered_all_gather(Context& ctx, const AlgorithmLists& lists, void* out, size_t count,
                           DType dtype) {
  const Schedule& mine = own(ctx, lists);
  if (ctx.size() == 1) return;
  char* data = static_cast<char*>(out);
  const Segments blocks = shares(count, ctx.size(), lists.blocks);
  run_schedule(ctx, mine, blocks, {data, data}, dtype, ReduceOp::kSum,
               slice_of(lists, dtype_size(dtype), ctx.size(), blocks));
  ctx.finish();
}

void registered_broadcast(Context& ctx, const AlgorithmLists& lists, void* buf, size_t bytes,
                          int root) {
  const Schedule mine = from_root(ctx, lists, root);
  if (ctx.size() == 1) return;
  char* data = static_cast<char*>(buf);
  const Segments blocks(bytes, lists.blocks);
  run_schedule(ctx, mine, blocks, {data, data}, DType::kUInt8, ReduceOp::kSum,
               slice_of(lists, 1, ctx.size(), blocks));
  ctx.finish();
}

void registered_reduce(Context& ctx, const AlgorithmLists& lists, void* buf, size_t count,
                       DType dtype, ReduceOp op, int root) {
  const Schedule mine = from_root(ctx, lists, root);
  if (ctx.size() == 1) return;
  ScratchFrame frame(ctx);  // closes after finish(): no send reads `work` any more
  char* data = static_cast<char*>(buf);
  // Other ranks combine into scratch so that their input survives.
  char* work = ctx.rank() == root ? data : ctx.scratch(count * dtype_size(dtype));
  const Segments blocks(count, lists.blocks);
  run_schedule(ctx, mine, blocks, {data, work}, dtype, op,
               slice_of(lists, dtype_size(dtype), ctx.size(), blocks));
  ctx.finish();
}

}  // namespace ringcomm
