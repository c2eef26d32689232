// 8-bit quantization kernels on the CPU: plain loops over kernels/quantize_math.h, one thread.
#include "kernels/cpu/quantize.h"

#include <algorithm>

#include "kernels/topk_math.h"

namespace ringcomm {
namespace cpu {

size_t quantize_chunks(size_t n, size_t chunk) {
  RC_CHECK_ARG(chunk >= 1, "chunk must be at least 1 element");
  return (n + chunk - 1) / chunk;
}

void quantize_ranges(DType dtype, const void* grad, void* residual, size_t n, size_t chunk,
                     float* ranges) {
  const size_t chunks = quantize_chunks(n, chunk);
  quantize::visit_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    using C = math::Compute<T>;
    const T* g = static_cast<const T*>(grad);
    T* r = static_cast<T*>(residual);
    for (size_t c = 0; c < chunks; ++c) {
      const size_t begin = c * chunk, end = std::min(n, begin + chunk);
      float lo = quantize::kEmptyLo, hi = quantize::kEmptyHi;
      for (size_t i = begin; i < end; ++i) {
        T x = g[i];
        if (r) x = r[i] = topk::accumulate(x, r[i]);
        const float v = C::load(x);
        lo = math::Min{}(lo, v);
        hi = math::Max{}(hi, v);
      }
      ranges[2 * c] = quantize::range_word(-lo);
      ranges[2 * c + 1] = quantize::range_word(hi);
    }
  });
}

void quantize(DType dtype, const void* source, void* error, size_t n, size_t chunk,
              const float* ranges, uint32_t levels, quantize::Rounding rounding, uint64_t key,
              uint8_t* codes) {
  quantize::check_levels(levels);
  const size_t chunks = quantize_chunks(n, chunk);
  quantize::visit_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    using C = math::Compute<T>;
    const T* src = static_cast<const T*>(source);
    T* err = static_cast<T*>(error);
    for (size_t c = 0; c < chunks; ++c) {
      const quantize::Scale s = quantize::scale_of(ranges[2 * c], ranges[2 * c + 1], levels);
      const size_t begin = c * chunk, end = std::min(n, begin + chunk);
      for (size_t i = begin; i < end; ++i) {
        const float x = C::load(src[i]);
        const uint32_t code =
            quantize::code_of(x, s, quantize::offset_of(rounding, key, i), levels);
        codes[i] = uint8_t(code);
        if (err) err[i] = C::store(quantize::sub(x, quantize::value_of(s, code)));
      }
    }
  });
}

void dequantize_mean(const uint8_t* sums, size_t n, size_t chunk, const float* ranges,
                     uint32_t levels, int world, DType out_dtype, void* out) {
  quantize::check_levels(levels);
  RC_CHECK_ARG(world >= 1, "world must be at least 1, got ", world);
  const size_t chunks = quantize_chunks(n, chunk);
  quantize::visit_dtype(out_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    using C = math::Compute<T>;
    T* o = static_cast<T*>(out);
    for (size_t c = 0; c < chunks; ++c) {
      const quantize::Scale s = quantize::scale_of(ranges[2 * c], ranges[2 * c + 1], levels);
      const size_t begin = c * chunk, end = std::min(n, begin + chunk);
      for (size_t i = begin; i < end; ++i) o[i] = C::store(quantize::mean_of(s, sums[i], world));
    }
  });
}

}  // namespace cpu
}  // namespace ringcomm
