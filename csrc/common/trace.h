// The timeline (RINGCOMM_TIMELINE, ringcomm.trace): spans of what each thread of this process did
// and when, kept in memory until Python takes them and writes Chrome trace JSON. Process-wide, so
// that the spans of every communicator share one clock (CLOCK_MONOTONIC, the clock of Python's
// time.monotonic_ns) and one list. Off by default; when off, a span costs one relaxed load.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ringcomm {
namespace trace {

struct Event {
  const char* name;    // a static string: "all_reduce", "send", "reduce", ...
  const char* detail;  // a static string or nullptr: the algorithm of a collective
  int64_t begin_ns, end_ns;
  int32_t thread;      // Linux thread id
  int32_t peer = -1;   // send/recv: the other rank
  int64_t seq = -1;    // collective: its sequence number in its communicator
  uint64_t bytes = 0;  // payload bytes
  uint64_t comm = 0;   // the communicator (its number in this process)
};

extern std::atomic<bool> active;
inline bool enabled() { return active.load(std::memory_order_relaxed); }
int64_t now_ns();
// A steady_clock time as now_ns() would have read it (both are CLOCK_MONOTONIC).
inline int64_t ns_of(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
int32_t thread_id();

// Starts recording (dropping what an earlier recording left) or stops it; what is recorded stays
// until take().
void enable(bool on, size_t max_events);
void record(const Event& e);
// The spans recorded since the last take(), the number dropped because the list was full, and
// the names of the threads they ran on (thread id, name).
struct Taken {
  std::vector<Event> events;
  uint64_t dropped = 0;
  std::vector<std::pair<int32_t, std::string>> threads;
};
Taken take();

// A span from construction to destruction on this thread, recorded if the timeline is on when
// it begins.
class Span {
 public:
  explicit Span(const char* name, uint64_t bytes = 0, int32_t peer = -1)
      : on_(enabled()), name_(name), bytes_(bytes), peer_(peer), begin_(on_ ? now_ns() : 0) {}
  ~Span() {
    if (!on_) return;
    Event e{name_, nullptr, begin_, now_ns(), thread_id()};
    e.peer = peer_;
    e.bytes = bytes_;
    record(e);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const bool on_;
  const char* name_;
  uint64_t bytes_;
  int32_t peer_;
  int64_t begin_;
};

}  // namespace trace
}  // namespace ringcomm
