// 8-bit quantization kernels on the GPU: one block per chunk for the ranges (a block reduction of
// min and max), element-wise grid-stride loops for the codes and the means. The arithmetic is
// kernels/quantize_math.h's, the one the CPU kernels run.
#include "kernels/cuda/quantize.h"

#include <cub/block/block_reduce.cuh>

#include "kernels/cuda/check.h"
#include "kernels/reduce_math.h"
#include "kernels/topk_math.h"

namespace ringcomm {
namespace cuda {
namespace {

constexpr unsigned kThreads = 256;

struct MinMax {
  float lo, hi;
};

struct CombineMinMax {
  __device__ MinMax operator()(const MinMax& a, const MinMax& b) const {
    return MinMax{math::Min{}(a.lo, b.lo), math::Max{}(a.hi, b.hi)};
  }
};

template <typename T>
__global__ void ranges_kernel(const T* grad, T* residual, size_t n, size_t chunk, float* ranges) {
  using C = math::Compute<T>;
  using Reduce = cub::BlockReduce<MinMax, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const size_t c = blockIdx.x;
  const size_t begin = c * chunk;
  const size_t end = begin + chunk < n ? begin + chunk : n;
  MinMax mine{quantize::kEmptyLo, quantize::kEmptyHi};  // a thread may have no element
  for (size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    T x = grad[i];
    if (residual) {
      x = topk::accumulate(x, residual[i]);
      residual[i] = x;
    }
    const float v = C::load(x);
    mine = MinMax{math::Min{}(mine.lo, v), math::Max{}(mine.hi, v)};
  }
  const MinMax all = Reduce(temp).Reduce(mine, CombineMinMax{});
  if (threadIdx.x == 0) {
    ranges[2 * c] = quantize::range_word(-all.lo);
    ranges[2 * c + 1] = quantize::range_word(all.hi);
  }
}

template <typename T>
__global__ void quantize_kernel(const T* source, T* error, size_t n, size_t chunk,
                                const float* ranges, uint32_t levels, quantize::Rounding rounding,
                                uint64_t key, uint8_t* codes) {
  using C = math::Compute<T>;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t c = i / chunk;
    const quantize::Scale s = quantize::scale_of(ranges[2 * c], ranges[2 * c + 1], levels);
    const float x = C::load(source[i]);
    const uint32_t code = quantize::code_of(x, s, quantize::offset_of(rounding, key, i), levels);
    codes[i] = uint8_t(code);
    if (error) error[i] = C::store(quantize::sub(x, quantize::value_of(s, code)));
  }
}

template <typename T>
__global__ void mean_kernel(const uint8_t* sums, size_t n, size_t chunk, const float* ranges,
                            uint32_t levels, int world, T* out) {
  using C = math::Compute<T>;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t c = i / chunk;
    const quantize::Scale s = quantize::scale_of(ranges[2 * c], ranges[2 * c + 1], levels);
    out[i] = C::store(quantize::mean_of(s, sums[i], world));
  }
}

size_t chunks_of(size_t n, size_t chunk) {
  RC_CHECK_ARG(chunk >= 1, "chunk must be at least 1 element");
  return (n + chunk - 1) / chunk;
}

}  // namespace

void quantize_ranges(DType dtype, const void* grad, void* residual, size_t n, size_t chunk,
                     float* ranges, cudaStream_t stream) {
  const size_t chunks = chunks_of(n, chunk);
  RC_CHECK_ARG(chunks < (size_t(1) << 31), n, " elements make too many chunks of ", chunk);
  if (chunks == 0) return;
  quantize::visit_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    ranges_kernel<T><<<unsigned(chunks), kThreads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<T*>(residual), n, chunk, ranges);
  });
  RC_CUDA_CHECK_LAUNCH();
}

void quantize(DType dtype, const void* source, void* error, size_t n, size_t chunk,
              const float* ranges, uint32_t levels, quantize::Rounding rounding, uint64_t key,
              uint8_t* codes, cudaStream_t stream) {
  quantize::check_levels(levels);
  chunks_of(n, chunk);
  if (n == 0) return;
  quantize::visit_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    quantize_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(source), static_cast<T*>(error), n, chunk, ranges, levels, rounding,
        key, codes);
  });
  RC_CUDA_CHECK_LAUNCH();
}

void dequantize_mean(const uint8_t* sums, size_t n, size_t chunk, const float* ranges,
                     uint32_t levels, int world, DType out_dtype, void* out, cudaStream_t stream) {
  quantize::check_levels(levels);
  RC_CHECK_ARG(world >= 1, "world must be at least 1, got ", world);
  chunks_of(n, chunk);
  if (n == 0) return;
  quantize::visit_dtype(out_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    mean_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(sums, n, chunk, ranges, levels,
                                                                   world, static_cast<T*>(out));
  });
  RC_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace ringcomm
