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

// out[i] = store(scale(load(in[i]))) for i in [begin, end).
template <typename In, typename Out>
RC_HOST_DEVICE void convert_range(Out* out, const In* in, size_t begin, size_t end,
                                  Scaling scaling) {
  using LoadC = Compute<In>;
  using StoreC = Compute<Out>;
  // The wider of the two compute types, so float64 never passes through float.
  using V = decltype(typename LoadC::type() + typename StoreC::type());
  const V factor = V(scaling.factor);
  switch (scaling.kind) {
    case ScaleKind::kNone:
      for (size_t i = begin; i < end; ++i) out[i] = StoreC::store(V(LoadC::load(in[i])));
      return;
    case ScaleKind::kMultiply:
      for (size_t i = begin; i < end; ++i) out[i] = StoreC::store(V(LoadC::load(in[i])) * factor);
      return;
    case ScaleKind::kDivide:
      for (size_t i = begin; i < end; ++i) out[i] = StoreC::store(V(LoadC::load(in[i])) / factor);
      return;
  }
}

}  // namespace math
}  // namespace ringcomm
