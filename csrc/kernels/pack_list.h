// What a pack/unpack works on, for the CPU and the CUDA kernels alike (host code): a list of
// buffers of one dtype viewed back to back as one fused sequence, and the conversions allowed
// between a list and a fusion buffer (kernels/pack_math.h does the per-element arithmetic).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "common/dtype.h"
#include "kernels/pack_math.h"

namespace ringcomm {
namespace kernels {

using math::ScaleKind;
using math::Scaling;

// Buffer i holds elements [offsets[i], offsets[i+1]) of the fused sequence. The buffers are host
// memory for the CPU kernels and device memory for the CUDA ones. A buffer added right where the
// last one ends (views of one tensor, in order) extends it, and an empty one adds nothing: a
// walk's cost goes with the number of buffers (each a call into the copy or reduction kernel),
// and views of one buffer walked one by one ran slower through the shared-memory boards than
// walked as one.
class PackList {
 public:
  explicit PackList(DType dtype) : dtype_(dtype), offsets_{0} {}
  void add(void* data, size_t count) {
    if (count == 0) return;
    char* at = static_cast<char*>(data);
    if (!data_.empty() && data_.back() + count_of_last() * dtype_size(dtype_) == at) {
      offsets_.back() += count;
      return;
    }
    data_.push_back(at);
    offsets_.push_back(offsets_.back() + count);
  }
  DType dtype() const { return dtype_; }
  size_t size() const { return data_.size(); }
  size_t count() const { return offsets_.back(); }
  char* data(size_t i) const { return data_[i]; }
  size_t offset(size_t i) const { return offsets_[i]; }
  size_t count(size_t i) const { return offsets_[i + 1] - offsets_[i]; }
  // The buffer holding fused element `pos` (< count()): the last one starting at or before pos,
  // which ends after pos, so it is not empty.
  size_t find(size_t pos) const {
    auto it = std::upper_bound(offsets_.begin(), offsets_.end() - 1, pos);
    return size_t(it - offsets_.begin()) - 1;
  }

 private:
  size_t count_of_last() const { return offsets_.back() - offsets_[offsets_.size() - 2]; }

  DType dtype_;
  std::vector<char*> data_;
  std::vector<size_t> offsets_;
};

// Calls fn(buffer index, first fused element, element count) for the parts of the list's buffers
// that cover fused elements [begin, end).
template <typename Fn>
void for_parts(const PackList& list, size_t begin, size_t end, Fn fn) {
  RC_CHECK_ARG(begin <= end && end <= list.count(), "fused range [", begin, ", ", end,
               ") outside a list of ", list.count(), " elements");
  if (begin == end) return;
  for (size_t i = list.find(begin); i < list.size() && list.offset(i) < end; ++i) {
    size_t first = std::max(begin, list.offset(i));
    size_t last = std::min(end, list.offset(i + 1));
    if (first < last) fn(i, first, last - first);
  }
}

// Throws std::invalid_argument unless pack/unpack can convert `from` to `to` with `scaling`: the
// same dtype, or float32 <-> float16 / bfloat16; scaling needs floating dtypes and, for kDivide,
// a non-zero factor.
inline void check_conversion(DType from, DType to, Scaling scaling) {
  auto is_half = [](DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; };
  bool cast_ok = from == to || (from == DType::kFloat32 && is_half(to)) ||
                 (is_half(from) && to == DType::kFloat32);
  RC_CHECK_ARG(cast_ok, "cannot convert ", dtype_name(from), " to ", dtype_name(to),
               ": casts are float32 <-> float16 / bfloat16");
  if (scaling.kind != ScaleKind::kNone)
    RC_CHECK_ARG(is_floating(from) && is_floating(to), "scaling needs floating dtypes, got ",
                 dtype_name(from), " -> ", dtype_name(to));
  RC_CHECK_ARG(scaling.kind != ScaleKind::kDivide || scaling.factor != 0, "division by zero");
}

}  // namespace kernels
}  // namespace ringcomm
