// Exact top-k by magnitude on the CPU (one thread), for float32, float16 and bfloat16.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace ringcomm {
namespace cpu {

// Writes the indices of the k elements of largest magnitude (ties: lower index first) to
// `indices`, in ascending index order, and their values (with sign) to `values`.
void topk(DType dtype, const void* data, size_t n, size_t k, int32_t* indices, void* values);

// Error-feedback compression step: acc = grad + residual (written to `residual`), select the
// top-k of acc like topk(), write their values as `value_dtype` (float32, float16 or bfloat16,
// rounded to nearest even), and leave in `residual`, at each selected position, what that
// rounding lost (acc - value, computed in float and stored as `dtype`; zero when value_dtype is
// dtype). Afterwards values + residual == grad + old residual, element by element, with values
// scattered back, up to the rounding of that difference where `dtype` is a 16-bit type.
void topk_with_residual(DType dtype, const void* grad, void* residual, size_t n, size_t k,
                        int32_t* indices, void* values, DType value_dtype);

}  // namespace cpu
}  // namespace ringcomm
