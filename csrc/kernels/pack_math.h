// Element conversion for packing tensors into a fusion buffer and back, shared by the CPU kernels
// (kernels/cpu/pack.cc) and the CUDA kernels: a cast between storage types (float32 <-> float16 /
// bfloat16, or none) with an optional scaling fused into the same pass.
//
// Values are loaded into a compute type (float for float32 and the half types, double for
// float64), scaled there, and stored with one rounding (nearest-even for the half types). So
// "multiply by 1/n, then cast to fp16" rounds once, and a division gives exactly the bits of
// reduce_math.h's divide_range: unpacking with kDivide by n is all_reduce's `avg`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/reduce_math.h"

namespace ringcomm {
namespace math {

enum class ScaleKind : uint8_t {
  kNone = 0,
  kMultiply = 1,  // x * factor (e.g. the 1/world_size of an average, applied before a sum)
  kDivide = 2,    // x / factor, a true division (what all_reduce's avg does after its sum)
};

struct Scaling {
  ScaleKind kind = ScaleKind::kNone;
  double factor = 1.0;
};

// The compute type of a conversion: the wider of the two, so float64 never passes through float.
template <typename In, typename Out>
using ConvertType = decltype(typename Compute<In>::type() + typename Compute<Out>::type());

// store(scale(load(x))) for one element, the scaling kind fixed at compile time.
template <ScaleKind kKind, typename In, typename Out>
RC_HOST_DEVICE Out convert_one(In x, ConvertType<In, Out> factor) {
  ConvertType<In, Out> v = ConvertType<In, Out>(Compute<In>::load(x));
  if constexpr (kKind == ScaleKind::kMultiply) v = v * factor;
  if constexpr (kKind == ScaleKind::kDivide) v = v / factor;
  return Compute<Out>::store(v);
}

// out[i] = store(scale(load(in[i]))) for i in [begin, end).
template <typename In, typename Out>
RC_HOST_DEVICE void convert_range(Out* out, const In* in, size_t begin, size_t end,
                                  Scaling scaling) {
  const auto factor = ConvertType<In, Out>(scaling.factor);
  switch (scaling.kind) {
    case ScaleKind::kNone:
      for (size_t i = begin; i < end; ++i)
        out[i] = convert_one<ScaleKind::kNone, In, Out>(in[i], factor);
      return;
    case ScaleKind::kMultiply:
      for (size_t i = begin; i < end; ++i)
        out[i] = convert_one<ScaleKind::kMultiply, In, Out>(in[i], factor);
      return;
    case ScaleKind::kDivide:
      for (size_t i = begin; i < end; ++i)
        out[i] = convert_one<ScaleKind::kDivide, In, Out>(in[i], factor);
      return;
  }
}

}  // namespace math
}  // namespace ringcomm
