// CUDA reduction kernels over raw device buffers, enqueued on `stream`: the element-wise math of
// kernels/reduce_math.h for every (dtype, op) that kernels/dispatch.h accepts, like kernels/cpu/.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/dtype.h"

namespace ringcomm {
namespace cuda {

// out[i] = op(a[i], b[i]) for n elements; out may alias a or b. AVG reduces as SUM.
void reduce(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n,
            cudaStream_t stream);

// x[i] /= divisor for n elements (truncating on integers; not defined on bool).
void divide(DType dtype, void* x, size_t n, int divisor, cudaStream_t stream);

}  // namespace cuda
}  // namespace ringcomm
