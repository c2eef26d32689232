// Writing into a peer's slots: plain stores, or non-temporal ones where the machine makes plain
// ones expensive, chosen by measurement.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>

namespace ringcomm {
namespace shm {

// dst <- src, n bytes, the lines of dst written around this CPU's caches (x86 non-temporal
// stores; a plain memcpy elsewhere). They are weakly ordered: stream_fence() before the release
// store that publishes them, once per fragment however many pieces filled it.
void stream_copy(void* dst, const void* src, size_t n);

// Orders every stream_copy before it ahead of the stores after it.
void stream_fence();

// RINGCOMM_SHM_STREAM: how a sender writes slot fragments.
enum class StreamMode { kAuto, kNever, kAlways };

// Writes one sender's fragments into one peer's slots. A slot the peer has read holds lines in
// the peer's caches, and a plain store must take each line back before writing it: a round trip
// between the two CPUs per line. Where they share a cache that is cheap, and plain stores leave
// the bytes in that cache for the peer to read. Where they do not (two CCDs of an AMD EPYC, two
// sockets, or a virtual machine whose vCPUs the host moved apart, as session 25's guest did for
// minutes at a time), plain writes ran at 2.5 GB/s against 20-25, and streaming ones, which
// take no line back, at 26-27 in both states (2 ranks, 16 MiB all-reduce through the slots:
// 9.5-10.4 ms plain, 1.3-1.4 ms streaming). Streaming costs where plain is cheap (the peer then
// reads from memory: 1.4-1.6 ms plain, 2.1-2.2 ms streaming), so kAuto times both and streams
// while a plain write takes more than kStreamAboveNsPerByte longer per byte, timing the other way
// again every kRecheck, as the host may move the CPUs back. With a shared cache, plain writes of
// lines the peer holds ran at 7-10 GB/s against 26-35 streaming (up to 1 MiB written at a time):
// 0.07-0.11 ns more per byte, and streaming there made a 64 KiB all-reduce 15-20% slower. Apart,
// 2.3-2.6 against 26-35: 0.35-0.40 ns more. A difference, not a ratio: both timings include
// reading the source, which a fragment gathered from a thousand small tensors does slowly, and
// that moved the ratio (2.4 against 10-13 GB/s) across the fifth that session 25 chose, while
// streaming made that coalesced all-reduce 1.4x faster. Each way's rate is the median of its
// last kSamples timings: a sender preempted mid-copy (more ranks than cores) looks slower once,
// and a plain write that finds the peer's copies of its lines already gone looks faster once
// (4.8 GB/s among 2.4-2.8: as the best of 4, that kept a coalesced all-reduce writing plainly for
// a third of its fragments).
class SlotWriter {
 public:
  // Fragments smaller than this are copied plainly and not timed: a few lines each, where the
  // clock's two readings would weigh on the copy.
  static constexpr size_t kLeastBytes = 16 << 10;
  static constexpr std::chrono::milliseconds kRecheck{10};
  // Streams while a plain write takes this much longer per byte than a streaming one, each way
  // at the median of its last kSamples timings.
  static constexpr double kStreamAboveNsPerByte = 0.2;
  static constexpr int kSamples = 5;
  using Copy = void (*)(void* dst, const void* src, size_t n);

  explicit SlotWriter(StreamMode mode = StreamMode::kAuto) : mode_(mode) {}

  // kAuto's rule, given each way's last timings in bytes per ns (1 .. kSamples of each).
  static bool stream_pays(const double* plain, int plain_count, const double* streaming,
                          int streaming_count);

  // Writes one fragment of `n` bytes into a slot: fill(copy) writes them all with `copy`, which
  // it may call once per piece of the fragment.
  template <typename Fill>
  void write(size_t n, Fill&& fill) {
    if (n < kLeastBytes || mode_ == StreamMode::kNever) return fill(plain_copy);
    if (mode_ == StreamMode::kAlways) {
      fill(stream_copy);
      return stream_fence();
    }
    const Clock::time_point start = Clock::now();
    const bool stream = choose(start);
    fill(stream ? stream_copy : plain_copy);
    if (stream) stream_fence();
    record(stream, n, start, Clock::now());
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Rate {
    double bytes_per_ns[kSamples] = {};  // the last `count` timings
    int next = 0, count = 0;
    Clock::time_point measured{};
  };
  static void plain_copy(void* dst, const void* src, size_t n);
  bool choose(Clock::time_point now) const;
  void record(bool stream, size_t n, Clock::time_point start, Clock::time_point end);

  StreamMode mode_;
  bool streaming_ = false;
  Rate plain_, stream_;
};

}  // namespace shm
}  // namespace ringcomm
