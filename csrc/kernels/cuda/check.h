// Every CUDA runtime call is checked: a failure raises ringcomm::Error (Python:
// ringcomm.RingcommError) naming the call and CUDA's own message.
#pragma once

#include <cuda_runtime.h>

#include "common/error.h"

#define RC_CUDA_CHECK(call)                                                \
  do {                                                                     \
    cudaError_t rc_cuda_status = (call);                                   \
    if (rc_cuda_status != cudaSuccess)                                     \
      RC_THROW(#call, " failed: ", cudaGetErrorName(rc_cuda_status), ": ", \
               cudaGetErrorString(rc_cuda_status));                        \
  } while (0)

// After a kernel launch: a bad configuration shows up here, not at the next call.
#define RC_CUDA_CHECK_LAUNCH() RC_CUDA_CHECK(cudaGetLastError())

namespace ringcomm {
namespace cuda {

// Makes `device` current for the scope of a call and restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    RC_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) RC_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

// Blocks for a grid-stride loop over n items with `threads` per block: enough to fill every SM
// of the current device a few times over, and no more than the items need.
inline unsigned grid_for(size_t n, unsigned threads) {
  int device = 0, sms = 0;
  RC_CUDA_CHECK(cudaGetDevice(&device));
  RC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t wanted = (n + threads - 1) / threads;
  const size_t most = size_t(sms) * 8;
  return unsigned(wanted < most ? (wanted > 0 ? wanted : 1) : most);
}

}  // namespace cuda
}  // namespace ringcomm
