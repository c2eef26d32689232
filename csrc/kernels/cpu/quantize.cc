// 8-bit quantization kernels on the CPU: plain loops over kernels/quantize_math.h, one thread.
// Entry points are RC_MULTIVERSION (kernels/cpu/multiversion.h): baseline x86-64 has no floor
// instruction, and a call to floorf per element keeps the loops from vectorising.
#include "kernels/cpu/quantize.h"

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "kernels/cpu/multiversion.h"

#include "kernels/topk_math.h"

namespace ringcomm {
namespace cpu {
namespace {

// Four floats as one value (GCC's vector extension), and four elements loaded as floats.
typedef float Lanes __attribute__((vector_size(16)));

template <typename C, typename T>
Lanes load_lanes(const T* x) {
  return Lanes{C::load(x[0]), C::load(x[1]), C::load(x[2]), C::load(x[3])};
}

}  // namespace

size_t quantize_chunks(size_t n, size_t chunk) {
  RC_CHECK_ARG(chunk >= 1, "chunk must be at least 1 element");
  return (n + chunk - 1) / chunk;
}

RC_MULTIVERSION
void quantize_ranges(DType dtype, const void* grad, void* residual, size_t n, size_t chunk,
                     float* ranges) {
  const size_t chunks = quantize_chunks(n, chunk);
  quantize::visit_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    using C = math::Compute<T>;
    const T* g = static_cast<const T*>(grad);
    T* r = static_cast<T*>(residual);
    const T* source = r ? r : g;
    for (size_t c = 0; c < chunks; ++c) {
      const size_t begin = c * chunk, end = std::min(n, begin + chunk);
      if (r) {
        for (size_t i = begin; i < end; ++i) r[i] = topk::accumulate(g[i], r[i]);
      }
      // Four running minima and maxima, compare-selects that vectorise (minps, maxps) at every
      // x86 level. A NaN passes them by, so `probe` sums x - x, NaN for a NaN or an infinity: a
      // chunk holding one is done again in order, so that it reports what math::Min/Max do.
      // The order otherwise changes at most the sign of a zero, which range_word drops.
      Lanes lo_of = {quantize::kEmptyLo, quantize::kEmptyLo, quantize::kEmptyLo,
                     quantize::kEmptyLo};
      Lanes hi_of = -lo_of, probe = {};
      size_t i = begin;
      for (; i + 4 <= end; i += 4) {
        const Lanes v = load_lanes<C>(source + i);
        lo_of = v < lo_of ? v : lo_of;
        hi_of = v > hi_of ? v : hi_of;
        probe += v - v;
      }
      float lo = quantize::kEmptyLo, hi = quantize::kEmptyHi;
      for (int j = 0; j < 4; ++j) {
        lo = math::Min{}(lo, lo_of[j]);
        hi = math::Max{}(hi, hi_of[j]);
      }
      if (!(probe[0] + probe[1] + probe[2] + probe[3] == 0.0f)) {
        i = begin, lo = quantize::kEmptyLo, hi = quantize::kEmptyHi;
      }
      for (; i < end; ++i) {
        const float v = C::load(source[i]);
        lo = math::Min{}(lo, v);
        hi = math::Max{}(hi, v);
      }
      ranges[2 * c] = quantize::range_word(-lo);
      ranges[2 * c + 1] = quantize::range_word(hi);
    }
  });
}

RC_MULTIVERSION
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
    // One loop per (rounding, error) pair, so that each is branch-free and vectorises.
    auto chunks_with = [&](auto offset, auto out_error) {
      for (size_t c = 0; c < chunks; ++c) {
        const quantize::Scale s = quantize::scale_of(ranges[2 * c], ranges[2 * c + 1], levels);
        const size_t begin = c * chunk, end = std::min(n, begin + chunk);
        for (size_t i = begin; i < end; ++i) {
          const float x = C::load(src[i]);
          const uint32_t code = quantize::code_of(x, s, offset(i), levels);
          codes[i] = uint8_t(code);
          if constexpr (!std::is_same_v<decltype(out_error), std::nullptr_t>) {
            out_error[i] = C::store(quantize::sub(x, quantize::value_of(s, code)));
          }
        }
      }
    };
    const auto nearest = [](size_t) { return 0.5f; };
    const auto stochastic = [key](size_t i) { return quantize::uniform(key, i); };
    if (rounding == quantize::Rounding::kStochastic) {
      err ? chunks_with(stochastic, err) : chunks_with(stochastic, nullptr);
    } else {
      err ? chunks_with(nearest, err) : chunks_with(nearest, nullptr);
    }
  });
}

RC_MULTIVERSION
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
