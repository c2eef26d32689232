// The device executor: collectives on a CUDA stream over a device transport
// (transport/device.h), with ringcomm's kernels (kernels/cuda/) combining what arrives. The
// algorithms are the core's, run as they run on the host: the step lists of
// algorithms/schedule.h, posted as the message groups of algorithms/stream_plan.h over a
// transport's messages. Every call only enqueues work on the caller's stream; nothing here
// synchronises the host.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "algorithms/schedule.h"
#include "common/dtype.h"
#include "common/signature.h"
#include "transport/device.h"

namespace ringcomm {
namespace device {

class Executor {
 public:
  // Over `transport`, which outlives the executor.
  explicit Executor(DeviceTransport& transport);

  // The all-reduce of `count` elements at `data` (on the transport's device), in place.
  // `algo`: kRing, kTree, kRecursiveDoubling, or kAuto (choose_all_reduce).
  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op, Algorithm algo,
                  cudaStream_t stream);
  // The all-gather into `data`, which holds every rank's block back to back (block q: counts[q]
  // elements, this rank's already in place), by the ring's step list.
  void all_gather(void* data, const std::vector<size_t>& counts, DType dtype,
                  cudaStream_t stream);

  // What kAuto runs for `bytes`: recursive doubling up to kSmallBytes, the ring above.
  Algorithm choose_all_reduce(size_t bytes) const;
  static constexpr size_t kSmallBytes = 256 << 10;

 private:
  // `schedule` (this rank's) over `blocks` of `data`, in place, in slices of `slice` elements,
  // as stream groups over the transport's messages.
  void run_groups(const Schedule& schedule, const Segments& blocks, size_t slice, char* data,
                  DType dtype, ReduceOp op, cudaStream_t stream);

  DeviceTransport& transport_;
};

}  // namespace device
}  // namespace ringcomm
