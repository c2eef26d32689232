// CUDA reduction: one kernel per (dtype, op). Where all three buffers are 16-byte aligned (the
// usual case for torch's allocations), each block takes a contiguous chunk of kThreads x kUnroll
// 16-byte vectors, every thread issuing its kUnroll loads of each input before it reduces any,
// and the few elements past the last whole vector go element by element. Otherwise a grid-stride
// loop element by element. The half types compute in fp32 (kernels/reduce_math.h).
#include "kernels/cuda/reduce.h"

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/dispatch.h"
#include "kernels/reduce_math.h"

namespace ringcomm {
namespace cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kUnroll = 4;
// A block per chunk, as torch's elementwise kernels launch: a grid-stride loop over sms x 8
// blocks with one vector a step fell short of torch.add's rate. The cap only keeps the grid
// within what a launch takes.
constexpr size_t kMostBlocks = size_t(1) << 30;

template <typename T>
struct alignas(16) Vector {
  static constexpr int kSize = 16 / sizeof(T);
  T item[kSize];
};

template <typename T, typename Op>
__device__ __forceinline__ Vector<T> combine(const Vector<T>& x, const Vector<T>& y, Op op) {
  Vector<T> r;
#pragma unroll
  for (int j = 0; j < Vector<T>::kSize; ++j) r.item[j] = math::reduce_one(x.item[j], y.item[j], op);
  return r;
}

// out may be a or b: each vector is read and then written by one thread alone.
template <typename T, typename Op>
__global__ void reduce_vectors_kernel(T* out, const T* a, const T* b, size_t n, Op op) {
  using V = Vector<T>;
  const V* va = reinterpret_cast<const V*>(a);
  const V* vb = reinterpret_cast<const V*>(b);
  V* vo = reinterpret_cast<V*>(out);
  const size_t vectors = n / V::kSize, chunk = size_t(blockDim.x) * kUnroll;
  for (size_t base = size_t(blockIdx.x) * chunk; base < vectors;
       base += size_t(gridDim.x) * chunk) {
    V x[kUnroll], y[kUnroll];
#pragma unroll
    for (unsigned k = 0; k < kUnroll; ++k) {
      const size_t v = base + threadIdx.x + k * blockDim.x;
      if (v < vectors) {
        x[k] = va[v];
        y[k] = vb[v];
      }
    }
#pragma unroll
    for (unsigned k = 0; k < kUnroll; ++k) {
      const size_t v = base + threadIdx.x + k * blockDim.x;
      if (v < vectors) vo[v] = combine(x[k], y[k], op);
    }
  }
  const size_t e = vectors * V::kSize + threadIdx.x;  // fewer than V::kSize left
  if (blockIdx.x == 0 && e < n) out[e] = math::reduce_one(a[e], b[e], op);
}

template <typename T, typename Op>
__global__ void reduce_kernel(T* out, const T* a, const T* b, size_t n, Op op) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride)
    out[e] = math::reduce_one(a[e], b[e], op);
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
      const size_t chunks = (n / Vector<T>::kSize + kThreads * kUnroll - 1) / (kThreads * kUnroll);
      const unsigned grid = unsigned(std::min<size_t>(std::max<size_t>(chunks, 1), kMostBlocks));
      reduce_vectors_kernel<<<grid, kThreads, 0, stream>>>(o, x, y, n, reduce_op);
    } else {
      reduce_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(o, x, y, n, reduce_op);
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
