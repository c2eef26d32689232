// Ranges and RangeCursor (transport.h): walking a message laid out over several ranges of memory.
#include <algorithm>

#include "common/trace.h"
#include "kernels/cpu/pack.h"
#include "transport/transport.h"

namespace ringcomm {

size_t Ranges::bytes() const {
  size_t total = 0;
  for (size_t i = 0; i < count; ++i) total += list[i].iov_len;
  return total;
}

// Calls copy(range pointer, len) for the next `bytes` bytes, a range at a time, and moves past
// them. Empty ranges are stepped over.
template <typename Copy>
void RangeCursor::walk(size_t bytes, Copy copy) {
  while (bytes > 0) {
    const iovec& range = ranges_.list[index_];
    const size_t len = std::min(bytes, range.iov_len - offset_);
    if (len) copy(static_cast<char*>(range.iov_base) + offset_, len);
    bytes -= len;
    offset_ += len;
    if (offset_ == range.iov_len) {
      ++index_;
      offset_ = 0;
    }
  }
}

void RangeCursor::gather(char* to, size_t bytes, const char* span) {
  trace::Span on_timeline(span, bytes);
  walk(bytes, [&](const char* at, size_t len) {
    cpu::copy_bytes(to, at, len);
    to += len;
  });
}

void RangeCursor::read(size_t bytes, const char* span,
                       InplaceFunction<void(const char*, size_t)> take) {
  trace::Span on_timeline(span, bytes);
  walk(bytes, [&](const char* at, size_t len) { take(at, len); });
}

void RangeCursor::scatter(const char* from, size_t bytes, const char* span) {
  trace::Span on_timeline(span, bytes);
  walk(bytes, [&](char* at, size_t len) {
    cpu::copy_bytes(at, from, len);
    from += len;
  });
}

void RangeCursor::skip(size_t bytes) {
  walk(bytes, [](const char*, size_t) {});
}

size_t RangeCursor::peek(size_t bytes, iovec* out, size_t max, size_t* used) const {
  size_t covered = 0, n = 0, offset = offset_;
  for (size_t i = index_; i < ranges_.count && n < max && covered < bytes; ++i, offset = 0) {
    const size_t len = std::min(bytes - covered, ranges_.list[i].iov_len - offset);
    if (len == 0) continue;
    out[n++] = {static_cast<char*>(ranges_.list[i].iov_base) + offset, len};
    covered += len;
  }
  *used = n;
  return covered;
}

}  // namespace ringcomm
