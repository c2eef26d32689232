// CPU reduction kernels: the shared loops of kernels/reduce_math.h for every (dtype, op) that
// kernels/dispatch.h accepts, with x86 fast paths for the half types.
// Entry points are RC_MULTIVERSION (kernels/cpu/multiversion.h).
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/multiversion.h"

#include "kernels/cpu/reduce_half_x86.h"
#include "kernels/dispatch.h"
#include "kernels/reduce_math.h"

namespace ringcomm {
namespace cpu {

RC_MULTIVERSION
void reduce(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  if (dtype == DType::kFloat16 && half_x86_available())
    return reduce_float16_f16c(op, out, a, b, n);
  if (dtype == DType::kBFloat16 && half_x86_available())
    return reduce_bfloat16_avx2(op, out, a, b, n);
  kernels::visit_reduce(dtype, op, [&](auto type, auto reduce_op) {
    using T = typename decltype(type)::type;
    math::reduce_range(static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), 0,
                       n, reduce_op);
  });
}

RC_MULTIVERSION
void divide(DType dtype, void* x, size_t n, int divisor) {
  kernels::visit_divide(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    math::divide_range(static_cast<T*>(x), divisor, 0, n);
  });
}

}  // namespace cpu
}  // namespace ringcomm
