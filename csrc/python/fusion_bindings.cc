// Bindings of the coalesced collectives and the pack/unpack kernels into ringcomm._C. Buffer lists
// cross as three lists: addresses, element counts and dtype codes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "communicator.h"
#include "kernels/cpu/pack.h"
#include "python/kernel_args.h"

namespace py = pybind11;

namespace ringcomm {
namespace {

using BufferRef = Communicator::BufferRef;
using python::pack_list;
using python::scaling;

std::vector<BufferRef> buffer_refs(const std::vector<uintptr_t>& ptrs,
                                   const std::vector<size_t>& counts,
                                   const std::vector<int>& dtypes) {
  RC_CHECK_ARG(ptrs.size() == counts.size() && ptrs.size() == dtypes.size(),
               "addresses, counts and dtypes differ in length");
  std::vector<BufferRef> refs;
  refs.reserve(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i)
    refs.push_back({reinterpret_cast<void*>(ptrs[i]), counts[i], checked_dtype(dtypes[i])});
  return refs;
}

}  // namespace

void bind_fusion(py::module_& m) {
  using G = py::call_guard<py::gil_scoped_release>;
  m.def("all_reduce_coalesced",
        [](Communicator& c, const std::vector<uintptr_t>& ptrs, const std::vector<size_t>& counts,
           const std::vector<int>& dtypes, int op, size_t bucket_bytes, int float32_wire,
           double prescale, bool async) {
          // The op code alone here; whether each buffer's dtype allows it is checked per buffer.
          RC_CHECK_ARG(op >= 0 && op < kNumReduceOps, "unsupported reduce op code ", op);
          ReduceOp rop = ReduceOp(op);
          return c.all_reduce_coalesced(buffer_refs(ptrs, counts, dtypes), rop, bucket_bytes,
                                        {checked_dtype(float32_wire), prescale}, async);
        }, G());
  m.def("broadcast_coalesced",
        [](Communicator& c, const std::vector<uintptr_t>& ptrs, const std::vector<size_t>& counts,
           const std::vector<int>& dtypes, int root, size_t bucket_bytes, bool async) {
          return c.broadcast_coalesced(buffer_refs(ptrs, counts, dtypes), root, bucket_bytes,
                                       async);
        }, G());
  m.def("all_gather_coalesced",
        [](Communicator& c, const std::vector<std::vector<uintptr_t>>& out_ptrs,
           const std::vector<uintptr_t>& ptrs, const std::vector<size_t>& counts,
           const std::vector<int>& dtypes, size_t bucket_bytes, bool async) {
          // Outputs are described by the inputs' counts and dtypes; the Python layer checks shapes.
          std::vector<std::vector<BufferRef>> outputs;
          for (const auto& rank_ptrs : out_ptrs)
            outputs.push_back(buffer_refs(rank_ptrs, counts, dtypes));
          return c.all_gather_coalesced(outputs, buffer_refs(ptrs, counts, dtypes), bucket_bytes,
                                        async);
        }, G());

  // Kernels, exposed for tests: fused elements [begin, end) of the buffers <-> dst / src.
  m.def("pack_kernel",
        [](int dtype, const std::vector<uintptr_t>& ptrs, const std::vector<size_t>& counts,
           size_t begin, size_t end, uintptr_t dst, int dst_dtype, int scale_kind, double factor) {
          math::Scaling s = scaling(scale_kind, factor);
          cpu::check_conversion(checked_dtype(dtype), checked_dtype(dst_dtype), s);
          cpu::pack(pack_list(dtype, ptrs, counts), begin, end, reinterpret_cast<void*>(dst),
                    DType(dst_dtype), s);
        }, G());
  m.def("unpack_kernel",
        [](uintptr_t src, int src_dtype, int dtype, const std::vector<uintptr_t>& ptrs,
           const std::vector<size_t>& counts, size_t begin, size_t end, int scale_kind,
           double factor) {
          math::Scaling s = scaling(scale_kind, factor);
          cpu::check_conversion(checked_dtype(src_dtype), checked_dtype(dtype), s);
          cpu::unpack(reinterpret_cast<const void*>(src), DType(src_dtype),
                      pack_list(dtype, ptrs, counts), begin, end, s);
        }, G());
}

}  // namespace ringcomm
