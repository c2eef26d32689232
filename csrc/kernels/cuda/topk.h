// Exact top-k by magnitude on a CUDA device, for float32, float16 and bfloat16, over raw device
// buffers and enqueued on `stream`: the same selection as kernels/cpu/topk.h (ties to the lower
// index, output in ascending index order), so a GPU and a CPU rank pick the same elements.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace ringcomm {
namespace cuda {

// Device scratch memory that topk() and topk_with_residual() need for n elements (the caller
// allocates it, e.g. from torch's caching allocator; it is only used on `stream`).
size_t topk_workspace_bytes(size_t n);

// Writes the indices of the k elements of largest magnitude to `indices` in ascending order and
// their values (with sign) to `values`.
void topk(DType dtype, const void* data, size_t n, size_t k, int32_t* indices, void* values,
          void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Error feedback: residual = grad + residual, select its top-k like topk(), then zero the selected
// entries of `residual`, all in the passes of the selection.
void topk_with_residual(DType dtype, const void* grad, void* residual, size_t n, size_t k,
                        int32_t* indices, void* values, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

// Decompression: out[indices[i]] += values[i] for i < k, indices distinct (one rank's top-k), so
// no two threads touch one element and the result does not depend on scheduling. Indices outside
// [0, n) are skipped and set *bad_index (a device int) to 1: they come from a peer and are not
// trusted.
void scatter_add(DType dtype, void* out, size_t n, const int32_t* indices, const void* values,
                 size_t k, int* bad_index, cudaStream_t stream);

}  // namespace cuda
}  // namespace ringcomm
