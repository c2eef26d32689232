// Element types and reduction operators understood by the core. The numeric values are part of
// the wire header and of the Python binding, so they never change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/error.h"

namespace ringcomm {

enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kBool = 8,
};
constexpr int kNumDTypes = 9;

// Values follow torch.distributed.ReduceOp (SUM=0, AVG=1, PRODUCT=2, MIN=3, MAX=4, BAND=5,
// BOR=6, BXOR=7).
enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg = 1,
  kProd = 2,
  kMin = 3,
  kMax = 4,
  kBand = 5,
  kBor = 6,
  kBxor = 7
};
constexpr int kNumReduceOps = 8;

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
  }
  RC_INVALID("unknown dtype code ", int(t));
}

inline const char* dtype_name(DType t) {
  static const char* names[] = {"float32", "float64", "float16", "bfloat16", "int8",
                                "uint8",   "int32",   "int64",   "bool"};
  return unsigned(t) < kNumDTypes ? names[unsigned(t)] : "invalid";
}

inline const char* op_name(ReduceOp op) {
  static const char* names[] = {"sum", "avg", "prod", "min", "max", "band", "bor", "bxor"};
  return unsigned(op) < kNumReduceOps ? names[unsigned(op)] : "invalid";
}

inline bool is_floating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 ||
         t == DType::kBFloat16;
}

inline DType checked_dtype(int code) {
  RC_CHECK_ARG(code >= 0 && code < kNumDTypes, "unsupported dtype code ", code);
  return DType(code);
}

inline bool is_bitwise(ReduceOp op) {
  return op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
}

// AVG is the sum divided by the number of ranks: a true division on floating types, C's
// truncating division on integers (NCCL's ncclAvg), undefined on bool. The bitwise ops need
// integers or bool. Every other op works on every type (on bool: sum/max = or, prod/min = and).
inline ReduceOp checked_op(int code, DType t) {
  RC_CHECK_ARG(code >= 0 && code < kNumReduceOps, "unsupported reduce op code ", code);
  ReduceOp op = ReduceOp(code);
  RC_CHECK_ARG(op != ReduceOp::kAvg || t != DType::kBool, "op avg is undefined on bool");
  RC_CHECK_ARG(!is_bitwise(op) || !is_floating(t), "op ", op_name(op),
               " needs an integer or bool dtype, got ", dtype_name(t));
  return op;
}

}  // namespace ringcomm
