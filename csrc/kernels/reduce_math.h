// Element-wise reduction arithmetic shared by the CPU kernels (kernels/cpu/) and the CUDA kernels:
// the same functions run on both sides so the CPU tests cover the GPU's arithmetic.
//
// Half types are reduced in fp32 and rounded back to nearest-even, one operation at a time.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define RC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RC_HOST_DEVICE inline
#endif

namespace ringcomm {
namespace math {

RC_HOST_DEVICE uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

RC_HOST_DEVICE float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

RC_HOST_DEVICE float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

RC_HOST_DEVICE uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // nearest even
  return uint16_t(u >> 16);
}

RC_HOST_DEVICE float fp16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    // Zero or subnormal: value = mant * 2^-24, exact in fp32.
    float v = float(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

RC_HOST_DEVICE uint16_t float_to_fp16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): round abs * 2^24 to the nearest even integer.
    // Adding 0.5f (2^-1) with magic exponent does the rounding in the FPU.
    float scaled = bits_float(abs) + 0.5f;
    return uint16_t(sign | uint16_t(float_bits(scaled) - 0x3f000000u));
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u) - (112u << 23);
  return uint16_t(sign | uint16_t(rounded >> 13));
}

// Binary operators. min/max propagate NaN from either side, like torch.minimum/maximum, and are
// applied with a fixed operand order by every algorithm so every rank gets the same bits.
struct Sum {
  template <typename T>
  RC_HOST_DEVICE T operator()(T a, T b) const {
    return a + b;
  }
  RC_HOST_DEVICE bool operator()(bool a, bool b) const { return a || b; }
};
struct Prod {
  template <typename T>
  RC_HOST_DEVICE T operator()(T a, T b) const {
    return a * b;
  }
  RC_HOST_DEVICE bool operator()(bool a, bool b) const { return a && b; }
};
struct Min {
  template <typename T>
  RC_HOST_DEVICE T operator()(T a, T b) const {
    if (a != a) return a;
    if (b != b) return b;
    return b < a ? b : a;
  }
};
struct Max {
  template <typename T>
  RC_HOST_DEVICE T operator()(T a, T b) const {
    if (a != a) return a;
    if (b != b) return b;
    return a < b ? b : a;
  }
};

// Bitwise operators, for integer types and bool (stored as bytes 0/1, which they keep).
struct BitAnd {
  template <typename T>
  RC_HOST_DEVICE T operator()(T a, T b) const {
    return T(a & b);
  }
};
struct BitOr {
  template <typename T>
  RC_HOST_DEVICE T operator()(T a, T b) const {
    return T(a | b);
  }
};
struct BitXor {
  template <typename T>
  RC_HOST_DEVICE T operator()(T a, T b) const {
    return T(a ^ b);
  }
};

// Storage type <-> compute type for every element type. Half types compute in float.
template <typename Storage>
struct Compute {
  using type = Storage;
  RC_HOST_DEVICE static type load(Storage v) { return v; }
  RC_HOST_DEVICE static Storage store(type v) { return v; }
};

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
struct Bool {
  uint8_t byte;
};  // torch's bool: one byte, 0 or 1

template <>
struct Compute<Half> {
  using type = float;
  RC_HOST_DEVICE static float load(Half v) { return fp16_to_float(v.bits); }
  RC_HOST_DEVICE static Half store(float v) { return Half{float_to_fp16(v)}; }
};
template <>
struct Compute<BFloat16> {
  using type = float;
  RC_HOST_DEVICE static float load(BFloat16 v) { return bf16_to_float(v.bits); }
  RC_HOST_DEVICE static BFloat16 store(float v) { return BFloat16{float_to_bf16(v)}; }
};

// bool computes as C++ bool, so the operators above are or (sum, max, bor), and (prod, min, band)
// and xor (bxor), and any non-zero byte counts as true; results are stored as 0 or 1.
template <>
struct Compute<Bool> {
  using type = bool;
  RC_HOST_DEVICE static bool load(Bool v) { return v.byte != 0; }
  RC_HOST_DEVICE static Bool store(bool v) { return Bool{uint8_t(v)}; }
};

// op(a, b) for one element.
template <typename T, typename Op>
RC_HOST_DEVICE T reduce_one(T a, T b, Op op) {
  using C = Compute<T>;
  return C::store(op(C::load(a), C::load(b)));
}

// out[i] = op(a[i], b[i]) for i in [begin, end).
template <typename T, typename Op>
RC_HOST_DEVICE void reduce_range(T* out, const T* a, const T* b, size_t begin, size_t end, Op op) {
  for (size_t i = begin; i < end; ++i) out[i] = reduce_one(a[i], b[i], op);
}

// x[i] = x[i] / divisor, for AVG's final division (a true division, not a multiply by the
// reciprocal, so averages match sum / n exactly; on integers C's division, truncating toward zero
// like NCCL's ncclAvg).
template <typename T>
RC_HOST_DEVICE T divide_one(T x, int divisor) {
  using C = Compute<T>;
  using V = typename C::type;
  return C::store(V(C::load(x) / V(divisor)));
}

// divide_one over [begin, end). A floating divisor that is a power of two has an exact
// reciprocal, and x * 2^-k rounds the same real number as x / 2^k, so the product gives the
// quotient's bits (NaN, infinities, zeros and subnormals included) at a multiply's cost: AVG
// over 2, 4, 8... ranks, a multiply being cheaper than a division.
template <typename T>
RC_HOST_DEVICE void divide_range(T* x, int divisor, size_t begin, size_t end) {
  using C = Compute<T>;
  using V = typename C::type;
  if constexpr (std::is_floating_point<V>::value) {
    if (divisor > 0 && (divisor & (divisor - 1)) == 0) {
      const V inverse = V(1) / V(divisor);
      for (size_t i = begin; i < end; ++i) x[i] = C::store(V(C::load(x[i]) * inverse));
      return;
    }
  }
  for (size_t i = begin; i < end; ++i) x[i] = divide_one(x[i], divisor);
}

}  // namespace math
}  // namespace ringcomm
