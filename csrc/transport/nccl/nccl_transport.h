// NCCL as a device transport (transport/device.h): ncclSend/ncclRecv of device ranges between
// ncclGroupStart/End, on the caller's stream. It moves bytes and knows no collective; the device
// executor (device/executor.h) runs ringcomm's step lists over it. all_reduce_by_nccl calls
// NCCL's own ncclAllReduce, the reference ringcomm's schedules are compared with.
//
// Every call checks NCCL's result. A peer that fails leaves NCCL's operations unfinished on the
// stream: synchronize() polls the stream and NCCL's asynchronous error with a deadline and
// aborts the communicator (ncclCommAbort never blocks) when either goes wrong.
#pragma once

#include <cuda_runtime.h>

#include "common/dtype.h"
#include "transport/device.h"
#include "transport/nccl/nccl_library.h"

namespace ringcomm {
namespace nccl {

class NcclTransport final : public device::DeviceTransport, public device::Messages {
 public:
  // Joins the communicator `id` (from Library::get_unique_id on one rank, shared by the caller)
  // as `rank` of `size`, on CUDA device `device`; blocks until every rank has joined.
  NcclTransport(const Library& lib, const UniqueId& id, int rank, int size, int device);
  ~NcclTransport() override;  // aborts the communicator if close() was not called
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  const char* name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const override { return device_; }
  // NCCL reaches every rank of its communicator.
  bool can_connect(int peer) const override { return peer >= 0 && peer < size_; }
  device::Messages* messages() override { return this; }
  void check_usable() override { live(); }
  void synchronize(cudaStream_t stream, double timeout_s) override;
  void close() override;
  void abort() noexcept override;

  void group_start() override;
  void send(const void* data, size_t bytes, int peer, cudaStream_t stream) override;
  void recv(void* data, size_t bytes, int peer, cudaStream_t stream) override;
  void group_end() override;

  // Enqueues NCCL's own all-reduce of `count` elements at `data`, in place.
  void all_reduce_by_nccl(void* data, size_t count, DType dtype, ReduceOp op, cudaStream_t stream);

 private:
  Comm live() const;  // the communicator, or an error once it is closed or aborted

  const Library& lib_;
  Comm comm_ = nullptr;
  int rank_, size_, device_;
  // Inside ncclGroupStart/End. NCCL's group depth is per thread: abort() closes an open group,
  // or the thread's later NCCL calls would join it.
  bool in_group_ = false;
};

}  // namespace nccl
}  // namespace ringcomm
