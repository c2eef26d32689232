#include "algorithms/window_plan.h"

#include <algorithm>

#include "algorithms/algorithms.h"

namespace ringcomm {
namespace {

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// Messages through inboxes: the channel a message is signalled on, the one its slot is returned
// on, and the inboxes' first sender index in the layout (world for the sends' inboxes).
struct Lane {
  uint8_t message, credit;
  int inboxes;
};
constexpr Lane kRingLane{kMessageChannel, kCreditChannel, 0};
constexpr Lane send_lane(int world) { return {kSendChannel, kReturnChannel, world}; }

// Builds one rank's plan, keeping the counts of `state` as it goes.
class Planner {
 public:
  Planner(const WindowLayout& layout, WindowState& state, int rank, size_t elem, bool avg)
      : layout_(layout), state_(state), rank_(rank), world_(layout.world), elem_(elem), avg_(avg) {}

  WindowPlan take() { return std::move(plan_); }

  // Both board algorithms: rounds over the buffer, at most round_bytes each.
  void rounds(size_t count, bool two_shot) {
    const size_t per_round = std::max<size_t>(1, layout_.round_bytes / elem_);
    for (size_t first = 0; first < count; first += per_round) {
      const int half = int(state_.rounds++ % 2);
      const size_t n = std::min(per_round, count - first);
      const WindowRef mine{WindowRef::kCaller, first * elem_};
      copy(mine, {rank_, layout_.board(half)}, n);
      all_to_all();
      if (!two_shot) {
        std::vector<WindowRef> sources;
        for (int r = 0; r < world_; ++r) sources.push_back({r, layout_.board(half)});
        fold(sources, {mine}, n, avg_);
        continue;
      }
      const Segments blocks = aligned_blocks(n, world_, std::max<size_t>(1, 16 / elem_));
      auto at = [&](int block, WindowRef base) {
        return WindowRef{base.rank, base.offset + blocks.offset(block) * elem_};
      };
      std::vector<WindowRef> sources;
      for (int r = 0; r < world_; ++r) sources.push_back(at(rank_, {r, layout_.board(half)}));
      fold(sources, {at(rank_, mine), {rank_, layout_.result(half)}}, blocks.count(rank_), avg_);
      all_to_all();
      for (int q = 0; q < world_; ++q)
        if (q != rank_) copy({q, layout_.result(half)}, at(q, mine), blocks.count(q));
    }
  }

  // The all-gather's rounds: each block's part through its rank's board, copied out by the others.
  void gather_rounds(const std::vector<size_t>& counts) {
    const size_t per_round = std::max<size_t>(1, layout_.round_bytes / elem_);
    const size_t longest = *std::max_element(counts.begin(), counts.end());
    const Segments blocks(counts);
    for (size_t first = 0; first < longest; first += per_round) {
      const int half = int(state_.rounds++ % 2);
      auto part = [&](int q) {
        return first < counts[size_t(q)] ? std::min(per_round, counts[size_t(q)] - first) : 0;
      };
      auto in_block = [&](int q) {
        return WindowRef{WindowRef::kCaller, (blocks.offset(q) + first) * elem_};
      };
      if (part(rank_) > 0) copy(in_block(rank_), {rank_, layout_.board(half)}, part(rank_));
      all_to_all();
      for (int q = 0; q < world_; ++q)
        if (q != rank_ && part(q) > 0) copy({q, layout_.board(half)}, in_block(q), part(q));
    }
  }

  // The reduce-scatter's and all-to-all's rounds: the round's part of every block onto my board,
  // at strides that keep each part 16-byte aligned; then part `rank` of every board folded into
  // my block (`fold`), or copied into block r for rank r's board.
  void exchange_rounds(size_t block, bool fold) {
    const size_t stride = layout_.round_bytes / size_t(world_) / 16 * 16;
    const size_t per_round = std::max<size_t>(1, stride / elem_);
    for (size_t first = 0; first < block; first += per_round) {
      const int half = int(state_.rounds++ % 2);
      const size_t n = std::min(per_round, block - first);
      auto in_block = [&](int q) {
        return WindowRef{WindowRef::kCaller, (size_t(q) * block + first) * elem_};
      };
      auto on_board = [&](int r, int q) {
        return WindowRef{r, layout_.board(half) + size_t(q) * stride};
      };
      for (int q = 0; q < world_; ++q) copy(in_block(q), on_board(rank_, q), n);
      all_to_all();
      if (!fold) {
        for (int r = 0; r < world_; ++r) copy(on_board(r, rank_), in_block(r), n);
        continue;
      }
      std::vector<WindowRef> sources;
      for (int r = 0; r < world_; ++r) sources.push_back(on_board(r, rank_));
      this->fold(sources, {in_block(rank_)}, n, avg_);
    }
  }

  // The exchange's rounds of one message per part; the part to itself copied first.
  void exchange(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, Lane lane) {
    const ExchangeParts parts = exchange_parts(world_, rank_, sends, recvs);
    if (parts.to_self != nullptr && parts.to_self->count > 0)
      copy({WindowRef::kSource, parts.to_self->offset * elem_},
           {WindowRef::kCaller, parts.from_self->offset * elem_}, parts.to_self->count);
    const size_t per_message = std::max<size_t>(1, layout_.slice_bytes / elem_);
    for (size_t first = 0; first < parts.longest; first += per_message) {
      for (const Transfer& t : sends) {
        if (t.peer == rank_ || first >= t.count) continue;
        copy({WindowRef::kSource, (t.offset + first) * elem_}, send_slot(t.peer, lane),
             std::min(per_message, t.count - first));
        signal(lane.message, t.peer);
      }
      for (const Transfer& t : recvs) {
        if (t.peer == rank_ || first >= t.count) continue;
        copy(receive_slot(t.peer, lane), {WindowRef::kCaller, (t.offset + first) * elem_},
             std::min(per_message, t.count - first));
        signal(lane.credit, t.peer);
      }
    }
  }

  // The ring's step list, each step's receive, fold and send as one fold, in rounds whose
  // blocks are at most a slice: one message per step, so that every rank sends and receives in
  // lockstep and two inbox slots keep the ring moving (with several messages a step, every rank
  // would wait for credits before any had received).
  void ring(size_t count) {
    const Schedule schedule = ring_all_reduce_schedule(world_, rank_);
    const size_t per_round = std::max<size_t>(1, layout_.slice_bytes / elem_) * size_t(world_);
    for (size_t first = 0; first < count; first += per_round) {
      const Segments blocks(std::min(per_round, count - first), world_);
      for (const Step& s : schedule.steps) {
        const size_t n = blocks.count(s.block);
        const WindowRef mine{WindowRef::kCaller, (first + blocks.offset(s.block)) * elem_};
        if (s.prim == Prim::kSend) {
          copy(mine, send_slot(s.to), n);
          signal(kMessageChannel, s.to);
          continue;
        }
        const WindowRef incoming = receive_slot(s.from);
        const bool reduces = s.prim == Prim::kRecvReduce || s.prim == Prim::kRecvReduceSend;
        const bool forwards = s.prim == Prim::kRecvSend || s.prim == Prim::kRecvReduceSend;
        std::vector<WindowRef> sources{incoming};
        if (reduces) sources.insert(s.incoming_first ? sources.end() : sources.begin(), mine);
        std::vector<WindowRef> dests{mine};
        if (forwards) dests.push_back(send_slot(s.to));
        fold(sources, dests, n, reduces && s.completes && avg_);
        signal(kCreditChannel, s.from);
        if (forwards) signal(kMessageChannel, s.to);
      }
    }
  }

 private:
  void sync(bool wait, uint8_t channel, int peer, uint32_t count) {
    WindowAction a{WindowAction::kSync};
    a.sync = {wait, channel, peer, count};
    plan_.actions.push_back(a);
  }
  void signal(uint8_t channel, int peer) {
    sync(false, channel, peer, ++state_.sent[channel][size_t(peer)]);
  }
  uint32_t await(uint8_t channel, int peer) {
    const uint32_t count = ++state_.seen[channel][size_t(peer)];
    sync(true, channel, peer, count);
    return count;
  }
  // Every peer is signalled, then waited for.
  void all_to_all() {
    for (int q = 0; q < world_; ++q)
      if (q != rank_) signal(kRoundChannel, q);
    for (int q = 0; q < world_; ++q)
      if (q != rank_) await(kRoundChannel, q);
  }
  // Where this rank's next message to `to` goes, once `to` has returned the slot it last held
  // (message m - kInboxSlots; before the first kInboxSlots messages, a count the slot's initial
  // value has reached cyclically).
  WindowRef send_slot(int to, Lane lane = kRingLane) {
    const uint32_t m = state_.sent[lane.message][size_t(to)] + 1;  // the message about to go
    sync(true, lane.credit, to, m - WindowLayout::kInboxSlots);
    return {to, layout_.inbox(lane.inboxes + rank_, int((m - 1) % WindowLayout::kInboxSlots))};
  }
  // Where the next message from `from` lies, once it has come.
  WindowRef receive_slot(int from, Lane lane = kRingLane) {
    const uint32_t m = await(lane.message, from);
    return {rank_, layout_.inbox(lane.inboxes + from, int((m - 1) % WindowLayout::kInboxSlots))};
  }
  void copy(WindowRef from, WindowRef to, size_t count) {
    WindowAction a{WindowAction::kCopy};
    a.first = uint32_t(plan_.refs.size());
    a.count = count;
    plan_.refs.push_back(from);
    plan_.refs.push_back(to);
    plan_.actions.push_back(a);
  }
  void fold(const std::vector<WindowRef>& sources, const std::vector<WindowRef>& dests,
            size_t count, bool divide) {
    WindowAction a{WindowAction::kFold};
    a.first = uint32_t(plan_.refs.size());
    a.sources = uint16_t(sources.size());
    a.dests = uint16_t(dests.size());
    a.count = count;
    a.divide = divide;
    plan_.refs.insert(plan_.refs.end(), sources.begin(), sources.end());
    plan_.refs.insert(plan_.refs.end(), dests.begin(), dests.end());
    plan_.actions.push_back(a);
  }

  const WindowLayout& layout_;
  WindowState& state_;
  const int rank_, world_;
  const size_t elem_;
  const bool avg_;
  WindowPlan plan_;
};

}  // namespace

WindowLayout window_layout(int world, size_t round_bytes) {
  WindowLayout l;
  l.world = world;
  l.round_bytes = round_up(std::max<size_t>(round_bytes, 4096), 256);
  // A block of aligned_blocks: at most count / world + 1 elements, rounded up to 16 bytes.
  l.result_bytes = round_up(l.round_bytes / size_t(world) + 64, 256);
  l.slice_bytes = round_up(std::max<size_t>(l.round_bytes / 4, 4096), 256);
  return l;
}

Segments aligned_blocks(size_t count, int n, size_t align) {
  const size_t per = round_up((count + size_t(n) - 1) / size_t(n), align);
  std::vector<size_t> counts;
  for (int i = 0; i < n; ++i) {
    const size_t begin = std::min(count, size_t(i) * per);
    counts.push_back(std::min(count, begin + per) - begin);
  }
  return Segments(counts);
}

WindowState::WindowState(int world, uint32_t base) {
  for (auto& v : sent) v.assign(size_t(world), base);
  for (auto& v : seen) v.assign(size_t(world), base);
}

WindowPlan window_all_reduce_plan(Algorithm algo, const WindowLayout& layout, WindowState& state,
                                  int rank, size_t count, size_t elem, bool avg) {
  RC_CHECK_ARG(
      algo == Algorithm::kOneShot || algo == Algorithm::kSharedBuffer || algo == Algorithm::kRing,
      "all_reduce by ", algorithm_name(algo), " does not run over windows");
  Planner planner(layout, state, rank, elem, avg);
  if (layout.world == 1) return planner.take();  // one contribution is its own reduction
  if (algo == Algorithm::kRing)
    planner.ring(count);
  else
    planner.rounds(count, algo == Algorithm::kSharedBuffer);
  return planner.take();
}

WindowPlan window_all_gather_plan(const WindowLayout& layout, WindowState& state, int rank,
                                  const std::vector<size_t>& counts, size_t elem) {
  RC_CHECK_ARG(int(counts.size()) == layout.world, counts.size(), " block sizes for ", layout.world,
               " ranks");
  Planner planner(layout, state, rank, elem, false);
  if (layout.world > 1) planner.gather_rounds(counts);
  return planner.take();
}

WindowPlan window_reduce_scatter_plan(const WindowLayout& layout, WindowState& state, int rank,
                                      size_t block, size_t elem, bool avg) {
  Planner planner(layout, state, rank, elem, avg);
  if (layout.world > 1) planner.exchange_rounds(block, true);
  return planner.take();
}

ExchangeParts exchange_parts(int world, int rank, const std::vector<Transfer>& sends,
                             const std::vector<Transfer>& recvs) {
  ExchangeParts parts;
  auto scan = [&](const std::vector<Transfer>& list, const char* way) {
    const Transfer* self = nullptr;
    std::vector<bool> seen(size_t(world), false);
    for (const Transfer& t : list) {
      RC_CHECK_ARG(t.peer >= 0 && t.peer < world && !seen[size_t(t.peer)], "rank ", rank, way,
                   t.peer, " twice or out of ", world);
      seen[size_t(t.peer)] = true;
      if (t.peer == rank) self = &t;
      parts.longest = std::max(parts.longest, t.count);
    }
    return self;
  };
  parts.to_self = scan(sends, " sends to rank ");
  parts.from_self = scan(recvs, " receives from rank ");
  RC_CHECK_ARG((parts.to_self == nullptr) == (parts.from_self == nullptr) &&
                   (parts.to_self == nullptr || parts.to_self->count == parts.from_self->count),
               "rank ", rank, "'s part to itself is sent and received alike");
  return parts;
}

WindowPlan window_exchange_plan(const WindowLayout& layout, WindowState& state, int rank,
                                const std::vector<Transfer>& sends,
                                const std::vector<Transfer>& recvs, size_t elem) {
  Planner planner(layout, state, rank, elem, false);
  planner.exchange(sends, recvs, kRingLane);
  return planner.take();
}

WindowPlan window_send_plan(const WindowLayout& layout, WindowState& state, int rank, int to,
                            size_t count, size_t elem) {
  RC_CHECK_ARG(to >= 0 && to < layout.world && to != rank, "rank ", rank, " cannot send to rank ",
               to, " of ", layout.world);
  Planner planner(layout, state, rank, elem, false);
  planner.exchange({{to, 0, count}}, {}, send_lane(layout.world));
  return planner.take();
}

WindowPlan window_recv_plan(const WindowLayout& layout, WindowState& state, int rank, int from,
                            size_t count, size_t elem) {
  RC_CHECK_ARG(from >= 0 && from < layout.world && from != rank, "rank ", rank,
               " cannot receive from rank ", from, " of ", layout.world);
  Planner planner(layout, state, rank, elem, false);
  planner.exchange({}, {{from, 0, count}}, send_lane(layout.world));
  return planner.take();
}

WindowPlan window_all_to_all_plan(const WindowLayout& layout, WindowState& state, int rank,
                                  size_t block, size_t elem) {
  Planner planner(layout, state, rank, elem, false);
  if (layout.world > 1) planner.exchange_rounds(block, false);
  return planner.take();
}

}  // namespace ringcomm
