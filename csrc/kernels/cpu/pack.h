// CPU pack/unpack kernels: a list of buffers of one dtype <-> a contiguous fusion buffer, with an
// optional cast (float32 <-> float16 / bfloat16) and scaling in the same pass
// (kernels/pack_math.h). Kernels see raw buffers only.
#pragma once

#include <algorithm>
#include <cstddef>
#include "common/dtype.h"
#include "common/prefetch.h"
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

// Starts loading the first lines of [data, data + bytes), the next piece of a walk over pieces that
// lie apart (the caller's tensors), while the walk works on the current one. Tensors allocated one
// by one lie in whatever order the heap handed them out, and walking them in list order, which
// every rank's layout follows, is slower than walking the same memory in address order. So pack,
// unpack, the reduction over the caller's buffers and the copy of ranges onto a board ask for the
// next piece's first lines one piece ahead, which makes a coalesced all-reduce of many small
// tensors faster. One piece ahead (every range's head at once as the ranges are listed, or 2
// pieces ahead, did no better) and 16 lines (1 KiB; 4 gained less, 32 or 64 lost).
inline void fetch_head(const void* data, size_t bytes) {
  constexpr size_t kLines = 16;
  prefetch_lines(data, std::min(bytes, kLines * 64));
}

// fetch_head of buffer i + 1 of `list`, for a walk that is about to work on buffer i.
inline void fetch_ahead(const PackList& list, size_t i) {
  if (i + 1 < list.size())
    fetch_head(list.data(i + 1), list.count(i + 1) * dtype_size(list.dtype()));
}

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
