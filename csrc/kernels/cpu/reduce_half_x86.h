// float16 / bfloat16 reductions on x86 CPUs with AVX2 and F16C (reduce_half_x86.cc); reduce()
// uses them when half_x86_available().
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace ringcomm {
namespace cpu {

bool half_x86_available();
// out[i] = op(a[i], b[i]) on float16 / bfloat16 bit patterns; only when half_x86_available().
void reduce_float16_f16c(ReduceOp op, void* out, const void* a, const void* b, size_t n);
void reduce_bfloat16_avx2(ReduceOp op, void* out, const void* a, const void* b, size_t n);

}  // namespace cpu
}  // namespace ringcomm
