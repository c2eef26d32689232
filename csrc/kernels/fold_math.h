// A fold of several sources, element by element, in their order: the reduction of the window
// plans (algorithms/window_plan.h), run by the CUDA kernel (kernels/cuda/window.cu) and by the
// host test of the plans (tests/native/ipc_protocol.cc), so that the bits one checks are the
// bits the other makes.
#pragma once

#include <cstddef>

#include "kernels/reduce_math.h"

namespace ringcomm {
namespace math {

// ((s0[i] op s1[i]) op s2[i]) ... over `n` sources (pointers to elements, or anything whose [i]
// reads one), each step rounded to the element type, then divided by `divisor` when it is
// above 1 (avg).
template <typename Source, typename Op>
RC_HOST_DEVICE auto fold_one(const Source* sources, int n, size_t i, Op op, int divisor) {
  auto acc = sources[0][i];
  for (int s = 1; s < n; ++s) acc = reduce_one(acc, sources[s][i], op);
  return divisor > 1 ? divide_one(acc, divisor) : acc;
}

}  // namespace math
}  // namespace ringcomm
