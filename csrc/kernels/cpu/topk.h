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
// top-k of acc like topk(), then zero the selected entries of `residual`. Afterwards
// values + residual == grad + old residual, element by element, with values scattered back.
void topk_with_residual(DType dtype, const void* grad, void* residual, size_t n, size_t k,
                        int32_t* indices, void* values);

}  // namespace cpu
}  // namespace ringcomm
