// Two processes exchange bytes through shared memory with plain memcpy, no ringcomm code: the
// machine's own rate for moving data between CPUs, sampled every half second, beside a local
// memcpy of 16 MiB (the bytes of a round) in the same process. On a virtual machine whose host
// moves its CPUs apart now and then, the exchange switches between two speeds for seconds at a
// time while the local copy stays put: the states that make ringcomm's shared-memory all-reduces
// flip between two speeds within one run (docs/performance.md).
//
//   g++ -O2 -o /tmp/cross_cpu_copy bench/cross_cpu_copy.cc && /tmp/cross_cpu_copy 40
//
// A round: each process sends 8 MiB to the other and receives 8 MiB, in 256 KiB fragments
// through an inbox of 8 slots per direction (the shape of RINGCOMM_SHM_SLOTS and
// RINGCOMM_SHM_SLOT_BYTES's defaults), copying in on the sending side and out on the receiving
// side: the bytes a 2-rank 16 MiB all-reduce moves between the ranks. Waiting spins with a pause
// instruction (run it on an otherwise idle machine with at least 2 CPUs).
//
// Each report also times a cache line passed back and forth between the two processes (the
// median round trip of 2000): what every flag a protocol waits on costs, which rises with the
// round's time when the CPUs move apart.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_PAUSE() _mm_pause()
#else
#define CPU_PAUSE() ((void)0)
#endif

namespace {

constexpr size_t kSlots = 8, kSlotBytes = 256 << 10, kRoundBytes = 8 << 20;
constexpr double kReportSeconds = 0.5, kGraceSeconds = 10;
constexpr uint64_t kTrips = 2000;  // round trips timed per report

struct Inbox {
  alignas(64) std::atomic<uint64_t> head;  // fragments written by the sender
  alignas(64) std::atomic<uint64_t> tail;  // fragments read by the receiver
};

struct Control {
  alignas(64) std::atomic<int> stop;
  alignas(64) std::atomic<uint64_t> request;  // round-trip timings asked for by process 0
  alignas(64) std::atomic<uint64_t> ball;     // odd: process 0 threw it; even: process 1 did
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Spins until `ball` holds `value`; false if that takes past `deadline` (the other one died).
bool wait_for(const std::atomic<uint64_t>& ball, uint64_t value, double deadline) {
  for (uint64_t spins = 1; ball.load(std::memory_order_acquire) != value; ++spins) {
    CPU_PAUSE();
    if (spins % 65536 == 0 && now() > deadline) return false;
  }
  return true;
}

// Timing `request`'s kTrips round trips of the ball: process 0 throws and times (median, s),
// process 1 throws it back. 0 when the other process stopped answering.
double round_trip(Control* c, int me, uint64_t request, double deadline) {
  std::vector<double> trips;
  for (uint64_t i = 0; i < kTrips; ++i) {
    const uint64_t thrown = 2 * ((request - 1) * kTrips + i) + 1;
    if (me == 1) {
      if (!wait_for(c->ball, thrown, deadline)) return 0;
      c->ball.store(thrown + 1, std::memory_order_release);
      continue;
    }
    const double t = now();
    c->ball.store(thrown, std::memory_order_release);
    if (!wait_for(c->ball, thrown + 1, deadline)) return 0;
    trips.push_back(now() - t);
  }
  return me == 0 ? median(trips) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 30;
  const size_t inbox_bytes = sizeof(Inbox) + kSlots * kSlotBytes;
  void* shared = mmap(nullptr, 2 * inbox_bytes + sizeof(Control), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  char* base = static_cast<char*>(shared);
  auto* control = new (base + 2 * inbox_bytes) Control{};
  std::atomic<int>* stop = &control->stop;
  for (int i = 0; i < 2; ++i) new (base + i * inbox_bytes) Inbox{};
  const pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  const int me = child == 0 ? 1 : 0;
  auto* out = reinterpret_cast<Inbox*>(base + me * inbox_bytes);  // I write, the other reads
  auto* in = reinterpret_cast<Inbox*>(base + (1 - me) * inbox_bytes);
  char* out_slots = reinterpret_cast<char*>(out + 1);
  char* in_slots = reinterpret_cast<char*>(in + 1);
  // written once, so no page is the kernel's shared zero page
  std::vector<char> send(kRoundBytes, 1), recv(kRoundBytes, 0);
  std::vector<char> local_src(2 * kRoundBytes, 2), local_dst(2 * kRoundBytes, 0);

  uint64_t sent = 0, received = 0, spins = 0, requests = 0;
  const double start = now();
  double mark = start;
  std::vector<double> rounds;
  if (me == 0)
    std::printf("# seconds  round(ms)  local memcpy of 16 MiB(ms)  cache-line round trip(ns)\n");
  while (!stop->load(std::memory_order_relaxed)) {
    const double round_start = now();
    size_t sent_bytes = 0, received_bytes = 0;
    while ((sent_bytes < kRoundBytes || received_bytes < kRoundBytes) &&
           !stop->load(std::memory_order_relaxed)) {
      if (sent_bytes < kRoundBytes && sent - out->tail.load(std::memory_order_acquire) < kSlots) {
        std::memcpy(out_slots + (sent % kSlots) * kSlotBytes, send.data() + sent_bytes, kSlotBytes);
        out->head.store(++sent, std::memory_order_release);
        sent_bytes += kSlotBytes;
      }
      if (received_bytes < kRoundBytes && in->head.load(std::memory_order_acquire) > received) {
        std::memcpy(recv.data() + received_bytes, in_slots + (received % kSlots) * kSlotBytes,
                    kSlotBytes);
        in->tail.store(++received, std::memory_order_release);
        received_bytes += kSlotBytes;
      }
      // Process 1 answers a timing wherever it is: process 0 asks between its rounds, maybe
      // while this one waits for the next round's bytes.
      const uint64_t asked = control->request.load(std::memory_order_acquire);
      if (me == 1 && asked > requests) {
        requests = asked;
        round_trip(control, me, asked, start + seconds + kGraceSeconds);
      }
      CPU_PAUSE();
      if (++spins % 65536 == 0 && now() - start > seconds + kGraceSeconds) {
        std::fprintf(stderr, "cross_cpu_copy: no progress from the other process\n");
        return 1;  // the other one died or never ran: give up rather than spin forever
      }
    }
    rounds.push_back(now() - round_start);
    if (now() - mark < kReportSeconds) continue;
    const double copy_start = now();
    std::memcpy(local_dst.data(), local_src.data(), local_src.size());
    const double copy = now() - copy_start;
    if (me == 0) {
      control->request.store(++requests, std::memory_order_release);
      const double trip = round_trip(control, me, requests, start + seconds + kGraceSeconds);
      if (trip == 0) {
        std::fprintf(stderr, "cross_cpu_copy: the other process stopped answering\n");
        return 1;
      }
      std::printf("%8.1f  %9.2f  %9.2f  %9.0f\n", mark - start, median(rounds) * 1e3, copy * 1e3,
                  trip * 1e9);
      std::fflush(stdout);
      if (now() - start > seconds) stop->store(1);
    }
    rounds.clear();
    mark = now();
  }
  if (me == 0) waitpid(child, nullptr, 0);
  return 0;
}
