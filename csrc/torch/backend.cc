// The c10d::Backend "ringcomm" (ringcomm._C_torch): the only code that sees libtorch. torch wraps
// it in a named ProcessGroup like gloo's, so groups, DeviceMesh, FSDP2, DTensor and functional
// collectives reach it through torch's own dispatch.
//
// It translates and nothing else: tensors to (pointer, count, dtype) of the torch-free core
// (libringcomm.so, shared with ringcomm._C), options to arguments, core Works to c10d Works with
// futures. Every collective is the core's; a non-contiguous tensor is staged through a contiguous
// copy that is copied back once the operation has finished. Operations on CUDA tensors are the
// device route's (ringcomm/backend.py), which runs them on the device path and hands back the
// stream each is on; where no device path serves (and for the coalesced all-gather of lists), they
// are staged through pinned host memory, as are sends and receives before a collective has joined
// the device path. A receive from any source raises once one has.
//
// Built against the installed torch on first use (ringcomm/backend.py). Only the headers it uses:
// torch/extension.h brings the whole C++ frontend (nn, optim), and parsing it was 21 s of a 56 s
// build on two cores.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>  // THPVariable: tensors read from Python lists
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>  // casters for c10::intrusive_ptr holders and torch types
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include <pybind11/chrono.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>

#include "common/knobs.h"
#include "common/prefetch.h"
#include "communicator.h"

namespace rc = ringcomm;

namespace {

constexpr const char* kName = "ringcomm";

[[noreturn]] void fail(const std::string& message) { C10_THROW_ERROR(DistBackendError, message); }

std::exception_ptr error_of(const std::string& message) {
  try {
    fail(message);
  } catch (...) {
    return std::current_exception();
  }
}

// The core's dtype of a torch dtype (the codes of ringcomm._buffers.TORCH_DTYPES), if it has one.
std::optional<rc::DType> core_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return rc::DType::kFloat32;
    case at::kDouble:
      return rc::DType::kFloat64;
    case at::kHalf:
      return rc::DType::kFloat16;
    case at::kBFloat16:
      return rc::DType::kBFloat16;
    case at::kChar:
      return rc::DType::kInt8;
    case at::kByte:
      return rc::DType::kUInt8;
    case at::kInt:
      return rc::DType::kInt32;
    case at::kLong:
      return rc::DType::kInt64;
    case at::kBool:
      return rc::DType::kBool;
    default:
      return std::nullopt;
  }
}

rc::DType dtype_of(const at::Tensor& t) {
  std::optional<rc::DType> dtype = core_dtype(t.scalar_type());
  TORCH_CHECK_TYPE(dtype, "ringcomm: unsupported dtype ", t.scalar_type(),
                   " (supported: float32, "
                   "float64, float16, bfloat16, int8, uint8, int32, int64, bool)");
  return *dtype;
}

// The core's dtype of `item` if it is a plain tensor (Tensor or Parameter, not a subclass whose
// methods may mean something else) on `device`, contiguous, of a supported dtype, with the memory
// its elements need; else nothing (a strided view, a negated view, a ZeroTensor, a storage freed
// or shrunk under it, as FSDP does, ...).
std::optional<rc::DType> plain_dtype(PyObject* item, c10::Device device) {
  if (!THPVariable_CheckExact(item)) return std::nullopt;
  const at::Tensor& t = THPVariable_Unpack(item);
  std::optional<rc::DType> dtype = core_dtype(t.scalar_type());
  if (!dtype || t.device() != device || t.layout() != at::kStrided || !t.has_storage() ||
      !t.is_contiguous() || t.is_neg() || t._is_zerotensor() ||
      t.storage().nbytes() < size_t(t.storage_offset() + t.numel()) * t.itemsize())
    return std::nullopt;
  return dtype;
}

// Starts loading the StorageImpl of `t` (its TensorImpl must be loaded): a hint only.
void prefetch_storage(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->has_storage())
    rc::prefetch_lines(impl->unsafe_storage().unsafeGetStorageImpl(), sizeof(c10::StorageImpl));
}

// Starts loading what plain_dtype and tensor_lists read of `item` (its Python object, its
// TensorImpl, its StorageImpl), `stage` links deep: 0 the object, 1 its TensorImpl (the object
// must be loaded), 2 its storage (the TensorImpl must be). Hints only, nothing is checked here
// but what following a link needs.
void prefetch_tensor(PyObject* item, int stage) {
  if (stage == 0) return rc::prefetch_lines(item, sizeof(THPVariable));
  if (!THPVariable_CheckExact(item)) return;
  const at::Tensor& t = THPVariable_Unpack(item);
  if (stage == 1) return rc::prefetch_lines(t.unsafeGetTensorImpl(), sizeof(c10::TensorImpl));
  prefetch_storage(t);
}

// (addresses, element counts, dtype codes) of a list or tuple of contiguous tensors on `device`
// ("cpu", "cuda:1"), each a bytes object of native uint64s, for the core's list arguments
// (ringcomm.fusion.BufferList) and the CUDA pack kernels (ringcomm.cuda.pack), or None when an
// item is anything else (on another device, a subclass, a numpy array, a strided view, a negated
// view, a tensor without the storage its elements need, ...): the caller's per-item path then
// names it.
// torch's Python accessors cost about 50 ns per attribute and tensor, and BufferList needs five;
// here a list of 1000 tensors takes a few tens of microseconds in cache.
py::object tensor_lists(py::handle items, const std::string& device_name) {
  const c10::Device device(device_name);
  // exactly list or tuple: a subclass may iterate differently from its items
  if (!PyList_CheckExact(items.ptr()) && !PyTuple_CheckExact(items.ptr())) return py::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items.ptr());
  PyObject** item = PySequence_Fast_ITEMS(items.ptr());
  // Filled in place: no int object per tensor and property, which cost as much again.
  auto words = [n] {
    PyObject* b = PyBytes_FromStringAndSize(nullptr, n * Py_ssize_t(sizeof(uint64_t)));
    if (b == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::bytes>(b);
  };
  py::bytes ptrs = words(), counts = words(), dtypes = words();
  auto at = [](const py::bytes& b, Py_ssize_t i) {
    return PyBytes_AS_STRING(b.ptr()) + i * Py_ssize_t(sizeof(uint64_t));
  };
  // A thousand tensors' objects lie all over the heap, and after a collective has streamed
  // megabytes through the caches each is a chain of misses (object, TensorImpl, storage), which
  // read one after another cost many times the same reads in cache. Each link is fetched some
  // items ahead of its use, so that the misses of many items overlap.
  constexpr Py_ssize_t kAhead = 8;
  for (Py_ssize_t i = -3 * kAhead; i < n; ++i) {
    for (int stage = 0; stage < 3; ++stage) {
      const Py_ssize_t ahead = i + (3 - stage) * kAhead;
      if (ahead >= 0 && ahead < n) prefetch_tensor(item[ahead], stage);
    }
    if (i < 0) continue;
    std::optional<rc::DType> dtype = plain_dtype(item[i], device);
    if (!dtype) return py::none();
    const at::Tensor& t = THPVariable_Unpack(item[i]);
    const uint64_t fields[3] = {uint64_t(reinterpret_cast<uintptr_t>(t.data_ptr())),
                                uint64_t(t.numel()), uint64_t(*dtype)};
    std::memcpy(at(ptrs, i), &fields[0], sizeof(uint64_t));
    std::memcpy(at(counts, i), &fields[1], sizeof(uint64_t));
    std::memcpy(at(dtypes, i), &fields[2], sizeof(uint64_t));
  }
  return py::make_tuple(ptrs, counts, dtypes);
}

// ringcomm.Communicator.all_reduce of a plain CPU tensor (plain_dtype), synchronous, on the
// communicator in `comm` (ringcomm._C.Communicator.capsule()): reading the tensor here is a
// fraction of what Python's accessors take, which would be most of what an 8-byte all-reduce
// costs beyond its messages. False, having done nothing, for any other tensor or an op its dtype
// does not have: the caller's own checks then name the problem. `algorithm`: a built-in's code, or
// the name of a registered one (ringcomm.algorithms).
bool all_reduce_tensor(py::capsule comm, py::handle tensor, int op, py::handle algorithm) {
  TORCH_CHECK_VALUE(std::string(comm.name() ? comm.name() : "") == rc::kCommunicatorCapsule,
                    "not a ringcomm communicator capsule");
  std::optional<rc::DType> dtype = plain_dtype(tensor.ptr(), c10::Device(c10::kCPU));
  if (!dtype) return false;
  rc::ReduceOp reduce_op;
  try {
    reduce_op = rc::checked_op(op, *dtype);
  } catch (const std::invalid_argument&) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(tensor.ptr());
  rc::Communicator& c = **static_cast<std::shared_ptr<rc::Communicator>*>(comm.get_pointer());
  const bool registered = py::isinstance<py::str>(algorithm);
  const std::string name = registered ? algorithm.cast<std::string>() : std::string();
  const int code = registered ? 0 : algorithm.cast<int>();
  try {
    py::gil_scoped_release nogil;
    if (registered)
      c.all_reduce_registered(t.data_ptr(), size_t(t.numel()), *dtype, reduce_op, name, false);
    else
      c.all_reduce(t.data_ptr(), size_t(t.numel()), *dtype, reduce_op, rc::Algorithm(code), false);
  } catch (const rc::Error& e) {  // as ringcomm._C raises it: this module's pybind11 is torch's
    py::object types = py::module_::import("ringcomm._C").attr("error_types");
    PyErr_SetString(py::tuple(types)[size_t(e.kind())].ptr(), e.what());
    throw py::error_already_set();
  }
  return true;
}

void check_tensor(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(),
                    "ringcomm moves CPU and CUDA "
                    "tensors, got one on ",
                    t.device(),
                    "; name a backend for that device, e.g. "
                    "init_process_group(\"cpu:ringcomm,",
                    t.device().type(), ":...\")");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "ringcomm: tensors must be dense, got ",
                    t.layout());
  dtype_of(t);
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "ringcomm ", what, ": dtypes differ (",
                   a.scalar_type(), " vs ", b.scalar_type(), ")");
}

const at::Tensor& one(const std::vector<at::Tensor>& tensors, const char* what) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "ringcomm ", what,
                    ": expected one tensor (one device "
                    "per process), got ",
                    tensors.size());
  return tensors[0];
}

// ReduceOp -> the core's; PREMUL_SUM is a sum of inputs scaled here first (`scaled`).
rc::ReduceOp op_of(const c10d::ReduceOp& op, const at::Tensor& t) {
  TORCH_CHECK_VALUE(op.op_ != c10d::ReduceOp::PREMUL_SUM && op.op_ < c10d::ReduceOp::UNUSED,
                    "ringcomm: unsupported reduce op ", int(op.op_));
  try {
    return rc::checked_op(int(op.op_), dtype_of(t));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_TYPE(false, "ringcomm: ", e.what());
  }
}

// Whether the interpreter runs and is not finalizing: Python may be called.
bool python_running() {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  return Py_IsInitialized() && !finalizing;
}

// Runs Python's pending signal handlers; an exception one raises propagates as a Python error.
void run_signal_handlers() {
  if (!python_running()) return;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// A completion handle: done once every core operation it tracks has finished and the copies out
// of staging buffers have run. Its future's value is the output tensors (what DDP reads).
// The CUDA devices of `tensors`: a future over them records, as it completes, an event on each
// one's current stream (the copies back from staging), and its waiters' streams wait for it.
std::vector<c10::Device> cuda_devices(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const at::Tensor& t : tensors)
    if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end())
      devices.push_back(t.device());
  return devices;
}

class RingcommWork : public c10d::Work {
 public:
  RingcommWork(int rank, c10d::OpType type, std::shared_ptr<rc::Communicator> comm,
               std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        comm_(std::move(comm)),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()), cuda_devices(outputs_))) {}

  // Tracks `ops`; `finish` runs (on the thread that finishes the last one) if all succeeded.
  // `keep`: tensors the operations read or write, alive until then.
  void track(std::vector<rc::WorkPtr> ops, std::function<void()> finish,
             std::vector<at::Tensor> keep) {
    auto state = std::make_shared<Pending>();
    state->remaining = ops.size();
    state->finish = std::move(finish);
    state->keep = std::move(keep);
    if (ops.empty()) return complete(*state);
    source_ = ops.front();
    c10::intrusive_ptr<RingcommWork> self = c10::intrusive_ptr<RingcommWork>::reclaim_copy(this);
    for (auto& op : ops) {
      op->on_finished([self, state, op] {
        std::string error = op->error();
        std::lock_guard<std::mutex> lk(state->mu);
        if (!error.empty() && state->error.empty()) state->error = error;
        if (--state->remaining == 0) self->complete(*state);
      });
    }
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lk(mutex_);
    return completed_;
  }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> lk(mutex_);
    return completed_ && !exception_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lk(mutex_);
    return exception_;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  // The peer a receive took its message from (a receive from any source decides it late).
  int sourceRank() const override { return source_ ? source_->source() : -1; }

  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lk(mutex_);
    if (!completed_ && comm_->on_progress_thread())
      fail(
          "ringcomm: waiting for an operation from a completion callback (the progress thread) "
          "would wait for itself; chain with future.then() instead");
    // In slices, with Python's signal handlers run in between (on the main thread, where
    // CPython runs them): a SIGINT or preemption SIGTERM handler runs, and may raise, while an
    // operation is pending.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!completed_) {
      auto slice = std::chrono::milliseconds(100);
      if (timeout != kNoTimeout) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0)
          fail(c10::str("ringcomm: Timed out waiting ", timeout.count(), "ms for ",
                        c10d::opTypeToString(retrieveOpType()), " to complete"));
        slice = std::min(slice, left);
      }
      if (cv_.wait_for(lk, slice, [&] { return completed_; })) break;
      lk.unlock();
      run_signal_handlers();
      lk.lock();
    }
    if (exception_) std::rethrow_exception(exception_);
    lk.unlock();
    // CUDA outputs: the caller's current streams wait for the copies back from staging.
    if (!future_->devices().empty()) future_->wait();
    return true;
  }

 private:
  struct Pending {
    std::mutex mu;
    size_t remaining = 0;
    std::string error;
    std::function<void()> finish;
    std::vector<at::Tensor> keep;
  };

  void complete(Pending& state) {
    std::exception_ptr error;
    if (state.error.empty() && state.finish) {
      try {
        state.finish();
      } catch (const std::exception& e) {
        state.error = e.what();
      }
    }
    if (!state.error.empty()) error = error_of(state.error);
    state.keep.clear();
    finish(error);  // c10d::Work: completed_, wakes wait()
    if (error)
      future_->setError(error);
    else
      future_->markCompleted(c10::IValue(outputs_));
  }

  std::shared_ptr<rc::Communicator> comm_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  rc::WorkPtr source_;  // the first core operation, whose source() a receive sets
};

// The Work of an all-reduce on the device route: for the host it is done once enqueued, the
// device once `stream` is past it, as ProcessGroupNCCL's. Its future is completed on `stream`
// (CUDA-aware: waiting on it, or on what it chains, orders the waiter's current stream after the
// operation); wait() orders the current stream after it without blocking the host.
class DeviceWork : public c10d::Work {
 public:
  DeviceWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, c10::Stream stream)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        done_(stream.device_type()),
        future_(
            c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                     std::vector<c10::Device>{stream.device()})) {
    c10::StreamGuard on(stream);  // the future records its event on the current stream
    done_.record(stream);
    future_->markCompleted(c10::IValue(outputs_));
    finish();
  }

  bool isCompleted() override { return done_.query(); }
  void synchronize() override { future_->wait(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  bool wait(std::chrono::milliseconds) override {
    future_->wait();
    return true;
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::Event done_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A Python object that C++ may drop on any thread: its last owner takes the GIL to release it,
// and leaks it once the interpreter is finalizing.
std::shared_ptr<py::object> python_held(py::object object) {
  return std::shared_ptr<py::object>(new py::object(std::move(object)), [](py::object* held) {
    if (python_running()) {
      py::gil_scoped_acquire gil;
      delete held;
    } else {
      held->release();
      delete held;
    }
  });
}

// A tensor as the core sees it: contiguous, in host memory. `dense` is the tensor itself when it
// already is; a CUDA tensor is copied to pinned host memory, after the work already on its
// current stream (a blocking copy: the host waits for it), and back once the operation is done.
std::atomic<uint64_t> bytes_staged{0};  // ringcomm.staging.bytes_to_host() adds them up

at::Tensor host_dense(const at::Tensor& t) {
  if (t.is_cuda()) {
    bytes_staged += uint64_t(t.nbytes());
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    host.copy_(t);
    return host;
  }
  return t.is_contiguous() ? t : t.contiguous();
}

struct Staged {
  at::Tensor user, dense;
  explicit Staged(const at::Tensor& t) : user(t), dense((check_tensor(t), host_dense(t))) {}
  bool copied() const { return !dense.is_same(user); }
  void* data() const { return dense.data_ptr(); }
  size_t count() const { return size_t(dense.numel()); }
  rc::DType dtype() const { return dtype_of(dense); }
};

// Copies staged outputs back into the user's tensors.
std::function<void()> copy_back(std::vector<Staged> outputs) {
  outputs.erase(
      std::remove_if(outputs.begin(), outputs.end(), [](const Staged& s) { return !s.copied(); }),
      outputs.end());
  if (outputs.empty()) return nullptr;
  // On the thread that completes the operation; a copy to CUDA is enqueued on that thread's
  // current stream (pinned memory: asynchronous), which the Work's future then records.
  return [outputs] {
    for (const Staged& s : outputs) s.user.copy_(s.dense, /*non_blocking=*/s.user.is_cuda());
  };
}

std::vector<at::Tensor> denses(const std::vector<Staged>& staged) {
  std::vector<at::Tensor> out;
  for (const Staged& s : staged) out.push_back(s.dense);
  return out;
}

class RingcommBackend : public c10d::Backend {
 public:
  RingcommBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size), timeout_(timeout) {
    comm_ = std::make_shared<rc::Communicator>(rank, size, timeout.count() / 1000.0,
                                               rc::knob_string("MASTER_ADDR"));
    // torch already made `store` private to this group and device; the prefix keeps ringcomm's
    // keys apart from anything else torch puts there.
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("ringcomm/backend", store);
    comm_->rendezvous({
        [prefixed](const std::string& key, const std::string& value) {
          prefixed->set(key, std::vector<uint8_t>(value.begin(), value.end()));
        },
        [prefixed, timeout](const std::string& key) {
          prefixed->wait({key}, timeout);
          auto bytes = prefixed->get(key);
          return std::string(bytes.begin(), bytes.end());
        },
    });
  }

  // The last reference to a group may go on the progress thread (a future callback's garbage
  // collection), which cannot join itself: a short-lived thread closes the communicator then.
  ~RingcommBackend() override {
    if (comm_->on_progress_thread())
      std::thread([comm = std::move(comm_)] { comm->close(); }).detach();
    else
      comm_->close();
  }

  const std::string getBackendName() const override { return kName; }
  std::shared_ptr<rc::Communicator> communicator() const { return comm_; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  // The core's own numbers, which its signatures carry: every rank starts at 0 and has taken the
  // same ones by the end of the rendezvous, so there is nothing to agree on here. torch's
  // TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper puts the number in each collective's fingerprint.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return comm_->sequence_number(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    if (tensors.size() == 1 && routed(tensors[0]))
      if (auto work = on_device(c10d::OpType::BROADCAST, tensors, tensors, "broadcast", tensors[0],
                                checked_root(opts.rootRank)))
        return work;
    Staged t(one(tensors, "broadcast"));
    return run(
        c10d::OpType::BROADCAST, tensors, {t},
        [&](bool async) {
          return std::vector<rc::WorkPtr>{
              comm_->broadcast(t.data(), t.count(), t.dtype(), int(opts.rootRank), async)};
        },
        {}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (!tensors.empty() && routed(tensors[0])) {
      const DeviceOp d = device_op(opts.reduceOp, tensors[0]);
      if (auto work = on_device(c10d::OpType::ALLREDUCE, tensors, tensors, "all_reduce", tensors,
                                d.op, d.tensor_factor, d.factor))
        return work;
    }
    Staged t(one(tensors, "allreduce"));
    rc::ReduceOp op = premultiply(opts.reduceOp, t);
    return run(
        c10d::OpType::ALLREDUCE, tensors, {t},
        [&](bool async) {
          return std::vector<rc::WorkPtr>{
              comm_->all_reduce(t.data(), t.count(), t.dtype(), op, rc::Algorithm::kAuto, async)};
        },
        {}, opts.asyncOp);
  }

  // Through the fused bucket path: bitwise what one allreduce per tensor gives.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    if (!tensors.empty() && routed(tensors[0])) {
      const DeviceOp d = device_op(opts.reduceOp, tensors[0]);
      if (auto work = on_device(c10d::OpType::ALLREDUCE_COALESCED, tensors, tensors, "all_reduce",
                                tensors, d.op, d.tensor_factor, d.factor))
        return work;
    }
    std::vector<Staged> staged;
    std::vector<rc::Communicator::BufferRef> refs;
    staged.reserve(tensors.size());
    refs.reserve(tensors.size());
    rc::ReduceOp op = rc::ReduceOp::kSum;
    // torch's unboxing has just touched each TensorImpl; their storages (the data pointers) are
    // still a miss each, fetched a few tensors ahead so that the misses overlap.
    constexpr size_t kAhead = 8;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (i + kAhead < tensors.size()) prefetch_storage(tensors[i + kAhead]);
      const at::Tensor& t = tensors[i];
      staged.emplace_back(t);
      op = premultiply(opts.reduceOp, staged.back());
      refs.push_back({staged.back().data(), staged.back().count(), staged.back().dtype()});
    }
    return run(
        c10d::OpType::ALLREDUCE_COALESCED, tensors, staged,
        [&](bool async) {
          return std::vector<rc::WorkPtr>{
              comm_->all_reduce_coalesced(refs, op, kBucketBytes, {}, async)};
        },
        {}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    if (tensors.size() == 1 && routed(tensors[0])) {
      const DeviceOp d = device_op(opts.reduceOp, tensors[0]);
      if (auto work = on_device(c10d::OpType::REDUCE, tensors, tensors, "reduce", tensors[0], d.op,
                                d.tensor_factor, d.factor, checked_root(opts.rootRank)))
        return work;
    }
    Staged t(one(tensors, "reduce"));
    rc::ReduceOp op = premultiply(opts.reduceOp, t);
    return run(
        c10d::OpType::REDUCE, tensors, {t},
        [&](bool async) {
          return std::vector<rc::WorkPtr>{
              comm_->reduce(t.data(), t.count(), t.dtype(), op, int(opts.rootRank), async)};
        },
        {}, opts.asyncOp);
  }

  // outputs[0][q] receives rank q's input.
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    one(inputs, "allgather");
    TORCH_CHECK_VALUE(outputs.size() == 1, "ringcomm allgather: expected one output list, got ",
                      outputs.size());
    if (routed(inputs[0])) {
      std::vector<at::Tensor> all = outputs[0];
      all.push_back(inputs[0]);
      if (auto work = on_device(c10d::OpType::ALLGATHER, all, outputs[0], "all_gather_list",
                                outputs[0], inputs[0]))
        return work;
    }
    std::vector<std::vector<at::Tensor>> per_rank;
    for (const auto& t : outputs[0]) per_rank.push_back({t});
    return gather_lists(c10d::OpType::ALLGATHER, per_rank, inputs, outputs[0], opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    std::vector<at::Tensor> results;
    for (auto& list : outputs) results.insert(results.end(), list.begin(), list.end());
    note_staged(c10d::OpType::ALLGATHER_COALESCED, results);  // the route carries the other form
    return gather_lists(c10d::OpType::ALLGATHER_COALESCED, outputs, inputs, results, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    std::vector<at::Tensor> outputs{output}, inputs{input};
    if (routed(input))
      if (auto work = on_device(c10d::OpType::_ALLGATHER_BASE, {output, input}, outputs,
                                "all_gather", outputs, inputs))
        return work;
    return allgather_into_tensor(c10d::OpType::_ALLGATHER_BASE, outputs, inputs, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    if (!inputs.empty() && routed(inputs[0]) && outputs.size() == inputs.size()) {
      std::vector<at::Tensor> all = outputs;
      all.insert(all.end(), inputs.begin(), inputs.end());
      if (auto work = on_device(c10d::OpType::ALLGATHER_COALESCED, all, outputs, "all_gather",
                                outputs, inputs))
        return work;
    }
    return allgather_into_tensor(c10d::OpType::ALLGATHER_COALESCED, outputs, inputs, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    const int root = checked_root(opts.rootRank);
    if (inputs.size() == 1 && routed(inputs[0])) {
      TORCH_CHECK_VALUE(getRank() != root || outputs.size() == 1,
                        "ringcomm gather: expected one output list");
      std::vector<at::Tensor> list = getRank() == root ? outputs[0] : std::vector<at::Tensor>{};
      std::vector<at::Tensor> all = list;
      all.push_back(inputs[0]);
      if (auto work = on_device(c10d::OpType::GATHER, all, list, "gather", list, inputs[0], root))
        return work;
    }
    Staged in(one(inputs, "gather"));
    std::vector<Staged> outs;
    std::vector<void*> pointers;
    std::vector<at::Tensor> results;
    if (getRank() == root) {
      TORCH_CHECK_VALUE(outputs.size() == 1, "ringcomm gather: expected one output list");
      per_rank(outputs[0], in.dense, "gather output");
      for (auto& o : outputs[0]) {
        outs.emplace_back(o);
        pointers.push_back(outs.back().data());
      }
      results = outputs[0];
    }
    return run(
        c10d::OpType::GATHER, results, outs,
        [&](bool async) {
          return std::vector<rc::WorkPtr>{
              comm_->gather(in.data(), pointers, in.count(), in.dtype(), root, async)};
        },
        {in.dense}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    const int root = checked_root(opts.rootRank);
    if (outputs.size() == 1 && routed(outputs[0])) {
      TORCH_CHECK_VALUE(getRank() != root || inputs.size() == 1,
                        "ringcomm scatter: expected one input list");
      std::vector<at::Tensor> list = getRank() == root ? inputs[0] : std::vector<at::Tensor>{};
      std::vector<at::Tensor> all = outputs;
      all.insert(all.end(), list.begin(), list.end());
      if (auto work =
              on_device(c10d::OpType::SCATTER, all, outputs, "scatter", outputs[0], list, root))
        return work;
    }
    Staged out(one(outputs, "scatter"));
    std::vector<const void*> pointers;
    std::vector<at::Tensor> keep;
    if (getRank() == root) {
      TORCH_CHECK_VALUE(inputs.size() == 1, "ringcomm scatter: expected one input list");
      per_rank(inputs[0], out.dense, "scatter input");
      for (auto& i : inputs[0]) {
        keep.push_back(host_dense(i));
        pointers.push_back(keep.back().data_ptr());
      }
    }
    return run(
        c10d::OpType::SCATTER, outputs, {out},
        [&](bool async) {
          return std::vector<rc::WorkPtr>{
              comm_->scatter(pointers, out.data(), out.count(), out.dtype(), root, async)};
        },
        keep, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK_VALUE(inputs.size() == 1, "ringcomm reduce_scatter: expected one input list");
    const at::Tensor& output = one(outputs, "reduce_scatter");
    per_rank(inputs[0], output, "reduce_scatter input");
    at::Tensor flat = at::cat(flatten_all(inputs[0]));
    if (routed(output)) {
      const DeviceOp d = device_op(opts.reduceOp, flat);
      if (auto work =
              on_device(c10d::OpType::REDUCE_SCATTER, {output, flat}, outputs, "reduce_scatter",
                        outputs, std::vector<at::Tensor>{flat}, d.op, d.tensor_factor, d.factor))
        return work;
    }
    Staged out(output);  // a CUDA output is copied to the host here
    return reduce_scatter_into(c10d::OpType::REDUCE_SCATTER, outputs, {out}, {flat}, opts.reduceOp,
                               opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> outputs{output};
    if (routed(input)) {
      const DeviceOp d = device_op(opts.reduceOp, input);
      if (auto work = on_device(c10d::OpType::_REDUCE_SCATTER_BASE, {output, input}, outputs,
                                "reduce_scatter", outputs, std::vector<at::Tensor>{input}, d.op,
                                d.tensor_factor, d.factor))
        return work;
    }
    return reduce_scatter_into(c10d::OpType::_REDUCE_SCATTER_BASE, outputs, {Staged(output)},
                               {input}, opts.reduceOp, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(),
                      "ringcomm reduce_scatter_tensor_coalesced: ", outputs.size(), " outputs for ",
                      inputs.size(), " inputs");
    if (!inputs.empty() && routed(inputs[0])) {
      const DeviceOp d = device_op(opts.reduceOp, inputs[0]);
      std::vector<at::Tensor> all = outputs;
      all.insert(all.end(), inputs.begin(), inputs.end());
      if (auto work = on_device(c10d::OpType::COALESCED, all, outputs, "reduce_scatter", outputs,
                                inputs, d.op, d.tensor_factor, d.factor))
        return work;
    }
    std::vector<Staged> outs(outputs.begin(), outputs.end());
    // OpType::COALESCED: REDUCE_SCATTER_TENSOR_COALESCED is newer than torch 2.11.
    return reduce_scatter_into(c10d::OpType::COALESCED, outputs, outs, inputs, opts.reduceOp,
                               opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    check_same(output, input, "alltoall_base");
    if (routed(input))
      if (auto work = on_device(c10d::OpType::ALLTOALL_BASE, {output, input}, {output},
                                "all_to_all", output, input, output_splits, input_splits))
        return work;
    Staged out(output), in(input);
    const auto out_rows = rows(out.dense, output_splits, "output");
    const auto in_rows = rows(in.dense, input_splits, "input");
    const size_t out_row = row_elements(out.dense), in_row = row_elements(in.dense);
    const size_t e = out.dense.element_size();
    std::vector<void*> outs;
    std::vector<const void*> ins;
    std::vector<size_t> out_counts, in_counts;
    size_t out_at = 0, in_at = 0;
    for (int q = 0; q < getSize(); ++q) {
      outs.push_back(static_cast<char*>(out.data()) + out_at * out_row * e);
      ins.push_back(static_cast<char*>(in.data()) + in_at * in_row * e);
      out_counts.push_back(out_rows[q] * out_row);
      in_counts.push_back(in_rows[q] * in_row);
      out_at += out_rows[q];
      in_at += in_rows[q];
    }
    std::vector<at::Tensor> outputs{output};
    return run(
        c10d::OpType::ALLTOALL_BASE, outputs, {out},
        [&](bool async) {
          return std::vector<rc::WorkPtr>{
              comm_->all_to_all(ins, in_counts, outs, out_counts, out.dtype(), async)};
        },
        {in.dense}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    TORCH_CHECK_VALUE(int(outputs.size()) == getSize() && int(inputs.size()) == getSize(),
                      "ringcomm alltoall: needs ", getSize(), " outputs and inputs, got ",
                      outputs.size(), " and ", inputs.size());
    if (routed(inputs[0])) {
      std::vector<at::Tensor> all = outputs;
      all.insert(all.end(), inputs.begin(), inputs.end());
      if (auto work =
              on_device(c10d::OpType::ALLTOALL, all, outputs, "all_to_all_list", outputs, inputs))
        return work;
    }
    std::vector<Staged> outs(outputs.begin(), outputs.end());
    std::vector<at::Tensor> keep;
    std::vector<void*> out_ptrs;
    std::vector<const void*> in_ptrs;
    std::vector<size_t> out_counts, in_counts;
    for (int q = 0; q < getSize(); ++q) {
      check_same(outputs[q], inputs[0], "alltoall");
      check_same(inputs[q], inputs[0], "alltoall");
      check_tensor(inputs[q]);
      keep.push_back(host_dense(inputs[q]));
      in_ptrs.push_back(keep.back().data_ptr());
      in_counts.push_back(size_t(keep.back().numel()));
      out_ptrs.push_back(outs[q].data());
      out_counts.push_back(outs[q].count());
    }
    return run(
        c10d::OpType::ALLTOALL, outputs, outs,
        [&](bool async) {
          return std::vector<rc::WorkPtr>{comm_->all_to_all(
              in_ptrs, in_counts, out_ptrs, out_counts, dtype_of(inputs[0]), async)};
        },
        keep, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    std::vector<at::Tensor> none;
    return run(
        c10d::OpType::BARRIER, none, {},
        [&](bool async) { return std::vector<rc::WorkPtr>{comm_->barrier(async)}; }, {},
        opts.asyncOp);
  }

  // Rank 0 hears from every rank within the timeout, then releases them; a rank that does not
  // report in time is named (all of them with wait_all_ranks).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    const auto timeout = opts.timeout == c10d::kUnsetTimeout ? timeout_ : opts.timeout;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    uint8_t byte = 0;
    if (getRank() != 0) {
      comm_->send(&byte, 1, rc::DType::kUInt8, 0, true);
      auto release = comm_->recv(&byte, 1, rc::DType::kUInt8, 0, true);
      if (!release->wait(seconds_until(deadline)))
        fail(c10::str("ringcomm monitoredBarrier: rank ", getRank(),
                      " was not released by rank 0 "
                      "within ",
                      timeout.count(), " ms"));
      return;
    }
    std::vector<uint8_t> bytes(getSize());
    std::vector<int> missing;
    for (int q = 1; q < getSize(); ++q) {
      auto arrived = comm_->recv(&bytes[q], 1, rc::DType::kUInt8, q, true);
      if (!arrived->wait(seconds_until(deadline))) {
        missing.push_back(q);
        if (!wait_all_ranks) break;
      }
    }
    if (!missing.empty()) {
      std::string ranks;
      for (int q : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
      fail(c10::str("ringcomm monitoredBarrier: rank", missing.size() > 1 ? "s " : " ", ranks,
                    " failed to pass monitoredBarrier in ", timeout.count(), " ms"));
    }
    for (int q = 1; q < getSize(); ++q) comm_->send(&byte, 1, rc::DType::kUInt8, q, true);
  }

  // Tags are not matched out of order: the k-th send from a to b pairs with the k-th receive at b
  // from a, and the signature carries the tag so a pair whose tags differ fails with both named.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    if (routed(one(tensors, "send")))
      if (auto work = on_device(c10d::OpType::SEND, tensors, tensors, "send", tensors[0], dst, tag))
        return work;
    Staged t(one(tensors, "send"));
    return run(c10d::OpType::SEND, tensors, {},
               [&](bool) {
                 return std::vector<rc::WorkPtr>{
                     comm_->send(t.data(), t.count(), t.dtype(), dst, true, uint32_t(tag))};
               },
               {t.dense});
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    if (routed(one(tensors, "recv")))
      if (auto work = on_device(c10d::OpType::RECV, tensors, tensors, "recv", tensors[0], src, tag))
        return work;
    Staged t(one(tensors, "recv"));
    return run(c10d::OpType::RECV, tensors, {t}, [&](bool) {
      return std::vector<rc::WorkPtr>{
          comm_->recv(t.data(), t.count(), t.dtype(), src, true, uint32_t(tag))};
    });
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    // Raises once the device path is joined; before, and for a non-contiguous tensor (which
    // on_device refuses), it stages.
    if (routed(one(tensors, "recv")) && tensors[0].is_contiguous())
      on_device(c10d::OpType::RECVANYSOURCE, tensors, tensors, "recv_any", tensors[0]);
    Staged t(one(tensors, "recv"));
    return run(c10d::OpType::RECVANYSOURCE, tensors, {t}, [&](bool) {
      return std::vector<rc::WorkPtr>{
          comm_->recv_any(t.data(), t.count(), t.dtype(), true, uint32_t(tag))};
    });
  }

  // shutdown() lets queued operations finish; abort() fails them at once and tells the peers.
  // The device route's paths likewise.
  void shutdown() override {
    std::exception_ptr route_error;
    try {
      call_route("close");
    } catch (...) {
      route_error = std::current_exception();
    }
    comm_->close();
    if (route_error) std::rethrow_exception(route_error);
  }
  void abort() override {
    try {
      call_route("abort");
    } catch (...) {  // the core's abort must still reach the peers
    }
    comm_->abort("ProcessGroup.abort() called");
    comm_->close();
  }

  // ringcomm/backend.py's _DeviceRoute, asked where each operation on CUDA tensors runs.
  void set_device_route(py::object route) { route_ = python_held(std::move(route)); }
  py::object device_route() const { return route_ ? *route_ : py::none(); }

 private:
  // What DDP's buckets are: one fused operation per 25 MiB.
  static constexpr size_t kBucketBytes = size_t(25) << 20;

  static double seconds_until(std::chrono::steady_clock::time_point deadline) {
    return std::max(
        0.0, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
  }

  int checked_root(int64_t root) const {
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "ringcomm: root ", root,
                      " out of range for a group of ", getSize());
    return int(root);
  }

  void per_rank(const std::vector<at::Tensor>& list, const at::Tensor& like,
                const char* what) const {
    TORCH_CHECK_VALUE(int(list.size()) == getSize(), "ringcomm ", what, ": needs ", getSize(),
                      " tensors (one per rank), got ", list.size());
    for (const auto& t : list) {
      check_tensor(t);
      check_same(t, like, what);
      TORCH_CHECK_VALUE(t.numel() == like.numel(), "ringcomm ", what, ": tensors of ", t.numel(),
                        " elements where ", like.numel(), " are expected");
    }
  }

  static std::vector<at::Tensor> flatten_all(const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> flat;
    for (const auto& t : ts) flat.push_back(t.reshape(-1));
    return flat;
  }

  static size_t row_elements(const at::Tensor& t) {
    return t.dim() == 0 ? 1 : size_t(t.numel() / std::max<int64_t>(t.size(0), 1));
  }

  std::vector<size_t> rows(const at::Tensor& t, const std::vector<int64_t>& splits,
                           const char* what) const {
    const int n = getSize();
    const int64_t total = t.dim() == 0 ? 1 : t.size(0);
    std::vector<size_t> out(n);
    if (splits.empty()) {
      TORCH_CHECK_VALUE(total % n == 0, "ringcomm alltoall_base: ", what, " of ", total,
                        " rows does not split evenly over ", n, " ranks; pass split sizes");
      std::fill(out.begin(), out.end(), size_t(total / n));
      return out;
    }
    TORCH_CHECK_VALUE(int(splits.size()) == n, "ringcomm alltoall_base: ", what,
                      " split sizes "
                      "need ",
                      n, " entries, got ", splits.size());
    int64_t sum = 0;
    for (int q = 0; q < n; ++q) {
      TORCH_CHECK_VALUE(splits[q] >= 0, "ringcomm alltoall_base: negative split size");
      out[q] = size_t(splits[q]);
      sum += splits[q];
    }
    TORCH_CHECK_VALUE(sum == total, "ringcomm alltoall_base: ", what, " split sizes add up to ",
                      sum, " rows, the tensor has ", total);
    return out;
  }

  // PREMUL_SUM scales the input by its factor here, then sums; other ops map directly.
  rc::ReduceOp premultiply(const c10d::ReduceOp& op, const Staged& t) {
    if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return op_of(op, t.dense);
    // NCCLPreMulSumSupplement: torch 2.11's name, kept as an alias where it was renamed.
    auto* factor = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK_VALUE(factor != nullptr, "ringcomm: PREMUL_SUM without a factor");
    TORCH_CHECK_TYPE(t.dense.is_floating_point(), "ringcomm: PREMUL_SUM needs a floating dtype");
    if (factor->tensor_factor.defined())
      t.dense.mul_(factor->tensor_factor.to(t.dense.device()));
    else
      t.dense.mul_(factor->double_factor);
    return rc::ReduceOp::kSum;
  }

  // Whether an operation on `first` (and its like) asks the device route.
  bool routed(const at::Tensor& first) const { return route_ && first.is_cuda(); }

  // A reduce op as the device route takes it: the core's op code, and PREMUL_SUM's factor (a
  // tensor or a number) with a sum.
  struct DeviceOp {
    int op;
    std::optional<at::Tensor> tensor_factor;
    std::optional<double> factor;
  };
  static DeviceOp device_op(const c10d::ReduceOp& reduce_op, const at::Tensor& t) {
    if (reduce_op.op_ != c10d::ReduceOp::PREMUL_SUM) return {int(op_of(reduce_op, t)), {}, {}};
    auto* f = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(reduce_op.supplement_.get());
    TORCH_CHECK_VALUE(f != nullptr, "ringcomm: PREMUL_SUM without a factor");
    TORCH_CHECK_TYPE(t.is_floating_point(), "ringcomm: PREMUL_SUM needs a floating dtype");
    if (f->tensor_factor.defined()) return {int(rc::ReduceOp::kSum), f->tensor_factor, {}};
    return {int(rc::ReduceOp::kSum), {}, f->double_factor};
  }

  // An operation on CUDA tensors goes to the device route's `method` (ringcomm/backend.py), which
  // enqueues it on its device path after the work on the caller's current stream and returns the
  // stream it runs on: the Work then completes there, as ProcessGroupNCCL's do. nullptr (no
  // device path reaches every rank) leaves it to the staged path.
  // `tensors`: every tensor it touches; `results`: the Work's.
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> on_device(c10d::OpType type,
                                           const std::vector<at::Tensor>& tensors,
                                           const std::vector<at::Tensor>& results,
                                           const char* method, const Args&... args) {
    for (const at::Tensor& t : tensors) {
      check_tensor(t);
      TORCH_CHECK_VALUE(t.device() == tensors[0].device(), "ringcomm ", c10d::opTypeToString(type),
                        ": tensors on ", tensors[0].device(), " and ", t.device(),
                        "; an operation takes one device");
      // As ProcessGroupNCCL: staging this rank's tensor alone would put it on another channel
      // than its peers'.
      TORCH_CHECK_VALUE(t.is_contiguous(), "ringcomm ", c10d::opTypeToString(type),
                        ": CUDA tensors must be contiguous");
    }
    std::tuple<int64_t, int64_t, int64_t> stream;
    {
      py::gil_scoped_acquire gil;
      try {
        py::object ran = route_->attr(method)(args...);
        if (ran.is_none()) return nullptr;
        stream = ran.cast<std::tuple<int64_t, int64_t, int64_t>>();
      } catch (py::error_already_set& e) {
        const std::string what = c10::str("ringcomm ", c10d::opTypeToString(type), " on ",
                                          tensors[0].device(), ": ", e.what());
        TORCH_CHECK_VALUE(!e.matches(PyExc_ValueError), what);
        TORCH_CHECK_TYPE(!e.matches(PyExc_TypeError), what);
        fail(what);
      }
    }
    return c10::make_intrusive<DeviceWork>(
        getRank(), type, results,
        c10::Stream::unpack3(std::get<0>(stream), c10::DeviceIndex(std::get<1>(stream)),
                             c10::DeviceType(std::get<2>(stream))));
  }

  static bool device_routed(c10d::OpType type) {
    switch (type) {
      case c10d::OpType::ALLREDUCE:
      case c10d::OpType::ALLREDUCE_COALESCED:
      case c10d::OpType::BROADCAST:
      case c10d::OpType::ALLGATHER:
      case c10d::OpType::_ALLGATHER_BASE:
      case c10d::OpType::ALLGATHER_COALESCED:
      case c10d::OpType::_REDUCE_SCATTER_BASE:
      case c10d::OpType::COALESCED:
      case c10d::OpType::REDUCE:
      case c10d::OpType::GATHER:
      case c10d::OpType::SCATTER:
      case c10d::OpType::ALLTOALL_BASE:
      case c10d::OpType::ALLTOALL:
      case c10d::OpType::REDUCE_SCATTER:
      case c10d::OpType::SEND:
      case c10d::OpType::RECV:
        return true;
      default:
        return false;
    }
  }

  // Tells the device route that `type` is staged, if any of `results` is a CUDA tensor.
  void note_staged(c10d::OpType type, const std::vector<at::Tensor>& results) {
    if (!route_ || !python_running()) return;
    auto cuda = std::find_if(results.begin(), results.end(),
                             [](const at::Tensor& t) { return t.is_cuda(); });
    if (cuda == results.end()) return;
    py::gil_scoped_acquire gil;
    route_->attr("staged")(c10d::opTypeToString(type), cuda->device().str());
  }

  // Calls the device route's `method` (close, abort) where there is one and Python runs.
  void call_route(const char* method) {
    if (!route_ || !python_running()) return;
    py::gil_scoped_acquire gil;
    route_->attr(method)();
  }

  // Issues the core operations of one torch op. `async` false (torch's async_op=False, which
  // waits right after) runs them on the caller's thread when nothing is queued, as a blocking
  // core call does: no hand-off to the progress thread and back.
  c10::intrusive_ptr<RingcommWork> run(c10d::OpType type, const std::vector<at::Tensor>& results,
                                       const std::vector<Staged>& outputs,
                                       const std::function<std::vector<rc::WorkPtr>(bool)>& issue,
                                       std::vector<at::Tensor> keep = {}, bool async = true) {
    auto work = c10::make_intrusive<RingcommWork>(getRank(), type, comm_, results);
    // An operation the route carries is staged only where no device path is, which the paths
    // log; any other is logged here.
    if (!device_routed(type)) note_staged(type, results);
    std::vector<rc::WorkPtr> ops;
    try {
      ops = issue(async || comm_->on_progress_thread());
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK_VALUE(false, "ringcomm ", c10d::opTypeToString(type), ": ", e.what());
    } catch (const rc::Error& e) {
      fail(c10::str("ringcomm ", c10d::opTypeToString(type), ": ", e.what()));
    }
    for (const Staged& s : outputs) keep.push_back(s.dense);
    work->track(std::move(ops), copy_back(outputs), std::move(keep));
    return work;
  }

  // per_rank[q][i] receives rank q's inputs[i]: the coalesced all-gather writes each in place.
  c10::intrusive_ptr<c10d::Work> gather_lists(c10d::OpType type,
                                              const std::vector<std::vector<at::Tensor>>& per_rank,
                                              const std::vector<at::Tensor>& inputs,
                                              std::vector<at::Tensor> results, bool async) {
    TORCH_CHECK_VALUE(int(per_rank.size()) == getSize(),
                      "ringcomm allgather: needs one output "
                      "list per rank (",
                      getSize(), "), got ", per_rank.size());
    std::vector<Staged> ins(inputs.begin(), inputs.end()), staged;
    std::vector<rc::Communicator::BufferRef> in_refs;
    for (const Staged& i : ins) in_refs.push_back({i.data(), i.count(), i.dtype()});
    std::vector<std::vector<rc::Communicator::BufferRef>> out_refs(getSize());
    for (int q = 0; q < getSize(); ++q) {
      TORCH_CHECK_VALUE(per_rank[q].size() == ins.size(),
                        "ringcomm allgather: the outputs for "
                        "rank ",
                        q, " hold ", per_rank[q].size(), " tensors for ", ins.size(), " inputs");
      for (size_t i = 0; i < ins.size(); ++i) {
        const at::Tensor& out = per_rank[q][i];
        check_same(out, ins[i].dense, "allgather");
        TORCH_CHECK_VALUE(out.numel() == ins[i].dense.numel(),
                          "ringcomm allgather: an output "
                          "of ",
                          out.numel(), " elements for an input of ", ins[i].dense.numel());
        staged.emplace_back(out);
        out_refs[q].push_back({staged.back().data(), staged.back().count(), staged.back().dtype()});
      }
    }
    return run(
        type, results, staged,
        [&](bool async) {
          return std::vector<rc::WorkPtr>{
              comm_->all_gather_coalesced(out_refs, in_refs, kBucketBytes, async)};
        },
        denses(ins), async);
  }

  // outputs[i] holds every rank's inputs[i], back to back.
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor(c10d::OpType type,
                                                       std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       bool async) {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "ringcomm allgather: ", outputs.size(),
                      " outputs for ", inputs.size(), " inputs");
    std::vector<Staged> outs(outputs.begin(), outputs.end()), ins(inputs.begin(), inputs.end());
    for (size_t i = 0; i < outs.size(); ++i) {
      check_same(outputs[i], inputs[i], "allgather_into_tensor");
      TORCH_CHECK_VALUE(outs[i].count() == ins[i].count() * size_t(getSize()),
                        "ringcomm "
                        "allgather_into_tensor: output has ",
                        outs[i].count(),
                        " elements, "
                        "expected world size x input = ",
                        ins[i].count() * getSize());
    }
    return run(
        type, outputs, outs,
        [&](bool async) {
          std::vector<rc::WorkPtr> ops;
          for (size_t i = 0; i < outs.size(); ++i)
            ops.push_back(comm_->all_gather(outs[i].data(), ins[i].data(), ins[i].count(),
                                            ins[i].dtype(), async));
          return ops;
        },
        denses(ins), async);
  }

  // outputs[i] receives this rank's block of inputs[i] reduced over all ranks.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_into(c10d::OpType type,
                                                     std::vector<at::Tensor>& results,
                                                     std::vector<Staged> outs,
                                                     const std::vector<at::Tensor>& inputs,
                                                     const c10d::ReduceOp& reduce_op, bool async) {
    std::vector<Staged> ins(inputs.begin(), inputs.end());
    std::vector<rc::ReduceOp> ops;
    for (size_t i = 0; i < outs.size(); ++i) {
      check_same(outs[i].dense, ins[i].dense, "reduce_scatter");
      TORCH_CHECK_VALUE(ins[i].count() == outs[i].count() * size_t(getSize()),
                        "ringcomm "
                        "reduce_scatter: input has ",
                        ins[i].count(),
                        " elements, expected "
                        "world size x output = ",
                        outs[i].count() * getSize());
      // PREMUL_SUM scales a copy: the input is not the caller's to change.
      if (reduce_op.op_ == c10d::ReduceOp::PREMUL_SUM) ins[i].dense = ins[i].dense.clone();
      ops.push_back(premultiply(reduce_op, ins[i]));
    }
    return run(
        type, results, outs,
        [&](bool async) {
          std::vector<rc::WorkPtr> works;
          for (size_t i = 0; i < outs.size(); ++i)
            works.push_back(comm_->reduce_scatter(outs[i].data(), ins[i].data(), outs[i].count(),
                                                  outs[i].dtype(), ops[i], async));
          return works;
        },
        denses(ins), async);
  }

  std::shared_ptr<rc::Communicator> comm_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<py::object> route_;
};

void release_capsule(PyObject* capsule) {
  delete static_cast<std::shared_ptr<rc::Communicator>*>(
      PyCapsule_GetPointer(capsule, rc::kCommunicatorCapsule));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringcomm's c10d::Backend, built against the installed torch";
  m.def("tensor_lists", &tensor_lists, py::arg("items"), py::arg("device") = "cpu");
  m.def("bytes_staged", [] { return uint64_t(bytes_staged); });
  m.def("all_reduce_tensor", &all_reduce_tensor, py::arg("comm"), py::arg("tensor"), py::arg("op"),
        py::arg("algorithm"));
  py::class_<RingcommBackend, c10d::Backend, c10::intrusive_ptr<RingcommBackend>>(m,
                                                                                  "RingcommBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             return c10::make_intrusive<RingcommBackend>(store, rank, size, timeout);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_device_route", &RingcommBackend::set_device_route, py::arg("route"))
      .def("device_route", &RingcommBackend::device_route)
      // The core communicator, for ringcomm.Communicator.from_capsule (the DDP hooks).
      .def("communicator_capsule", [](const RingcommBackend& b) {
        auto* held = new std::shared_ptr<rc::Communicator>(b.communicator());
        PyObject* capsule = PyCapsule_New(held, rc::kCommunicatorCapsule, release_capsule);
        if (capsule == nullptr) {
          delete held;
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::object>(capsule);
      });
}
