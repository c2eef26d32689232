// The window plans' kernels. A fold reads 16-byte vectors where every source and destination is
// 16-byte aligned (the windows are; a caller's buffer usually is), each thread folding one
// vector of every source in order, and element by element otherwise; either way each element is
// math::fold_one of its sources, the function the host test of the plans runs.
#include "kernels/cuda/window.h"

#include <algorithm>
#include <cstring>

#include "kernels/cuda/check.h"
#include "kernels/dispatch.h"
#include "kernels/fold_math.h"

namespace ringcomm {
namespace cuda {
namespace {

constexpr unsigned kThreads = 256;

template <typename T>
struct alignas(16) Vector {
  static constexpr int kSize = 16 / sizeof(T);
  T item[kSize];
};

// A load cached in L2 only (ld.global.cg): the memory may have been written by another process.
template <typename T>
__device__ __forceinline__ T load_l2(const T* p) {
  T v;
  if constexpr (sizeof(T) == 16) {
    const int4 raw = __ldcg(reinterpret_cast<const int4*>(p));
    memcpy(&v, &raw, 16);
  } else if constexpr (sizeof(T) == 8) {
    const unsigned long long raw = __ldcg(reinterpret_cast<const unsigned long long*>(p));
    memcpy(&v, &raw, 8);
  } else if constexpr (sizeof(T) == 4) {
    const unsigned raw = __ldcg(reinterpret_cast<const unsigned*>(p));
    memcpy(&v, &raw, 4);
  } else if constexpr (sizeof(T) == 2) {
    const unsigned short raw = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&v, &raw, 2);
  } else {
    const unsigned char raw = __ldcg(reinterpret_cast<const unsigned char*>(p));
    memcpy(&v, &raw, 1);
  }
  return v;
}

// Element i of the fold, its sources read through L2: fold_one over pointers that load_l2 reads.
template <typename T>
struct L2Source {
  const T* p;
  __device__ __forceinline__ T operator[](size_t i) const { return load_l2(p + i); }
};

template <typename T, typename Op>
__device__ __forceinline__ T fold_element(const FoldArgs& a, size_t i, Op op) {
  L2Source<T> sources[kMostSources];
  for (int s = 0; s < a.source_count; ++s) sources[s] = {static_cast<const T*>(a.sources[s])};
  return math::fold_one(sources, a.source_count, i, op, a.divisor);
}

template <typename T, typename Op>
__global__ void fold_vectors_kernel(const __grid_constant__ FoldArgs a, Op op) {
  using V = Vector<T>;
  const size_t vectors = a.n / V::kSize, stride = size_t(gridDim.x) * blockDim.x;
  for (size_t v = size_t(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    V acc = load_l2(static_cast<const V*>(a.sources[0]) + v);
    for (int s = 1; s < a.source_count; ++s) {
      const V x = load_l2(static_cast<const V*>(a.sources[s]) + v);
#pragma unroll
      for (int j = 0; j < V::kSize; ++j) acc.item[j] = math::reduce_one(acc.item[j], x.item[j], op);
    }
    if (a.divisor > 1) {
#pragma unroll
      for (int j = 0; j < V::kSize; ++j) acc.item[j] = math::divide_one(acc.item[j], a.divisor);
    }
    for (int d = 0; d < a.dest_count; ++d) static_cast<V*>(a.dests[d])[v] = acc;
  }
  const size_t e = vectors * V::kSize + threadIdx.x;  // fewer than V::kSize left
  if (blockIdx.x == 0 && e < a.n) {
    const T r = fold_element<T>(a, e, op);
    for (int d = 0; d < a.dest_count; ++d) static_cast<T*>(a.dests[d])[e] = r;
  }
}

template <typename T, typename Op>
__global__ void fold_kernel(const __grid_constant__ FoldArgs a, Op op) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n; i += stride) {
    const T r = fold_element<T>(a, i, op);
    for (int d = 0; d < a.dest_count; ++d) static_cast<T*>(a.dests[d])[i] = r;
  }
}

struct Pieces {
  CopyPiece piece[kMostPieces];
};

// Block row y copies piece y: 16-byte vectors where both ends are aligned, else bytes.
__global__ void copy_kernel(const __grid_constant__ Pieces pieces) {
  const CopyPiece p = pieces.piece[blockIdx.y];
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if ((reinterpret_cast<uintptr_t>(p.from) | reinterpret_cast<uintptr_t>(p.to)) % 16 == 0) {
    const int4* from = static_cast<const int4*>(p.from);
    int4* to = static_cast<int4*>(p.to);
    const size_t vectors = p.bytes / 16;
    for (size_t v = first; v < vectors; v += stride) to[v] = __ldcg(from + v);
    const size_t b = vectors * 16 + threadIdx.x;
    if (blockIdx.x == 0 && b < p.bytes)
      static_cast<unsigned char*>(p.to)[b] = __ldcg(static_cast<const unsigned char*>(p.from) + b);
    return;
  }
  const unsigned char* from = static_cast<const unsigned char*>(p.from);
  unsigned char* to = static_cast<unsigned char*>(p.to);
  for (size_t b = first; b < p.bytes; b += stride) to[b] = __ldcg(from + b);
}

struct Words {
  uint64_t* at[kMostSources];
  uint64_t value[kMostSources];
};

__global__ void write_words_kernel(const __grid_constant__ Words words, int n) {
  const int i = int(threadIdx.x);
  if (i < n) *words.at[i] = words.value[i];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void fold(DType dtype, ReduceOp op, const FoldArgs& args, cudaStream_t stream) {
  RC_CHECK_ARG(args.source_count >= 1 && args.source_count <= kMostSources, "a fold of ",
               args.source_count, " sources");
  RC_CHECK_ARG(args.dest_count >= 1 && args.dest_count <= kMostDests, "a fold into ",
               args.dest_count, " destinations");
  kernels::visit_reduce(dtype, op, [&](auto type, auto reduce_op) {
    using T = typename decltype(type)::type;
    if (args.n == 0) return;
    bool aligned = true;
    for (int s = 0; s < args.source_count; ++s) aligned = aligned && aligned16(args.sources[s]);
    for (int d = 0; d < args.dest_count; ++d) aligned = aligned && aligned16(args.dests[d]);
    if (aligned)
      fold_vectors_kernel<T><<<grid_for(std::max<size_t>(1, args.n / Vector<T>::kSize), kThreads),
                               kThreads, 0, stream>>>(args, reduce_op);
    else
      fold_kernel<T><<<grid_for(args.n, kThreads), kThreads, 0, stream>>>(args, reduce_op);
    RC_CUDA_CHECK_LAUNCH();
  });
}

void copy_pieces(const CopyPiece* pieces, int n, cudaStream_t stream) {
  RC_CHECK_ARG(n >= 0 && n <= kMostPieces, n, " pieces in one copy");
  Pieces batch;
  size_t most = 0;
  int used = 0;
  for (int i = 0; i < n; ++i)
    if (pieces[i].bytes > 0) {
      batch.piece[used++] = pieces[i];
      most = std::max(most, pieces[i].bytes);
    }
  if (used == 0) return;
  const dim3 grid(grid_for(std::max<size_t>(1, most / 16), kThreads), unsigned(used));
  copy_kernel<<<grid, kThreads, 0, stream>>>(batch);
  RC_CUDA_CHECK_LAUNCH();
}

void write_words(uint64_t* const* at, const uint64_t* values, int n, cudaStream_t stream) {
  RC_CHECK_ARG(n >= 0 && n <= kMostSources, n, " words in one write");
  if (n == 0) return;
  Words words;
  std::copy(at, at + n, words.at);
  std::copy(values, values + n, words.value);
  write_words_kernel<<<1, kMostSources, 0, stream>>>(words, n);
  RC_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace ringcomm
