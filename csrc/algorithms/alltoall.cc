// All-to-all: rank r's inputs[q] (in_bytes[q]) lands in rank q's outputs[r] (out_bytes[r] there);
// block sizes may differ per pair (torch's uneven split sizes), and each pair's two sides must
// agree: the transport fails a receive whose message has another size.
//
// Steps (pairwise, all at once): post a receive from every peer, send to every peer starting
// with rank + 1 (so that not every rank sends to rank 0 first), copy the own block, wait. The mesh
// progresses every posted message together, so no order of posting can deadlock.
// Bytes on the wire: sum over q != r of in_bytes[q] out of rank r.
#include <cstring>

#include "algorithms/algorithms.h"

namespace ringcomm {

void pairwise_all_to_all(Context& ctx, const std::vector<const void*>& inputs,
                         const std::vector<size_t>& in_bytes, const std::vector<void*>& outputs,
                         const std::vector<size_t>& out_bytes) {
  const int n = ctx.size(), rank = ctx.rank();
  std::vector<Request> receives;
  for (int step = 1; step < n; ++step) {
    int q = mod(rank - step, n);
    receives.push_back(ctx.recv(q, outputs[q], out_bytes[q]));
  }
  for (int step = 1; step < n; ++step) {
    int q = mod(rank + step, n);
    ctx.send(q, inputs[q], in_bytes[q]);
  }
  if (outputs[rank] != inputs[rank] && in_bytes[rank] > 0)
    std::memmove(outputs[rank], inputs[rank], in_bytes[rank]);
  for (Request r : receives) ctx.wait(r);
  ctx.finish();
}

}  // namespace ringcomm
