// Shared-buffer all-reduce, for ranks of one host that map each other's shared memory (the
// design of DeepSpeed's CPU all-reduce and Open MPI's coll/xhc): each rank reduces one slice
// reading every rank's contribution where it lies, on that rank's board (transport/shm), and
// every rank copies the other slices' results from their owners' boards.
//
// The buffer goes in rounds over pieces of n slices (Segments of the piece), each at most a
// slot: the board is two halves of n slots, round k using half k % 2. Slot s of rank r's half
// carries r's contribution to slice s, and slot r carries r's result. Rank r's steps:
//   in(k):     copy slice s of piece k into slot s of half k % 2, for every s != r, then send an
//              empty message to every peer ("on my board");
//   reduce(k): once every peer's in(k) message is here, reduce slice r, x_0 op x_1 op .. op
//              x_{n-1} left to right in rank order (x_r in the buffer, x_p in slot r of p's
//              half), into the buffer and into slot r of its half; send an empty message to
//              every peer ("result on my board");
//   out(k):    once every peer's reduce(k) message is here, copy slot s of rank s's half into
//              slice s, for every s != r.
// in order in(0), then for each k: reduce(k), in(k+1), out(k): the next round's copy runs while
// the peers finish their reductions. The messages order the boards' reuse: rank r writes slot
// s != r of a half again (in(k+2)) after rank s's reduce(k) message, sent once s has read it; it
// writes its result slot again (reduce(k+2)) after every peer's in(k+2) message, sent after the
// peer's out(k). The same holds from one operation to the next. Each message carries the
// operation's signature: a rank in another collective is reported (a mismatch) before anyone
// reads its board.
//
// Bytes a rank touches per piece of P bytes: (n-1)/n P copied in and (n-1)/n P copied out (each
// read once and written once), P read and 2P/n written by the reduction: (5n-2)/n P, against
// (6n-3)/n P for the ring over the slots, which copies into the peer's slots and out again at
// every step (18 against 27 block-passes at n = 4). Two rounds of messages per piece instead of
// the ring's 2(n-1) steps. Payload, as the statistics count it: what peers read of a rank's board
// is sent, what it reads of theirs received, 2(n-1)/n P each way, as the ring's.
//
// Every element is reduced at one rank, in rank order whatever the size: the same bits on every
// rank (reduction_order.cc). The rounds work on BoardElements: a flat buffer's, here, or a
// coalesced bucket's over the caller's buffers (coalesced.cc), each element reduced in the order
// of its own buffer's all_reduce.

#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/reduction_order.h"

namespace ringcomm {

namespace {

// Reduction sub-pieces: the result is copied to the board while it is still in cache.
constexpr size_t kReducePieceBytes = 64 << 10;

// A round's message to every peer, and waiting for every peer's: no bytes, only the signature.
char nothing;
void notify(Context& ctx, const Signature& sig) {
  for (int d = 1; d < ctx.size(); ++d) ctx.send((ctx.rank() + d) % ctx.size(), &nothing, 0, sig);
}
void await_peers(Context& ctx, const Signature& sig) {
  const int n = ctx.size(), me = ctx.rank();
  std::vector<Request> notices;
  for (int d = 1; d < n; ++d) notices.push_back(ctx.recv((me + n - d) % n, &nothing, 0, sig));
  for (Request r : notices) ctx.wait(r);
}

// x_0 op x_1 op .. op x_{n-1}, left to right.
ReductionProgram rank_order_program(int n) {
  ReductionProgram program(n);
  int value = 0;
  for (int r = 1; r < n; ++r) value = program.add(value, r);
  program.finish();
  return program;
}

// One buffer's elements, reduced in rank order.
class FlatElements : public BoardElements {
 public:
  FlatElements(Context& ctx, void* buf, DType dtype, ReduceOp op)
      : buf_(static_cast<char*>(buf)),
        elem_(dtype_size(dtype)),
        dtype_(dtype),
        op_(op),
        n_(ctx.size()),
        program_(rank_order_program(n_)),
        scratch_(ctx.scratch(program_.scratch_bytes(dtype))),
        inputs_(size_t(n_)) {}
  void copy_in(Context& ctx, size_t first, size_t count, size_t offset) override {
    ctx.write_board(offset, buf_ + first * elem_, count * elem_, 1);
  }
  void reduce(Context& ctx, size_t first, size_t count, const char* const* inputs,
              size_t offset) override {
    char* mine = buf_ + first * elem_;
    for (int p = 0; p < n_; ++p) inputs_[size_t(p)] = p == ctx.rank() ? mine : inputs[p];
    program_.run(dtype_, op_, inputs_.data(), mine, count, scratch_);
    if (op_ == ReduceOp::kAvg) cpu::divide(dtype_, mine, count, n_);
    ctx.write_board(offset, mine, count * elem_, n_ - 1);
  }
  void copy_out(size_t first, size_t count, const char* src) override {
    std::memcpy(buf_ + first * elem_, src, count * elem_);
  }

 private:
  char* buf_;
  size_t elem_;
  DType dtype_;
  ReduceOp op_;
  int n_;
  ReductionProgram program_;
  char* scratch_;
  std::vector<const char*> inputs_;
};

}  // namespace

void shared_buffer_rounds(Context& ctx, BoardElements& elements, size_t count, DType dtype,
                          const Signature& sig) {
  const int n = ctx.size(), me = ctx.rank();
  RC_CHECK_ARG(ctx.has_boards(),
               "the shared_buffer all_reduce needs every rank on one host, "
               "reaching each other through shared memory with a board (RINGCOMM_SHM_BOARD_BYTES)");
  const size_t elem = dtype_size(dtype);
  const size_t half_bytes = ctx.board_bytes() / 2;
  const size_t slot = half_bytes / size_t(n) / 64 * 64 / elem;  // elements, lines whole
  RC_CHECK_ARG(slot > 0, "RINGCOMM_SHM_BOARD_BYTES too small for ", n, " ranks");
  const size_t slot_bytes = slot * elem, piece = slot * size_t(n);
  std::vector<const char*> inputs(static_cast<size_t>(n));
  const size_t reduce_elems = std::max<size_t>(1, kReducePieceBytes / elem);
  const size_t rounds = piece_count(count, piece);
  // Round k's slices, and where slot s of its half lies on a board.
  auto slices = [&](size_t k) {
    return Segments(std::min(count - std::min(count, k * piece), piece), n);
  };
  auto slot_at = [&](size_t k, int s) { return (k % 2) * half_bytes + size_t(s) * slot_bytes; };
  auto copy_in = [&](size_t k) {
    const Segments sl = slices(k);
    trace::Span span("board-in", (sl.offset(n) - sl.count(me)) * elem);
    for (int s = 0; s < n; ++s)
      if (s != me) elements.copy_in(ctx, k * piece + sl.offset(s), sl.count(s), slot_at(k, s));
    notify(ctx, sig);
  };
  copy_in(0);
  for (size_t k = 0; k < rounds; ++k) {
    const Segments sl = slices(k);
    await_peers(ctx, sig);
    {
      trace::Span span("reduce", sl.count(me) * elem * size_t(n));
      for (size_t done = 0; done < sl.count(me); done += reduce_elems) {
        const size_t len = std::min(reduce_elems, sl.count(me) - done);
        for (int p = 0; p < n; ++p)
          if (p != me)
            inputs[size_t(p)] = ctx.read_board(p, slot_at(k, me) + done * elem, len * elem);
        elements.reduce(ctx, k * piece + sl.offset(me) + done, len, inputs.data(),
                        slot_at(k, me) + done * elem);
      }
    }
    notify(ctx, sig);
    if (k + 1 < rounds) copy_in(k + 1);
    await_peers(ctx, sig);
    trace::Span span("board-out", (sl.offset(n) - sl.count(me)) * elem);
    for (int s = 0; s < n; ++s)
      if (s != me)
        elements.copy_out(k * piece + sl.offset(s), sl.count(s),
                          ctx.read_board(s, slot_at(k, s), sl.count(s) * elem));
  }
  ctx.finish();
}

void shared_buffer_all_reduce(Context& ctx, void* buffer, size_t count, DType dtype, ReduceOp op) {
  if (ctx.size() == 1) return;  // avg of one rank is its value
  FlatElements elements(ctx, buffer, dtype, op);
  shared_buffer_rounds(ctx, elements, count, dtype, ctx.signature());
}

}  // namespace ringcomm
