// Compact encoding of int32 index lists for sparse exchanges: each index as the zigzag varint of
// its difference from the previous one. Ascending top-k indices at 1% density cost about 1.3
// bytes each instead of 4; any order still round-trips, less compactly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ringcomm {
namespace cpu {

// Upper bound of encode_indices' output for n indices; each takes 1 to 5 bytes.
inline size_t max_encoded_bytes(size_t n) { return n * 5; }

// Writes the encoding of `indices[0..n)` to `out`; returns its length in bytes.
size_t encode_indices(const int32_t* indices, size_t n, uint8_t* out);

// What decode_indices saw, so that a caller checks the indices without another pass over them:
// their least and greatest, and whether they never decrease.
struct DecodedIndices {
  int32_t least = INT32_MAX, greatest = INT32_MIN;
  bool ascending = true;
};

// Decodes n indices from `in` (at most `in_bytes` long) into `indices`; returns the bytes
// consumed, or 0 if the input is truncated or malformed (so for n > 0, 0 is never a success).
// With `seen`, also what the indices were (DecodedIndices).
size_t decode_indices(const uint8_t* in, size_t in_bytes, size_t n, int32_t* indices,
                      DecodedIndices* seen = nullptr);

}  // namespace cpu
}  // namespace ringcomm
