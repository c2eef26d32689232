// Arguments of the kernel bindings as they cross from Python (addresses as integers, codes as
// ints), checked and turned into the kernels' types: shared by ringcomm._C and ringcomm._C_cuda.
#pragma once

#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "kernels/pack_list.h"

namespace ringcomm {
namespace python {

inline math::Scaling scaling(int kind, double factor) {
  RC_CHECK_ARG(kind >= 0 && kind <= 2, "unknown scaling kind ", kind);
  return {math::ScaleKind(kind), factor};
}

inline kernels::PackList pack_list(int dtype, const std::vector<uintptr_t>& ptrs,
                                   const std::vector<size_t>& counts) {
  RC_CHECK_ARG(ptrs.size() == counts.size(), "addresses and counts differ in length");
  kernels::PackList list(checked_dtype(dtype));
  for (size_t i = 0; i < ptrs.size(); ++i) list.add(reinterpret_cast<void*>(ptrs[i]), counts[i]);
  return list;
}

inline void* address(uintptr_t a) { return reinterpret_cast<void*>(a); }

}  // namespace python
}  // namespace ringcomm
