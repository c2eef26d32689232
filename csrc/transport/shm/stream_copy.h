// Writing into a peer's slots: plain stores, or non-temporal ones where the machine makes plain
// ones expensive, chosen by measurement.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>

namespace ringcomm {
namespace shm {

// One fragment's bytes on their way into a slot, appended piece after piece (a message gathered
// from several buffers), with plain stores or streamed: the lines written around this CPU's
// caches (x86 non-temporal stores; plain ones elsewhere). Streaming writes whole lines only. The
// bytes of a piece that do not fill its last line wait here for the next piece's, so a fragment
// gathered from a thousand tensors streams every line but its last (a slot's payload starts on
// a line), where streaming each piece on its own stored the line at each edge between two
// pieces plainly: a round trip to the peer's CPU per edge where the two do not share a cache.
class SlotOut {
 public:
  SlotOut(char* dst, bool stream) : at_(dst), stream_(stream) {}
  SlotOut(const SlotOut&) = delete;
  SlotOut& operator=(const SlotOut&) = delete;
  bool streaming() const { return stream_; }
  // The next n bytes of the fragment.
  void append(const void* src, size_t n);
  // Stores what waits of the last line, and orders the streamed lines ahead of the stores after
  // this (the release that hands the slot to the peer).
  void finish();

 private:
  char* at_;  // where the first byte not yet stored goes
  bool stream_;
  size_t held_ = 0;  // bytes waiting in line_, for at_ onwards
  alignas(16) unsigned char line_[64];
};

// RINGCOMM_SHM_STREAM: how a sender writes slot fragments.
enum class StreamMode { kAuto, kNever, kAlways };

// Writes one sender's fragments into one peer's slots. A slot the peer has read holds lines in
// the peer's caches, and a plain store must take each line back before writing it: a round trip
// between the two CPUs per line. Where they share a cache that is cheap, and plain stores leave
// the bytes in that cache for the peer to read. Where they do not (two CCDs of an AMD EPYC, two
// sockets, or a virtual machine whose CPUs the host moves apart for minutes at a time), plain
// writes run several times slower than streaming ones, which take no line back and run alike in
// both states. Streaming costs where plain is cheap (the peer then reads from memory), so kAuto
// times both and streams while a plain write takes more than kStreamAboveNsPerByte longer per
// byte, timing the other way again every kRecheck, as the host may move the CPUs back. That
// threshold lies between what plain writes cost more with a shared cache, where streaming slows
// small all-reduces, and apart (docs/algorithms.md). A difference, not a ratio: both timings
// include reading the source, which a fragment gathered from a thousand small tensors does
// slowly, and that narrows the ratio while streaming still makes that all-reduce faster. Each
// way's rate is the median of its last kSamples timings: a sender preempted mid-copy (more ranks
// than cores) looks slower once, and a plain write that finds the peer's copies of its lines
// already gone looks faster once, which the best of a few would follow.
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

  explicit SlotWriter(StreamMode mode = StreamMode::kAuto) : mode_(mode) {}

  // kAuto's rule, given each way's median rate in bytes per ns.
  static bool stream_pays(double plain, double streaming);
  // The median of `count` (1 .. kSamples) rates.
  static double median(const double* rates, int count);

  // Writes one fragment of `n` bytes into a slot at `dst`: fill(out) appends them all to the
  // SlotOut `out`, or, where !out.streaming(), may store them at dst itself.
  template <typename Fill>
  void write(char* dst, size_t n, Fill&& fill) {
    const bool timed = n >= kLeastBytes && mode_ == StreamMode::kAuto;
    const Clock::time_point start = timed ? Clock::now() : Clock::time_point{};
    const bool stream = n >= kLeastBytes && (mode_ == StreamMode::kAlways ||
                                             (mode_ == StreamMode::kAuto && choose(start)));
    SlotOut out(dst, stream);
    fill(out);
    out.finish();
    if (timed) record(stream, n, start, Clock::now());
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Rate {
    double bytes_per_ns[kSamples] = {};  // the last `count` timings
    double median = 0;                   // theirs, updated as each comes in
    int next = 0, count = 0;
    Clock::time_point measured{};
  };
  bool choose(Clock::time_point now) const;
  void record(bool stream, size_t n, Clock::time_point start, Clock::time_point end);

  StreamMode mode_;
  bool streaming_ = false;
  Rate plain_, stream_;
};

}  // namespace shm
}  // namespace ringcomm
