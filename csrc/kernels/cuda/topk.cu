// Exact top-k on the GPU: radix selection of the k-th largest key, then one ordered compaction.
// The selection math (digits, which digit holds the k-th, which elements are kept and where they
// go) is kernels/topk_math.h's, the one the CPU kernel runs too.
//
// 1. histogram, once per radix pass (3 for float32, 2 for 16-bit keys): every block counts the
//    next digit of the keys still in the running in shared memory and adds its counts to the
//    global ones. The first pass of topk_with_residual also forms residual = grad + residual.
// 2. pick (one block): a block-wide scan of the counts from the top finds the digit that holds
//    the k-th key and fixes it into the prefix; then clears the counts for the next pass.
// 3. count: per tile of kTile elements, how many keys are above the k-th and how many equal it.
// 4. scan: exclusive prefix sums of the tile counts (cub::DeviceScan).
// 5. write: each tile walks its elements in order, with a block scan for the counts before each
//    thread's items, and writes every kept element to its slot: indices come out ascending.
// Memory traffic: passes + 2 reads of the input (plus one write of the residual), against
// torch.topk's selection followed by a sort of the k winners.
#include "kernels/cuda/topk.h"

#include <cub/block/block_load.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/reduce.h"
#include "kernels/reduce_math.h"
#include "kernels/topk_math.h"

namespace ringcomm {
namespace cuda {
namespace {

using topk::Key;
using topk::RadixPass;
using topk::RadixState;

constexpr unsigned kThreads = 256;
constexpr int kItems = 16;  // per thread in the count and write kernels
constexpr size_t kTile = size_t(kThreads) * kItems;
constexpr unsigned kPickThreads = 1024;
constexpr int kBinsPerPickThread = topk::kRadixBins / int(kPickThreads);
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

size_t tiles_of(size_t n) { return (n + kTile - 1) / kTile; }

// Scratch layout: counts, state, per-tile (greater << 32 | equal) counts and their exclusive sums,
// then cub's scan storage.
struct Workspace {
  uint32_t* counts;
  RadixState* state;
  uint64_t* tile_counts;
  uint64_t* tile_before;
  void* scan_storage;
  size_t scan_bytes;
};

size_t scan_bytes_for(size_t tiles) {
  size_t bytes = 0;
  RC_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<uint64_t*>(nullptr),
                                              static_cast<uint64_t*>(nullptr), int(tiles)));
  return bytes;
}

size_t fixed_bytes(size_t tiles) {
  return align_up(topk::kRadixBins * sizeof(uint32_t)) + align_up(sizeof(RadixState)) +
         2 * align_up(tiles * sizeof(uint64_t));
}

Workspace carve(void* base, size_t bytes, size_t n) {
  const size_t tiles = tiles_of(n);
  const size_t scan = scan_bytes_for(tiles);
  RC_CHECK_ARG(bytes >= fixed_bytes(tiles) + scan, "top-k workspace of ", bytes,
               " bytes is too small for ", n, " elements: topk_workspace_bytes() says ",
               fixed_bytes(tiles) + scan);
  char* p = static_cast<char*>(base);
  Workspace w;
  w.counts = reinterpret_cast<uint32_t*>(p);
  p += align_up(topk::kRadixBins * sizeof(uint32_t));
  w.state = reinterpret_cast<RadixState*>(p);
  p += align_up(sizeof(RadixState));
  w.tile_counts = reinterpret_cast<uint64_t*>(p);
  p += align_up(tiles * sizeof(uint64_t));
  w.tile_before = reinterpret_cast<uint64_t*>(p);
  p += align_up(tiles * sizeof(uint64_t));
  w.scan_storage = p;
  w.scan_bytes = scan;
  return w;
}

__global__ void start_kernel(RadixState* state, uint32_t k) { *state = topk::radix_start(k); }

// Counts the digit of pass `pass` of every key in the running. With kAccumulate, the key is that
// of in[i] + acc[i], stored into acc[i] on the way. Gradients crowd a few digits (their
// exponents) in the first pass, so the lanes of a warp holding one digit add to it once, through
// their leader: one shared-memory atomic per distinct digit instead of one per element. Every
// thread of a block runs the same number of iterations, so the whole warp takes part in each match.
template <typename T, bool kAccumulate>
__global__ void histogram_kernel(const T* in, T* acc, size_t n, int key_bits, int pass,
                                 const RadixState* state, uint32_t* counts) {
  constexpr unsigned kNone = 0xffffffffu;  // not a digit: out of range or out of the running
  __shared__ uint32_t local[topk::kRadixBins];
  const RadixPass p = topk::radix_pass(key_bits, pass);
  const int bins = 1 << p.bits;
  for (int b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const RadixState s = *state;
  const unsigned lane = threadIdx.x % 32;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t base = size_t(blockIdx.x) * blockDim.x; base < n; base += stride) {
    const size_t i = base + threadIdx.x;
    unsigned digit = kNone;
    if (i < n) {
      T x = in[i];
      if constexpr (kAccumulate) {
        x = topk::accumulate(x, acc[i]);
        acc[i] = x;
      }
      const Key key = topk::magnitude_key(x);
      if (topk::radix_matches(key, s)) digit = topk::radix_digit(key, p);
    }
    const unsigned peers = __match_any_sync(0xffffffffu, digit);
    if (digit != kNone && lane == unsigned(__ffs(peers) - 1))
      atomicAdd(&local[digit], unsigned(__popc(peers)));
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x)
    if (local[b]) atomicAdd(&counts[b], local[b]);
}

// Thread t owns digits bins-1-t*kBinsPerPickThread downwards, so an exclusive scan over threads
// gives each thread the count above its digits.
__global__ void pick_kernel(int key_bits, int pass, RadixState* state, uint32_t* counts) {
  using Scan = cub::BlockScan<uint32_t, kPickThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const RadixPass p = topk::radix_pass(key_bits, pass);
  const int bins = 1 << p.bits;
  RadixState s = *state;
  uint32_t mine[kBinsPerPickThread];
  uint32_t total = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerPickThread; ++j) {
    const int digit = bins - 1 - int(threadIdx.x) * kBinsPerPickThread - j;
    mine[j] = digit >= 0 ? counts[digit] : 0u;
    total += mine[j];
  }
  uint32_t above;
  Scan(scan_storage).ExclusiveSum(total, above);
#pragma unroll
  for (int j = 0; j < kBinsPerPickThread; ++j) {
    const int digit = bins - 1 - int(threadIdx.x) * kBinsPerPickThread - j;
    if (digit >= 0 && topk::radix_is_pick(above, mine[j], s.remaining)) {
      topk::radix_advance(s, p, unsigned(digit), above);
      *state = s;  // exactly one digit of one thread is the pick
    }
    above += mine[j];
  }
  for (int b = threadIdx.x; b < topk::kRadixBins; b += blockDim.x) counts[b] = 0;
}

__device__ __forceinline__ uint64_t greater_equal(Key key, Key kth) {
  return (uint64_t(key > kth) << 32) | uint64_t(key == kth);
}

template <typename T>
__global__ void count_kernel(const T* data, size_t n, const RadixState* state,
                             uint64_t* tile_counts) {
  using Reduce = cub::BlockReduce<uint64_t, kThreads>;
  __shared__ typename Reduce::TempStorage reduce_storage;
  const Key kth = state->prefix;
  const size_t start = size_t(blockIdx.x) * kTile;
  const size_t end = start + kTile < n ? start + kTile : n;
  uint64_t mine = 0;
  for (size_t i = start + threadIdx.x; i < end; i += kThreads)
    mine += greater_equal(topk::magnitude_key(data[i]), kth);
  const uint64_t total = Reduce(reduce_storage).Sum(mine);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = total;
}

template <typename T, bool kZeroSelected>
__global__ void write_kernel(T* data, size_t n, const RadixState* state,
                             const uint64_t* tile_before, int32_t* indices, T* values) {
  using Load = cub::BlockLoad<T, kThreads, kItems, cub::BLOCK_LOAD_TRANSPOSE>;
  using Scan = cub::BlockScan<uint64_t, kThreads>;
  __shared__ union {
    typename Load::TempStorage load;
    typename Scan::TempStorage scan;
  } storage;
  const RadixState s = *state;
  const size_t start = size_t(blockIdx.x) * kTile;
  const int valid = int(n - start < kTile ? n - start : kTile);
  T items[kItems];
  Load(storage.load).Load(data + start, items, valid, T{});
  __syncthreads();
  uint64_t mine = 0;
#pragma unroll
  for (int j = 0; j < kItems; ++j)
    if (int(threadIdx.x) * kItems + j < valid)
      mine += greater_equal(topk::magnitude_key(items[j]), s.prefix);
  uint64_t before;
  Scan(storage.scan).ExclusiveSum(mine, before);
  before += tile_before[blockIdx.x];
  uint32_t greater_before = uint32_t(before >> 32), equal_before = uint32_t(before);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int item = int(threadIdx.x) * kItems + j;
    if (item >= valid) break;
    const Key key = topk::magnitude_key(items[j]);
    if (topk::radix_keeps(key, equal_before, s)) {
      const uint32_t slot = topk::radix_slot(greater_before, equal_before, s);
      indices[slot] = int32_t(start + item);
      values[slot] = items[j];
      if constexpr (kZeroSelected) data[start + item] = T{};
    }
    greater_before += key > s.prefix;
    equal_before += key == s.prefix;
  }
}

// The passes, the count, the scan and the write. `grad` non-null: residual mode, where `data` is
// the residual, accumulated in pass 0 and zeroed where selected.
template <typename T>
void select(const T* grad, T* data, size_t n, size_t k, int32_t* indices, T* values,
            const Workspace& w, cudaStream_t stream) {
  constexpr int kBits = topk::key_bits<T>();
  start_kernel<<<1, 1, 0, stream>>>(w.state, uint32_t(k));
  RC_CUDA_CHECK_LAUNCH();
  RC_CUDA_CHECK(cudaMemsetAsync(w.counts, 0, topk::kRadixBins * sizeof(uint32_t), stream));
  const unsigned grid = grid_for(n, kThreads);
  for (int pass = 0; pass < topk::radix_passes(kBits); ++pass) {
    if (grad && pass == 0)
      histogram_kernel<T, true>
          <<<grid, kThreads, 0, stream>>>(grad, data, n, kBits, pass, w.state, w.counts);
    else
      histogram_kernel<T, false>
          <<<grid, kThreads, 0, stream>>>(data, nullptr, n, kBits, pass, w.state, w.counts);
    RC_CUDA_CHECK_LAUNCH();
    pick_kernel<<<1, kPickThreads, 0, stream>>>(kBits, pass, w.state, w.counts);
    RC_CUDA_CHECK_LAUNCH();
  }
  const size_t tiles = tiles_of(n);
  count_kernel<<<unsigned(tiles), kThreads, 0, stream>>>(data, n, w.state, w.tile_counts);
  RC_CUDA_CHECK_LAUNCH();
  size_t scan_bytes = w.scan_bytes;
  RC_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(w.scan_storage, scan_bytes, w.tile_counts,
                                              w.tile_before, int(tiles), stream));
  if (grad)
    write_kernel<T, true><<<unsigned(tiles), kThreads, 0, stream>>>(data, n, w.state, w.tile_before,
                                                                    indices, values);
  else
    write_kernel<T, false><<<unsigned(tiles), kThreads, 0, stream>>>(
        data, n, w.state, w.tile_before, indices, values);
  RC_CUDA_CHECK_LAUNCH();
}

template <typename T>
__global__ void scatter_add_kernel(T* out, size_t n, const int32_t* indices, const T* values,
                                   size_t k, int* bad_index) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < k; i += stride) {
    const int32_t index = indices[i];
    if (index < 0 || size_t(index) >= n) {
      *bad_index = 1;
      continue;
    }
    out[index] = math::reduce_one(out[index], values[i], math::Sum{});
  }
}

void check(DType dtype, size_t n, size_t k) {
  RC_CHECK_ARG(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16,
               "top-k supports float32, float16 and bfloat16, got ", dtype_name(dtype));
  RC_CHECK_ARG(k <= n, "k = ", k, " is larger than the number of elements ", n);
  RC_CHECK_ARG(n <= size_t(INT32_MAX), "top-k indices are int32: at most 2^31-1 elements, got ", n);
}

// f(T*) for the three top-k types.
template <typename F>
void visit_topk(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(static_cast<float*>(nullptr));
    case DType::kFloat16:
      return f(static_cast<math::Half*>(nullptr));
    default:
      return f(static_cast<math::BFloat16*>(nullptr));
  }
}

}  // namespace

size_t topk_workspace_bytes(size_t n) {
  const size_t tiles = tiles_of(n);
  return fixed_bytes(tiles) + scan_bytes_for(tiles);
}

void topk(DType dtype, const void* data, size_t n, size_t k, int32_t* indices, void* values,
          void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check(dtype, n, k);
  if (k == 0) return;
  const Workspace w = carve(workspace, workspace_bytes, n);
  visit_topk(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    // The write kernel only writes `data` in residual mode.
    select<T>(nullptr, const_cast<T*>(static_cast<const T*>(data)), n, k, indices,
              static_cast<T*>(values), w, stream);
  });
}

void topk_with_residual(DType dtype, const void* grad, void* residual, size_t n, size_t k,
                        int32_t* indices, void* values, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  check(dtype, n, k);
  if (n == 0) return;
  if (k == 0) {  // nothing selected: the residual still takes the gradient
    reduce(dtype, ReduceOp::kSum, residual, residual, grad, n, stream);
    return;
  }
  visit_topk(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const Workspace w = carve(workspace, workspace_bytes, n);
    select<T>(static_cast<const T*>(grad), static_cast<T*>(residual), n, k, indices,
              static_cast<T*>(values), w, stream);
  });
}

void scatter_add(DType dtype, void* out, size_t n, const int32_t* indices, const void* values,
                 size_t k, int* bad_index, cudaStream_t stream) {
  RC_CHECK_ARG(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16,
               "scatter_add supports float32, float16 and bfloat16, got ", dtype_name(dtype));
  if (k == 0) return;
  visit_topk(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    scatter_add_kernel<<<grid_for(k, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(out), n, indices, static_cast<const T*>(values), k, bad_index);
    RC_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace cuda
}  // namespace ringcomm
