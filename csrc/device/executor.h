// The device executor: collectives on a CUDA stream over a device transport
// (transport/device.h), with ringcomm's kernels (kernels/cuda/). The algorithms are the core's,
// run as they run on the host: over a transport's messages, the step lists of
// algorithms/schedule.h posted as the groups of algorithms/stream_plan.h, ringcomm's reduction
// kernel combining what arrives; over its windows, the plans of algorithms/window_plan.h, each
// copy and fold a kernel and each signal and wait a stream operation. Every call only enqueues
// work on the caller's stream; nothing here synchronises the host.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "algorithms/schedule.h"
#include "algorithms/window_plan.h"
#include "common/dtype.h"
#include "common/signature.h"
#include "transport/device.h"

namespace ringcomm {
namespace device {

class Executor {
 public:
  // Over `transport`, which outlives the executor. Windows are laid out for board rounds of
  // `round_bytes` (window_layout); the transport's windows must hold that layout.
  Executor(DeviceTransport& transport, size_t round_bytes);

  // The all-reduce of `count` elements at `data` (on the transport's device), in place.
  // `algo`: over messages kRing, kTree, kRecursiveDoubling; over windows kOneShot,
  // kSharedBuffer, kRing; kAuto: choose_all_reduce.
  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op, Algorithm algo,
                  cudaStream_t stream);
  // The all-gather into `data`, which holds every rank's block back to back (block q: counts[q]
  // elements, this rank's already in place): by the ring's step list over messages, by the
  // board rounds of window_all_gather_plan over windows.
  void all_gather(void* data, const std::vector<size_t>& counts, DType dtype, cudaStream_t stream);
  // The reduce-scatter of `data`, the ranks' blocks of `block` elements back to back: block
  // `rank` ends reduced in place (the rest is left as scratch). By the ring's reduce-scatter step
  // list over messages, by window_reduce_scatter_plan over windows.
  void reduce_scatter(void* data, size_t block, DType dtype, ReduceOp op, cudaStream_t stream);
  // The all-to-all in place of `data`, the ranks' blocks of `block` elements back to back: block
  // r receives block `rank` of rank r's. Over windows by window_all_to_all_plan; over messages
  // one group of a send and a receive per peer, sent from a copy.
  void all_to_all(void* data, size_t block, DType dtype, cudaStream_t stream);

  // `count` elements from `data` to rank `peer`, and from rank `peer` into `data`: the k-th send
  // from one rank to another pairs with the other's k-th receive from it, of the same count and
  // dtype. Over windows by window_send_plan and window_recv_plan, which keep to channels of their
  // own: a send or receive may go on another stream than the collectives (and than the
  // messages the other way), so that sends that wait for their receives cannot hold back a
  // receive. Over messages, one group of one message.
  void send(const void* data, size_t count, DType dtype, int peer, uint32_t tag,
            cudaStream_t stream);
  void recv(void* data, size_t count, DType dtype, int peer, uint32_t tag, cudaStream_t stream);

  // An exchange: `sends` from `source`, `recvs` into `data`, parts of elements of `dtype`, at
  // most one of each per peer, in rank order (window_exchange_plan). The ranks agree on `sig`,
  // the collective it carries out, and each pair on the size of each part. Over windows by
  // window_exchange_plan; over messages, one group of every part's send and receive.
  void exchange(const void* source, void* data, const std::vector<Transfer>& sends,
                const std::vector<Transfer>& recvs, DType dtype, Signature sig,
                cudaStream_t stream);

  // What kAuto runs for `bytes`: up to kSmallBytes recursive doubling over messages and
  // one_shot over windows; above, the ring over messages and shared_buffer over windows (one
  // fold per element, two rounds of signals per board, where the ring takes 2(n - 1) steps).
  // Neither threshold has been measured on a GPU.
  Algorithm choose_all_reduce(size_t bytes) const;
  static constexpr size_t kSmallBytes = 256 << 10;

  // The window bytes a transport needs for `world` ranks and rounds of `round_bytes`.
  static size_t window_bytes(int world, size_t round_bytes);

 private:
  // `schedule` (this rank's) over `blocks` of `data`, in place, in slices of `slice` elements,
  // as stream groups over the transport's messages.
  void run_groups(const Schedule& schedule, const Segments& blocks, size_t slice, char* data,
                  DType dtype, ReduceOp op, cudaStream_t stream);
  // A send (`send`) or receive of `count` elements at `data` with `peer`.
  void message(char* data, size_t count, DType dtype, int peer, uint32_t tag, bool send,
               cudaStream_t stream);
  // `plan`'s actions in order over the transport's windows; the caller's buffer is `data`, its
  // source buffer `source`.
  void run_plan(const WindowPlan& plan, char* data, DType dtype, ReduceOp op, cudaStream_t stream,
                const char* source = nullptr);

  DeviceTransport& transport_;
  WindowLayout layout_;
  WindowState state_;
};

}  // namespace device
}  // namespace ringcomm
