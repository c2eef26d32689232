// float16 reduction with the F16C conversion instructions (8 lanes at a time): the portable
// loop in reduce_math.h converts in software, one element at a time, which made float16 2-3x
// slower than bfloat16. Same arithmetic: convert to float, one operation, round to nearest even;
// min/max propagate NaN with the same precedence (left operand first). NaN payloads may differ
// from the portable loop's canonical NaN, the value is NaN either way.
#include "kernels/cpu/reduce_f16c.h"

#include "kernels/reduce_math.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace ringcomm {
namespace cpu {

bool f16c_available() {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return available;
}

__attribute__((target("avx2,f16c")))
void reduce_float16_f16c(ReduceOp op, void* out_v, const void* a_v, const void* b_v, size_t n) {
  auto* out = static_cast<uint16_t*>(out_v);
  auto* a = static_cast<const uint16_t*>(a_v);
  auto* b = static_cast<const uint16_t*>(b_v);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    __m256 r;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: r = _mm256_add_ps(x, y); break;
      case ReduceOp::kProd: r = _mm256_mul_ps(x, y); break;
      default: {
        __m256 take_y = op == ReduceOp::kMin ? _mm256_cmp_ps(y, x, _CMP_LT_OQ)
                                             : _mm256_cmp_ps(x, y, _CMP_LT_OQ);
        r = _mm256_blendv_ps(x, y, take_y);
        r = _mm256_blendv_ps(r, y, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
        r = _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      }
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  auto* ho = reinterpret_cast<math::Half*>(out);
  auto* ha = reinterpret_cast<const math::Half*>(a);
  auto* hb = reinterpret_cast<const math::Half*>(b);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return math::reduce_range(ho, ha, hb, i, n, math::Sum{});
    case ReduceOp::kProd: return math::reduce_range(ho, ha, hb, i, n, math::Prod{});
    case ReduceOp::kMin: return math::reduce_range(ho, ha, hb, i, n, math::Min{});
    case ReduceOp::kMax: return math::reduce_range(ho, ha, hb, i, n, math::Max{});
  }
}

}  // namespace cpu
}  // namespace ringcomm

#else

namespace ringcomm {
namespace cpu {
bool f16c_available() { return false; }
void reduce_float16_f16c(ReduceOp, void*, const void*, const void*, size_t) {}
}  // namespace cpu
}  // namespace ringcomm

#endif
