// Recursive doubling all-reduce, for small messages: latency of log2(n) exchanges.
//
// With p the largest power of two <= n and rem = n - p:
//   1. fold:  among ranks 0 .. 2*rem-1, each even rank sends its buffer to the odd rank above it,
//             which combines them (lower rank's data on the left) and stays in; even ranks drop out.
//   2. butterfly, for mask = 1, 2, 4, .. < p: exchange the whole buffer with the partner whose
//             index differs in `mask`, combine as (lower index's data) op (higher index's data).
//   3. unfold: each odd rank of step 1 sends the result back to its even partner.
// Bytes on the wire per rank: S * log2(p) (+ S for the fold) for a buffer of S bytes. Both
// partners compute the same expression with the same operand order, so results are bitwise equal
// on every rank. reduction_order.cc replays this order for coalesced all-reduce (checked by
// tests/test_fusion.py).
#include "algorithms/algorithms.h"
#include "kernels/cpu/reduce.h"

namespace ringcomm {

void recursive_doubling_all_reduce(Context& ctx, void* buf, size_t count, DType dtype,
                                   ReduceOp op) {
  const int n = ctx.size(), rank = ctx.rank();
  if (n == 1) return;
  const size_t bytes = count * dtype_size(dtype);
  char* data = static_cast<char*>(buf);
  ScratchFrame frame(ctx);
  char* incoming = ctx.scratch(bytes);
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int rem = n - p;

  int index;  // position in the butterfly, -1 for ranks folded away
  if (rank < 2 * rem) {
    if (rank % 2 == 0) {
      ctx.send(rank + 1, data, bytes);
      index = -1;
    } else {
      ctx.wait(ctx.recv(rank - 1, incoming, bytes));
      cpu::reduce(dtype, op, data, incoming, data, count);
      index = rank / 2;
    }
  } else {
    index = rank - rem;
  }

  if (index >= 0) {
    auto rank_of = [&](int i) { return i < rem ? 2 * i + 1 : i + rem; };
    for (int mask = 1; mask < p; mask <<= 1) {
      int partner_index = index ^ mask;
      int partner = rank_of(partner_index);
      ctx.send(partner, data, bytes);
      ctx.wait(ctx.recv(partner, incoming, bytes));
      ctx.finish();  // our buffer is about to change: the send must be out of it first
      if (partner_index < index)
        cpu::reduce(dtype, op, data, incoming, data, count);
      else
        cpu::reduce(dtype, op, data, data, incoming, count);
    }
    if (op == ReduceOp::kAvg) cpu::divide(dtype, data, count, n);
  }

  if (rank < 2 * rem) {
    if (rank % 2 == 1)
      ctx.send(rank - 1, data, bytes);
    else
      ctx.wait(ctx.recv(rank + 1, data, bytes));
  }
  ctx.finish();
}

}  // namespace ringcomm
