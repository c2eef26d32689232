// 8-bit quantization with error feedback on a CUDA device, over raw device buffers and enqueued on
// `stream`: the steps and results of kernels/cpu/quantize.h, bit for bit (both run
// kernels/quantize_math.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/quantize_math.h"

namespace ringcomm {
namespace cuda {

void quantize_ranges(DType dtype, const void* grad, void* residual, size_t n, size_t chunk,
                     float* ranges, cudaStream_t stream);

void quantize(DType dtype, const void* source, void* error, size_t n, size_t chunk,
              const float* ranges, uint32_t levels, quantize::Rounding rounding, uint64_t key,
              uint8_t* codes, cudaStream_t stream);

void dequantize_mean(const uint8_t* sums, size_t n, size_t chunk, const float* ranges,
                     uint32_t levels, int world, DType out_dtype, void* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace ringcomm
