// Bindings of the coalesced collectives and the pack/unpack kernels into ringcomm._C. A list of
// buffers crosses as three buffers of uint64 (fusion.BufferList's): addresses, element counts and
// dtype codes, read in place (converting three Python lists of a thousand ints would weigh on
// every call).
#include <algorithm>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "algorithms/algorithms.h"
#include "algorithms/reduction_order.h"
#include "algorithms/stream_plan.h"
#include "communicator.h"
#include "kernels/cpu/pack.h"
#include "python/kernel_args.h"

namespace py = pybind11;

namespace ringcomm {
namespace {

using BufferRef = Communicator::BufferRef;
using python::pack_list;
using python::scaling;
using python::Words;

std::vector<BufferRef> buffer_refs(const py::buffer& ptrs_buffer, const py::buffer& counts_buffer,
                                   const py::buffer& dtypes_buffer) {
  const Words ptrs(ptrs_buffer, "addresses"), counts(counts_buffer, "counts"),
      dtypes(dtypes_buffer, "dtypes");
  RC_CHECK_ARG(ptrs.size() == counts.size() && ptrs.size() == dtypes.size(),
               "addresses, counts and dtypes differ in length");
  std::vector<BufferRef> refs;
  refs.reserve(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) {
    RC_CHECK_ARG(dtypes[i] <= uint64_t(INT32_MAX), "unknown dtype code ", dtypes[i]);
    refs.push_back({reinterpret_cast<void*>(uintptr_t(ptrs[i])), size_t(counts[i]),
                    checked_dtype(int(dtypes[i]))});
  }
  return refs;
}

}  // namespace

void bind_fusion(py::module_& m) {
  using G = py::call_guard<py::gil_scoped_release>;
  // The step lists of the all-reduce algorithms and the orders derived from them
  // (algorithms/schedule.h, reduction_order.h), for tests and docs.
  m.def("schedule", [](int algo, int n, int rank) {
    RC_CHECK_ARG(n >= 1 && rank >= 0 && rank < n, "rank ", rank, " of ", n);
    return all_reduce_schedule(Algorithm(algo), n, rank, 0, 1).schedule.describe();
  });
  // The groups in which the stream-ordered (NCCL) executor posts rank `rank`'s messages
  // (stream_plan.h) for `count` elements in slices of `slice`: per group, its messages as
  // ("send" or "recv", peer, first element, elements), and whether a reduction follows. Of
  // all_reduce by `algo`, or with `all_gather` of the ring all-gather over Segments(count, n).
  m.def(
      "stream_groups",
      [](int algo, int n, int rank, size_t count, size_t slice, bool all_gather) {
        RC_CHECK_ARG(n >= 1 && rank >= 0 && rank < n && slice > 0, "rank ", rank, " of ", n);
        const AllReduceSchedule s =
            all_gather
                ? AllReduceSchedule{ring_all_gather_schedule(n, rank), Segments(count, n), slice}
                : all_reduce_schedule(Algorithm(algo), n, rank, count, 1);
        py::list out;
        for (const StreamGroup& g : stream_groups(s.schedule, s.blocks, slice)) {
          py::list messages;
          for (const StreamMessage& m : g.messages) {
            const Step& step = s.schedule.steps[size_t(m.step)];
            const size_t block = s.blocks.count(step.block),
                         begin = std::min(block, m.slice * slice);
            messages.append(py::make_tuple(m.send ? "send" : "recv", m.peer,
                                           s.blocks.offset(step.block) + begin,
                                           std::min(slice, block - begin)));
          }
          out.append(py::make_tuple(messages, g.reduce));
        }
        return out;
      },
      py::arg("algorithm"), py::arg("n"), py::arg("rank"), py::arg("count"), py::arg("slice"),
      py::arg("all_gather") = false);
  // The orders of a buffer of `count` elements, as runs of elements that share one: (elements,
  // "((0 1) 2)" for (x0 op x1) op x2); `hosts` for the hierarchical algorithm.
  m.def(
      "reduction_orders",
      [](int algo, int n, size_t count, const std::vector<std::vector<int>>& hosts) {
        ReductionOrders orders(n, HostLayout{hosts});
        orders.require(Algorithm(algo));
        std::vector<OrderedRange> ranges;
        orders.ranges(Algorithm(algo), count, 0, ranges);
        std::vector<std::pair<size_t, std::string>> out;
        for (const OrderedRange& r : ranges)
          out.emplace_back(r.count, orders.program(r.program).describe());
        return out;
      },
      py::arg("algorithm"), py::arg("n"), py::arg("count"),
      py::arg("hosts") = std::vector<std::vector<int>>{});
  // The buffers are read with the GIL held, the collective runs without it.
  m.def("all_reduce_coalesced",
        [](Communicator& c, const py::buffer& ptrs, const py::buffer& counts,
           const py::buffer& dtypes, int op, size_t bucket_bytes, int float32_wire, double prescale,
           bool async) {
          // The op code alone here; whether each buffer's dtype allows it is checked per buffer.
          RC_CHECK_ARG(op >= 0 && op < kNumReduceOps, "unsupported reduce op code ", op);
          const std::vector<BufferRef> refs = buffer_refs(ptrs, counts, dtypes);
          py::gil_scoped_release nogil;
          return c.all_reduce_coalesced(refs, ReduceOp(op), bucket_bytes,
                                        {checked_dtype(float32_wire), prescale}, async);
        });
  m.def("broadcast_coalesced",
        [](Communicator& c, const py::buffer& ptrs, const py::buffer& counts,
           const py::buffer& dtypes, int root, size_t bucket_bytes, bool async) {
          const std::vector<BufferRef> refs = buffer_refs(ptrs, counts, dtypes);
          py::gil_scoped_release nogil;
          return c.broadcast_coalesced(refs, root, bucket_bytes, async);
        });
  m.def("all_gather_coalesced",
        [](Communicator& c, const std::vector<py::buffer>& out_ptrs, const py::buffer& ptrs,
           const py::buffer& counts, const py::buffer& dtypes, size_t bucket_bytes, bool async) {
          // Outputs are described by the inputs' counts and dtypes; the Python layer checks shapes.
          std::vector<std::vector<BufferRef>> outputs;
          for (const py::buffer& rank_ptrs : out_ptrs)
            outputs.push_back(buffer_refs(rank_ptrs, counts, dtypes));
          const std::vector<BufferRef> inputs = buffer_refs(ptrs, counts, dtypes);
          py::gil_scoped_release nogil;
          return c.all_gather_coalesced(outputs, inputs, bucket_bytes, async);
        });

  // Kernels, exposed for tests: fused elements [begin, end) of the buffers <-> dst / src.
  m.def(
      "pack_kernel",
      [](int dtype, const std::vector<uintptr_t>& ptrs, const std::vector<size_t>& counts,
         size_t begin, size_t end, uintptr_t dst, int dst_dtype, int scale_kind, double factor) {
        math::Scaling s = scaling(scale_kind, factor);
        cpu::check_conversion(checked_dtype(dtype), checked_dtype(dst_dtype), s);
        cpu::pack(pack_list(dtype, ptrs, counts), begin, end, reinterpret_cast<void*>(dst),
                  DType(dst_dtype), s);
      },
      G());
  m.def(
      "unpack_kernel",
      [](uintptr_t src, int src_dtype, int dtype, const std::vector<uintptr_t>& ptrs,
         const std::vector<size_t>& counts, size_t begin, size_t end, int scale_kind,
         double factor) {
        math::Scaling s = scaling(scale_kind, factor);
        cpu::check_conversion(checked_dtype(src_dtype), checked_dtype(dtype), s);
        cpu::unpack(reinterpret_cast<const void*>(src), DType(src_dtype),
                    pack_list(dtype, ptrs, counts), begin, end, s);
      },
      G());
  // The two passes an all-reduce of a list makes over the caller's memory, without the
  // exchange, for the benchmark's layout limit (python -m ringcomm.bench --coll
  // all_reduce_coalesced --floor): every element read (packed into a staging buffer one
  // RINGCOMM_FUSION_SLICE_BYTES message at a time, as the pipeline packs), then every element
  // written (unpacked from it). The buffers end up holding what the staging buffer held: a
  // benchmark's buffers only.
  m.def("layout_passes", [](const py::buffer& ptrs, const py::buffer& counts,
                            const py::buffer& dtypes) {
    const std::vector<BufferRef> refs = buffer_refs(ptrs, counts, dtypes);
    RC_CHECK_ARG(!refs.empty(), "layout_passes needs at least one buffer");
    cpu::PackList list(refs[0].dtype);
    for (const BufferRef& r : refs) {
      RC_CHECK_ARG(r.dtype == list.dtype(), "layout_passes needs buffers of one dtype");
      list.add(r.data, r.count);
    }
    const size_t step =
        std::max<size_t>(1, AlgorithmTuning::get().fusion_slice_bytes / dtype_size(list.dtype()));
    std::vector<char> staging(step * dtype_size(list.dtype()));
    py::gil_scoped_release nogil;
    for (size_t b = 0; b < list.count(); b += step)
      cpu::pack(list, b, std::min(list.count(), b + step), staging.data(), list.dtype(), {});
    for (size_t b = 0; b < list.count(); b += step)
      cpu::unpack(staging.data(), list.dtype(), list, b, std::min(list.count(), b + step), {});
  });
}

}  // namespace ringcomm
