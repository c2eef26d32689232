// Bindings of the compression kernels (top-k, 8-bit quantization) and of the choices the
// compression hooks make by the cost model, into ringcomm._C.
#include <pybind11/pybind11.h>

#include "algorithms/select.h"
#include "communicator.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/topk.h"

namespace py = pybind11;

namespace ringcomm {

void bind_compress(py::module_& m) {
  using G = py::call_guard<py::gil_scoped_release>;
  auto ptr = [](uintptr_t address) { return reinterpret_cast<void*>(address); };
  m.def(
      "topk_kernel",
      [ptr](int dt, uintptr_t data, size_t n, size_t k, uintptr_t indices, uintptr_t values) {
        cpu::topk(checked_dtype(dt), ptr(data), n, k, static_cast<int32_t*>(ptr(indices)),
                  ptr(values));
      },
      G());
  m.def(
      "topk_with_residual_kernel",
      [ptr](int dt, uintptr_t grad, uintptr_t residual, size_t n, size_t k, uintptr_t indices,
            uintptr_t values, int value_dt) {
        cpu::topk_with_residual(checked_dtype(dt), ptr(grad), ptr(residual), n, k,
                                static_cast<int32_t*>(ptr(indices)), ptr(values),
                                checked_dtype(value_dt));
      },
      G());

  m.def("quantize_chunks", &cpu::quantize_chunks);
  m.def(
      "quantize_ranges_kernel",
      [ptr](int dt, uintptr_t grad, uintptr_t residual, size_t n, size_t chunk, uintptr_t ranges) {
        cpu::quantize_ranges(checked_dtype(dt), ptr(grad), ptr(residual), n, chunk,
                             static_cast<float*>(ptr(ranges)));
      },
      G());
  m.def(
      "quantize_kernel",
      [ptr](int dt, uintptr_t source, uintptr_t error, size_t n, size_t chunk, uintptr_t ranges,
            uint32_t levels, bool stochastic, uint64_t key, uintptr_t codes) {
        cpu::quantize(checked_dtype(dt), ptr(source), ptr(error), n, chunk,
                      static_cast<const float*>(ptr(ranges)), levels,
                      stochastic ? quantize::Rounding::kStochastic : quantize::Rounding::kNearest,
                      key, static_cast<uint8_t*>(ptr(codes)));
      },
      G());
  m.def(
      "dequantize_mean_kernel",
      [ptr](uintptr_t sums, size_t n, size_t chunk, uintptr_t ranges, uint32_t levels, int world,
            int out_dt, uintptr_t out) {
        cpu::dequantize_mean(static_cast<const uint8_t*>(ptr(sums)), n, chunk,
                             static_cast<const float*>(ptr(ranges)), levels, world,
                             checked_dtype(out_dt), ptr(out));
      },
      G());

  // What the compression hooks decide by the fixed link model (LinkModel's defaults, the figures
  // of RINGCOMM_TUNING=off) over the communicator's ranks and hosts: a function of the sizes
  // alone, so the same on every run whatever the probe measured.
  m.def("fixed_all_reduce", [](const Communicator& c, size_t bytes) {
    return std::string(algorithm_name(c.selector().with_model(LinkModel{}).all_reduce(bytes)));
  });
  m.def("fixed_compression_costs",
        [](const Communicator& c, size_t numel, size_t k, int value_dt, int out_dt) {
          const Selector fixed = c.selector().with_model(LinkModel{});
          const size_t out_size = dtype_size(checked_dtype(out_dt));
          const Algorithm dense = fixed.all_reduce(numel * out_size);
          const CompressionCosts costs = compression_costs(
              fixed, numel, k, dtype_size(checked_dtype(value_dt)), out_size, dense);
          return py::make_tuple(costs.sparse, costs.dense, algorithm_name(costs.way));
        });
}

}  // namespace ringcomm
