// CPU pack/unpack kernels: the shared loop of kernels/pack_math.h for every (from, to) pair of
// kernels/dispatch.h. Plain copies go to memcpy; conversions are compiled twice (AVX2 and
// baseline x86-64) like the reduction kernels.
#include "kernels/cpu/pack.h"
#include "kernels/cpu/multiversion.h"

#include <cstring>

#include "kernels/dispatch.h"

namespace ringcomm {
namespace cpu {

RC_MULTIVERSION
void convert(DType in_dtype, const void* in, DType out_dtype, void* out, size_t n,
             Scaling scaling) {
  if (in_dtype == out_dtype && scaling.kind == ScaleKind::kNone) {
    if (n > 0) std::memcpy(out, in, n * dtype_size(in_dtype));
    return;
  }
  kernels::visit_conversion(in_dtype, out_dtype, [&](auto from, auto to) {
    using In = typename decltype(from)::type;
    using Out = typename decltype(to)::type;
    math::convert_range(static_cast<Out*>(out), static_cast<const In*>(in), 0, n, scaling);
  });
}

void pack(const PackList& src, size_t begin, size_t end, void* dst, DType dst_dtype,
          Scaling scaling) {
  const size_t in_size = dtype_size(src.dtype()), out_size = dtype_size(dst_dtype);
  char* out = static_cast<char*>(dst);
  kernels::for_parts(src, begin, end, [&](size_t i, size_t first, size_t n) {
    convert(src.dtype(), src.data(i) + (first - src.offset(i)) * in_size, dst_dtype,
            out + (first - begin) * out_size, n, scaling);
  });
}

void unpack(const void* src, DType src_dtype, const PackList& dst, size_t begin, size_t end,
            Scaling scaling) {
  const size_t in_size = dtype_size(src_dtype), out_size = dtype_size(dst.dtype());
  const char* in = static_cast<const char*>(src);
  kernels::for_parts(dst, begin, end, [&](size_t i, size_t first, size_t n) {
    convert(src_dtype, in + (first - begin) * in_size, dst.dtype(),
            dst.data(i) + (first - dst.offset(i)) * out_size, n, scaling);
  });
}

}  // namespace cpu
}  // namespace ringcomm
