// What the fuzz targets share: reading a fuzzer input front to back, and failing loudly.
//
// Peer data is copied into a heap buffer of exactly its length (Input::bytes), as a transport
// delivers it, so AddressSanitizer reports any read past what the peer sent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

// A property every input must keep; a failure is a crash libFuzzer saves the input of.
#define FUZZ_CHECK(cond)                                                                   \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "FUZZ_CHECK failed: %s at %s:%d\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

// A buffer of exactly n bytes (ASan sees the first byte past it), or null for none, as an empty
// tensor's data may be: code given no bytes must not touch the pointer.
inline std::unique_ptr<char[]> exact_buffer(size_t n) {
  return n ? std::unique_ptr<char[]>(new char[n]) : nullptr;
}

class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}

  size_t left() const { return size_t(end_ - p_); }

  // The next sizeof(T) bytes, little-endian; missing ones (past the end) read as zero.
  template <typename T>
  T take() {
    uint8_t raw[sizeof(T)] = {};
    size_t n = left() < sizeof(T) ? left() : sizeof(T);
    if (n) std::memcpy(raw, p_, n);
    p_ += n;
    T v;
    std::memcpy(&v, raw, sizeof(T));
    return v;
  }

  // The next n bytes (at most left(): a transport delivers a message whole or not at all) in an
  // exact_buffer.
  std::unique_ptr<char[]> bytes(size_t n) {
    if (n > left()) std::abort();  // the target did not check left()
    std::unique_ptr<char[]> b = exact_buffer(n);
    if (n) std::memcpy(b.get(), p_, n);
    p_ += n;
    return b;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};
