// stream_copy (csrc/transport/shm/stream_copy.h) against memcpy: every alignment of source and
// destination within a line, lengths around the 16-byte head and the 64-byte body, and the bytes
// around the destination left alone; then SlotWriter in each mode copying fragments of several
// pieces. Prints "ok", or the first difference and exits 1.
//
// usage: stream_copy
#include <cstdio>
#include <cstring>
#include <vector>

#include "transport/shm/stream_copy.h"

namespace {

using ringcomm::shm::SlotWriter;
using ringcomm::shm::StreamMode;

bool check(const std::vector<unsigned char>& got, const std::vector<unsigned char>& want,
           const char* what, size_t a, size_t b, size_t n) {
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      std::printf("%s: dst offset %zu, src offset %zu, %zu bytes: byte %zu is %d, not %d\n", what,
                  a, b, n, i, got[i], want[i]);
      return false;
    }
  return true;
}

}  // namespace

int main() {
  constexpr size_t kGuard = 128;
  const size_t lengths[] = {0, 1, 15, 16, 17, 63, 64, 65, 79, 127, 128, 129, 1000, 4096 + 13,
                            (64 << 10) + 7};
  std::vector<unsigned char> src((128 << 10) + 256);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  for (size_t n : lengths)
    for (size_t a = 0; a < 64; a += (n > 4096 ? 13 : 1))
      for (size_t b = 0; b < 64; b += (n > 4096 ? 17 : 3)) {
        std::vector<unsigned char> got(n + a + 2 * kGuard, 0xee), want = got;
        ringcomm::shm::stream_copy(got.data() + kGuard + a, src.data() + b, n);
        ringcomm::shm::stream_fence();
        std::memcpy(want.data() + kGuard + a, src.data() + b, n);
        if (!check(got, want, "stream_copy", a, b, n)) return 1;
      }
  // A fragment written as three pieces, as a slot is filled from a message's ranges.
  const size_t n = (64 << 10) + 5, pieces[] = {1000, 40000 + 3, n - 41003};
  for (StreamMode mode : {StreamMode::kNever, StreamMode::kAlways, StreamMode::kAuto}) {
    SlotWriter writer(mode);
    for (int fragment = 0; fragment < 50; ++fragment) {  // auto: both ways timed, then chosen
      std::vector<unsigned char> got(n + 2 * kGuard, 0xee), want = got;
      writer.write(n, [&](SlotWriter::Copy copy) {
        size_t at = 0;
        for (size_t len : pieces) {
          copy(got.data() + kGuard + 1 + at, src.data() + fragment + at, len);
          at += len;
        }
      });
      std::memcpy(want.data() + kGuard + 1, src.data() + fragment, n);
      if (!check(got, want, "SlotWriter", 1, size_t(fragment), n)) return 1;
    }
  }
  std::printf("ok\n");
  return 0;
}
