// NCCL as a wire for CUDA buffers: ringcomm's own schedules (the ring, the double binary tree,
// recursive doubling: the step lists of csrc/algorithms/) run with ncclSend/ncclRecv, posted in
// the groups of algorithms/stream_plan.h, while ringcomm's CUDA kernels (kernels/cuda/) combine
// what arrives, all on the caller's stream. Algorithm::kNccl calls NCCL's own ncclAllReduce
// instead, for comparison. Nothing here synchronises the host except synchronize().
//
// Every call checks NCCL's result. A peer that fails leaves NCCL's operations unfinished on the
// stream: synchronize() polls the stream and NCCL's asynchronous error with a deadline and
// aborts the communicator (ncclCommAbort never blocks) when either goes wrong.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "algorithms/context.h"
#include "algorithms/schedule.h"
#include "common/dtype.h"
#include "common/signature.h"
#include "transport/nccl/nccl_library.h"

namespace ringcomm {
namespace nccl {

class NcclTransport {
 public:
  // Joins the communicator `id` (from Library::get_unique_id on one rank, shared by the caller)
  // as `rank` of `size`, on CUDA device `device`; blocks until every rank has joined.
  NcclTransport(const Library& lib, const UniqueId& id, int rank, int size, int device);
  ~NcclTransport();  // aborts the communicator if close() was not called
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }

  // Enqueues on `stream` the all-reduce of `count` elements at `data` (this communicator's
  // device), in place. `algo`: kRing, kTree, kRecursiveDoubling, kNccl, or kAuto (recursive
  // doubling up to kSmallBytes, the ring above).
  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op, Algorithm algo,
                  cudaStream_t stream);
  static constexpr size_t kSmallBytes = 256 << 10;
  // Enqueues on `stream` the all-gather into `data`, which holds every rank's block back to back
  // (block q: counts[q] elements, this rank's already in place), by the ring's step list.
  void all_gather(void* data, const std::vector<size_t>& counts, DType dtype,
                  cudaStream_t stream);

  // Waits for the work enqueued on `stream`. Raises if NCCL reports an error or `timeout_s`
  // passes, aborting the communicator first: it cannot be used after that.
  void synchronize(cudaStream_t stream, double timeout_s);
  // Frees the communicator (ncclCommDestroy) once its work is done; abort() drops it at once.
  void close();
  void abort();

 private:
  // Runs `schedule` over `blocks` of `data` (in place) in slices of `slice` elements.
  void run_schedule(const Schedule& schedule, const Segments& blocks, size_t slice, char* data,
                    DType dtype, ReduceOp op, cudaStream_t stream);
  Comm live() const;  // the communicator, or an error once it is closed or aborted

  const Library& lib_;
  Comm comm_ = nullptr;
  int rank_, size_, device_;
};

}  // namespace nccl
}  // namespace ringcomm
