// 8-bit quantization with error feedback on the CPU, for float32, float16 and bfloat16 (the
// scheme: kernels/quantize_math.h). A bucket's average takes three steps around two all-reduces:
//   ranges (error feedback, then each chunk's (-min, max))  -> all-reduce max ->
//   quantize (codes, and what they lost back into the residual) -> all-reduce sum of uint8 ->
//   dequantize_mean (the average, the same bits on every rank).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/quantize_math.h"

namespace ringcomm {
namespace cpu {

// Chunks of `chunk` elements in n (the last may be shorter): ranges hold two floats for each.
size_t quantize_chunks(size_t n, size_t chunk);

// With a residual: residual = grad + residual (in float, stored as dtype), then the ranges of the
// residual; without (nullptr): the ranges of grad. ranges[2c] = -min, ranges[2c + 1] = max of
// chunk c, zeros made +0.
void quantize_ranges(DType dtype, const void* grad, void* residual, size_t n, size_t chunk,
                     float* ranges);

// codes[i] = the code of source[i] under chunk i / chunk's agreed ranges, with `levels` steps
// (1 .. 255). `error`, when not nullptr (it may be source), gets source - the code's value: what
// quantization lost, for error feedback. Stochastic rounding draws element i's offset from the
// stream `key`.
void quantize(DType dtype, const void* source, void* error, size_t n, size_t chunk,
              const float* ranges, uint32_t levels, quantize::Rounding rounding, uint64_t key,
              uint8_t* codes);

// out[i] = the mean of `world` ranks' values whose codes summed to sums[i], as out_dtype.
void dequantize_mean(const uint8_t* sums, size_t n, size_t chunk, const float* ranges,
                     uint32_t levels, int world, DType out_dtype, void* out);

}  // namespace cpu
}  // namespace ringcomm
