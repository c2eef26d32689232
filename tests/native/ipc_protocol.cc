// The CUDA IPC transport's signals (transport/cuda_ipc/ipc_protocol.h) and the window plans
// (algorithms/window_plan.h) run by real processes over shared memory, as the transport runs
// them over a GPU's: a memfd segment of signal slots and one window per rank, every rank a
// forked process that runs its plans action by action (copies with memcpy, folds with the fold
// the CUDA kernel runs, kernels/fold_math.h), with random pauses between actions.
//
// usage: ipc_protocol MODE
//   plans    worlds 1-8: one-shot, shared-buffer and ring all-reduces back to back (three dtypes,
//            four ops, sizes 0 to several rounds), counts from 0 and from just below 2^32; each
//            rank checks its result bit for bit against the fold it expects; all-gathers of
//            equal and unequal blocks between them; reduce-scatters, each rank's block bit
//            for bit, and all-to-alls
//   timeout  a peer that never arrives: the bounded wait returns, naming it
//   abort    a peer sets the abort word: every waiting rank returns, naming it and its reason
//   stale    counts left from the last operation never satisfy the next; cyclic counts; a
//            waiting process released by another's stores (the watchdog's release)
//   agree    the posts of operations' signatures: ranks that run up to thousands of operations
//            apart never see a mismatch where there is none; ranks that post at once, one of
//            them another operation, always have at least one that sees it
//   messages worlds 2-8: every rank sends to the next and receives from the one before while it
//            runs an all-reduce, the three plans run at once by three threads (as by three
//            streams), sizes from empty to several slices; what arrives is checked bit for bit.
//            The posts of sends and receives: none differs where the pair agrees, at least one
//            side sees a receive of another size. Exchanges (all-to-alls of uneven parts,
//            scatters, gathers) between ring all-reduces, every part checked
// Prints "ok", or what failed and exits 1.
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/window_plan.h"
#include "kernels/dispatch.h"
#include "kernels/fold_math.h"
#include "transport/cuda_ipc/ipc_protocol.h"

namespace {

using namespace ringcomm;
using Clock = std::chrono::steady_clock;

constexpr size_t kRoundBytes = 4096;  // small rounds and slices: several per all-reduce
constexpr size_t kReportBytes = 512;

void* shared_memory(size_t bytes) {
  const int fd = int(syscall(SYS_memfd_create, "ringcomm-ipc-test", 0u));
  if (fd < 0 || ftruncate(fd, off_t(bytes)) != 0) {
    std::perror("memfd");
    std::exit(1);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  return p;
}

// What every rank shares: the signal segment, the windows, and a line of report per rank.
struct World {
  World(int n, uint32_t base) : n(n), layout(window_layout(n, kRoundBytes)) {
    segment = ipc::Segment(shared_memory(ipc::segment_bytes(n)), n);
    segment.init(42);
    for (int q = 0; q < n; ++q)
      for (int c = 0; c < ipc::kChannels; ++c)
        for (int p = 0; p < n; ++p) *segment.slot(q, c, p) = base;
    windows = static_cast<char*>(shared_memory(size_t(n) * layout.bytes()));
    reports = static_cast<char*>(shared_memory(size_t(n) * kReportBytes));
  }
  char* window(int r) const { return windows + size_t(r) * layout.bytes(); }
  void report(int r, const std::string& line) const {
    std::snprintf(reports + size_t(r) * kReportBytes, kReportBytes, "%s", line.c_str());
  }
  std::string report(int r) const { return reports + size_t(r) * kReportBytes; }

  int n;
  WindowLayout layout;
  ipc::Segment segment;
  char* windows;
  char* reports;
};

// Runs `body(rank)` in `n` forked processes and waits for them.
template <typename Body>
void fork_ranks(int n, Body body) {
  std::vector<pid_t> children;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      body(r);
      std::fflush(stdout);
      _exit(0);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) waitpid(pid, nullptr, 0);
}

// The outcome of a bounded wait, as a rank reports it ("" when every signal came).
std::string wait_signals(const World& w, int rank, const ipc::Await* waits, size_t n,
                         double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  int missing = -1;
  switch (ipc::wait_for(
      w.segment, rank, waits, n, [&] { return Clock::now() > deadline; }, [] { sched_yield(); },
      &missing)) {
    case ipc::WaitResult::kReady:
      return "";
    case ipc::WaitResult::kTimeout:
      return "timeout: rank " + std::to_string(waits[missing].peer) + " did not signal " +
             std::to_string(waits[missing].count) + " on channel " +
             std::to_string(waits[missing].channel);
    case ipc::WaitResult::kAborted: {
      const int by = w.segment.aborted_by();
      return "aborted by rank " + std::to_string(by) + ": " + w.segment.reason(by);
    }
  }
  return "?";
}

// Rank `rank` runs `plan` over its buffer `data`; "" when it ran through, else why it stopped.
std::string run_plan(const World& w, int rank, const WindowPlan& plan, char* data, DType dtype,
                     ReduceOp op, double timeout_s, std::mt19937& random,
                     const char* source = nullptr) {
  const size_t e = dtype_size(dtype);
  auto address = [&](const WindowRef& r) -> char* {
    if (r.rank == WindowRef::kCaller) return data + r.offset;
    if (r.rank == WindowRef::kSource) return const_cast<char*>(source) + r.offset;
    return w.window(r.rank) + r.offset;
  };
  for (const WindowAction& a : plan.actions) {
    // Pauses where another process may run: the orders the signals allow, not one schedule.
    const unsigned dice = random() % 16;
    if (dice == 0) sched_yield();
    if (dice == 1) std::this_thread::sleep_for(std::chrono::microseconds(random() % 300));
    const WindowRef* refs = plan.refs.data() + a.first;
    switch (a.kind) {
      case WindowAction::kSync:
        if (!a.sync.wait) {
          w.segment.signal(rank, a.sync.peer, a.sync.channel, a.sync.count);
        } else {
          const ipc::Await wait{a.sync.channel, a.sync.peer, a.sync.count};
          const std::string why = wait_signals(w, rank, &wait, 1, timeout_s);
          if (!why.empty()) return why;
        }
        break;
      case WindowAction::kCopy:
        std::memcpy(address(refs[1]), address(refs[0]), a.count * e);
        break;
      case WindowAction::kFold:
        kernels::visit_reduce(dtype, op, [&](auto type, auto reduce_op) {
          using T = typename decltype(type)::type;
          std::vector<const T*> sources;
          for (int s = 0; s < a.sources; ++s)
            sources.push_back(reinterpret_cast<const T*>(address(refs[s])));
          const int divisor = a.divide ? w.n : 0;
          for (size_t i = 0; i < a.count; ++i) {
            const T v = math::fold_one(sources.data(), a.sources, i, reduce_op, divisor);
            for (int d = 0; d < a.dests; ++d)
              reinterpret_cast<T*>(address(refs[a.sources + d]))[i] = v;
          }
        });
        break;
    }
  }
  return "";
}

template <typename T>
T make(float x) {
  if constexpr (std::is_same_v<T, math::Half>)
    return T{math::float_to_fp16(x)};
  else if constexpr (std::is_same_v<T, math::BFloat16>)
    return T{math::float_to_bf16(x)};
  else
    return T(x);
}

struct Case {
  Algorithm algo;
  DType dtype;
  ReduceOp op;
  size_t count;
};

// Whether every rank reported "ok"; prints the first that did not.
bool all_ok(const World& w, uint32_t base) {
  for (int r = 0; r < w.n; ++r)
    if (w.report(r) != "ok") {
      std::printf("world %d, counts from %u, rank %d: %s\n", w.n, base, r, w.report(r).c_str());
      return false;
    }
  return true;
}

// Rank r's input to case `index`: whole numbers for the ring, whose order of folding differs
// from block to block (any order gives their exact sum); any float for the others.
std::vector<char> input(const Case& c, int index, int r) {
  std::vector<char> bytes(c.count * dtype_size(c.dtype) + 1);
  std::mt19937 random(unsigned(1000 * index + r));
  kernels::visit_dtype(c.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    if constexpr (!std::is_same_v<T, math::Bool>) {
      T* data = reinterpret_cast<T*>(bytes.data());
      for (size_t i = 0; i < c.count; ++i) {
        const float x = c.algo == Algorithm::kRing ? float(int(random() % 17) - 8)
                                                   : float(random() % 100000) / 12345.0f - 4.0f;
        data[i] = make<T>(x);
      }
    }
  });
  return bytes;
}

// What every rank must hold after case `index`: every rank's input folded in rank order.
std::vector<char> expected(const Case& c, int index, int n) {
  std::vector<std::vector<char>> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(input(c, index, r));
  std::vector<char> out(c.count * dtype_size(c.dtype) + 1);
  kernels::visit_reduce(c.dtype, c.op, [&](auto type, auto reduce_op) {
    using T = typename decltype(type)::type;
    std::vector<const T*> sources;
    for (const auto& in : inputs) sources.push_back(reinterpret_cast<const T*>(in.data()));
    T* o = reinterpret_cast<T*>(out.data());
    for (size_t i = 0; i < c.count; ++i)
      o[i] = math::fold_one(sources.data(), n, i, reduce_op, c.op == ReduceOp::kAvg ? n : 0);
  });
  return out;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const size_t counts[] = {0, 1, 7, 1001, 3 * 1024 + 5};
  for (Algorithm algo : {Algorithm::kOneShot, Algorithm::kSharedBuffer, Algorithm::kRing})
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax})
        for (size_t count : counts) out.push_back({algo, dtype, op, count});
  // The algorithms interleaved: the halves and counts carry over from one to the next.
  for (int i = 0; i < 24; ++i) {
    const Algorithm algo = i % 3 == 0   ? Algorithm::kRing
                           : i % 3 == 1 ? Algorithm::kOneShot
                                        : Algorithm::kSharedBuffer;
    out.push_back({algo, DType::kFloat32, ReduceOp::kSum, size_t(1 + 977 * i)});
  }
  return out;
}

bool plans(int n, uint32_t base) {
  World w(n, base);
  const std::vector<Case> all = cases();
  fork_ranks(n, [&](int rank) {
    WindowState state(n, base);
    std::mt19937 random(unsigned(rank + 7));
    for (size_t k = 0; k < all.size(); ++k) {
      const Case& c = all[k];
      std::vector<char> data = input(c, int(k), rank);
      const WindowPlan plan = window_all_reduce_plan(c.algo, w.layout, state, rank, c.count,
                                                     dtype_size(c.dtype), c.op == ReduceOp::kAvg);
      const std::string why = run_plan(w, rank, plan, data.data(), c.dtype, c.op, 20.0, random);
      const std::string what = std::string(algorithm_name(c.algo)) + " " + dtype_name(c.dtype) +
                               " " + op_name(c.op) + " of " + std::to_string(c.count) + ": ";
      if (!why.empty()) return w.report(rank, what + why);
      const std::vector<char> want = expected(c, int(k), n);
      if (std::memcmp(data.data(), want.data(), c.count * dtype_size(c.dtype)) != 0)
        return w.report(rank, what + "wrong result");
    }
    w.report(rank, "ok");
  });
  return all_ok(w, base);
}

// All-gathers of equal and unequal blocks (some empty, some over several rounds), each after a
// one-shot all-reduce, so the halves and counts carry over between the two kinds of plan. Each
// rank checks every block bit for bit against its owner's input.
bool gathers(int n, uint32_t base) {
  World w(n, base);
  const size_t elem = sizeof(float);
  auto block = [](int k, int q, size_t count) {
    std::vector<float> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = float(1000 * k + 100 * q) + float(i) / 8.0f;
    return out;
  };
  std::vector<std::vector<size_t>> patterns;
  for (size_t c : {size_t(0), size_t(1), size_t(7), size_t(1001), 3 * kRoundBytes + 5})
    patterns.push_back(std::vector<size_t>(size_t(n), c));
  std::vector<size_t> uneven;
  for (int q = 0; q < n; ++q) uneven.push_back(q % 3 == 1 ? 0 : size_t(q) * 700 + 3);
  patterns.push_back(uneven);
  fork_ranks(n, [&](int rank) {
    WindowState state(n, base);
    std::mt19937 random(unsigned(rank + 11));
    for (size_t k = 0; k < patterns.size(); ++k) {
      const std::vector<size_t>& counts = patterns[k];
      const std::string what = "all_gather " + std::to_string(k) + ": ";
      std::vector<float> sum(9, float(rank));
      std::string why = run_plan(
          w, rank,
          window_all_reduce_plan(Algorithm::kOneShot, w.layout, state, rank, 9, elem, false),
          reinterpret_cast<char*>(sum.data()), DType::kFloat32, ReduceOp::kSum, 20.0, random);
      if (!why.empty()) return w.report(rank, what + "the all-reduce before: " + why);
      const Segments blocks(counts);
      std::vector<float> data(blocks.offset(n) + 1, -1.0f);
      const std::vector<float> mine = block(int(k), rank, counts[size_t(rank)]);
      std::copy(mine.begin(), mine.end(), data.begin() + long(blocks.offset(rank)));
      why = run_plan(w, rank, window_all_gather_plan(w.layout, state, rank, counts, elem),
                     reinterpret_cast<char*>(data.data()), DType::kFloat32, ReduceOp::kSum, 20.0,
                     random);
      if (!why.empty()) return w.report(rank, what + why);
      for (int q = 0; q < n; ++q) {
        const std::vector<float> want = block(int(k), q, counts[size_t(q)]);
        if (!std::equal(want.begin(), want.end(), data.begin() + long(blocks.offset(q))))
          return w.report(rank, what + "block " + std::to_string(q) + " wrong");
      }
      if (data.back() != -1.0f) return w.report(rank, what + "wrote past the last block");
    }
    w.report(rank, "ok");
  });
  return all_ok(w, base);
}

// Reduce-scatters of every dtype, four ops and blocks from empty to several rounds, each after a
// one-shot all-reduce and before an all-to-all of the same inputs, so the halves and counts carry
// over between the kinds of plan. Each rank checks its reduced block bit for bit against every
// rank's input folded in rank order, and every block the all-to-all brought against its sender's.
bool scatters(int n, uint32_t base) {
  World w(n, base);
  std::vector<Case> all;  // count: the whole buffer, n blocks
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax})
      for (size_t block : {size_t(0), size_t(1), size_t(7), size_t(1001), kRoundBytes + 5})
        all.push_back({Algorithm::kOneShot, dtype, op, size_t(n) * block});
  fork_ranks(n, [&](int rank) {
    WindowState state(n, base);
    std::mt19937 random(unsigned(rank + 13));
    for (size_t k = 0; k < all.size(); ++k) {
      const Case& c = all[k];
      const size_t e = dtype_size(c.dtype), block = c.count / size_t(n);
      const std::string what = std::string("reduce_scatter ") + dtype_name(c.dtype) + " " +
                               op_name(c.op) + " of " + std::to_string(block) + " a block: ";
      std::vector<float> sum(9, float(rank));
      std::string why = run_plan(w, rank,
                                 window_all_reduce_plan(Algorithm::kOneShot, w.layout, state, rank,
                                                        9, sizeof(float), false),
                                 reinterpret_cast<char*>(sum.data()), DType::kFloat32,
                                 ReduceOp::kSum, 20.0, random);
      if (!why.empty()) return w.report(rank, what + "the all-reduce before: " + why);
      std::vector<char> data = input(c, int(k), rank);
      why = run_plan(
          w, rank,
          window_reduce_scatter_plan(w.layout, state, rank, block, e, c.op == ReduceOp::kAvg),
          data.data(), c.dtype, c.op, 20.0, random);
      if (!why.empty()) return w.report(rank, what + why);
      const std::vector<char> want = expected(c, int(k), n);
      if (std::memcmp(data.data() + size_t(rank) * block * e,
                      want.data() + size_t(rank) * block * e, block * e) != 0)
        return w.report(rank, what + "wrong result");
      // An all-to-all of the same inputs, in place: block r from rank r's block `rank`.
      data = input(c, int(k), rank);
      why = run_plan(w, rank, window_all_to_all_plan(w.layout, state, rank, block, e), data.data(),
                     c.dtype, ReduceOp::kSum, 20.0, random);
      if (!why.empty()) return w.report(rank, "all_to_all after " + what + why);
      for (int r = 0; r < n; ++r) {
        const std::vector<char> theirs = input(c, int(k), r);
        if (std::memcmp(data.data() + size_t(r) * block * e,
                        theirs.data() + size_t(rank) * block * e, block * e) != 0)
          return w.report(rank,
                          "all_to_all after " + what + "block " + std::to_string(r) + " wrong");
      }
    }
    w.report(rank, "ok");
  });
  return all_ok(w, base);
}

// Rank 2 of 3 never arrives: ranks 0 and 1 give up after their timeout, naming it.
bool timeout() {
  World w(3, 0);
  fork_ranks(3, [&](int rank) {
    if (rank == 2) return;
    WindowState state(3);
    std::mt19937 random(1);
    std::vector<char> data(64);
    const auto start = Clock::now();
    const std::string why = run_plan(
        w, rank, window_all_reduce_plan(Algorithm::kOneShot, w.layout, state, rank, 16, 4, false),
        data.data(), DType::kFloat32, ReduceOp::kSum, 0.3, random);
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    w.report(rank, took < 5 ? why : "took " + std::to_string(took) + " s: " + why);
  });
  for (int r = 0; r < 2; ++r)
    if (w.report(r) != "timeout: rank 2 did not signal 1 on channel 0") {
      std::printf("rank %d: %s\n", r, w.report(r).c_str());
      return false;
    }
  return true;
}

// Rank 3 of 4 gives up while the others wait for it: they return at once, naming it.
bool abort_word() {
  World w(4, 0);
  fork_ranks(4, [&](int rank) {
    if (rank == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      w.report(rank, w.segment.abort(rank, 5, "stopped by the test") ? "first" : "not first");
      return;
    }
    WindowState state(4);
    std::mt19937 random(2);
    std::vector<char> data(4096);
    w.report(rank, run_plan(w, rank,
                            window_all_reduce_plan(Algorithm::kSharedBuffer, w.layout, state, rank,
                                                   1000, 4, false),
                            data.data(), DType::kFloat32, ReduceOp::kSum, 30.0, random));
  });
  if (w.report(3) != "first") {
    std::printf("rank 3: %s\n", w.report(3).c_str());
    return false;
  }
  for (int r = 0; r < 3; ++r)
    if (w.report(r) != "aborted by rank 3: stopped by the test") {
      std::printf("rank %d: %s\n", r, w.report(r).c_str());
      return false;
    }
  // A second rank giving up does not replace the first's reason.
  if (w.segment.abort(1, 1, "later") || w.segment.aborted_by() != 3 || w.segment.kind(3) != 5) {
    std::printf("a second abort replaced the first\n");
    return false;
  }
  return true;
}

bool stale() {
  // Rank 0 runs two one-shot all-reduces, rank 1 only one: what rank 1's signals of the first
  // left in rank 0's slots must not let rank 0's second through.
  {
    World w(2, 0);
    fork_ranks(2, [&](int rank) {
      WindowState state(2);
      std::mt19937 random(3);
      std::vector<char> data(64);
      std::string why;
      for (int k = 0; k < (rank == 0 ? 2 : 1) && why.empty(); ++k)
        why = run_plan(
            w, rank,
            window_all_reduce_plan(Algorithm::kOneShot, w.layout, state, rank, 16, 4, false),
            data.data(), DType::kFloat32, ReduceOp::kSum, 0.3, random);
      w.report(rank, why);
    });
    if (w.report(0) != "timeout: rank 1 did not signal 2 on channel 0" || w.report(1) != "") {
      std::printf("stale counts: rank 0: %s; rank 1: %s\n", w.report(0).c_str(),
                  w.report(1).c_str());
      return false;
    }
  }
  // Cyclic counts, in one process.
  World w(2, 0);
  const ipc::Await wait{1, 1, 0xfffffffeu};
  auto ready = [&] { return wait_signals(w, 0, &wait, 1, 0.01).empty(); };
  w.segment.signal(1, 0, 1, 0xfffffffdu);
  if (ready()) return std::printf("0xfffffffd reached 0xfffffffe\n"), false;
  w.segment.signal(1, 0, 1, 2);  // wrapped past it
  if (!ready()) return std::printf("2 did not reach 0xfffffffe\n"), false;
  const ipc::Await later{1, 1, 3};
  w.segment.signal(1, 0, 1, 0xfffffffeu);
  if (wait_signals(w, 0, &later, 1, 0.01).empty())
    return std::printf("0xfffffffe reached 3\n"), false;
  // A process waiting for a signal that will not come, released by another's stores.
  const ipc::Await never{0, 1, 7};
  fork_ranks(2, [&](int rank) {
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      w.segment.release(0, &never, 1);
      return;
    }
    const auto start = Clock::now();
    const std::string why = wait_signals(w, 0, &never, 1, 30.0);
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    w.report(0, why.empty() && took < 10 ? "released" : why);
  });
  if (w.report(0) != "released") return std::printf("release: %s\n", w.report(0).c_str()), false;
  return true;
}

// Now and then a pause of up to 2 ms, or a yield: ranks drift apart by many posts.
void random_pause(std::mt19937& random) {
  const unsigned dice = random() % 64;
  if (dice == 0) std::this_thread::sleep_for(std::chrono::microseconds(random() % 2000));
  if (dice == 1) sched_yield();
}

// Every rank's arrival counted in `arrived` (shared memory); waits until it reaches `count`.
void spin_barrier(uint32_t* arrived, uint32_t count) {
  __atomic_fetch_add(arrived, 1u, __ATOMIC_ACQ_REL);
  while (__atomic_load_n(arrived, __ATOMIC_ACQUIRE) < count) sched_yield();
}

// Operation k's signature words; `other`: one word off.
void operation_words(uint64_t k, bool other, uint64_t (&words)[ipc::kPostWords]) {
  for (int i = 0; i < ipc::kPostWords; ++i) words[i] = k * 0x9e3779b97f4a7c15ull + uint64_t(i);
  if (other) words[3] ^= 1;
}

bool agree() {
  // Four ranks, 3,000 operations each, pausing at random: a rank runs kPosts and more ahead,
  // writing over posts its peers have yet to compare, and none sees a mismatch.
  {
    World w(4, 0);
    fork_ranks(4, [&](int rank) {
      std::mt19937 random(10 + unsigned(rank));
      std::string why;
      for (uint64_t k = 0; k < 3000 && why.empty(); ++k) {
        uint64_t mine[ipc::kPostWords], theirs[ipc::kPostWords];
        operation_words(k, false, mine);
        w.segment.post(rank, k, mine);
        const int q = w.segment.differing(rank, k, mine, theirs);
        if (q >= 0)
          why = "operation " + std::to_string(k) + ": rank " + std::to_string(q) + " differs";
        random_pause(random);
      }
      w.report(rank, why.empty() ? "ok" : why);
    });
    if (!all_ok(w, 0)) return false;
  }
  // Trials in which the four ranks post operation t at once (a spin barrier before each); in odd
  // trials rank 2 posts another. seen[t][r]: 1 + the peer rank r found differing, 0 for none.
  constexpr int kRanks = 4, kTrials = 400;
  World w(kRanks, 0);
  auto* arrived = static_cast<uint32_t*>(shared_memory(sizeof(uint32_t)));
  auto* seen = static_cast<int8_t*>(shared_memory(size_t(kTrials) * kRanks));
  fork_ranks(kRanks, [&](int rank) {
    for (int t = 0; t < kTrials; ++t) {
      spin_barrier(arrived, uint32_t((t + 1) * kRanks));
      uint64_t mine[ipc::kPostWords], theirs[ipc::kPostWords];
      operation_words(uint64_t(t), t % 2 == 1 && rank == 2, mine);
      w.segment.post(rank, uint64_t(t), mine);
      seen[t * kRanks + rank] = int8_t(1 + w.segment.differing(rank, uint64_t(t), mine, theirs));
    }
  });
  for (int t = 0; t < kTrials; ++t) {
    bool any = false;
    for (int r = 0; r < kRanks; ++r) {
      const int peer = seen[t * kRanks + r] - 1;
      any = any || peer >= 0;
      const bool allowed = t % 2 == 1 && (r == 2 ? peer != 2 : peer == 2 || peer < 0);
      if (peer >= 0 && !allowed) {
        std::printf("trial %d: rank %d found rank %d differing\n", t, r, peer);
        return false;
      }
    }
    if (t % 2 == 1 && !any) {
      std::printf("trial %d: no rank saw rank 2's other operation\n", t);
      return false;
    }
  }
  return true;
}

// Sends and receives beside collectives: in each case every rank sends a block to rank + 1 and
// receives one from rank - 1 (with 2 ranks, both ways between the pair) while it runs an
// all-reduce, alternately the ring (whose messages use inboxes too) and the one-shot. The three
// plans are made in that order, then run at once by three threads, as three streams would run
// them. Sizes run from empty to several slices, so that sends wait for their credits.
bool messages(int n, uint32_t base) {
  World w(n, base);
  const size_t slice = w.layout.slice_bytes / sizeof(float);
  const std::vector<size_t> sizes{0, 1, 7, slice, slice + 1, 3 * slice + 5, 1001};
  auto payload = [](size_t k, int from, size_t count) {
    std::vector<float> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = float(1000 * k + 100 * size_t(from)) + float(i) / 8;
    return out;
  };
  fork_ranks(n, [&](int rank) {
    WindowState state(n, base);
    const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t count = sizes[k], sum_count = k % 2 ? 3 * slice * size_t(n) : 9;
      std::vector<float> out = payload(k, rank, count), in(count + 1, -1.0f);
      std::vector<float> sum(sum_count, float(rank));
      const WindowPlan plans[3] = {
          window_send_plan(w.layout, state, rank, next, count, sizeof(float)),
          window_recv_plan(w.layout, state, rank, prev, count, sizeof(float)),
          window_all_reduce_plan(k % 2 ? Algorithm::kRing : Algorithm::kOneShot, w.layout, state,
                                 rank, sum_count, sizeof(float), false)};
      char* buffers[3] = {reinterpret_cast<char*>(out.data()), reinterpret_cast<char*>(in.data()),
                          reinterpret_cast<char*>(sum.data())};
      std::string why[3];
      std::vector<std::thread> streams;
      for (int i = 0; i < 3; ++i)
        streams.emplace_back([&, i] {
          std::mt19937 random(unsigned(100 * rank + 10 * i) + unsigned(k));
          why[i] = run_plan(w, rank, plans[i], buffers[i], DType::kFloat32, ReduceOp::kSum, 20.0,
                            random, buffers[i]);
        });
      for (std::thread& t : streams) t.join();
      const std::string what =
          "message " + std::to_string(k) + " of " + std::to_string(count) + ": ";
      for (int i = 0; i < 3; ++i)
        if (!why[i].empty())
          return w.report(rank, what +
                                    (i == 0   ? "send: "
                                     : i == 1 ? "recv: "
                                              : "all_reduce: ") +
                                    why[i]);
      const std::vector<float> want = payload(k, prev, count);
      if (!std::equal(want.begin(), want.end(), in.begin()))
        return w.report(rank, what + "wrong bytes from rank " + std::to_string(prev));
      if (in.back() != -1.0f) return w.report(rank, what + "wrote past the receive");
      const float total = float(n * (n - 1) / 2);
      for (float x : sum)
        if (x != total) return w.report(rank, what + "the all-reduce beside it is wrong");
    }
    w.report(rank, "ok");
  });
  return all_ok(w, base);
}

// Exchanges of every shape the collectives give them, each before a ring all-reduce, so that the
// ring's inboxes and counts carry over between the two: an all-to-all of uneven parts (some
// empty, some of several slices), a scatter and a gather from each root in turn. Each rank
// checks every part bit for bit against its sender's, and that nothing else was written.
bool exchanges(int n, uint32_t base) {
  World w(n, base);
  const size_t slice = w.layout.slice_bytes / sizeof(float);
  // What rank `from` sends rank `to` in exchange k: its size, and its values.
  auto size = [&](size_t k, int from, int to) -> size_t {
    if (k % 3 == 0)
      return (size_t(from) * 7 + size_t(to) * 3 + k) % 5 == 0 ? 0 : (from + 2 * to) * 37 + 1;
    if (k % 3 == 1) return from == int(k / 3) % n ? 2 * slice + size_t(to) : 0;  // scatter
    return to == int(k / 3) % n ? slice + 3 + size_t(from) : 0;                  // gather
  };
  auto value = [](size_t k, int from, int to, size_t i) {
    return float(100000 * k + 1000 * size_t(from) + 10 * size_t(to)) + float(i) / 4;
  };
  const size_t cases = 3 * size_t(n) + 3;
  fork_ranks(n, [&](int rank) {
    WindowState state(n, base);
    std::mt19937 random(unsigned(rank + 31));
    for (size_t k = 0; k < cases; ++k) {
      std::vector<Transfer> sends, recvs;
      size_t out = 0, in = 0;
      for (int q = 0; q < n; ++q) {
        const size_t s = size(k, rank, q), r = size(k, q, rank);
        // Every peer listed, even with nothing to send: its part is agreed.
        sends.push_back({q, out, s});
        recvs.push_back({q, in, r});
        out += s;
        in += r;
      }
      std::vector<float> source(out), data(in + 1, -1.0f);
      for (const Transfer& t : sends)
        for (size_t i = 0; i < t.count; ++i) source[t.offset + i] = value(k, rank, t.peer, i);
      const std::string what = "exchange " + std::to_string(k) + ": ";
      std::string why = run_plan(
          w, rank, window_exchange_plan(w.layout, state, rank, sends, recvs, sizeof(float)),
          reinterpret_cast<char*>(data.data()), DType::kFloat32, ReduceOp::kSum, 20.0, random,
          reinterpret_cast<const char*>(source.data()));
      if (!why.empty()) return w.report(rank, what + why);
      for (const Transfer& t : recvs)
        for (size_t i = 0; i < t.count; ++i)
          if (data[t.offset + i] != value(k, t.peer, rank, i))
            return w.report(rank, what + "wrong part from rank " + std::to_string(t.peer));
      if (data.back() != -1.0f) return w.report(rank, what + "wrote past the last part");
      std::vector<float> sum(3 * slice * size_t(n) + 1, float(rank));
      why = run_plan(w, rank,
                     window_all_reduce_plan(Algorithm::kRing, w.layout, state, rank, sum.size(),
                                            sizeof(float), false),
                     reinterpret_cast<char*>(sum.data()), DType::kFloat32, ReduceOp::kSum, 20.0,
                     random);
      if (!why.empty()) return w.report(rank, what + "the all-reduce after: " + why);
      for (float x : sum)
        if (x != float(n * (n - 1) / 2))
          return w.report(rank, what + "the all-reduce after is wrong");
    }
    w.report(rank, "ok");
  });
  return all_ok(w, base);
}

bool message_posts() {
  // Rank 0 sends 3,000 messages to rank 1 and rank 1 receives them, each pausing at random (the
  // sender runs kMessagePosts and more ahead): no side sees a mismatch.
  {
    World w(2, 0);
    fork_ranks(2, [&](int rank) {
      std::mt19937 random(20 + unsigned(rank));
      std::string why;
      for (uint64_t k = 0; k < 3000 && why.empty(); ++k) {
        uint64_t mine[ipc::kPostWords], theirs[ipc::kPostWords];
        operation_words(k, false, mine);
        if (w.segment.message_differs(rank, 1 - rank, rank == 0, 0, k, mine, theirs))
          why = "message " + std::to_string(k) + " differs";
        random_pause(random);
      }
      w.report(rank, why.empty() ? "ok" : why);
    });
    if (!all_ok(w, 0)) return false;
  }
  // Trials in which rank 1 posts its send to rank 2 and rank 2 its receive at once (a spin
  // barrier before each), rank 2 another size in odd trials; ranks 0 and 3 post messages between
  // them meanwhile, which never differ. seen[t][r]: whether rank r saw a mismatch.
  constexpr int kRanks = 4, kTrials = 400;
  World w(kRanks, 0);
  auto* arrived = static_cast<uint32_t*>(shared_memory(sizeof(uint32_t)));
  auto* seen = static_cast<int8_t*>(shared_memory(size_t(kTrials) * kRanks));
  fork_ranks(kRanks, [&](int rank) {
    const int peer = rank == 1 ? 2 : rank == 2 ? 1 : 3 - rank;
    for (int t = 0; t < kTrials; ++t) {
      spin_barrier(arrived, uint32_t((t + 1) * kRanks));
      uint64_t mine[ipc::kPostWords], theirs[ipc::kPostWords];
      operation_words(uint64_t(t), t % 2 == 1 && rank == 2, mine);
      seen[t * kRanks + rank] =
          int8_t(w.segment.message_differs(rank, peer, rank < peer, 1, uint64_t(t), mine, theirs));
    }
  });
  for (int t = 0; t < kTrials; ++t) {
    for (int r : {0, 3})
      if (seen[t * kRanks + r]) {
        std::printf("trial %d: rank %d saw a mismatch where there was none\n", t, r);
        return false;
      }
    const bool any = seen[t * kRanks + 1] || seen[t * kRanks + 2];
    if (t % 2 == 0 && any) {
      std::printf("trial %d: a mismatch seen between ranks 1 and 2, which agree\n", t);
      return false;
    }
    if (t % 2 == 1 && !any) {
      std::printf("trial %d: neither rank 1 nor rank 2 saw the other size\n", t);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  bool ok = false;
  if (mode == "plans") {
    ok = true;
    for (int n = 1; n <= 8 && ok; ++n) ok = plans(n, 0) && gathers(n, 0) && scatters(n, 0);
    for (int n : {3, 8})
      if (ok) ok = plans(n, 0xfffffff0u) && gathers(n, 0xfffffff0u) && scatters(n, 0xfffffff0u);
  } else if (mode == "timeout") {
    ok = timeout();
  } else if (mode == "abort") {
    ok = abort_word();
  } else if (mode == "stale") {
    ok = stale();
  } else if (mode == "agree") {
    ok = agree();
  } else if (mode == "messages") {
    ok = message_posts();
    for (int n = 2; n <= 8 && ok; ++n) ok = messages(n, 0) && exchanges(n, 0);
    if (ok) ok = messages(3, 0xfffffff0u) && exchanges(3, 0xfffffff0u);
  } else {
    std::printf("usage: ipc_protocol plans|timeout|abort|stale|agree|messages\n");
    return 2;
  }
  if (ok) std::printf("ok\n");
  return ok ? 0 : 1;
}
