// CPU reduction kernels: a dtype x op switch over the shared loops in kernels/reduce_math.h.
// Entry points are RC_MULTIVERSION (kernels/cpu/multiversion.h).
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/multiversion.h"

#include <cstdint>
#include <type_traits>

#include "kernels/cpu/reduce_half_x86.h"
#include "kernels/reduce_math.h"

namespace ringcomm {
namespace cpu {
namespace {

// The bitwise ops exist only for integers: checked_op (common/dtype.h) keeps them from floats.
template <typename T>
void reduce_typed(ReduceOp op, T* out, const T* a, const T* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: math::reduce_range(out, a, b, 0, n, math::Sum{}); return;
    case ReduceOp::kProd: math::reduce_range(out, a, b, 0, n, math::Prod{}); return;
    case ReduceOp::kMin: math::reduce_range(out, a, b, 0, n, math::Min{}); return;
    case ReduceOp::kMax: math::reduce_range(out, a, b, 0, n, math::Max{}); return;
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case ReduceOp::kBand: math::reduce_range(out, a, b, 0, n, math::BitAnd{}); return;
      case ReduceOp::kBor: math::reduce_range(out, a, b, 0, n, math::BitOr{}); return;
      case ReduceOp::kBxor: math::reduce_range(out, a, b, 0, n, math::BitXor{}); return;
      default: break;
    }
  }
  RC_INVALID("op ", op_name(op), " is not defined on this dtype");
}

// bool: sum/max/bor are logical or, prod/min/band logical and, bxor exclusive or; bytes are
// normalised to 0/1.
void reduce_bool(ReduceOp op, uint8_t* out, const uint8_t* a, const uint8_t* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      for (size_t i = 0; i < n; ++i) out[i] = uint8_t((a[i] | b[i]) != 0);
      return;
    case ReduceOp::kProd:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      for (size_t i = 0; i < n; ++i) out[i] = uint8_t((a[i] != 0) & (b[i] != 0));
      return;
    case ReduceOp::kBxor:
      for (size_t i = 0; i < n; ++i) out[i] = uint8_t((a[i] != 0) != (b[i] != 0));
      return;
    case ReduceOp::kAvg: break;
  }
  RC_INVALID("op ", op_name(op), " is not defined on bool");
}

}  // namespace

RC_MULTIVERSION
void reduce(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  if (dtype == DType::kFloat16 && half_x86_available())
    return reduce_float16_f16c(op, out, a, b, n);
  if (dtype == DType::kBFloat16 && half_x86_available())
    return reduce_bfloat16_avx2(op, out, a, b, n);
  switch (dtype) {
#define RC_CASE(code, T) \
  case code: reduce_typed(op, static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n); return;
    RC_CASE(DType::kFloat32, float)
    RC_CASE(DType::kFloat64, double)
    RC_CASE(DType::kFloat16, math::Half)
    RC_CASE(DType::kBFloat16, math::BFloat16)
    RC_CASE(DType::kInt8, int8_t)
    RC_CASE(DType::kUInt8, uint8_t)
    RC_CASE(DType::kInt32, int32_t)
    RC_CASE(DType::kInt64, int64_t)
#undef RC_CASE
    case DType::kBool:
      reduce_bool(op, static_cast<uint8_t*>(out), static_cast<const uint8_t*>(a),
                  static_cast<const uint8_t*>(b), n);
      return;
  }
}

RC_MULTIVERSION
void divide(DType dtype, void* x, size_t n, int divisor) {
  switch (dtype) {
    case DType::kFloat32: math::divide_range(static_cast<float*>(x), divisor, 0, n); return;
    case DType::kFloat64: math::divide_range(static_cast<double*>(x), divisor, 0, n); return;
    case DType::kFloat16: math::divide_range(static_cast<math::Half*>(x), divisor, 0, n); return;
    case DType::kBFloat16:
      math::divide_range(static_cast<math::BFloat16*>(x), divisor, 0, n);
      return;
    case DType::kInt8: math::divide_range(static_cast<int8_t*>(x), divisor, 0, n); return;
    case DType::kUInt8: math::divide_range(static_cast<uint8_t*>(x), divisor, 0, n); return;
    case DType::kInt32: math::divide_range(static_cast<int32_t*>(x), divisor, 0, n); return;
    case DType::kInt64: math::divide_range(static_cast<int64_t*>(x), divisor, 0, n); return;
    case DType::kBool: break;
  }
  RC_INVALID("divide is undefined on ", dtype_name(dtype));
}

}  // namespace cpu
}  // namespace ringcomm
