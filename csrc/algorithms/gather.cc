// Gather: every rank's block of `count` elements lands in the root's outputs[rank].
//
// Steps (direct; rooted trees would relay blocks and only pay off for many tiny blocks):
//   root:      post a receive from every other rank into its output, copy its own block, wait.
//   non-root:  send its block to the root.
// Bytes on the wire: (n-1) * B into the root, B out of every other rank (B = count * dtype size).
#include <cstring>

#include "algorithms/algorithms.h"

namespace ringcomm {

void direct_gather(Context& ctx, const void* in, const std::vector<void*>& outputs, size_t bytes,
                   int root) {
  if (ctx.rank() != root) {
    ctx.send(root, in, bytes);
    ctx.finish();
    return;
  }
  std::vector<Request> receives;
  for (int q = 0; q < ctx.size(); ++q)
    if (q != root) receives.push_back(ctx.recv(q, outputs[q], bytes));
  if (outputs[root] != in && bytes > 0) std::memmove(outputs[root], in, bytes);
  for (Request r : receives) ctx.wait(r);
}

}  // namespace ringcomm
