#include "transport/nccl/nccl_transport.h"

#include <chrono>
#include <thread>

#include "algorithms/algorithms.h"
#include "algorithms/stream_plan.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/reduce.h"

namespace ringcomm {
namespace nccl {
namespace {

constexpr Result kInProgress = 7;  // ncclInProgress

// The slice length on a stream: a step pipelined by step (the ring) is one group whichever way
// it is cut, and NCCL pipelines each message itself, so it goes whole, one message per step; the
// trees keep their slices, which pipeline across levels.
size_t stream_slice(const Schedule& schedule, const Segments& blocks, size_t slice) {
  return schedule.pipeline == Pipeline::kByStep ? std::max<size_t>(1, blocks.max_count()) : slice;
}

// Makes `device` current for the scope of a call and restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    RC_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) RC_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace

NcclTransport::NcclTransport(const Library& lib, const UniqueId& id, int rank, int size,
                             int device)
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

NcclTransport::~NcclTransport() {
  if (comm_ != nullptr) lib_.comm_abort(comm_);
}

Comm NcclTransport::live() const {
  if (comm_ == nullptr) RC_THROW("the NCCL communicator is closed or aborted");
  return comm_;
}

void NcclTransport::close() {
  if (comm_ == nullptr) return;
  DeviceScope scope(device_);
  Comm comm = comm_;
  comm_ = nullptr;
  lib_.check(lib_.comm_destroy(comm), "ncclCommDestroy");
}

void NcclTransport::abort() {
  if (comm_ == nullptr) return;
  Comm comm = comm_;
  comm_ = nullptr;
  lib_.comm_abort(comm);
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

void NcclTransport::all_reduce(void* data, size_t count, DType dtype, ReduceOp op, Algorithm algo,
                               cudaStream_t stream) {
  Comm comm = live();
  DeviceScope scope(device_);
  if (algo == Algorithm::kNccl) {
    lib_.check(lib_.all_reduce(data, data, count, data_type(dtype), red_op(dtype, op), comm, stream),
               "ncclAllReduce", comm);
    return;
  }
  if (algo == Algorithm::kAuto)
    algo = count * dtype_size(dtype) <= kSmallBytes ? Algorithm::kRecursiveDoubling
                                                    : Algorithm::kRing;
  // Its steps receive from one peer over several steps after sending to it over several: stream
  // groups (stream_plan.h) of one receiving step each would wait on each other.
  RC_CHECK_ARG(algo != Algorithm::kHalvingDoubling, "halving_doubling does not run over NCCL");
  if (size_ == 1) {
    RC_CHECK_ARG(op != ReduceOp::kAvg || dtype != DType::kBool, "op avg is undefined on bool");
    return;  // every op of one contribution is that contribution
  }
  const AllReduceSchedule s = all_reduce_schedule(algo, size_, rank_, count, dtype_size(dtype));
  run_schedule(s.schedule, s.blocks, stream_slice(s.schedule, s.blocks, s.slice),
               static_cast<char*>(data), dtype, op, stream);
}

void NcclTransport::all_gather(void* data, const std::vector<size_t>& counts, DType dtype,
                               cudaStream_t stream) {
  live();
  RC_CHECK_ARG(int(counts.size()) == size_, counts.size(), " block sizes for ", size_, " ranks");
  if (size_ == 1) return;
  DeviceScope scope(device_);
  const Schedule schedule = ring_all_gather_schedule(size_, rank_);
  const Segments blocks(counts);
  run_schedule(schedule, blocks,
               stream_slice(schedule, blocks, ring_slice(dtype_size(dtype), size_)),
               static_cast<char*>(data), dtype, ReduceOp::kSum, stream);
}

// The schedule's groups one after another on `stream`: the group's messages between
// ncclGroupStart/End, then the reduction of what it received into staging.
void NcclTransport::run_schedule(const Schedule& schedule, const Segments& blocks, size_t slice,
                                 char* data, DType dtype, ReduceOp op, cudaStream_t stream) {
  const size_t e = dtype_size(dtype);
  const std::vector<StreamGroup> groups = stream_groups(schedule, blocks, slice);
  // Room for the receives of one group: the stream runs a group's reductions before the next
  // group receives.
  size_t staging_elems = 1;
  for (const StreamGroup& g : groups)
    if (g.reduce) staging_elems = std::max(staging_elems, (g.last - g.first) * slice);
  staging_elems = std::min(staging_elems, std::max<size_t>(1, blocks.max_count()));
  char* staging = nullptr;
  RC_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&staging), staging_elems * e, stream));
  // Slice j of a step: where it lives in `data`, and its length.
  auto slice_of = [&](int step, size_t j) {
    const Step& st = schedule.steps[size_t(step)];
    const size_t block = blocks.count(st.block), first = std::min(block, j * slice);
    return std::make_pair(data + (blocks.offset(st.block) + first) * e,
                          std::min(slice, block - first));
  };
  bool in_group = false;
  try {
    for (const StreamGroup& g : groups) {
      lib_.check(lib_.group_start(), "ncclGroupStart", comm_);
      in_group = true;
      for (const StreamMessage& m : g.messages) {
        auto [at, n] = slice_of(m.step, m.slice);
        if (m.send) {
          lib_.check(lib_.send(at, n * e, kUint8, m.peer, comm_, stream), "ncclSend", comm_);
        } else {
          char* into = m.to_staging ? staging + (m.slice - g.first) * slice * e : at;
          lib_.check(lib_.recv(into, n * e, kUint8, m.peer, comm_, stream), "ncclRecv", comm_);
        }
      }
      in_group = false;
      lib_.check(lib_.group_end(), "ncclGroupEnd", comm_);
      if (!g.reduce) continue;
      const Step& step = schedule.steps[size_t(g.step)];
      for (size_t j = g.first; j < g.last; ++j) {
        auto [mine, n] = slice_of(g.step, j);
        const char* incoming = staging + (j - g.first) * slice * e;
        cuda::reduce(dtype, op, mine, step.incoming_first ? incoming : mine,
                     step.incoming_first ? mine : incoming, n, stream);
        if (step.completes && op == ReduceOp::kAvg) cuda::divide(dtype, mine, n, size_, stream);
      }
    }
  } catch (...) {
    // NCCL's group depth is per thread: close the group, or the thread's later NCCL calls would
    // join it. Messages already posted may never be matched: the communicator is done.
    if (in_group) lib_.group_end();
    cudaFreeAsync(staging, stream);
    abort();
    throw;
  }
  RC_CUDA_CHECK(cudaFreeAsync(staging, stream));
}

}  // namespace nccl
}  // namespace ringcomm
