// Bindings of the compression kernels (top-k) into ringcomm._C.
#include <pybind11/pybind11.h>

#include "kernels/cpu/topk.h"

namespace py = pybind11;

namespace ringcomm {

void bind_compress(py::module_& m) {
  using G = py::call_guard<py::gil_scoped_release>;
  auto ptr = [](uintptr_t address) { return reinterpret_cast<void*>(address); };
  m.def("topk_kernel",
        [ptr](int dt, uintptr_t data, size_t n, size_t k, uintptr_t indices, uintptr_t values) {
          cpu::topk(checked_dtype(dt), ptr(data), n, k, static_cast<int32_t*>(ptr(indices)),
                    ptr(values));
        }, G());
  m.def("topk_with_residual_kernel",
        [ptr](int dt, uintptr_t grad, uintptr_t residual, size_t n, size_t k, uintptr_t indices,
              uintptr_t values, int value_dt) {
          cpu::topk_with_residual(checked_dtype(dt), ptr(grad), ptr(residual), n, k,
                                  static_cast<int32_t*>(ptr(indices)), ptr(values),
                                  checked_dtype(value_dt));
        }, G());
}

}  // namespace ringcomm
