// Top-k by magnitude: the ordering and the per-element steps, shared by the CPU kernel
// (kernels/cpu/topk.cc) and the CUDA kernel.
//
// An element's key is its bit pattern with the sign cleared. For IEEE floats of one width this
// orders magnitudes exactly like |x| does, with +0 and -0 equal, +inf above every finite value and
// NaN above inf (as torch.topk does). Ties between equal keys go to the lower index, so the selected
// set is a deterministic function of the input.
#pragma once

#include <cstdint>

#include "kernels/reduce_math.h"

namespace ringcomm {
namespace topk {

using Key = uint32_t;

RC_HOST_DEVICE Key magnitude_key(float x) { return math::float_bits(x) & 0x7fffffffu; }
RC_HOST_DEVICE Key magnitude_key(math::Half x) { return x.bits & 0x7fffu; }
RC_HOST_DEVICE Key magnitude_key(math::BFloat16 x) { return x.bits & 0x7fffu; }

// True if element (key_a, index_a) ranks before (key_b, index_b) in the selection order.
RC_HOST_DEVICE bool ranks_before(Key key_a, uint32_t index_a, Key key_b, uint32_t index_b) {
  return key_a != key_b ? key_a > key_b : index_a < index_b;
}

// Error feedback, one element: acc = grad + residual, computed in float and stored in the
// element type. The caller zeroes the residual of the elements it sends.
template <typename T>
RC_HOST_DEVICE T accumulate(T grad, T residual) {
  using C = math::Compute<T>;
  return C::store(C::load(grad) + C::load(residual));
}

}  // namespace topk
}  // namespace ringcomm
