// 8-bit quantization with a scale every rank agrees on, shared by the CPU kernel
// (kernels/cpu/quantize.cc) and the CUDA kernel (kernels/cuda/quantize.cu): the same functions
// run on both sides, so a CPU rank and a GPU rank quantize and decode to the same bits.
//
// A vector is cut into chunks of `chunk` elements. Every rank writes each chunk's (-min, max)
// (ranges), the ranks all-reduce them with max, and each chunk's agreed [lo, hi] gives every rank
// the same scale: `levels` = floor(255 / world) steps of (hi - lo) / levels. A rank's code for x
// is floor((x - lo) / step + offset) in [0, levels] (offset 1/2: nearest, ties up; a uniform draw
// in [0, 1): stochastic rounding, unbiased); the codes of all ranks then sum to at most 255, so
// an all-reduce of the uint8 codes adds them exactly, whatever the algorithm and its order, and
// every rank decodes the same mean lo + step * (sum / world).
//
// Each operation is rounded on its own (no fused multiply-add): the device side spells the
// rounding out with intrinsics, the host side is compiled with -ffp-contract=off.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/dtype.h"
#include "common/error.h"
#include "kernels/dispatch.h"
#include "kernels/reduce_math.h"

namespace ringcomm {
namespace quantize {

// The most a uint8 sum holds: with `world` ranks, each rank's codes go up to 255 / world.
constexpr uint32_t kCodeSum = 255;

enum class Rounding : int { kNearest = 0, kStochastic = 1 };

RC_HOST_DEVICE float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
RC_HOST_DEVICE float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
RC_HOST_DEVICE float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
RC_HOST_DEVICE float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Where a chunk's min and max start (every chunk has an element, so neither survives).
constexpr float kEmptyLo = INFINITY;
constexpr float kEmptyHi = -INFINITY;

// A chunk's entries in the ranges all-reduced with max: -min and max, +0 for -0 (max does not
// order the two zeros, and different algorithms would then leave different signs).
RC_HOST_DEVICE float range_word(float v) { return add(v, 0.0f); }

struct Scale {
  float lo;       // the agreed minimum
  float step;     // (hi - lo) / levels
  float inverse;  // levels / (hi - lo), 0 where the range is empty or not finite
};

// From a chunk's agreed (-min, max).
RC_HOST_DEVICE Scale scale_of(float negative_lo, float hi, uint32_t levels) {
  const float lo = -negative_lo;
  const float range = sub(hi, lo);
  Scale s;
  s.lo = lo;
  s.step = div(range, float(levels));
  s.inverse = range > 0.0f && range <= 3.4028234663852886e38f ? div(float(levels), range) : 0.0f;
  return s;
}

// floor((x - lo) / step + offset) clamped to [0, levels]; NaN gives 0. Selects, not branches,
// and conversions through int32 (AVX2 has none between float and uint32), so that the CPU loops
// over it vectorise; codes fit an int32 either way.
RC_HOST_DEVICE uint32_t code_of(float x, const Scale& s, float offset, uint32_t levels) {
  float v = floorf(add(mul(sub(x, s.lo), s.inverse), offset));
  v = v > 0.0f ? v : 0.0f;
  v = v < float(levels) ? v : float(levels);
  return uint32_t(int32_t(v));
}

// What a code stands for.
RC_HOST_DEVICE float value_of(const Scale& s, uint32_t code) {
  return add(s.lo, mul(float(int32_t(code)), s.step));
}

// The mean of `world` ranks' values whose codes summed to `sum`.
RC_HOST_DEVICE float mean_of(const Scale& s, uint32_t sum, int world) {
  return add(s.lo, mul(s.step, div(float(int32_t(sum)), float(world))));
}

// splitmix64's finalizer: a bijection of 64-bit words whose outputs look independent.
RC_HOST_DEVICE uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A uniform draw in [0, 1) (24 bits) for element `index` of the stream `key`: a function of the
// two alone, so the draws do not depend on how the work is split over threads or devices.
RC_HOST_DEVICE float uniform(uint64_t key, uint64_t index) {
  const uint64_t h = mix(key + mix(index + 0x9e3779b97f4a7c15ull));
  return float(uint32_t(h >> 40)) * 5.9604644775390625e-8f;  // 2^-24
}

RC_HOST_DEVICE float offset_of(Rounding rounding, uint64_t key, uint64_t index) {
  return rounding == Rounding::kStochastic ? uniform(key, index) : 0.5f;
}

// Host code: f(kernels::Type<T>{}) for the element types quantized (float32, float16, bfloat16);
// any other raises.
template <typename F>
void visit_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(kernels::Type<float>{});
    case DType::kFloat16:
      return f(kernels::Type<math::Half>{});
    case DType::kBFloat16:
      return f(kernels::Type<math::BFloat16>{});
    default:
      RC_INVALID("8-bit quantization does not support ", dtype_name(dtype));
  }
}

inline void check_levels(uint32_t levels) {
  RC_CHECK_ARG(levels >= 1 && levels <= kCodeSum, "levels must be in [1, ", kCodeSum, "], got ",
               levels);
}

}  // namespace quantize
}  // namespace ringcomm
