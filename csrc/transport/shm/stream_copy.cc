#include "transport/shm/stream_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/pack.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace ringcomm {
namespace shm {

namespace {

#if defined(__x86_64__)
// Whole lines to a line-aligned dst, streamed.
void stream_lines(char* d, const char* s, size_t lines) {
  for (; lines; --lines, d += 64, s += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
}
#endif

}  // namespace

void SlotOut::append(const void* src, size_t n) {
  const auto* s = static_cast<const char*>(src);
#if defined(__x86_64__)
  if (stream_) {
    // Fill the line that waits, up to at_'s next line boundary (a dst that is not line-aligned
    // makes its first line short, stored plainly as the one edge streaming cannot cover).
    const size_t edge = 64 - (reinterpret_cast<uintptr_t>(at_) + held_) % 64;
    if (held_ || edge != 64) {
      const size_t take = std::min(n, edge);
      std::memcpy(line_ + held_, s, take);
      held_ += take, s += take, n -= take;
      if (take < edge) return;
      if (held_ == 64)
        stream_lines(at_, reinterpret_cast<const char*>(line_), 1);
      else
        std::memcpy(at_, line_, held_);
      at_ += held_;
      held_ = 0;
    }
    // Lines lead to bytes that wait: at_ is on a line boundary here.
    stream_lines(at_, s, n / 64);
    at_ += n / 64 * 64, s += n / 64 * 64;
    held_ = n % 64;
    std::memcpy(line_, s, held_);
    return;
  }
#endif
  cpu::copy_bytes(at_, s, n);
  at_ += n;
}

void SlotOut::finish() {
  if (!stream_) return;
  std::memcpy(at_, line_, held_);
  at_ += held_;
  held_ = 0;
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// The way in use, or the other one once its figure is kRecheck old (or missing).
bool SlotWriter::choose(Clock::time_point now) const {
  const Rate& other = streaming_ ? plain_ : stream_;
  return other.count == 0 || now - other.measured > kRecheck ? !streaming_ : streaming_;
}

void SlotWriter::record(bool stream, size_t n, Clock::time_point start, Clock::time_point end) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
  Rate& r = stream ? stream_ : plain_;
  r.bytes_per_ns[r.next] = double(n) / double(std::max<int64_t>(ns, 1));
  r.next = (r.next + 1) % kSamples;
  r.count = std::min(r.count + 1, kSamples);
  r.measured = end;
  r.median = median(r.bytes_per_ns, r.count);
  if (plain_.count && stream_.count) streaming_ = stream_pays(plain_.median, stream_.median);
}

double SlotWriter::median(const double* rates, int count) {
  double sorted[kSamples];
  count = std::clamp(count, 1, kSamples);
  std::copy(rates, rates + count, sorted);
  std::nth_element(sorted, sorted + count / 2, sorted + count);
  return sorted[count / 2];
}

bool SlotWriter::stream_pays(double plain, double streaming) {
  return 1 / plain - 1 / streaming > kStreamAboveNsPerByte;
}

}  // namespace shm
}  // namespace ringcomm
