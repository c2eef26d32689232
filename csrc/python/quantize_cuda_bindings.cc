// Bindings of the CUDA 8-bit quantization kernels (kernels/cuda/quantize.h) into
// ringcomm._C_cuda: raw device addresses and a stream handle, as cuda_bindings.cc's kernels take.
#include <pybind11/pybind11.h>

#include "kernels/cuda/quantize.h"
#include "python/kernel_args.h"

namespace py = pybind11;

namespace ringcomm {

void bind_quantize_cuda(py::module_& m) {
  using G = py::call_guard<py::gil_scoped_release>;
  using python::address;
  auto stream_of = [](uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); };
  m.def(
      "quantize_ranges",
      [stream_of](int dtype, uintptr_t grad, uintptr_t residual, size_t n, size_t chunk,
                  uintptr_t ranges, uintptr_t stream) {
        cuda::quantize_ranges(checked_dtype(dtype), address(grad), address(residual), n, chunk,
                              static_cast<float*>(address(ranges)), stream_of(stream));
      },
      G());
  m.def(
      "quantize",
      [stream_of](int dtype, uintptr_t source, uintptr_t error, size_t n, size_t chunk,
                  uintptr_t ranges, uint32_t levels, bool stochastic, uint64_t key, uintptr_t codes,
                  uintptr_t stream) {
        cuda::quantize(checked_dtype(dtype), address(source), address(error), n, chunk,
                       static_cast<const float*>(address(ranges)), levels,
                       stochastic ? quantize::Rounding::kStochastic : quantize::Rounding::kNearest,
                       key, static_cast<uint8_t*>(address(codes)), stream_of(stream));
      },
      G());
  m.def(
      "dequantize_mean",
      [stream_of](uintptr_t sums, size_t n, size_t chunk, uintptr_t ranges, uint32_t levels,
                  int world, int out_dtype, uintptr_t out, uintptr_t stream) {
        cuda::dequantize_mean(static_cast<const uint8_t*>(address(sums)), n, chunk,
                              static_cast<const float*>(address(ranges)), levels, world,
                              checked_dtype(out_dtype), address(out), stream_of(stream));
      },
      G());
}

}  // namespace ringcomm
