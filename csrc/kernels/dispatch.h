// From run-time codes (DType, ReduceOp) to the compile-time types of the shared math: one switch
// for the CPU loops (kernels/cpu/) and the CUDA launches (kernels/cuda/), so both accept exactly
// the same combinations. Host code only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "kernels/reduce_math.h"

namespace ringcomm {
namespace kernels {

template <typename T>
struct Type {
  using type = T;
};

// f(Type<T>{}) with T the storage type of `dtype` (bool as one byte). Types outside `allowed`
// raise, naming `what`.
template <typename F>
decltype(auto) visit_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(Type<float>{});
    case DType::kFloat64:
      return f(Type<double>{});
    case DType::kFloat16:
      return f(Type<math::Half>{});
    case DType::kBFloat16:
      return f(Type<math::BFloat16>{});
    case DType::kInt8:
      return f(Type<int8_t>{});
    case DType::kUInt8:
      return f(Type<uint8_t>{});
    case DType::kInt32:
      return f(Type<int32_t>{});
    case DType::kInt64:
      return f(Type<int64_t>{});
    case DType::kBool:
      return f(Type<math::Bool>{});
  }
  RC_INVALID("unknown dtype code ", int(dtype));
}

// f(Type<T>{}, Op{}) for an element-wise reduction of `dtype` by `op`. AVG reduces as SUM (the
// algorithms divide once at the end). On bool (computed as C++ bool: kernels/reduce_math.h) sum
// and max are logical or, prod and min logical and. The bitwise ops exist for integers and bool.
template <typename F>
void visit_reduce(DType dtype, ReduceOp op, F&& f) {
  RC_CHECK_ARG(op != ReduceOp::kAvg || dtype != DType::kBool, "op avg is undefined on bool");
  visit_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return f(type, math::Sum{});
      case ReduceOp::kProd:
        return f(type, math::Prod{});
      case ReduceOp::kMin:
        return f(type, math::Min{});
      case ReduceOp::kMax:
        return f(type, math::Max{});
      default:
        break;
    }
    if constexpr (std::is_integral_v<T> || std::is_same_v<T, math::Bool>) {
      switch (op) {
        case ReduceOp::kBand:
          return f(type, math::BitAnd{});
        case ReduceOp::kBor:
          return f(type, math::BitOr{});
        case ReduceOp::kBxor:
          return f(type, math::BitXor{});
        default:
          break;
      }
    }
    RC_INVALID("op ", op_name(op), " is not defined on ", dtype_name(dtype));
  });
}

// f(Type<T>{}) for AVG's final division: every type but bool.
template <typename F>
void visit_divide(DType dtype, F&& f) {
  RC_CHECK_ARG(dtype != DType::kBool, "divide is undefined on bool");
  visit_dtype(dtype, [&](auto type) {
    if constexpr (!std::is_same_v<typename decltype(type)::type, math::Bool>) f(type);
  });
}

// f(Type<T>{}) for the element types top-k selects over and sends (float32, float16, bfloat16);
// any other raises.
template <typename F>
void visit_topk(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(Type<float>{});
    case DType::kFloat16:
      return f(Type<math::Half>{});
    case DType::kBFloat16:
      return f(Type<math::BFloat16>{});
    default:
      RC_INVALID("top-k does not support ", dtype_name(dtype));
  }
}

// f(Type<In>{}, Type<Out>{}) for a pack/unpack conversion between the floating types
// (check_conversion in kernels/pack_list.h says which pairs are allowed).
template <typename F>
void visit_conversion(DType from, DType to, F&& f) {
  auto floating = [](DType t, auto&& g) {
    switch (t) {
      case DType::kFloat32:
        return g(Type<float>{});
      case DType::kFloat64:
        return g(Type<double>{});
      case DType::kFloat16:
        return g(Type<math::Half>{});
      case DType::kBFloat16:
        return g(Type<math::BFloat16>{});
      default:
        RC_INVALID("cannot convert ", dtype_name(t), ": not a floating type");
    }
  };
  floating(from, [&](auto in) { floating(to, [&](auto out) { f(in, out); }); });
}

}  // namespace kernels
}  // namespace ringcomm
