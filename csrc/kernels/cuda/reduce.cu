// CUDA reduction: one grid-stride kernel per (dtype, op), 16-byte loads and stores when all three
// buffers are 16-byte aligned (the usual case for torch's allocations), element by element
// otherwise and for the tail. The half types compute in fp32 (kernels/reduce_math.h).
#include "kernels/cuda/reduce.h"

#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/dispatch.h"
#include "kernels/reduce_math.h"

namespace ringcomm {
namespace cuda {
namespace {

constexpr unsigned kThreads = 256;

template <typename T>
struct alignas(16) Vector {
  static constexpr int kSize = 16 / sizeof(T);
  T item[kSize];
};

template <typename T, typename Op, bool kVectorised>
__global__ void reduce_kernel(T* out, const T* a, const T* b, size_t n, Op op) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t done = 0;
  if constexpr (kVectorised) {
    using V = Vector<T>;
    const size_t vectors = n / V::kSize;
    for (size_t v = i; v < vectors; v += stride) {
      const V x = reinterpret_cast<const V*>(a)[v];
      const V y = reinterpret_cast<const V*>(b)[v];
      V r;
#pragma unroll
      for (int j = 0; j < V::kSize; ++j) r.item[j] = math::reduce_one(x.item[j], y.item[j], op);
      reinterpret_cast<V*>(out)[v] = r;
    }
    done = vectors * V::kSize;
  }
  for (size_t e = done + i; e < n; e += stride) out[e] = math::reduce_one(a[e], b[e], op);
}

template <typename T>
__global__ void divide_kernel(T* x, size_t n, int divisor) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = math::divide_one(x[i], divisor);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void reduce(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n,
            cudaStream_t stream) {
  kernels::visit_reduce(dtype, op, [&](auto type, auto reduce_op) {
    using T = typename decltype(type)::type;
    if (n == 0) return;
    T* o = static_cast<T*>(out);
    const T* x = static_cast<const T*>(a);
    const T* y = static_cast<const T*>(b);
    if (aligned16(out) && aligned16(a) && aligned16(b)) {
      const unsigned grid = grid_for(n / Vector<T>::kSize + 1, kThreads);
      reduce_kernel<T, decltype(reduce_op), true><<<grid, kThreads, 0, stream>>>(o, x, y, n, reduce_op);
    } else {
      reduce_kernel<T, decltype(reduce_op), false>
          <<<grid_for(n, kThreads), kThreads, 0, stream>>>(o, x, y, n, reduce_op);
    }
    RC_CUDA_CHECK_LAUNCH();
  });
}

void divide(DType dtype, void* x, size_t n, int divisor, cudaStream_t stream) {
  RC_CHECK_ARG(divisor != 0, "division by zero");
  kernels::visit_divide(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    if (n == 0) return;
    divide_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(static_cast<T*>(x), n, divisor);
    RC_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace cuda
}  // namespace ringcomm
