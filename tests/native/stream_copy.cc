// SlotOut (csrc/transport/shm/stream_copy.h) against memcpy, streaming and plain: every
// alignment of source and destination within a line, lengths around the head (up to a line
// boundary) and the 64-byte body, as one piece and cut into pieces that end inside a line, on
// its edge and across several, and the bytes around the destination left alone; then SlotWriter
// in each mode writing fragments of several pieces; then kAuto's rule on rates of CPUs that share
// a cache and of CPUs that do not. Prints "ok", or the first difference and exits 1.
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
  const size_t lengths[] = {
      0, 1, 15, 16, 17, 63, 64, 65, 79, 127, 128, 129, 1000, 4096 + 13, (64 << 10) + 7};
  std::vector<unsigned char> src((128 << 10) + 256);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  // Cuts of a fragment into pieces: none, then pieces of these lengths over and over.
  const std::vector<std::vector<size_t>> cuts = {{}, {1}, {3, 61}, {64}, {5, 200, 64, 1}, {130}};
  for (bool stream : {true, false})
    for (size_t n : lengths)
      for (const auto& cut : cuts)
        for (size_t a = 0; a < 64; a += (n > 4096 ? 13 : 1))
          for (size_t b = 0; b < 64; b += (n > 4096 ? 17 : 3)) {
            std::vector<unsigned char> got(n + a + 2 * kGuard, 0xee), want = got;
            {
              ringcomm::shm::SlotOut out(reinterpret_cast<char*>(got.data() + kGuard + a), stream);
              size_t at = 0;
              for (size_t i = 0; at < n; ++i) {
                const size_t len = cut.empty() ? n : std::min(n - at, cut[i % cut.size()]);
                out.append(src.data() + b + at, len);
                at += len;
              }
              out.finish();
            }
            std::memcpy(want.data() + kGuard + a, src.data() + b, n);
            if (!check(got, want, stream ? "SlotOut streaming" : "SlotOut plain", a, b, n))
              return 1;
          }
  // A fragment written as three pieces, as a slot is filled from a message's ranges.
  const size_t n = (64 << 10) + 5, pieces[] = {1000, 40000 + 3, n - 41003};
  for (StreamMode mode : {StreamMode::kNever, StreamMode::kAlways, StreamMode::kAuto}) {
    SlotWriter writer(mode);
    for (int fragment = 0; fragment < 50; ++fragment) {  // auto: both ways timed, then chosen
      std::vector<unsigned char> got(n + 2 * kGuard, 0xee), want = got;
      writer.write(reinterpret_cast<char*>(got.data() + kGuard + 1), n,
                   [&](ringcomm::shm::SlotOut& out) {
                     size_t at = 0;
                     for (size_t len : pieces) {
                       out.append(src.data() + fragment + at, len);
                       at += len;
                     }
                   });
      std::memcpy(want.data() + kGuard + 1, src.data() + fragment, n);
      if (!check(got, want, "SlotWriter", 1, size_t(fragment), n)) return 1;
    }
  }
  // kAuto's rule, GB/s (= bytes per ns), plain then streaming: sharing a cache, plain writes of
  // lines the peer read ran at 7-10 against 26-35; apart, 2.3-2.6 against 26-27; gathered from
  // a thousand spread tensors, apart, 2.4 against 10-13 (a ratio of more than a fifth, and
  // streaming 1.4x faster); a plain write that found the peer's lines gone, 4.8 once; a
  // streaming one preempted, 1.0 once; coalesced parts sharing a cache, plain 35-45.
  struct Case {
    const char* what;
    double plain[SlotWriter::kSamples], streaming[SlotWriter::kSamples];
    int plain_count, streaming_count;
    bool streams;
  } cases[] = {
      {"shared cache", {8.5, 9.0, 7.0, 10.0, 8.0}, {26, 30, 35, 28, 27}, 5, 5, false},
      {"apart", {2.4, 2.5, 2.6, 2.3, 2.4}, {26, 27, 26, 26, 27}, 5, 5, true},
      {"apart, spread sources", {2.4, 2.4, 2.5, 2.4, 2.3}, {10, 11, 12, 13, 10.5}, 5, 5, true},
      {"apart, one fast plain write",
       {2.4, 4.8, 2.5, 2.6, 2.4},
       {19.5, 19.5, 19.5, 19.5, 19.5},
       5,
       5,
       true},
      {"shared, one preempted stream", {20, 19, 21, 18, 20}, {26, 1.0, 27, 28, 26}, 5, 5, false},
      {"shared, coalesced parts", {40, 35, 45, 38, 42}, {26, 25, 26, 24, 26}, 5, 5, false},
      {"first timings, apart", {2.4}, {26, 27}, 1, 2, true},
  };
  for (const Case& c : cases)
    if (SlotWriter::stream_pays(SlotWriter::median(c.plain, c.plain_count),
                                SlotWriter::median(c.streaming, c.streaming_count)) != c.streams) {
      std::printf("stream_pays, %s: %s, expected %s\n", c.what, c.streams ? "plain" : "streams",
                  c.streams ? "streams" : "plain");
      return 1;
    }
  std::printf("ok\n");
  return 0;
}
