// float16 and bfloat16 reductions on x86 with AVX2 (+F16C), 8 lanes at a time: the portable loop
// in reduce_math.h converts one element at a time, in software. Same arithmetic: convert to float,
// one operation, round to nearest even; min/max propagate NaN with the same precedence (left
// operand first). A float16 NaN's payload may differ from the portable loop's canonical NaN; the
// value is NaN either way. bfloat16 conversion is the same bit arithmetic as float_to_bf16.
#include "kernels/cpu/reduce_half_x86.h"

#include "kernels/reduce_math.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace ringcomm {
namespace cpu {

bool half_x86_available() {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return available;
}

namespace {

// op(x, y) on 8 floats, as math::Sum/Prod/Min/Max do one at a time.
__attribute__((target("avx2"))) inline __m256 apply(ReduceOp op, __m256 x, __m256 y) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return _mm256_add_ps(x, y);
    case ReduceOp::kProd:
      return _mm256_mul_ps(x, y);
    default: {
      __m256 take_y =
          op == ReduceOp::kMin ? _mm256_cmp_ps(y, x, _CMP_LT_OQ) : _mm256_cmp_ps(x, y, _CMP_LT_OQ);
      __m256 r = _mm256_blendv_ps(x, y, take_y);
      r = _mm256_blendv_ps(r, y, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
      return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
  }
}

template <typename T>
void scalar_tail(ReduceOp op, T* out, const T* a, const T* b, size_t begin, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return math::reduce_range(out, a, b, begin, n, math::Sum{});
    case ReduceOp::kProd:
      return math::reduce_range(out, a, b, begin, n, math::Prod{});
    case ReduceOp::kMin:
      return math::reduce_range(out, a, b, begin, n, math::Min{});
    case ReduceOp::kMax:
      return math::reduce_range(out, a, b, begin, n, math::Max{});
    default:
      RC_INVALID("op ", op_name(op), " is not defined on floating types");
  }
}

__attribute__((target("avx2"))) inline __m256 load_bf16(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

__attribute__((target("avx2"))) inline void store_bf16(uint16_t* p, __m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i upper = _mm256_srli_epi32(u, 16);
  __m256i lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
  __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  __m256i quiet_nan = _mm256_or_si256(upper, _mm256_set1_epi32(0x40));
  __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  __m256i bits = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  // 32-bit lanes -> 16-bit: pack works per 128-bit half, so gather the two halves' results.
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

__attribute__((target("avx2,f16c"))) inline __m256 load_fp16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((target("avx2,f16c"))) inline void store_fp16(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// 8 lanes at a time through Load/Store (the element type's conversions), the rest one by one.
template <typename T, __m256 (*Load)(const uint16_t*), void (*Store)(uint16_t*, __m256)>
__attribute__((target("avx2,f16c"))) void reduce_lanes(ReduceOp op, void* out_v, const void* a_v,
                                                       const void* b_v, size_t n) {
  auto* out = static_cast<uint16_t*>(out_v);
  auto* a = static_cast<const uint16_t*>(a_v);
  auto* b = static_cast<const uint16_t*>(b_v);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) Store(out + i, apply(op, Load(a + i), Load(b + i)));
  scalar_tail(op, reinterpret_cast<T*>(out), reinterpret_cast<const T*>(a),
              reinterpret_cast<const T*>(b), i, n);
}

}  // namespace

void reduce_float16_f16c(ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  reduce_lanes<math::Half, load_fp16, store_fp16>(op, out, a, b, n);
}

void reduce_bfloat16_avx2(ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  reduce_lanes<math::BFloat16, load_bf16, store_bf16>(op, out, a, b, n);
}

}  // namespace cpu
}  // namespace ringcomm

#else

namespace ringcomm {
namespace cpu {
bool half_x86_available() { return false; }
void reduce_float16_f16c(ReduceOp, void*, const void*, const void*, size_t) {}
void reduce_bfloat16_avx2(ReduceOp, void*, const void*, const void*, size_t) {}
}  // namespace cpu
}  // namespace ringcomm

#endif
