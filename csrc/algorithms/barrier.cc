// Dissemination barrier: in round k = 0, 1, .. (while 2^k < n) rank r sends an empty message to
// r + 2^k and waits for one from r - 2^k. After ceil(log2 n) rounds every rank has (transitively)
// heard from every other. Bytes on the wire: headers only.
#include "algorithms/algorithms.h"

namespace ringcomm {

void dissemination_barrier(Context& ctx) {
  const int n = ctx.size(), rank = ctx.rank();
  for (int dist = 1; dist < n; dist *= 2) {
    ctx.send(mod(rank + dist, n), nullptr, 0);
    ctx.wait(ctx.recv(mod(rank - dist, n), nullptr, 0));
  }
  ctx.finish();
}

}  // namespace ringcomm
