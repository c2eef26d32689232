// CPU pack/unpack kernels: a (from, to) dtype switch over the shared loop in
// kernels/pack_math.h. Plain copies go to memcpy; conversions are compiled twice (AVX2 and
// baseline x86-64) like the reduction kernels.
#include "kernels/cpu/pack.h"
#include "kernels/cpu/multiversion.h"

#include <algorithm>
#include <cstring>


namespace ringcomm {
namespace cpu {
namespace {

bool is_half(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }

template <typename In>
void convert_from(const In* in, DType out_dtype, void* out, size_t n, Scaling s) {
  switch (out_dtype) {
    case DType::kFloat32: math::convert_range(static_cast<float*>(out), in, 0, n, s); return;
    case DType::kFloat64: math::convert_range(static_cast<double*>(out), in, 0, n, s); return;
    case DType::kFloat16: math::convert_range(static_cast<math::Half*>(out), in, 0, n, s); return;
    case DType::kBFloat16:
      math::convert_range(static_cast<math::BFloat16*>(out), in, 0, n, s);
      return;
    default: RC_INVALID("cannot convert to ", dtype_name(out_dtype));
  }
}

// Calls fn(buffer index, first fused element, element count) for the parts of dst's buffers that
// cover fused elements [begin, end).
template <typename Fn>
void for_parts(const PackList& list, size_t begin, size_t end, Fn fn) {
  RC_CHECK_ARG(begin <= end && end <= list.count(), "fused range [", begin, ", ", end,
               ") outside a list of ", list.count(), " elements");
  if (begin == end) return;
  for (size_t i = list.find(begin); i < list.size() && list.offset(i) < end; ++i) {
    size_t first = std::max(begin, list.offset(i));
    size_t last = std::min(end, list.offset(i + 1));
    if (first < last) fn(i, first, last - first);
  }
}

}  // namespace

size_t PackList::find(size_t pos) const {
  // The last buffer starting at or before pos: it ends after pos, so it is not empty.
  auto it = std::upper_bound(offsets_.begin(), offsets_.end() - 1, pos);
  return size_t(it - offsets_.begin()) - 1;
}

void check_conversion(DType from, DType to, Scaling scaling) {
  bool cast_ok = from == to || (from == DType::kFloat32 && is_half(to)) ||
                 (is_half(from) && to == DType::kFloat32);
  RC_CHECK_ARG(cast_ok, "cannot convert ", dtype_name(from), " to ", dtype_name(to),
               ": casts are float32 <-> float16 / bfloat16");
  if (scaling.kind != ScaleKind::kNone)
    RC_CHECK_ARG(is_floating(from) && is_floating(to), "scaling needs floating dtypes, got ",
                 dtype_name(from), " -> ", dtype_name(to));
  RC_CHECK_ARG(scaling.kind != ScaleKind::kDivide || scaling.factor != 0, "division by zero");
}

RC_MULTIVERSION
void convert(DType in_dtype, const void* in, DType out_dtype, void* out, size_t n,
             Scaling scaling) {
  if (in_dtype == out_dtype && scaling.kind == ScaleKind::kNone) {
    if (n > 0) std::memcpy(out, in, n * dtype_size(in_dtype));
    return;
  }
  switch (in_dtype) {
    case DType::kFloat32:
      return convert_from(static_cast<const float*>(in), out_dtype, out, n, scaling);
    case DType::kFloat64:
      return convert_from(static_cast<const double*>(in), out_dtype, out, n, scaling);
    case DType::kFloat16:
      return convert_from(static_cast<const math::Half*>(in), out_dtype, out, n, scaling);
    case DType::kBFloat16:
      return convert_from(static_cast<const math::BFloat16*>(in), out_dtype, out, n, scaling);
    default: RC_INVALID("cannot convert from ", dtype_name(in_dtype));
  }
}

void pack(const PackList& src, size_t begin, size_t end, void* dst, DType dst_dtype,
          Scaling scaling) {
  const size_t in_size = dtype_size(src.dtype()), out_size = dtype_size(dst_dtype);
  char* out = static_cast<char*>(dst);
  for_parts(src, begin, end, [&](size_t i, size_t first, size_t n) {
    convert(src.dtype(), src.data(i) + (first - src.offset(i)) * in_size, dst_dtype,
            out + (first - begin) * out_size, n, scaling);
  });
}

void unpack(const void* src, DType src_dtype, const PackList& dst, size_t begin, size_t end,
            Scaling scaling) {
  const size_t in_size = dtype_size(src_dtype), out_size = dtype_size(dst.dtype());
  const char* in = static_cast<const char*>(src);
  for_parts(dst, begin, end, [&](size_t i, size_t first, size_t n) {
    convert(src_dtype, in + (first - begin) * in_size, dst.dtype(),
            dst.data(i) + (first - dst.offset(i)) * out_size, n, scaling);
  });
}

}  // namespace cpu
}  // namespace ringcomm
