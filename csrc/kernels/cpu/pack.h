// CPU pack/unpack kernels: a list of buffers of one dtype <-> a contiguous fusion buffer, with an
// optional cast (float32 <-> float16 / bfloat16) and scaling in the same pass
// (kernels/pack_math.h). Kernels see raw buffers only.
#pragma once

#include <cstddef>
#include <vector>

#include "common/dtype.h"
#include "kernels/pack_math.h"

namespace ringcomm {
namespace cpu {

using math::ScaleKind;
using math::Scaling;

// Buffers of one dtype viewed back to back (the fused sequence): buffer i holds elements
// [offsets[i], offsets[i+1]) of it.
class PackList {
 public:
  explicit PackList(DType dtype) : dtype_(dtype), offsets_{0} {}
  void add(void* data, size_t count) {
    data_.push_back(static_cast<char*>(data));
    offsets_.push_back(offsets_.back() + count);
  }
  DType dtype() const { return dtype_; }
  size_t size() const { return data_.size(); }
  size_t count() const { return offsets_.back(); }
  char* data(size_t i) const { return data_[i]; }
  size_t offset(size_t i) const { return offsets_[i]; }
  size_t count(size_t i) const { return offsets_[i + 1] - offsets_[i]; }
  // The buffer holding fused element `pos` (< count()).
  size_t find(size_t pos) const;

 private:
  DType dtype_;
  std::vector<char*> data_;
  std::vector<size_t> offsets_;
};

// Throws std::invalid_argument unless pack/unpack can convert `from` to `to` with `scaling`: the
// same dtype, or float32 <-> float16 / bfloat16; scaling needs floating dtypes and, for kDivide,
// a non-zero factor.
void check_conversion(DType from, DType to, Scaling scaling);

// out[i] = convert(in[i]) for n elements.
void convert(DType in_dtype, const void* in, DType out_dtype, void* out, size_t n, Scaling scaling);

// dst[0 .. end-begin) = fused elements [begin, end) of `src`, converted to `dst_dtype`.
void pack(const PackList& src, size_t begin, size_t end, void* dst, DType dst_dtype,
          Scaling scaling);
// Fused elements [begin, end) of `dst` = src[0 .. end-begin), converted from `src_dtype`.
void unpack(const void* src, DType src_dtype, const PackList& dst, size_t begin, size_t end,
            Scaling scaling);

}  // namespace cpu
}  // namespace ringcomm
