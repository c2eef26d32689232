#include "kernels/cpu/index_codec.h"

#include <algorithm>

namespace ringcomm {
namespace cpu {

size_t encode_indices(const int32_t* indices, size_t n, uint8_t* out) {
  uint8_t* p = out;
  int64_t previous = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t delta = int64_t(indices[i]) - previous;
    previous = indices[i];
    uint64_t zigzag = (uint64_t(delta) << 1) ^ uint64_t(delta >> 63);
    while (zigzag >= 0x80) {
      *p++ = uint8_t(zigzag | 0x80);
      zigzag >>= 7;
    }
    *p++ = uint8_t(zigzag);
  }
  return size_t(p - out);
}

namespace {

// One varint of at most 5 bytes, what encode_indices writes for any difference of two int32s
// (34 bits): longer is malformed, and the caller's sum stays far from overflowing int64.
// Returns false if it is malformed or runs past `end`.
inline bool read_varint(const uint8_t*& p, const uint8_t* end, uint64_t& value) {
  if (end - p >= 5) {  // the common case: no bound to check byte by byte
    value = p[0] & 0x7f;
    if (p[0] < 0x80) return ++p, true;
    for (int i = 1; i < 5; ++i) {
      value |= uint64_t(p[i] & 0x7f) << (7 * i);
      if (p[i] < 0x80) return p += i + 1, true;
    }
    return false;
  }
  value = 0;
  for (int shift = 0;; shift += 7) {
    if (p == end || shift > 28) return false;
    const uint8_t byte = *p++;
    value |= uint64_t(byte & 0x7f) << shift;
    if (!(byte & 0x80)) return true;
  }
}

}  // namespace

size_t decode_indices(const uint8_t* in, size_t in_bytes, size_t n, int32_t* indices,
                      DecodedIndices* seen) {
  const uint8_t* p = in;
  const uint8_t* end = in + in_bytes;
  int64_t previous = 0;
  uint64_t descents = 0;  // differences below zero after the first index
  for (size_t i = 0; i < n; ++i) {
    uint64_t zigzag;
    if (!read_varint(p, end, zigzag)) return 0;
    const int64_t delta = int64_t(zigzag >> 1) ^ -int64_t(zigzag & 1);
    previous += delta;
    if (previous < INT32_MIN || previous > INT32_MAX) return 0;
    indices[i] = int32_t(previous);
    descents += zigzag & 1;  // odd zigzag: a negative difference
  }
  if (seen && n > 0) {
    descents -= indices[0] < 0;  // the first "difference" is from 0
    if (descents == 0) {
      *seen = DecodedIndices{indices[0], indices[n - 1], true};
    } else {  // any order round-trips: its range needs a look at every index
      auto [least, greatest] = std::minmax_element(indices, indices + n);
      *seen = DecodedIndices{*least, *greatest, false};
    }
  } else if (seen) {
    *seen = DecodedIndices{};
  }
  return size_t(p - in);
}

}  // namespace cpu
}  // namespace ringcomm
