// CPU reduction kernels over raw buffers.
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace ringcomm {
namespace cpu {

// out[i] = op(a[i], b[i]) for n elements; out may alias a or b. AVG reduces as SUM (the
// algorithms divide once at the end with divide()).
void reduce(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n);

// x[i] /= divisor for n elements (truncating on integers; not defined on bool).
void divide(DType dtype, void* x, size_t n, int divisor);

}  // namespace cpu
}  // namespace ringcomm
