// CPU pack/unpack kernels: a list of buffers of one dtype <-> a contiguous fusion buffer, with an
// optional cast (float32 <-> float16 / bfloat16) and scaling in the same pass
// (kernels/pack_math.h). Kernels see raw buffers only.
#pragma once

#include <cstddef>
#include "common/dtype.h"
#include "kernels/pack_list.h"

namespace ringcomm {
namespace cpu {

using kernels::check_conversion;
using kernels::PackList;
using math::ScaleKind;
using math::Scaling;

// dst <- src, n bytes, at the same speed however the two are aligned to each other (glibc's
// memcpy does not: pack.cc). For the pieces of a list and the slots of a transport, which are
// rarely aligned alike.
void copy_bytes(void* dst, const void* src, size_t n);

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
