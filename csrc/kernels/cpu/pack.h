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
// by one lie in whatever order the heap handed them out (in the bench, two in five lie below the
// one before), and walking them in list order cost 1.06-1.22x walking the same memory in address
// order (bench_kernels pack). With the next piece's first 4 lines asked for one piece ahead in
// pack, unpack, the reduction over the caller's buffers and the copy of ranges onto a board,
// all_reduce_coalesced of 1000 such tensors of 1-16 KiB was 1-17% faster at 2 ranks in 7 runs of 7,
// and at 4 ranks on 2 CPUs 1-6% faster in 4 runs of 6, the same in one, 7% slower in one
// (interleaved in one process). Asking for every range's head at once when the ranges are listed
// was slower than one ahead, and both together slower than either; 2 lines, or 2 pieces ahead,
// gained nothing (docs/performance.md, session 39). 16 lines (1 KiB) made the same all-reduce
// 3-18% faster than 4 lines at 2 ranks in 11 launches of 12 (level in the other), and level or
// 6% faster at 4 ranks (2 launches); 32 or 64 lines, or 16 of each of the next two pieces, were
// slower than 16 (session 41).
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
