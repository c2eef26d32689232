#include "transport/nccl/nccl_transport.h"

#include <chrono>
#include <thread>

#include "kernels/cuda/check.h"

namespace ringcomm {
namespace nccl {
namespace {

constexpr Result kInProgress = 7;  // ncclInProgress

}  // namespace

using cuda::DeviceScope;

NcclTransport::NcclTransport(const Library& lib, const UniqueId& id, int rank, int size, int device)
    : lib_(lib), rank_(rank), size_(size), device_(device) {
  RC_CHECK_ARG(size >= 1 && rank >= 0 && rank < size, "rank ", rank, " of ", size);
  int devices = 0;
  RC_CUDA_CHECK(cudaGetDeviceCount(&devices));
  RC_CHECK_ARG(device >= 0 && device < devices, "CUDA device ", device, " of ", devices);
  DeviceScope scope(device);
  const Result joined = lib_.comm_init_rank(&comm_, size, id, rank);
  if (joined != 0 && comm_ != nullptr) {  // no destructor runs after a throwing constructor
    const char* last = lib_.get_last_error(comm_);
    const std::string why = last != nullptr ? last : "";
    lib_.comm_abort(comm_);
    comm_ = nullptr;
    RC_THROW("ncclCommInitRank failed: ", lib_.get_error_string(joined), " (", why, ")");
  }
  lib_.check(joined, "ncclCommInitRank");
}

NcclTransport::~NcclTransport() { abort(); }

Comm NcclTransport::live() const {
  if (comm_ == nullptr) RC_THROW_AS(kAborted, "the NCCL communicator is closed or aborted");
  return comm_;
}

void NcclTransport::close() {
  if (comm_ == nullptr) return;
  DeviceScope scope(device_);
  Comm comm = comm_;
  comm_ = nullptr;
  lib_.check(lib_.comm_destroy(comm), "ncclCommDestroy");
}

void NcclTransport::abort() noexcept {
  if (in_group_) {
    in_group_ = false;
    lib_.group_end();
  }
  if (comm_ == nullptr) return;
  Comm comm = comm_;
  comm_ = nullptr;
  lib_.comm_abort(comm);
}

void NcclTransport::group_start() {
  live();
  lib_.check(lib_.group_start(), "ncclGroupStart", comm_);
  in_group_ = true;
}

void NcclTransport::send(const void* data, size_t bytes, int peer, cudaStream_t stream) {
  lib_.check(lib_.send(data, bytes, kUint8, peer, live(), stream), "ncclSend", comm_);
}

void NcclTransport::recv(void* data, size_t bytes, int peer, cudaStream_t stream) {
  lib_.check(lib_.recv(data, bytes, kUint8, peer, live(), stream), "ncclRecv", comm_);
}

void NcclTransport::group_end() {
  in_group_ = false;
  lib_.check(lib_.group_end(), "ncclGroupEnd", comm_);
}

void NcclTransport::all_reduce_by_nccl(void* data, size_t count, DType dtype, ReduceOp op,
                                       cudaStream_t stream) {
  Comm comm = live();
  DeviceScope scope(device_);
  lib_.check(lib_.all_reduce(data, data, count, data_type(dtype), red_op(dtype, op), comm, stream),
             "ncclAllReduce", comm);
}

void NcclTransport::synchronize(cudaStream_t stream, double timeout_s) {
  DeviceScope scope(device_);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  for (;;) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done != cudaSuccess && done != cudaErrorNotReady) {
      abort();  // the stream's NCCL work will not finish; peers see this rank leave
      RC_CUDA_CHECK(done);
    }
    Result async = 0;
    lib_.check(lib_.comm_get_async_error(live(), &async), "ncclCommGetAsyncError", comm_);
    if (async != 0 && async != kInProgress) {
      const std::string what = lib_.get_error_string(async);
      abort();
      RC_THROW("NCCL failed while running this rank's work: ", what,
               " (the communicator is aborted)");
    }
    if (done == cudaSuccess) return;
    if (std::chrono::steady_clock::now() > deadline) {
      abort();
      RC_THROW_AS(kTimeout, "NCCL work did not finish within ", timeout_s,
                  " s (a peer may have failed or be running other collectives); the communicator "
                  "is aborted");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace nccl
}  // namespace ringcomm
