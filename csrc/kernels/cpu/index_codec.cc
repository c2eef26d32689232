#include "kernels/cpu/index_codec.h"

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

size_t decode_indices(const uint8_t* in, size_t in_bytes, size_t n, int32_t* indices) {
  const uint8_t* p = in;
  const uint8_t* end = in + in_bytes;
  int64_t previous = 0;
  for (size_t i = 0; i < n; ++i) {
    uint64_t zigzag = 0;
    // At most 5 bytes, what encode_indices writes for any difference of two int32s (34 bits):
    // longer is malformed, and the sum below stays far from overflowing int64.
    for (int shift = 0;; shift += 7) {
      if (p == end || shift > 28) return 0;
      uint8_t byte = *p++;
      zigzag |= uint64_t(byte & 0x7f) << shift;
      if (!(byte & 0x80)) break;
    }
    int64_t delta = int64_t(zigzag >> 1) ^ -int64_t(zigzag & 1);
    previous += delta;
    if (previous < INT32_MIN || previous > INT32_MAX) return 0;
    indices[i] = int32_t(previous);
  }
  return size_t(p - in);
}

}  // namespace cpu
}  // namespace ringcomm
