// All-reduce over windows (transport/device.h): every rank's device buffer addressable by every
// rank, and counted signals between ranks. A plan is one rank's actions for one all-reduce, in
// stream order: signals and waits, copies, and reductions (a fold of several sources in a fixed
// order into one or two destinations). The device executor (device/executor.h) enqueues them as
// stream operations and kernels; tests/native/ipc_protocol.cc runs them in processes over shared
// memory. A window holds (window_layout):
//   boards:  two halves of `round_bytes`, where a rank copies its part of the buffer for a round;
//   results: two halves of `result_bytes`, where a rank leaves its reduced block of a round;
//   inboxes: for each sender, kInboxSlots messages of `slice_bytes` (the ring's), then as many
//            again for the messages of sends.
//
// all_gather: in rounds of at most round_bytes of the longest block (round k on half k % 2): copy
//   the round's part of my block onto my board; signal every peer; wait for every peer; copy the
//   round's part of every peer's block from its board into my buffer. A rank whose block ends
//   sooner still signals and waits in every round. Wire: each rank's block read once by each
//   peer, (n - 1) x its bytes.
// reduce_scatter: the buffer holds n blocks of `block` elements; block `rank` ends reduced in
//   place. In rounds of at most round_bytes / n of each block (round k on half k % 2): copy the
//   round's part of every block onto my board (block q's at q x stride); signal every peer; wait
//   for every peer; fold part `rank` of every rank's board, rank 0's first, into my block. Wire:
//   each rank's block q read once, by rank q: (n - 1) / n of the buffer, half the two-shot
//   all-reduce's, and each element folded in the all-reduces' order: their bits.
// all_to_all: the reduce-scatter's rounds with copies for the fold: block r of my buffer receives
//   part `rank` of rank r's board, in place (my blocks' part of a round is on my board before any
//   peer's is copied over it). Wire: (n - 1) / n of the buffer, read once.
// one_shot: in rounds of at most round_bytes (round k on half k % 2): copy the round's part of
//   the buffer onto my board; signal every peer; wait for every peer; fold every rank's board,
//   rank 0's first, into my buffer. Every rank folds in the same order: the same bits.
// shared_buffer (two-shot; the host's shared_buffer.cc over windows): copy onto my board;
//   signal, wait; fold block `rank` (aligned_blocks) of every board into my buffer and my result
//   half; signal, wait; copy every peer's result block into my buffer. Each block is folded once,
//   in rank order: the same bits on every rank, and the bits one_shot gives.
// ring: the ring's step list (ring.cc) with each receive, reduce and send of a step in one fold:
//   a message is written into the receiver's inbox (slot (m - 1) % kInboxSlots for the sender's
//   m-th message) and signalled on kMessageChannel; the receiver folds it as the step says into
//   its buffer and, when the step forwards, into the next rank's inbox, then returns the slot
//   with a signal on kCreditChannel; a sender waits for the credit of message m - kInboxSlots
//   before writing message m.
// exchange (scatter, gather, all-to-all of any splits): each rank sends parts of its source
//   buffer to peers and receives parts from peers into its buffer, a part from itself copied:
//   each part in messages of at most a slice, by the ring's protocol through the ring's inboxes,
//   message j to every peer it sends to, then message j from every peer it receives from, for
//   j = 0, 1, ... Message j waits for the credit of message j - kInboxSlots of its pair, which
//   the receiver returned in an earlier round: every rank finishes each round. Wire: each part
//   once.
// send, recv (point to point, between two ranks only): an exchange of one part on channels and
//   inboxes of their own (kSendChannel, kReturnChannel, the sends' inboxes), so that a send or
//   receive may run on another stream than the collectives, and than the messages the other way,
//   without their counts crossing.
//
// Why the halves are enough: a rank writes half h of its board or results in round k + 2 only
// after every peer's first signal of round k + 1, which each peer sends after its reads of
// round k. The same holds across all-reduces, whatever the algorithm in between: each rank's
// signals follow its earlier work on its stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/context.h"
#include "common/signature.h"
#include "transport/device.h"

namespace ringcomm {

// Board rounds' signals; ring messages' (sender to receiver); their credits (back); then the
// same two for the messages of sends and receives.
enum WindowChannel : uint8_t {
  kRoundChannel = 0,
  kMessageChannel = 1,
  kCreditChannel = 2,
  kSendChannel = 3,
  kReturnChannel = 4,
};

struct WindowLayout {
  static constexpr int kInboxSlots = 2;  // a power of two: slots follow counts across their wrap
  int world = 1;
  size_t round_bytes = 0;
  size_t result_bytes = 0;
  size_t slice_bytes = 0;

  size_t board(int half) const { return size_t(half) * round_bytes; }
  size_t result(int half) const { return 2 * round_bytes + size_t(half) * result_bytes; }
  size_t inbox(int from, int slot) const {
    return 2 * (round_bytes + result_bytes) +
           (size_t(from) * kInboxSlots + size_t(slot)) * slice_bytes;
  }
  // Senders 0 to world - 1: the ring's inboxes; world + q: rank q's sends'.
  size_t bytes() const { return inbox(2 * world, 0); }
};
// The layout for `world` ranks and rounds of about `round_bytes` (at least 4 KiB).
WindowLayout window_layout(int world, size_t round_bytes);

// `count` elements cut into `n` blocks whose starts are multiples of `align` elements (the later
// ones may be empty).
Segments aligned_blocks(size_t count, int n, size_t align);

// A place in a window (rank >= 0), in the caller's buffer (kCaller) or in the caller's source
// buffer (kSource: what an exchange sends), `offset` bytes in.
struct WindowRef {
  static constexpr int kCaller = -1;
  static constexpr int kSource = -2;
  int rank;
  size_t offset;
};

struct WindowAction {
  enum Kind : uint8_t { kSync, kCopy, kFold };
  Kind kind;
  device::WindowSync sync{};  // kSync
  // kCopy: refs[first] to refs[first + 1]. kFold: `sources` refs from refs[first], folded in
  // that order (op, as the caller's all-reduce), then `dests` refs to write the result to.
  uint32_t first = 0;
  uint16_t sources = 0, dests = 0;
  size_t count = 0;     // elements
  bool divide = false;  // kFold: then divided by the number of ranks (avg)
};

struct WindowPlan {
  std::vector<WindowAction> actions;
  std::vector<WindowRef> refs;
};

// What one rank carries from one all-reduce to the next: the same on every rank that ran the
// same all-reduces.
struct WindowState {
  // Counts start at `base`, as every slot does (0 in a new segment).
  explicit WindowState(int world, uint32_t base = 0);
  uint64_t rounds = 0;  // board rounds so far: the next one uses half rounds % 2
  // Signals sent to each peer, and signals waited for from each, per channel.
  std::vector<uint32_t> sent[device::Windows::kChannels];
  std::vector<uint32_t> seen[device::Windows::kChannels];
};

// Rank `rank`'s plan for the all-reduce of `count` elements of `elem` bytes by `algo` (kOneShot,
// kSharedBuffer, kRing), over windows laid out as `layout`; `avg` divides the result by the
// number of ranks. Advances `state`. Empty for one rank.
WindowPlan window_all_reduce_plan(Algorithm algo, const WindowLayout& layout, WindowState& state,
                                  int rank, size_t count, size_t elem, bool avg);

// Rank `rank`'s plan for the all-gather into a buffer holding every rank's block back to back
// (block q: counts[q] elements of `elem` bytes, this rank's already in place), over windows laid
// out as `layout`. Advances `state` as the all-reduces do. Empty for one rank.
WindowPlan window_all_gather_plan(const WindowLayout& layout, WindowState& state, int rank,
                                  const std::vector<size_t>& counts, size_t elem);

// Rank `rank`'s plan for the reduce-scatter of a buffer of n blocks of `block` elements of `elem`
// bytes (n the world), block `rank` reduced in place; `avg` divides it by n. Advances `state`
// as the all-reduces do. Empty for one rank.
WindowPlan window_reduce_scatter_plan(const WindowLayout& layout, WindowState& state, int rank,
                                      size_t block, size_t elem, bool avg);

// Rank `rank`'s plan for the all-to-all in place of a buffer of n blocks of `block` elements:
// block r receives block `rank` of rank r's buffer. Advances `state` as the all-reduces do.
// Empty for one rank.
WindowPlan window_all_to_all_plan(const WindowLayout& layout, WindowState& state, int rank,
                                  size_t block, size_t elem);

// `count` elements at element `offset` of a buffer, to or from rank `peer`.
struct Transfer {
  int peer;
  size_t offset, count;
};

// An exchange's parts, checked (at most one each way per peer, in the world; the part to itself,
// if any, sent and received alike): the part to itself each way (nullptr for none) and the
// longest part.
struct ExchangeParts {
  const Transfer* to_self = nullptr;
  const Transfer* from_self = nullptr;
  size_t longest = 0;
};
ExchangeParts exchange_parts(int world, int rank, const std::vector<Transfer>& sends,
                             const std::vector<Transfer>& recvs);

// Rank `rank`'s plan for an exchange: `sends` from its source buffer, `recvs` into its buffer, at
// most one of each per peer, in an order every rank shares (rank order); the send to `peer` pairs
// with `peer`'s receive from this rank, of the same count (one to itself: a copy). Advances
// `state` as the all-reduces do.
WindowPlan window_exchange_plan(const WindowLayout& layout, WindowState& state, int rank,
                                const std::vector<Transfer>& sends,
                                const std::vector<Transfer>& recvs, size_t elem);

// Rank `rank`'s plan for sending `count` elements of `elem` bytes from its source buffer to rank
// `to`, and rank `from`'s for receiving them into its buffer: the k-th send from one rank to
// another pairs with the other's k-th receive from it, and both must give the same count.
// Advances the send channels' counts of `state` (between this pair, this way), which no
// collective uses.
WindowPlan window_send_plan(const WindowLayout& layout, WindowState& state, int rank, int to,
                            size_t count, size_t elem);
WindowPlan window_recv_plan(const WindowLayout& layout, WindowState& state, int rank, int from,
                            size_t count, size_t elem);

}  // namespace ringcomm
