// float16 reduction on x86 CPUs with F16C (see reduce_f16c.cc); reduce() uses it when available.
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace ringcomm {
namespace cpu {

bool f16c_available();
// out[i] = op(a[i], b[i]) on float16 bit patterns; only call when f16c_available().
void reduce_float16_f16c(ReduceOp op, void* out, const void* a, const void* b, size_t n);

}  // namespace cpu
}  // namespace ringcomm
