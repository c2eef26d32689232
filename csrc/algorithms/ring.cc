// Ring algorithms (reduce-scatter, all-gather, and all-reduce as the two back to back).
//
// n ranks in a ring, rank r sends to r+1 and receives from r-1. The buffer is cut into n
// segments (segment k: elements of block k), and each segment into slices of
// RINGCOMM_RING_SLICE_BYTES; slices move independently, so while slice j is being reduced,
// slice j+1 is on the wire and slice j-1 is already travelling to the next rank.
//
// Rank r's steps (schedule.h; Schedule::describe prints them):
// Reduce-scatter:
//   send             segment r-1 to r+1                (this rank's own input)
//   recv-reduce-send segment r-s-2 from r-1 to r+1, s = 0 .. n-3: acc = mine (op) incoming
//   recv-reduce      segment r from r-1: complete (avg divides here); in all-reduce,
//                    recv-reduce-send, which forwards it as the all-gather's first step
// All-gather:
//   send             segment r to r+1                  (not in all-reduce: already sent)
//   recv-send        segment r-s-1 from r-1 to r+1, s = 0 .. n-3, received straight into place
//   recv             segment r+1 from r-1
//
// Bytes on the wire per rank: reduce-scatter (n-1)/n * S, all-gather (n-1)/n * S, all-reduce
// 2(n-1)/n * S, for a buffer of S bytes: bandwidth-optimal. Each segment's reduction is done once,
// in ring order, and then copied everywhere, so every rank ends with the same bits, and the same
// inputs give the same bits on every run. reduction_order.cc replays this order for coalesced
// all-reduce from the same step lists (checked by tests/test_fusion.py).
#include <cstring>

#include "algorithms/algorithms.h"

namespace ringcomm {
namespace {

// Reduce-scatter: segment k leaves rank k+1 and is combined at each rank it reaches, ending
// complete at rank k. With `then_gather` the last step forwards the completed segment: the
// first step of the all-gather that follows.
void append_reduce_scatter(std::vector<Step>& steps, int n, int r, bool then_gather) {
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  steps.push_back({Prim::kSend, mod(r - 1, n), -1, next});
  for (int s = 0; s <= n - 3; ++s)
    steps.push_back({Prim::kRecvReduceSend, mod(r - s - 2, n), prev, next});
  Step last{then_gather ? Prim::kRecvReduceSend : Prim::kRecvReduce, r, prev,
            then_gather ? next : -1};
  last.completes = true;
  steps.push_back(last);
}

// All-gather: segment k leaves rank k and is copied at each rank it reaches. With `own_sent`,
// this rank's segment is already on its way (all-reduce).
void append_all_gather(std::vector<Step>& steps, int n, int r, bool own_sent) {
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  if (!own_sent) steps.push_back({Prim::kSend, r, -1, next});
  for (int s = 0; s <= n - 3; ++s)
    steps.push_back({Prim::kRecvSend, mod(r - s - 1, n), prev, next});
  steps.push_back({Prim::kRecv, mod(r + 1, n), prev, -1});
}

}  // namespace

// Unset, 512 KiB, but 1 MiB for two ranks. A slice crosses n-1 links before the ring is full, so
// more ranks want smaller slices; two ranks have one link, and their slices are what shared
// memory's single copy pulls (RINGCOMM_SHM_SINGLE_COPY_BYTES, from 1 MiB), one system call each.
size_t ring_slice(size_t elem, int n) {
  size_t bytes = AlgorithmTuning::get().ring_slice_bytes;
  if (!bytes) bytes = n == 2 ? (1 << 20) : (512 << 10);
  return std::max<size_t>(1, bytes / elem);
}

Schedule ring_all_reduce_schedule(int n, int rank) {
  Schedule s;
  append_reduce_scatter(s.steps, n, rank, /*then_gather=*/true);
  append_all_gather(s.steps, n, rank, /*own_sent=*/true);
  return s;
}

Schedule ring_reduce_scatter_schedule(int n, int rank) {
  Schedule s;
  append_reduce_scatter(s.steps, n, rank, /*then_gather=*/false);
  return s;
}

Schedule ring_all_gather_schedule(int n, int rank) {
  Schedule s;
  append_all_gather(s.steps, n, rank, /*own_sent=*/false);
  return s;
}

void ring_all_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op) {
  scheduled_all_reduce(ctx, Algorithm::kRing, buf, count, dtype, op);
}

void ring_reduce_scatter_in_place(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op) {
  if (ctx.size() == 1) return;
  char* data = static_cast<char*>(buf);
  run_schedule(ctx, ring_reduce_scatter_schedule(ctx.size(), ctx.rank()),
               Segments(count, ctx.size()), {data, data}, dtype, op,
               ring_slice(dtype_size(dtype), ctx.size()));
}

void ring_reduce_scatter(Context& ctx, const void* in, void* out, size_t count, DType dtype,
                         ReduceOp op) {
  const int n = ctx.size();
  if (n == 1) {
    if (out != in) std::memmove(out, in, count * dtype_size(dtype));
    return;
  }
  ScratchFrame frame(ctx);  // closes after finish(): no send reads `work` any more
  // Partial sums of other ranks' blocks are kept until sent, so they need their own space.
  char* work = ctx.scratch(count * size_t(n) * dtype_size(dtype));
  run_schedule(ctx, ring_reduce_scatter_schedule(n, ctx.rank()), Segments(count * size_t(n), n),
               {static_cast<const char*>(in), work, static_cast<char*>(out)}, dtype, op,
               ring_slice(dtype_size(dtype), ctx.size()));
  ctx.finish();
}

void ring_all_gather(Context& ctx, void* out, const std::vector<size_t>& counts, DType dtype) {
  if (ctx.size() == 1) return;
  char* data = static_cast<char*>(out);
  run_schedule(ctx, ring_all_gather_schedule(ctx.size(), ctx.rank()), Segments(counts),
               {data, data}, dtype, ReduceOp::kSum, ring_slice(dtype_size(dtype), ctx.size()));
  ctx.finish();
}

}  // namespace ringcomm
