// Arguments of the kernel bindings as they cross from Python (addresses as integers, codes as
// ints), checked and turned into the kernels' types: shared by ringcomm._C and ringcomm._C_cuda.
#pragma once

#include <pybind11/pybind11.h>

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

// A one-dimensional, contiguous buffer of uint64 (a memoryview cast to "Q", an array("Q")), held
// while it is read: the GIL must be held from construction to destruction.
class Words {
 public:
  Words(const pybind11::buffer& b, const char* what) : info_(b.request()) {
    RC_CHECK_ARG(info_.ndim == 1 && info_.itemsize == 8 &&
                     (info_.format == "Q" || info_.format == "L") &&
                     (info_.shape[0] <= 1 || info_.strides[0] == 8),
                 what, " must be a contiguous buffer of uint64 (format Q), got format '",
                 info_.format, "' of ", info_.ndim, " dimensions");
  }
  size_t size() const { return size_t(info_.shape[0]); }
  uint64_t operator[](size_t i) const { return static_cast<const uint64_t*>(info_.ptr)[i]; }

 private:
  pybind11::buffer_info info_;
};

// `Addresses` and `Counts`: std::vector or Words.
template <typename Addresses, typename Counts>
kernels::PackList pack_list(int dtype, const Addresses& ptrs, const Counts& counts) {
  RC_CHECK_ARG(ptrs.size() == counts.size(), "addresses and counts differ in length");
  kernels::PackList list(checked_dtype(dtype));
  for (size_t i = 0; i < ptrs.size(); ++i) list.add(reinterpret_cast<void*>(ptrs[i]), counts[i]);
  return list;
}

inline void* address(uintptr_t a) { return reinterpret_cast<void*>(a); }

}  // namespace python
}  // namespace ringcomm
