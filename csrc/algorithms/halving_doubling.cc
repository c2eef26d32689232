// Halving-doubling all-reduce (Rabenseifner's; Gloo's allreduce_halving_doubling): the ring's
// bytes in recursive doubling's number of rounds, for mid-size messages on more than two ranks.
//
// With p the largest power of two <= n and rem = n - p, a rank's steps (schedule.h), over p
// blocks (Segments(count, p)):
//   1. fold, as recursive doubling's (recursive_doubling.cc): among ranks 0 .. 2*rem-1, each even
//      rank sends every block to the odd rank above it, which recv-reduces them (incoming, the
//      lower rank's data, first) and stays in; even ranks drop out.
//   2. reduce-scatter by recursive halving, for mask = p/2, p/4, .. 1: the rank holds the 2 mask
//      blocks of its index's group; it sends the half that does not hold block `index` to the
//      partner (index ^ mask) and recv-reduces the partner's copy of the other half ((lower
//      index's data) op (higher index's)). After mask 1, block `index` is complete here.
//   3. all-gather by recursive doubling, for mask = 1, 2, .. p/2: send the mask complete blocks it
//      holds to the partner, receive the partner's mask blocks in place.
//   4. unfold: each odd rank of step 1 sends every block back to its even partner.
// Bytes on the wire per rank: 2 (p-1)/p x S for a buffer of S bytes (+ S each way in a folded
// pair), in 2 log2(p) rounds (+ 2): a ring's bytes, where the ring waits through 2 (n-1) rounds.
// Each block is completed at one rank and copied to the others: the same bits on every rank.
// A block sent in step 2 is overwritten by step 3's receive from the same partner, which sends
// it only after it has received the whole block.
#include "algorithms/algorithms.h"

namespace ringcomm {

Schedule halving_doubling_schedule(int n, int rank) {
  const int p = butterfly_size(n), rem = n - p;
  Schedule s;
  auto every_block = [&](Prim prim, int from, int to) {
    for (int b = 0; b < p; ++b) {
      Step step{prim, b, from, to};
      step.incoming_first = prim == Prim::kRecvReduce;  // the fold: the lower rank's data first
      s.steps.push_back(step);
    }
  };
  if (rank < 2 * rem && rank % 2 == 0) {  // folded away: hand over, get the result back
    every_block(Prim::kSend, -1, rank + 1);
    every_block(Prim::kRecv, rank + 1, -1);
    return s;
  }
  if (rank < 2 * rem) every_block(Prim::kRecvReduce, rank - 1, -1);
  const int index = rank < 2 * rem ? rank / 2 : rank - rem;
  auto rank_of = [&](int i) { return i < rem ? 2 * i + 1 : i + rem; };
  int group = 0;  // the first block of the 2 mask blocks this rank still reduces
  for (int mask = p / 2; mask >= 1; mask /= 2) {
    const int partner = index ^ mask, peer = rank_of(partner);
    const int keep = group + (index & mask), give = group + (partner & mask);
    for (int b = give; b < give + mask; ++b) s.steps.push_back({Prim::kSend, b, -1, peer});
    for (int b = keep; b < keep + mask; ++b) {
      Step step{Prim::kRecvReduce, b, peer, -1};
      step.incoming_first = partner < index;
      step.completes = mask == 1;
      s.steps.push_back(step);
    }
    group = keep;
  }
  for (int mask = 1; mask < p; mask *= 2) {
    const int partner = index ^ mask, peer = rank_of(partner);
    const int mine = index & ~(mask - 1), theirs = partner & ~(mask - 1);
    for (int b = mine; b < mine + mask; ++b) s.steps.push_back({Prim::kSend, b, -1, peer});
    for (int b = theirs; b < theirs + mask; ++b) s.steps.push_back({Prim::kRecv, b, peer, -1});
  }
  if (rank < 2 * rem) every_block(Prim::kSend, -1, rank - 1);
  return s;
}

}  // namespace ringcomm
