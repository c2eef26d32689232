// Fuzz target: cpu::decode_indices (kernels/cpu/index_codec.h), the sparse all-reduce's decoder
// of the index lists peers send (zigzag-varint deltas).
//
// Input: byte 0 picks the mode.
//   even: decode. Bytes 1-2 are the count n claimed for the list (up to 4096, more than the
//         bytes can hold is allowed), the rest is the encoding as a peer sent it. The decoder
//         must stay within the bytes and the n output slots, consume no more than it was given,
//         and whatever it accepts must be a list it could have encoded: re-encoding it is no
//         longer and decodes to the same indices. What it reports seeing (DecodedIndices) is
//         what the list holds.
//   odd:  round trip. The rest is an index list: int32s as they come (bit 1 of byte 0 clear)
//         or ascending, one byte of delta each (set; the top-k case). Encoding fits in
//         max_encoded_bytes, decodes back exactly, consuming all of it, and any truncation of
//         it is rejected.
#include <algorithm>
#include <vector>

#include "fuzz_input.h"
#include "kernels/cpu/index_codec.h"

using ringcomm::cpu::decode_indices;
using ringcomm::cpu::encode_indices;
using ringcomm::cpu::max_encoded_bytes;

namespace {

// Encodes indices[0..n) into an exact-size buffer and checks it decodes back.
std::vector<uint8_t> round_trip(const int32_t* indices, size_t n) {
  const size_t room = max_encoded_bytes(n);
  std::unique_ptr<char[]> enc = exact_buffer(room);
  const auto* bytes = reinterpret_cast<const uint8_t*>(enc.get());
  const size_t len = encode_indices(indices, n, reinterpret_cast<uint8_t*>(enc.get()));
  FUZZ_CHECK(len <= room);
  FUZZ_CHECK(n == 0 || len >= n);  // at least one byte per index
  std::unique_ptr<char[]> back = exact_buffer(n * sizeof(int32_t));
  auto* decoded = reinterpret_cast<int32_t*>(back.get());
  FUZZ_CHECK(decode_indices(bytes, len, n, decoded) == len);
  FUZZ_CHECK(n == 0 || std::memcmp(decoded, indices, n * sizeof(int32_t)) == 0);
  // Cut short, it is malformed: the last index is missing a byte.
  if (n > 0) {
    std::unique_ptr<char[]> cut = exact_buffer(len - 1);
    if (len > 1) std::memcpy(cut.get(), enc.get(), len - 1);
    FUZZ_CHECK(decode_indices(reinterpret_cast<const uint8_t*>(cut.get()), len - 1, n, decoded) ==
               0);
  }
  return std::vector<uint8_t>(bytes, bytes + len);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const uint8_t mode = in.take<uint8_t>();
  if (mode % 2 == 0) {
    const size_t n = in.take<uint16_t>() % 4097;
    const size_t in_bytes = in.left();
    std::unique_ptr<char[]> peer = in.bytes(in_bytes);
    const auto* bytes = reinterpret_cast<const uint8_t*>(peer.get());
    std::unique_ptr<char[]> slots = exact_buffer(n * sizeof(int32_t));  // exactly n slots
    auto* indices = reinterpret_cast<int32_t*>(slots.get());
    ringcomm::cpu::DecodedIndices seen;
    const size_t used = decode_indices(bytes, in_bytes, n, indices, &seen);
    FUZZ_CHECK(used <= in_bytes);
    if (n > in_bytes) FUZZ_CHECK(used == 0);  // every index takes a byte at least
    if (n > 0 && used > 0) {
      // Accepted: the list re-encodes (canonically, so never longer) and round-trips.
      std::vector<uint8_t> canonical = round_trip(indices, n);
      FUZZ_CHECK(canonical.size() <= used);
      // The bytes after what was consumed do not matter.
      std::vector<int32_t> again(n);
      FUZZ_CHECK(decode_indices(bytes, used, n, again.data()) == used);
      FUZZ_CHECK(std::memcmp(again.data(), indices, n * sizeof(int32_t)) == 0);
      FUZZ_CHECK(seen.least == *std::min_element(again.begin(), again.end()));
      FUZZ_CHECK(seen.greatest == *std::max_element(again.begin(), again.end()));
      FUZZ_CHECK(seen.ascending == std::is_sorted(again.begin(), again.end()));
    }
    return 0;
  }
  std::vector<int32_t> indices;
  if (mode & 2) {
    int32_t at = 0;
    while (in.left() > 0 && at <= INT32_MAX - 255) indices.push_back(at += in.take<uint8_t>());
  } else {
    while (in.left() > 0) indices.push_back(in.take<int32_t>());
  }
  round_trip(indices.data(), indices.size());
  return 0;
}
