// CUDA kernels of the window plans (algorithms/window_plan.h), enqueued on `stream`: folds of
// several sources into one or two destinations, batches of copies, and the words the CUDA IPC
// transport writes into its peers' windows to prove they arrive. Any source may lie in another
// process's window (mapped by CUDA IPC): it is read through L2, which every process's writes
// reach, never from a stale L1 line.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace ringcomm {
namespace cuda {

constexpr int kMostSources = 64;  // the CUDA IPC transport's most ranks
constexpr int kMostDests = 2;

struct FoldArgs {
  const void* sources[kMostSources];
  void* dests[kMostDests];
  int source_count = 0;
  int dest_count = 0;
  size_t n = 0;     // elements
  int divisor = 0;  // above 1: the fold is then divided by it (avg)
};

// dests[d][i] = math::fold_one(sources, source_count, i, op, divisor) for every d and i < n
// (kernels/fold_math.h). A destination may be a source: each element is read, then written, by
// one thread.
void fold(DType dtype, ReduceOp op, const FoldArgs& args, cudaStream_t stream);

struct CopyPiece {
  const void* from;
  void* to;
  size_t bytes;
};
constexpr int kMostPieces = 64;
// The pieces' copies, in one launch (n <= kMostPieces; pieces do not overlap).
void copy_pieces(const CopyPiece* pieces, int n, cudaStream_t stream);

// *at[i] = values[i] for i < n (n <= kMostSources), each a 64-bit store.
void write_words(uint64_t* const* at, const uint64_t* values, int n, cudaStream_t stream);

}  // namespace cuda
}  // namespace ringcomm
