// CUDA pack/unpack kernels over raw device buffers, enqueued on `stream`: a list of buffers of one
// dtype <-> a contiguous fusion buffer, with an optional cast (float32 <-> float16 / bfloat16) and
// scaling in the same pass (kernels/pack_math.h), as kernels/cpu/pack.h does on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/dtype.h"
#include "kernels/pack_list.h"

namespace ringcomm {
namespace cuda {

using kernels::PackList;
using math::Scaling;

// out[i] = convert(in[i]) for n elements.
void convert(DType in_dtype, const void* in, DType out_dtype, void* out, size_t n, Scaling scaling,
             cudaStream_t stream);

// dst[0 .. end-begin) = fused elements [begin, end) of `src`, converted to `dst_dtype`.
void pack(const PackList& src, size_t begin, size_t end, void* dst, DType dst_dtype,
          Scaling scaling, cudaStream_t stream);
// Fused elements [begin, end) of `dst` = src[0 .. end-begin), converted from `src_dtype`.
void unpack(const void* src, DType src_dtype, const PackList& dst, size_t begin, size_t end,
            Scaling scaling, cudaStream_t stream);

}  // namespace cuda
}  // namespace ringcomm
