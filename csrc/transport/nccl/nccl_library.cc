#include "transport/nccl/nccl_library.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>

#include "common/error.h"

namespace ringcomm {
namespace nccl {
namespace {

template <typename Fn>
void resolve(void* handle, const std::string& path, const char* name, Fn* fn) {
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) RC_THROW("NCCL library ", path, " has no ", name, ": ", dlerror());
  *fn = reinterpret_cast<Fn>(symbol);
}

}  // namespace

const Library& Library::load(const std::string& path) {
  static std::mutex mutex;
  static std::unique_ptr<Library> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded) {
    RC_CHECK_ARG(loaded->path == path, "NCCL is already loaded from ", loaded->path,
                 "; cannot load ", path, " as well");
    return *loaded;
  }
  // RTLD_LOCAL: NCCL's symbols stay out of the global namespace, where torch's own NCCL (if any)
  // lives. The handle is kept for the life of the process.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr)
    RC_THROW("cannot load the NCCL library ", path, ": ", dlerror(),
             " (install nvidia-nccl-cu13, or set RINGCOMM_NCCL_LIBRARY to libnccl.so.2)");
  auto lib = std::make_unique<Library>();
  lib->path = path;
  resolve(handle, path, "ncclGetVersion", &lib->get_version);
  resolve(handle, path, "ncclGetUniqueId", &lib->get_unique_id);
  resolve(handle, path, "ncclCommInitRank", &lib->comm_init_rank);
  resolve(handle, path, "ncclCommDestroy", &lib->comm_destroy);
  resolve(handle, path, "ncclCommAbort", &lib->comm_abort);
  resolve(handle, path, "ncclCommGetAsyncError", &lib->comm_get_async_error);
  resolve(handle, path, "ncclGetErrorString", &lib->get_error_string);
  resolve(handle, path, "ncclGetLastError", &lib->get_last_error);
  resolve(handle, path, "ncclSend", &lib->send);
  resolve(handle, path, "ncclRecv", &lib->recv);
  resolve(handle, path, "ncclGroupStart", &lib->group_start);
  resolve(handle, path, "ncclGroupEnd", &lib->group_end);
  resolve(handle, path, "ncclAllReduce", &lib->all_reduce);
  loaded = std::move(lib);
  return *loaded;
}

void Library::check(Result result, const char* what, Comm comm) const {
  if (result == 0) return;
  const char* last = get_last_error(comm);
  RC_THROW(what, " failed: ", get_error_string(result),
           last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string());
}

DataType data_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return kFloat32;
    case DType::kFloat64:
      return kFloat64;
    case DType::kFloat16:
      return kFloat16;
    case DType::kBFloat16:
      return kBfloat16;
    case DType::kInt8:
      return kInt8;
    case DType::kUInt8:
    case DType::kBool:
      return kUint8;
    case DType::kInt32:
      return kInt32;
    case DType::kInt64:
      return kInt64;
  }
  RC_INVALID("NCCL has no type for ", dtype_name(dtype));
}

RedOp red_op(DType dtype, ReduceOp op) {
  if (dtype == DType::kBool) {
    RC_CHECK_ARG(op != ReduceOp::kAvg, "op avg is undefined on bool");
    return op == ReduceOp::kSum || op == ReduceOp::kMax ? kMax : kMin;
  }
  switch (op) {
    case ReduceOp::kSum:
      return kSum;
    case ReduceOp::kProd:
      return kProd;
    case ReduceOp::kMax:
      return kMax;
    case ReduceOp::kMin:
      return kMin;
    case ReduceOp::kAvg:
      return kAvg;
    default:
      RC_INVALID("NCCL's all_reduce has no op ", op_name(op), " (use a ringcomm algorithm)");
  }
}

}  // namespace nccl
}  // namespace ringcomm
