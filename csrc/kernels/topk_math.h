// Top-k by magnitude: the ordering, the per-element steps and the radix selection, shared by the
// CPU kernel (kernels/cpu/topk.cc) and the CUDA kernel (kernels/cuda/topk.cu).
//
// An element's key is its bit pattern with the sign cleared. For IEEE floats of one width this
// orders magnitudes exactly like |x| does, with +0 and -0 equal, +inf above every finite value and
// NaN above inf (as torch.topk does). Ties between equal keys go to the lower index, so the
// selected set is a deterministic function of the input.
#pragma once

#include <cstdint>

#include "kernels/reduce_math.h"

namespace ringcomm {
namespace topk {

using Key = uint32_t;

RC_HOST_DEVICE Key magnitude_key(float x) { return math::float_bits(x) & 0x7fffffffu; }
RC_HOST_DEVICE Key magnitude_key(math::Half x) { return x.bits & 0x7fffu; }
RC_HOST_DEVICE Key magnitude_key(math::BFloat16 x) { return x.bits & 0x7fffu; }

// Key widths: the sign bit is cleared, so float32 keys use 31 bits and 16-bit keys 15.
template <typename T>
constexpr int key_bits() {
  return sizeof(T) == 4 ? 31 : 15;
}

// True if element (key_a, index_a) ranks before (key_b, index_b) in the selection order.
RC_HOST_DEVICE bool ranks_before(Key key_a, uint32_t index_a, Key key_b, uint32_t index_b) {
  return key_a != key_b ? key_a > key_b : index_a < index_b;
}

// Error feedback, one element: acc = grad + residual, computed in float and stored in the
// element type. The caller zeroes the residual of the elements it sends.
template <typename T>
RC_HOST_DEVICE T accumulate(T grad, T residual) {
  using C = math::Compute<T>;
  return C::store(C::load(grad) + C::load(residual));
}

// Radix selection of the k-th largest key, most significant digit first (as torch's
// SortingRadixSelect and the AIR top-k do). Each pass counts, among the elements still in the
// running (their key matches `prefix` under `mask`), how many have each value of the next digit;
// the digit where the count from the top first reaches `remaining` is fixed into the prefix, and
// the elements above it are taken for good. After the last pass `prefix` is the k-th largest key,
// and `remaining` says how many elements equal to it are taken: the first ones in index order.
constexpr int kRadixBits = 11;
constexpr int kRadixBins = 1 << kRadixBits;

struct RadixPass {
  int shift;  // lowest key bit of this pass's digit
  int bits;   // digit width
};

struct RadixState {
  Key prefix;
  Key mask;
  uint32_t remaining;
};

RC_HOST_DEVICE int radix_passes(int key_bits) { return (key_bits + kRadixBits - 1) / kRadixBits; }

RC_HOST_DEVICE RadixPass radix_pass(int key_bits, int pass) {
  const int top = key_bits - kRadixBits * pass;  // one above the digit's highest bit
  const int shift = top > kRadixBits ? top - kRadixBits : 0;
  return RadixPass{shift, top - shift};
}

RC_HOST_DEVICE RadixState radix_start(uint32_t k) { return RadixState{0, 0, k}; }

RC_HOST_DEVICE bool radix_matches(Key key, const RadixState& s) {
  return (key & s.mask) == s.prefix;
}

RC_HOST_DEVICE unsigned radix_digit(Key key, RadixPass p) {
  return (key >> p.shift) & ((1u << p.bits) - 1u);
}

// Walking the digits from the highest: `above` elements in the running have a higher digit and
// `count` have this one. This digit holds the k-th exactly when the walk reaches `remaining` here.
RC_HOST_DEVICE bool radix_is_pick(uint32_t above, uint32_t count, uint32_t remaining) {
  return above < remaining && remaining <= above + count;
}

RC_HOST_DEVICE void radix_advance(RadixState& s, RadixPass p, unsigned digit, uint32_t above) {
  s.prefix |= Key(digit) << p.shift;
  s.mask |= ((1u << p.bits) - 1u) << p.shift;
  s.remaining -= above;
}

// After the last pass: whether an element is selected, given how many elements equal to the
// k-th key precede it in index order.
RC_HOST_DEVICE bool radix_keeps(Key key, uint32_t equal_before, const RadixState& s) {
  return key > s.prefix || (key == s.prefix && equal_before < s.remaining);
}

// Its position in the output (ascending index order), given the greater and equal keys before it.
RC_HOST_DEVICE uint32_t radix_slot(uint32_t greater_before, uint32_t equal_before,
                                   const RadixState& s) {
  return greater_before + (equal_before < s.remaining ? equal_before : s.remaining);
}

}  // namespace topk
}  // namespace ringcomm
