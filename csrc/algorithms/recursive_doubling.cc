// Recursive doubling all-reduce, for small messages: latency of log2(n) exchanges.
//
// With p the largest power of two <= n and rem = n - p, a rank's steps (schedule.h), over the
// whole buffer as one block:
//   1. fold:  among ranks 0 .. 2*rem-1, each even rank sends its buffer to the odd rank above
//             it, which recv-reduces it (incoming, the lower rank's data, first) and stays in;
//             even ranks drop out.
//   2. butterfly, for mask = 1, 2, 4, .. < p: exchange-reduce the whole buffer with the partner
//             whose index differs in `mask`: (lower index's data) op (higher index's data); the
//             last exchange completes it.
//   3. unfold: each odd rank of step 1 sends the result back to its even partner, which
//             receives it in place.
// Bytes on the wire per rank: S * log2(p) (+ S for the fold) for a buffer of S bytes. Both
// partners compute the same expression with the same operand order, so results are bitwise equal
// on every rank. reduction_order.cc replays this order for coalesced all-reduce, from the same
// step lists (checked by tests/test_fusion.py).
#include "algorithms/algorithms.h"

namespace ringcomm {

Schedule recursive_doubling_schedule(int n, int rank) {
  const int p = butterfly_size(n), rem = n - p;
  Schedule s;
  if (rank < 2 * rem && rank % 2 == 0) {  // folded away: hand over, get the result back
    s.steps.push_back({Prim::kSend, 0, -1, rank + 1});
    s.steps.push_back({Prim::kRecv, 0, rank + 1, -1});
    return s;
  }
  if (rank < 2 * rem) {
    Step fold{Prim::kRecvReduce, 0, rank - 1, -1};
    fold.incoming_first = true;  // the lower rank's data on the left
    s.steps.push_back(fold);
  }
  const int index = rank < 2 * rem ? rank / 2 : rank - rem;
  auto rank_of = [&](int i) { return i < rem ? 2 * i + 1 : i + rem; };
  for (int mask = 1; mask < p; mask <<= 1) {
    const int partner = index ^ mask;
    Step x{Prim::kExchangeReduce, 0, -1, rank_of(partner)};
    x.incoming_first = partner < index;
    x.completes = mask * 2 >= p;
    s.steps.push_back(x);
  }
  if (rank < 2 * rem) s.steps.push_back({Prim::kSend, 0, -1, rank - 1});
  return s;
}

void recursive_doubling_all_reduce(Context& ctx, void* buf, size_t count, DType dtype,
                                   ReduceOp op) {
  scheduled_all_reduce(ctx, Algorithm::kRecursiveDoubling, buf, count, dtype, op);
}

}  // namespace ringcomm
