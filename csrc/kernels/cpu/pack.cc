// CPU pack/unpack kernels: the shared loop of kernels/pack_math.h for every (from, to) pair of
// kernels/dispatch.h. Plain copies go to copy_bytes below; conversions are compiled twice (AVX2
// and baseline x86-64) like the reduction kernels.
#include "kernels/cpu/pack.h"
#include "kernels/cpu/multiversion.h"

#include <cstring>

#include "kernels/dispatch.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace ringcomm {
namespace cpu {
namespace {

#if defined(__x86_64__) && defined(__GNUC__)
// A piece of a tensor lands at any 4-byte offset of a fusion buffer, while the tensor itself
// starts on a 64-byte boundary, so a pack or unpack copy rarely has its source and destination
// aligned alike. glibc's memcpy moves 2 KiB and more with `rep movsb`, which on AMD Zen runs
// slower for such pairs than for pairs aligned alike, and several times slower where they are
// 4 bytes apart (docs/algorithms.md).
// Unaligned vector loads and stores do not care how the two are aligned.
//
// Inlined into each caller below, so the vectors are those of the caller's instruction set
// (and never passed by value: no vector-argument ABI between the two sets).
template <typename Vec>
__attribute__((always_inline)) inline void copy_vectors(char* dst, const char* src, size_t n) {
  constexpr size_t w = sizeof(Vec);
  Vec a, b, c, d;
  size_t i = 0;
  for (; i + 4 * w <= n; i += 4 * w) {
    __builtin_memcpy(&a, src + i, w);
    __builtin_memcpy(&b, src + i + w, w);
    __builtin_memcpy(&c, src + i + 2 * w, w);
    __builtin_memcpy(&d, src + i + 3 * w, w);
    __builtin_memcpy(dst + i, &a, w);
    __builtin_memcpy(dst + i + w, &b, w);
    __builtin_memcpy(dst + i + 2 * w, &c, w);
    __builtin_memcpy(dst + i + 3 * w, &d, w);
  }
  for (; i + w <= n; i += w) {
    __builtin_memcpy(&a, src + i, w);
    __builtin_memcpy(dst + i, &a, w);
  }
  if (i < n) std::memcpy(dst + i, src + i, n - i);  // under one vector: no rep movsb
}

__attribute__((target("avx2"))) void copy_avx2(char* dst, const char* src, size_t n) {
  copy_vectors<__m256i>(dst, src, n);
}

void copy_sse2(char* dst, const char* src, size_t n) { copy_vectors<__m128i>(dst, src, n); }
#endif

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
void copy_bytes(void* dst, const void* src, size_t n) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (n < 256) {  // glibc's own vector paths, far below its rep movsb threshold
    std::memcpy(dst, src, n);
    return;
  }
  (avx2 ? copy_avx2 : copy_sse2)(static_cast<char*>(dst), static_cast<const char*>(src), n);
}
#else
void copy_bytes(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
#endif

RC_MULTIVERSION
void convert(DType in_dtype, const void* in, DType out_dtype, void* out, size_t n,
             Scaling scaling) {
  if (in_dtype == out_dtype && scaling.kind == ScaleKind::kNone) {
    if (n > 0) copy_bytes(out, in, n * dtype_size(in_dtype));
    return;
  }
  kernels::visit_conversion(in_dtype, out_dtype, [&](auto from, auto to) {
    using In = typename decltype(from)::type;
    using Out = typename decltype(to)::type;
    math::convert_range(static_cast<Out*>(out), static_cast<const In*>(in), 0, n, scaling);
  });
}

void pack(const PackList& src, size_t begin, size_t end, void* dst, DType dst_dtype,
          Scaling scaling) {
  const size_t in_size = dtype_size(src.dtype()), out_size = dtype_size(dst_dtype);
  char* out = static_cast<char*>(dst);
  kernels::for_parts(src, begin, end, [&](size_t i, size_t first, size_t n) {
    fetch_ahead(src, i);
    convert(src.dtype(), src.data(i) + (first - src.offset(i)) * in_size, dst_dtype,
            out + (first - begin) * out_size, n, scaling);
  });
}

void unpack(const void* src, DType src_dtype, const PackList& dst, size_t begin, size_t end,
            Scaling scaling) {
  const size_t in_size = dtype_size(src_dtype), out_size = dtype_size(dst.dtype());
  const char* in = static_cast<const char*>(src);
  kernels::for_parts(dst, begin, end, [&](size_t i, size_t first, size_t n) {
    fetch_ahead(dst, i);
    convert(src_dtype, in + (first - begin) * in_size, dst.dtype(),
            dst.data(i) + (first - dst.offset(i)) * out_size, n, scaling);
  });
}

}  // namespace cpu
}  // namespace ringcomm
