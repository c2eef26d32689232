// ringcomm._C_cuda: the CUDA kernels on raw device addresses and a stream handle (an integer, as
// torch.cuda.Stream.cuda_stream gives it; 0 is the legacy default stream). Every call only
// enqueues work on the stream; none synchronises the host. ringcomm/cuda.py is the torch-side
// wrapper. Errors: ValueError for bad arguments, ringcomm.RingcommError for CUDA failures.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>
#include <dlfcn.h>

#include "device/executor.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/pack.h"
#include "kernels/cuda/reduce.h"
#include "kernels/cuda/topk.h"
#include "python/kernel_args.h"
#include "transport/cuda_ipc/ipc_transport.h"
#include "transport/nccl/nccl_transport.h"

namespace py = pybind11;

namespace ringcomm {

void bind_quantize_cuda(py::module_& m);  // quantize_cuda_bindings.cc

namespace {

using python::address;
using python::pack_list;
using python::scaling;
using python::Words;

cudaStream_t stream_of(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// A device transport and the executor running collectives over it: what ringcomm/nccl.py and
// ringcomm/device.py hold.
class DeviceCommunicator {
 public:
  DeviceCommunicator(std::unique_ptr<device::DeviceTransport> transport, size_t round_bytes)
      : transport_(std::move(transport)), executor_(*transport_, round_bytes) {}

  device::DeviceTransport& transport() { return *transport_; }

  void all_reduce(uintptr_t data, size_t count, int dtype, int op, int algo, uintptr_t stream) {
    const DType d = checked_dtype(dtype);
    const ReduceOp o = checked_op(op, d);
    if (Algorithm(algo) == Algorithm::kNccl) {
      auto* nccl = dynamic_cast<nccl::NcclTransport*>(transport_.get());
      RC_CHECK_ARG(nccl != nullptr, "algorithm nccl needs the NCCL transport, not ",
                   transport_->name());
      nccl->all_reduce_by_nccl(address(data), count, d, o, stream_of(stream));
      return;
    }
    executor_.all_reduce(address(data), count, d, o, Algorithm(algo), stream_of(stream));
  }
  void all_gather(uintptr_t data, const std::vector<size_t>& counts, int dtype, uintptr_t stream) {
    executor_.all_gather(address(data), counts, checked_dtype(dtype), stream_of(stream));
  }
  void all_to_all(uintptr_t data, size_t block, int dtype, uintptr_t stream) {
    executor_.all_to_all(address(data), block, checked_dtype(dtype), stream_of(stream));
  }
  void reduce_scatter(uintptr_t data, size_t block, int dtype, int op, uintptr_t stream) {
    const DType d = checked_dtype(dtype);
    executor_.reduce_scatter(address(data), block, d, checked_op(op, d), stream_of(stream));
  }
  // `kind`: the collective the exchange carries out ("scatter", "gather", "all_to_all"), with its
  // root (-1 for none) and count, for the ranks to agree on. Transfers: (peer, offset, count).
  void exchange(uintptr_t source, uintptr_t data,
                const std::vector<std::tuple<int, size_t, size_t>>& sends,
                const std::vector<std::tuple<int, size_t, size_t>>& recvs, int dtype,
                const std::string& kind, int root, size_t count, uintptr_t stream) {
    static const std::pair<const char*, Collective> kinds[] = {
        {"scatter", Collective::kScatter},
        {"gather", Collective::kGather},
        {"all_to_all", Collective::kAllToAll}};
    Collective coll = Collective::kBarrier;
    for (const auto& [name, c] : kinds)
      if (kind == name) coll = c;
    RC_CHECK_ARG(coll != Collective::kBarrier, "no exchange carries out ", kind);
    auto transfers = [](const std::vector<std::tuple<int, size_t, size_t>>& list) {
      std::vector<Transfer> out;
      for (const auto& [peer, offset, n] : list) out.push_back({peer, offset, n});
      return out;
    };
    const DType d = checked_dtype(dtype);
    executor_.exchange(
        address(source), address(data), transfers(sends), transfers(recvs), d,
        Signature{coll, d, ReduceOp::kSum, Algorithm::kAuto, false, root, 0, count, 0},
        stream_of(stream));
  }
  void send(uintptr_t data, size_t count, int dtype, int peer, uint32_t tag, uintptr_t stream) {
    executor_.send(address(data), count, checked_dtype(dtype), peer, tag, stream_of(stream));
  }
  void recv(uintptr_t data, size_t count, int dtype, int peer, uint32_t tag, uintptr_t stream) {
    executor_.recv(address(data), count, checked_dtype(dtype), peer, tag, stream_of(stream));
  }

 private:
  std::unique_ptr<device::DeviceTransport> transport_;
  device::Executor executor_;
};

// The devices this process sees, or why it sees none (no driver, no device): ringcomm/cuda.py
// turns the reason into its skip and error messages.
py::tuple device_count() {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear it: the process may still load a driver later
    // Without any driver the runtime says "insufficient driver": name the missing library.
    if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
      dlclose(driver);
    } else {
      return py::make_tuple(0, std::string("no CUDA driver: ") + dlerror());
    }
    return py::make_tuple(
        0, std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
  }
  return py::make_tuple(count, count ? "" : "no CUDA device");
}

}  // namespace
}  // namespace ringcomm

PYBIND11_MODULE(_C_cuda, m) {
  using namespace ringcomm;
  using G = py::call_guard<py::gil_scoped_release>;
  // ringcomm::Error as ringcomm._C's RingcommError or its kind's subclass, so callers catch the
  // same classes for both modules. The tuple lives as long as the interpreter (held for good).
  static PyObject* error_types =
      py::object(py::module_::import("ringcomm._C").attr("error_types")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(PyTuple_GET_ITEM(error_types, int(e.kind())), e.what());
    }
  });

  m.def("device_count", &device_count, "(number of CUDA devices, reason when there are none)");
  // A stream of its own for the device path, never destroyed: torch's streams come from a pool
  // shared round robin by the whole process, where the stream of a send could be that of the
  // receive it waits for; and torch's caching allocator records events on a stream whenever a
  // tensor once used there is freed, which may be after the path has closed.
  m.def("new_stream", [](int device) {
    cuda::DeviceScope scope(device);
    cudaStream_t stream = nullptr;
    RC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return reinterpret_cast<uintptr_t>(stream);
  });
  m.def("runtime_version", [] {
    int version = 0;
    RC_CUDA_CHECK(cudaRuntimeGetVersion(&version));
    return version;
  });

  m.def(
      "reduce",
      [](int dtype, int op, uintptr_t out, uintptr_t a, uintptr_t b, size_t n, uintptr_t stream) {
        const DType t = checked_dtype(dtype);
        cuda::reduce(t, checked_op(op, t), address(out), address(a), address(b), n,
                     stream_of(stream));
      },
      G());
  m.def(
      "divide",
      [](int dtype, uintptr_t x, size_t n, int divisor, uintptr_t stream) {
        cuda::divide(checked_dtype(dtype), address(x), n, divisor, stream_of(stream));
      },
      G());

  // The lists cross as buffers of uint64 (ringcomm/cuda.py's, read by the torch module's
  // tensor_lists where it is built): read with the GIL held, launched without it.
  m.def("pack",
        [](int dtype, const py::buffer& ptrs, const py::buffer& counts, size_t begin, size_t end,
           uintptr_t dst, int dst_dtype, int scale_kind, double factor, uintptr_t stream) {
          const kernels::PackList list =
              pack_list(dtype, Words(ptrs, "addresses"), Words(counts, "counts"));
          py::gil_scoped_release release;
          cuda::pack(list, begin, end, address(dst), checked_dtype(dst_dtype),
                     scaling(scale_kind, factor), stream_of(stream));
        });
  m.def("unpack", [](uintptr_t src, int src_dtype, int dtype, const py::buffer& ptrs,
                     const py::buffer& counts, size_t begin, size_t end, int scale_kind,
                     double factor, uintptr_t stream) {
    const kernels::PackList list =
        pack_list(dtype, Words(ptrs, "addresses"), Words(counts, "counts"));
    py::gil_scoped_release release;
    cuda::unpack(address(src), checked_dtype(src_dtype), list, begin, end,
                 scaling(scale_kind, factor), stream_of(stream));
  });

  m.def("topk_workspace_bytes", &cuda::topk_workspace_bytes);
  m.def(
      "topk",
      [](int dtype, uintptr_t data, size_t n, size_t k, uintptr_t indices, uintptr_t values,
         uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
        cuda::topk(checked_dtype(dtype), address(data), n, k,
                   static_cast<int32_t*>(address(indices)), address(values), address(workspace),
                   workspace_bytes, stream_of(stream));
      },
      G());
  m.def(
      "topk_with_residual",
      [](int dtype, uintptr_t grad, uintptr_t residual, size_t n, size_t k, uintptr_t indices,
         uintptr_t values, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
        cuda::topk_with_residual(checked_dtype(dtype), address(grad), address(residual), n, k,
                                 static_cast<int32_t*>(address(indices)), address(values),
                                 address(workspace), workspace_bytes, stream_of(stream));
      },
      G());
  bind_quantize_cuda(m);
  m.def(
      "scatter_add",
      [](int dtype, uintptr_t out, size_t n, uintptr_t indices, uintptr_t values, size_t k,
         uintptr_t bad_index, uintptr_t stream) {
        cuda::scatter_add(checked_dtype(dtype), address(out), n,
                          static_cast<const int32_t*>(address(indices)), address(values), k,
                          static_cast<int*>(address(bad_index)), stream_of(stream));
      },
      G());

  // NCCL (transport/nccl/), from the library at `library` (ringcomm/nccl.py finds it).
  m.def("nccl_unique_id", [](const std::string& library) {
    const nccl::Library& lib = nccl::Library::load(library);
    nccl::UniqueId id;
    {
      py::gil_scoped_release release;
      lib.check(lib.get_unique_id(&id), "ncclGetUniqueId");
    }
    return py::bytes(id.internal, sizeof(id.internal));
  });
  m.def(
      "nccl_communicator",
      [](const std::string& library, const py::bytes& id, int rank, int size, int device) {
        const std::string raw = id;
        RC_CHECK_ARG(raw.size() == nccl::kUniqueIdBytes, "an NCCL unique id has ",
                     nccl::kUniqueIdBytes, " bytes, got ", raw.size());
        nccl::UniqueId uid;
        std::copy(raw.begin(), raw.end(), uid.internal);
        const nccl::Library& lib = nccl::Library::load(library);
        py::gil_scoped_release release;  // joining blocks until every rank has joined
        // Over messages, windows (and their rounds) play no part.
        return std::make_unique<DeviceCommunicator>(
            std::make_unique<nccl::NcclTransport>(lib, uid, rank, size, device), 0);
      },
      py::arg("library"), py::arg("unique_id"), py::arg("rank"), py::arg("size"),
      py::arg("device"));

  // CUDA IPC (transport/cuda_ipc/): (communicator, "") or (None, why every rank refused it).
  // `exchange(bytes) -> list of every rank's bytes` is called with the GIL held.
  m.def(
      "ipc_communicator",
      [](int rank, int size, int device, size_t round_bytes, double timeout_s,
         const py::function& exchange) -> py::tuple {
        ipc::Exchange all = [&exchange](const std::string& mine) {
          py::gil_scoped_acquire acquire;
          std::vector<std::string> out;
          for (const py::handle& item : exchange(py::bytes(mine)))
            out.push_back(std::string(py::reinterpret_borrow<py::bytes>(item)));
          return out;
        };
        std::string refused;
        std::unique_ptr<ipc::IpcTransport> transport;
        {
          py::gil_scoped_release release;
          transport = ipc::IpcTransport::connect(rank, size, device,
                                                 device::Executor::window_bytes(size, round_bytes),
                                                 timeout_s, all, &refused);
        }
        if (!transport) return py::make_tuple(py::none(), refused);
        return py::make_tuple(
            std::make_unique<DeviceCommunicator>(std::move(transport), round_bytes), std::string());
      },
      py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("round_bytes"),
      py::arg("timeout_s"), py::arg("exchange"));
  m.attr("DEVICE_ALGORITHM_CODES") = [] {
    py::dict codes;
    for (Algorithm a :
         {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree, Algorithm::kRecursiveDoubling,
          Algorithm::kNccl, Algorithm::kOneShot, Algorithm::kSharedBuffer})
      codes[algorithm_name(a)] = int(a);
    return codes;
  }();

  // Collectives over a device transport (device/executor.h), enqueued on a stream.
  py::class_<DeviceCommunicator>(m, "DeviceCommunicator")
      .def_property_readonly("transport",
                             [](DeviceCommunicator& c) { return c.transport().name(); })
      .def_property_readonly("rank", [](DeviceCommunicator& c) { return c.transport().rank(); })
      .def_property_readonly("size", [](DeviceCommunicator& c) { return c.transport().size(); })
      .def_property_readonly("device", [](DeviceCommunicator& c) { return c.transport().device(); })
      .def("all_reduce", &DeviceCommunicator::all_reduce, G())
      .def("all_gather", &DeviceCommunicator::all_gather, G())
      .def("reduce_scatter", &DeviceCommunicator::reduce_scatter, G())
      .def("all_to_all", &DeviceCommunicator::all_to_all, G())
      .def("exchange", &DeviceCommunicator::exchange, G())
      .def("send", &DeviceCommunicator::send, G())
      .def("recv", &DeviceCommunicator::recv, G())
      .def(
          "synchronize",
          [](DeviceCommunicator& c, uintptr_t stream, double timeout_s) {
            c.transport().synchronize(stream_of(stream), timeout_s);
          },
          G())
      .def(
          "close", [](DeviceCommunicator& c) { c.transport().close(); }, G())
      .def("abort", [](DeviceCommunicator& c) { c.transport().abort(); }, G());
}
