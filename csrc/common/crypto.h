// The little cryptography the handshake needs (docs/security.md): SHA-256 and HMAC-SHA256
// (FIPS 180-4, RFC 2104), a comparison whose time does not depend on where inputs differ, and
// random bytes from the kernel. Written here so that the core depends on no crypto library.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace ringcomm {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t bytes);
  Digest finish();

 private:
  void compress(const uint8_t* block);
  uint32_t state_[8];
  uint8_t block_[64];
  size_t block_bytes_ = 0;
  uint64_t total_bytes_ = 0;
};

// HMAC-SHA256 of the concatenation of `parts` (pointer, size) under `key`.
struct Bytes {
  const void* data;
  size_t size;
};
Digest hmac_sha256(const std::string& key, std::initializer_list<Bytes> parts);

// True iff a and b are equal; reads every byte whatever the first difference.
bool equal_in_constant_time(const uint8_t* a, const uint8_t* b, size_t bytes);

// `bytes` random bytes from getrandom(2); throws ringcomm::Error if the kernel has none.
void random_bytes(void* out, size_t bytes);

}  // namespace ringcomm
