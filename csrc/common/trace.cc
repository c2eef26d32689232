#include "common/trace.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <string>

namespace ringcomm {
namespace trace {

std::atomic<bool> active{false};

namespace {
std::mutex mu;
std::vector<Event> events;
size_t capacity = 0;
uint64_t dropped = 0;
std::map<int32_t, std::string> thread_names;  // every thread that recorded since enable()
}  // namespace

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int32_t thread_id() {
  thread_local const int32_t id = int32_t(syscall(SYS_gettid));
  return id;
}

void enable(bool on, size_t max_events) {
  std::lock_guard<std::mutex> lk(mu);
  if (on) {
    events.clear();
    thread_names.clear();
    dropped = 0;
    capacity = max_events;
    events.reserve(std::min<size_t>(max_events, 1 << 16));
  }
  active.store(on, std::memory_order_relaxed);
}

void record(const Event& e) {
  std::lock_guard<std::mutex> lk(mu);
  if (events.size() >= capacity) {
    ++dropped;
    return;
  }
  events.push_back(e);
  // Named at its first span, not when it starts: Python may name a thread after starting it.
  if (e.thread == thread_id() && !thread_names.count(e.thread)) {
    char name[16] = "";
    pthread_getname_np(pthread_self(), name, sizeof name);
    thread_names[e.thread] = name;
  }
}

Taken take() {
  Taken t;
  std::lock_guard<std::mutex> lk(mu);
  t.events.swap(events);
  t.dropped = dropped;
  dropped = 0;
  t.threads.assign(thread_names.begin(), thread_names.end());
  return t;
}

}  // namespace trace
}  // namespace ringcomm
