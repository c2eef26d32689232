#include "transport/shm/stream_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace ringcomm {
namespace shm {

void stream_copy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Plain stores up to dst's first 16-byte boundary, streaming ones 64 bytes at a time, plain
  // ones for the tail.
  const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 64; d += 64, s += 64, n -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, n);
  _mm_sfence();  // streaming stores are weakly ordered: all of them before the caller publishes
#else
  std::memcpy(dst, src, n);
#endif
}

void SlotWriter::plain_copy(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }

// The way in use, or the other one once its figure is kRecheck old (or missing).
bool SlotWriter::choose(Clock::time_point now) const {
  const Rate& other = streaming_ ? plain_ : stream_;
  return other.best() == 0 || now - other.measured > kRecheck ? !streaming_ : streaming_;
}

void SlotWriter::record(bool stream, size_t n, Clock::time_point start, Clock::time_point end) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
  Rate& r = stream ? stream_ : plain_;
  r.bytes_per_ns[r.next] = double(n) / double(std::max<int64_t>(ns, 1));
  r.next = (r.next + 1) % kSamples;
  r.measured = end;
  if (plain_.best() > 0 && stream_.best() > 0) streaming_ = plain_.best() < 0.2 * stream_.best();
}

}  // namespace shm
}  // namespace ringcomm
