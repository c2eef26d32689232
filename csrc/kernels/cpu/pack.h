// CPU pack/unpack kernels: a list of buffers of one dtype <-> a contiguous fusion buffer, with an
// optional cast (float32 <-> float16 / bfloat16) and scaling in the same pass
// (kernels/pack_math.h). Kernels see raw buffers only.
#pragma once

#include <algorithm>
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

// Starts loading the first lines of buffer i + 1 of `list`, for a walk over the list that is about
// to work on buffer i. Tensors allocated one by one lie in whatever order the heap handed them out
// (in the bench, two in five lie below the one before), and walking them in list order cost
// 1.06-1.22x walking the same memory in address order (bench_kernels pack). Asking for the next
// buffer's first 4 lines while the current one is worked on made all_reduce_coalesced of 1000 such
// tensors of 1-16 KiB faster in all 14 runs at 2 ranks (interleaved in one process): by 6-18% in
// 13, by 1% in one; at 4 ranks on 2 CPUs five runs of seven were 2-12% faster, two 2% and 10%
// slower. 2 lines, or a second buffer ahead, gained nothing more (docs/performance.md, session 39).
inline void fetch_ahead(const PackList& list, size_t i) {
  constexpr size_t kLines = 4;
  if (i + 1 >= list.size()) return;
  const char* next = list.data(i + 1);
  const size_t lines = std::min(kLines, (list.count(i + 1) * dtype_size(list.dtype()) + 63) / 64);
  for (size_t l = 0; l < lines; ++l) __builtin_prefetch(next + 64 * l, /*rw=*/0, /*locality=*/3);
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
