// NCCL, loaded at run time: ringcomm is built without NCCL and uses the libnccl.so.2 that the
// process can find when a communicator is made (the one torch's CUDA wheels bring in the
// nvidia-nccl wheel, or the system's). Only the C ABI below is used; its types and constants
// are NCCL's (nccl.h, stable since NCCL 2.0).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "common/dtype.h"

namespace ringcomm {
namespace nccl {

using Result = int;  // ncclResult_t: 0 is ncclSuccess, 7 ncclInProgress
using Comm = struct ncclComm*;
constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct UniqueId {
  char internal[kUniqueIdBytes];
};
// ncclDataType_t and ncclRedOp_t values.
enum DataType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kInt64 = 4,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9
};
enum RedOp : int { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };

class Library {
 public:
  // The library at `path` (a file, or a name for the dynamic loader), loaded once per process;
  // later calls must name the same one. Throws with the loader's message if it cannot be
  // loaded or lacks a function.
  static const Library& load(const std::string& path);

  // Throws, naming `what`, NCCL's description of `result` and, with a communicator, NCCL's
  // last error message, unless `result` is ncclSuccess.
  void check(Result result, const char* what, Comm comm = nullptr) const;

  std::string path;
  Result (*get_version)(int*);
  Result (*get_unique_id)(UniqueId*);
  Result (*comm_init_rank)(Comm*, int, UniqueId, int);
  Result (*comm_destroy)(Comm);
  Result (*comm_abort)(Comm);
  Result (*comm_get_async_error)(Comm, Result*);
  const char* (*get_error_string)(Result);
  const char* (*get_last_error)(Comm);
  Result (*send)(const void*, size_t, int, int, Comm, cudaStream_t);
  Result (*recv)(void*, size_t, int, int, Comm, cudaStream_t);
  Result (*group_start)();
  Result (*group_end)();
  Result (*all_reduce)(const void*, void*, size_t, int, int, Comm, cudaStream_t);
};

// NCCL's type and operation for an all-reduce of `dtype` by `op`. bool travels as uint8, its
// sum as max and its product as min (logical or / and), as torch's ProcessGroupNCCL does.
DataType data_type(DType dtype);
RedOp red_op(DType dtype, ReduceOp op);

}  // namespace nccl
}  // namespace ringcomm
