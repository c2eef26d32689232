// CUDA pack/unpack: every part of a pack or unpack (one buffer's share of the fused range) is a
// conversion from one device address to another. Parts go to the kernel in batches carried in its
// parameters (no descriptor upload, no host synchronisation): block row y of a launch converts
// part y, its blocks striding over that part's elements. So fusing 1000 small tensors costs
// 1000 / kPartsPerLaunch launches, not 1000.
#include "kernels/cuda/pack.h"

#include <algorithm>

#include "kernels/cuda/check.h"
#include "kernels/dispatch.h"
#include "kernels/pack_math.h"

namespace ringcomm {
namespace cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr int kPartsPerLaunch = 128;  // 128 x 24 bytes of parameters, well under the 4 KiB limit
constexpr unsigned kBlocksPerPart = 64;

struct Part {
  const void* in;
  void* out;
  size_t count;
};

struct Batch {
  Part part[kPartsPerLaunch];
};

template <math::ScaleKind kKind, typename In, typename Out>
__global__ void convert_kernel(Batch batch, math::ConvertType<In, Out> factor) {
  const Part part = batch.part[blockIdx.y];
  const In* in = static_cast<const In*>(part.in);
  Out* out = static_cast<Out*>(part.out);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < part.count; i += stride)
    out[i] = math::convert_one<kKind, In, Out>(in[i], factor);
}

template <typename In, typename Out>
void launch(const Batch& batch, int parts, size_t longest, Scaling scaling, cudaStream_t stream) {
  const dim3 grid(std::min<unsigned>(kBlocksPerPart, unsigned((longest + kThreads - 1) / kThreads)),
                  unsigned(parts));
  const auto factor = math::ConvertType<In, Out>(scaling.factor);
  switch (scaling.kind) {
    case math::ScaleKind::kNone:
      convert_kernel<math::ScaleKind::kNone, In, Out><<<grid, kThreads, 0, stream>>>(batch, factor);
      break;
    case math::ScaleKind::kMultiply:
      convert_kernel<math::ScaleKind::kMultiply, In, Out>
          <<<grid, kThreads, 0, stream>>>(batch, factor);
      break;
    case math::ScaleKind::kDivide:
      convert_kernel<math::ScaleKind::kDivide, In, Out>
          <<<grid, kThreads, 0, stream>>>(batch, factor);
      break;
  }
  RC_CUDA_CHECK_LAUNCH();
}

bool plain_copy(DType in_dtype, DType out_dtype, Scaling scaling) {
  return in_dtype == out_dtype && scaling.kind == math::ScaleKind::kNone;
}

// Converts every (in, out, count) that `for_each_part` yields, in batches. A plain copy runs the
// same kernel with In = Out, for any dtype.
template <typename ForEachPart>
void convert_parts(DType in_dtype, DType out_dtype, Scaling scaling, cudaStream_t stream,
                   ForEachPart for_each_part) {
  kernels::check_conversion(in_dtype, out_dtype, scaling);
  auto run = [&](auto from, auto to) {
    using In = typename decltype(from)::type;
    using Out = typename decltype(to)::type;
    Batch batch;
    int parts = 0;
    size_t longest = 0;
    for_each_part([&](const void* in, void* out, size_t count) {
      batch.part[parts++] = Part{in, out, count};
      longest = std::max(longest, count);
      if (parts == kPartsPerLaunch) {
        launch<In, Out>(batch, parts, longest, scaling, stream);
        parts = 0;
        longest = 0;
      }
    });
    if (parts > 0) launch<In, Out>(batch, parts, longest, scaling, stream);
  };
  if (plain_copy(in_dtype, out_dtype, scaling))
    kernels::visit_dtype(in_dtype, [&](auto type) { run(type, type); });
  else
    kernels::visit_conversion(in_dtype, out_dtype, run);
}

}  // namespace

void convert(DType in_dtype, const void* in, DType out_dtype, void* out, size_t n, Scaling scaling,
             cudaStream_t stream) {
  if (n == 0) return;
  if (plain_copy(in_dtype, out_dtype, scaling)) {
    RC_CUDA_CHECK(
        cudaMemcpyAsync(out, in, n * dtype_size(in_dtype), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  convert_parts(in_dtype, out_dtype, scaling, stream, [&](auto add) { add(in, out, n); });
}

void pack(const PackList& src, size_t begin, size_t end, void* dst, DType dst_dtype,
          Scaling scaling, cudaStream_t stream) {
  const size_t in_size = dtype_size(src.dtype()), out_size = dtype_size(dst_dtype);
  char* out = static_cast<char*>(dst);
  convert_parts(src.dtype(), dst_dtype, scaling, stream, [&](auto add) {
    kernels::for_parts(src, begin, end, [&](size_t i, size_t first, size_t n) {
      add(src.data(i) + (first - src.offset(i)) * in_size, out + (first - begin) * out_size, n);
    });
  });
}

void unpack(const void* src, DType src_dtype, const PackList& dst, size_t begin, size_t end,
            Scaling scaling, cudaStream_t stream) {
  const size_t in_size = dtype_size(src_dtype), out_size = dtype_size(dst.dtype());
  const char* in = static_cast<const char*>(src);
  convert_parts(src_dtype, dst.dtype(), scaling, stream, [&](auto add) {
    kernels::for_parts(dst, begin, end, [&](size_t i, size_t first, size_t n) {
      add(in + (first - begin) * in_size, dst.data(i) + (first - dst.offset(i)) * out_size, n);
    });
  });
}

}  // namespace cuda
}  // namespace ringcomm
