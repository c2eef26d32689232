// Ring algorithms (reduce-scatter, all-gather, and all-reduce as the two back to back).
//
// n ranks in a ring, rank r sends to r+1 and receives from r-1. The buffer is cut into n
// segments (segment k: elements of block k), and each segment into slices of
// RINGCOMM_RING_SLICE_BYTES; slices move independently, so while slice j is being reduced,
// slice j+1 is on the wire and slice j-1 is already travelling to the next rank.
//
// Reduce-scatter, steps s = 0 .. n-2:
//   send segment (r-s-1) to r+1          (step 0: this rank's own input; later: what step s-1 reduced)
//   receive segment (r-s-2) from r-1, reduce it into this rank's copy: acc = mine (op) incoming
//   after the last step this rank holds segment r reduced over all ranks.
// All-gather, steps s = 0 .. n-2:
//   send segment (r-s) to r+1, receive segment (r-s-1) from r-1 straight into place.
//
// Bytes on the wire per rank: reduce-scatter (n-1)/n * S, all-gather (n-1)/n * S, all-reduce
// 2(n-1)/n * S, for a buffer of S bytes: bandwidth-optimal. Each segment's reduction is done once,
// in ring order, and then copied everywhere, so every rank ends with the same bits, and the same
// inputs give the same bits on every run. reduction_order.cc replays this order for coalesced
// all-reduce (checked by tests/test_fusion.py).
#include <cstring>
#include <functional>

#include "algorithms/algorithms.h"
#include "kernels/cpu/reduce.h"

namespace ringcomm {
namespace {

struct Ring {
  int n, rank, next, prev;
  size_t elem, slice;  // element size, slice length in elements
  explicit Ring(Context& ctx, DType dtype)
      : n(ctx.size()), rank(ctx.rank()), next(mod(ctx.rank() + 1, n)), prev(mod(ctx.rank() - 1, n)),
        elem(dtype_size(dtype)),
        slice(std::max<size_t>(1, AlgorithmTuning::get().ring_slice_bytes / elem)) {}

  // Room for the receive requests of one segment's slices (in scratch, so that a step allocates
  // nothing).
  Request* requests(Context& ctx, const Segments& seg) const {
    return reinterpret_cast<Request*>(
        ctx.scratch(piece_count(seg.max_count(), slice) * sizeof(Request)));
  }
  // Calls fn(first element, element count) for every slice of a segment of `count` elements.
  template <typename Fn>
  void for_slices(size_t count, Fn fn) const {
    size_t pieces = piece_count(count, slice);
    for (size_t j = 0; j < pieces; ++j) {
      size_t begin = j * slice;
      fn(begin, std::min(slice, count - std::min(count, begin)));
    }
  }
};

// Reduce-scatter over segments `seg` of `src`. Reduced segments are written to `work` (which may
// be `src`); the final segment (this rank's) goes to `final_out`, and `on_final(offset, count)`
// runs for each of its slices as soon as it is complete, so a following all-gather can start
// sending it at once.
void reduce_scatter_steps(Context& ctx, const Ring& ring, const char* src, char* work,
                          char* final_out, const Segments& seg, DType dtype, ReduceOp op,
                          const std::function<void(size_t, size_t)>& on_final) {
  ScratchFrame frame(ctx);
  const size_t e = ring.elem;
  char* incoming = ctx.scratch(seg.max_count() * e);
  Request* recvs = ring.requests(ctx, seg);
  int first = mod(ring.rank - 1, ring.n);
  ring.for_slices(seg.count(first), [&](size_t b, size_t c) {
    ctx.send(ring.next, src + (seg.offset(first) + b) * e, c * e);
  });
  for (int s = 0; s <= ring.n - 2; ++s) {
    int k = mod(ring.rank - s - 2, ring.n);
    bool last = s == ring.n - 2;
    char* dst = last ? final_out : work + seg.offset(k) * e;
    const char* mine = src + seg.offset(k) * e;
    size_t j = 0;
    ring.for_slices(seg.count(k), [&](size_t b, size_t c) {
      recvs[j++] =
          ctx.recv_reduce(ring.prev, dst + b * e, mine + b * e, incoming + b * e, c, dtype, op);
    });
    j = 0;
    ring.for_slices(seg.count(k), [&](size_t b, size_t c) {
      ctx.wait(recvs[j++]);
      if (last)
        on_final(b, c);
      else
        ctx.send(ring.next, dst + b * e, c * e);
    });
  }
}

// All-gather over segments `seg` of `buf`. With `own_sent`, step 0's slices (this rank's own
// segment) were already sent by the caller.
void all_gather_steps(Context& ctx, const Ring& ring, char* buf, const Segments& seg, bool own_sent) {
  ScratchFrame frame(ctx);
  const size_t e = ring.elem;
  Request* recvs = ring.requests(ctx, seg);
  if (!own_sent)
    ring.for_slices(seg.count(ring.rank), [&](size_t b, size_t c) {
      ctx.send(ring.next, buf + (seg.offset(ring.rank) + b) * e, c * e);
    });
  for (int s = 0; s <= ring.n - 2; ++s) {
    int k = mod(ring.rank - s - 1, ring.n);
    char* dst = buf + seg.offset(k) * e;
    size_t j = 0;
    ring.for_slices(seg.count(k), [&](size_t b, size_t c) { recvs[j++] = ctx.recv(ring.prev, dst + b * e, c * e); });
    j = 0;
    ring.for_slices(seg.count(k), [&](size_t b, size_t c) {
      ctx.wait(recvs[j++]);
      if (s < ring.n - 2) ctx.send(ring.next, dst + b * e, c * e);
    });
  }
}

}  // namespace

void ring_all_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op) {
  if (ctx.size() == 1) return;
  Ring ring(ctx, dtype);
  Segments seg(count, ring.n);
  char* data = static_cast<char*>(buf);
  char* own = data + seg.offset(ring.rank) * ring.elem;
  reduce_scatter_steps(ctx, ring, data, data, own, seg, dtype, op, [&](size_t b, size_t c) {
    if (op == ReduceOp::kAvg) cpu::divide(dtype, own + b * ring.elem, c, ring.n);
    ctx.send(ring.next, own + b * ring.elem, c * ring.elem);
  });
  all_gather_steps(ctx, ring, data, seg, /*own_sent=*/true);
  ctx.finish();
}

void ring_reduce_scatter_in_place(Context& ctx, void* buf, size_t count, DType dtype,
                                  ReduceOp op) {
  if (ctx.size() == 1) return;
  Ring ring(ctx, dtype);
  Segments seg(count, ring.n);
  char* data = static_cast<char*>(buf);
  reduce_scatter_steps(ctx, ring, data, data, data + seg.offset(ring.rank) * ring.elem, seg, dtype,
                       op, [](size_t, size_t) {});
}

void ring_reduce_scatter(Context& ctx, const void* in, void* out, size_t count, DType dtype,
                         ReduceOp op) {
  Ring ring(ctx, dtype);
  if (ring.n == 1) {
    if (out != in) std::memmove(out, in, count * ring.elem);
    return;
  }
  Segments seg(count * ring.n, ring.n);
  ScratchFrame frame(ctx);  // closes after finish(): no send reads `work` any more
  // Partial sums of other ranks' blocks are kept until sent, so they need their own space.
  char* work = ctx.scratch(count * ring.n * ring.elem);
  char* result = static_cast<char*>(out);
  reduce_scatter_steps(ctx, ring, static_cast<const char*>(in), work, result, seg, dtype, op,
                       [&](size_t b, size_t c) {
                         if (op == ReduceOp::kAvg)
                           cpu::divide(dtype, result + b * ring.elem, c, ring.n);
                       });
  ctx.finish();
}

void ring_all_gather(Context& ctx, void* out, const std::vector<size_t>& counts, DType dtype) {
  if (ctx.size() == 1) return;
  Ring ring(ctx, dtype);
  all_gather_steps(ctx, ring, static_cast<char*>(out), Segments(counts), /*own_sent=*/false);
  ctx.finish();
}

}  // namespace ringcomm
