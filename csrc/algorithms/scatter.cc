// Scatter: the root's inputs[q] (`count` elements each) lands in rank q's output.
//
// Steps (direct, the mirror of gather.cc):
//   root:      send inputs[q] to every other rank q, copy its own block, wait for the sends.
//   non-root:  receive its block from the root.
// Bytes on the wire: (n-1) * B out of the root, B into every other rank (B = count * dtype size).
#include <cstring>

#include "algorithms/algorithms.h"

namespace ringcomm {

void direct_scatter(Context& ctx, const std::vector<const void*>& inputs, void* out, size_t bytes,
                    int root) {
  if (ctx.rank() != root) {
    ctx.wait(ctx.recv(root, out, bytes));
    return;
  }
  for (int q = 0; q < ctx.size(); ++q)
    if (q != root) ctx.send(q, inputs[q], bytes);
  if (inputs[root] != out && bytes > 0) std::memmove(out, inputs[root], bytes);
  ctx.finish();
}

}  // namespace ringcomm
