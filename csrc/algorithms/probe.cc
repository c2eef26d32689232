// The link probe behind the cost model (algorithms/select.h), run once when a communicator
// connects, on every rank at once:
//   1. alpha, by where the links run:
//      - among ranks of one host, 3 + 15 all-reduces of 8 bytes by recursive doubling and as
//        many by the ring, in turn: alpha is the difference of their median times over the
//        difference of their rounds (2(n-1) against log2(p), + 2 for a fold). What a call costs
//        whatever its rounds (the executor's set-up, the reduce, the last wait) cancels out, and
//        each round waits for a message its partner sends only once it has the previous one.
//        Shifts (below) do not wait so: ranks of one host share its CPUs, and a rank can run
//        many shifts back to back, timing a post rather than a round. Timing the
//        recursive-doubling calls alone would put a call's fixed cost on its one round at 2 ranks.
//      - where the ranks span several hosts, 3 + 15 shifts of 8 bytes around the ring (each rank
//        sends to rank+1 while receiving from rank-1, and waits for both): the median of the
//        last 15; for the links inside each host too (step 3). Between hosts a round's latency
//        overlaps its transfer, as back-to-back shifts do; the difference above charges every
//        round a whole hop, and so steered auto to recursive doubling where halving-doubling was
//        faster. Inside hosts whose ranks share CPUs with other hosts' ranks it swings with their
//        load.
//   2. shifts of 64 KiB, then of 512 KiB, then of 4 MiB, until the slowest rank's shift takes
//      2 ms (every rank learns that time by a recursive-doubling max, so all go on alike): each
//      size first untimed for 512 KiB in all (a link's token bucket or a TCP window has grown
//      by then), then 3 timed; beta = bytes / (median time - alpha) of the last size.
//   3. where the ranks span several hosts with several on each: steps 1 and 2 again inside each
//      host (a view of its ranks, all hosts at once), for the links inside a host; the ring of
//      step 1 and 2 is then held to the pace of the links between hosts.
//   4. gamma: the best of 3 local float32 sums of 256 KiB.
//   5. where all ranks, 3 or more, share one host (probe_algorithms): all-reduces of 4 KiB, 64 KiB,
//      256 KiB, 1 MiB, 4 MiB and 16 MiB (kMeasuredBytes) by each algorithm whose estimate,
//      scaled by its factor where it was last timed or shifted by its miss there, whichever is
//      less (plan_probe), is within 1.5 times the cheapest, in blocks of 1 untimed and 3-15
//      timed rounds (about 0.5 ms by that guess). What each took over its estimate becomes its
//      factor at that size (LinkModel::factors). An algorithm not timed is taken to cost its
//      guess, and at least 1.5 times what the slowest timed one took, so
//      it stays out of reach there: given the largest factor found instead, an untimed algorithm
//      with the lowest estimate could still come out cheapest, and at just the slowest one's
//      time it could tie with it and take the tie.
//      Timed because the alpha-beta figures alone misjudge the algorithms on one host:
//      - they charge the ring and halving-doubling the same bytes, and halving-doubling fewer
//        rounds, so it wins at every size, where with ranks sharing CPUs the ring is often faster;
//      - at 64 KiB, alpha from 8 bytes and beta from 4 MiB can put the ring ahead of recursive
//        doubling, the faster of the two there.
//      Between two sizes the factors are interpolated, and beyond 16 MiB each stays at 16 MiB's.
//      Up to 16 MiB, not 4: an algorithm level with the ring at 4 MiB can be well apart from it
//      at 64 MiB, which 4 MiB's factors would hand it. 256 KiB and 4 MiB too: interpolated between
//      1 and 16 MiB, the factors gave 4 MiB to the ring where halving-doubling was faster.
//      A size whose all-reduces would take more than 200 ms in all, by the guesses, is not
//      timed, nor any larger: their factors are 1, the estimates alone. Not the last timed
//      size's factors: a small size's can favour an algorithm that moves more bytes (recursive
//      doubling), which the bytes alone rule out at large sizes.
// And, before them where local ranks may single-copy (probe_single_copy): inside each host, a ring
// all-reduce of 16 MiB (at least 2 x n messages) in slices of the single-copy size, in blocks of
// 2 untimed + 2 timed rounds with single copy off, on, on, off; single copy stays if its better
// block is the faster one on the slowest rank. Timed, not assumed: whether the kernel's one copy
// beats two memcpys depends on the host (how fast its kernel copies, whether the ranks' CPUs share
// a cache), and on some hosts single copy is the slower way (docs/algorithms.md).
// Bytes on the wire per rank: at most 11 x 64 KiB + 4 x 512 KiB + 4 x 4 MiB in steps 1-2, and in
// step 5 two blocks of 4-16 all-reduces of each size by each algorithm timed there (at 16 MiB
// usually 2 of the 4). Each rank times its own links; the caller agrees on the slowest rank's
// figures (a collective crosses every link in lockstep).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "algorithms/algorithms.h"
#include "common/logging.h"
#include "kernels/cpu/reduce.h"

namespace ringcomm {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds each of `timed` shifts of `bytes` took, after `untimed` ones.
std::vector<double> shifts(Context& ctx, char* out, char* in, size_t bytes, int untimed,
                           int timed) {
  const int n = ctx.size(), right = mod(ctx.rank() + 1, n), left = mod(ctx.rank() - 1, n);
  std::vector<double> seconds;
  for (int i = 0; i < untimed + timed; ++i) {
    const auto start = Clock::now();
    Request r = ctx.recv(left, in, bytes);
    ctx.send(right, out, bytes);
    ctx.wait(r);
    ctx.finish();
    if (i >= untimed)
      seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return seconds;
}

// Step 1 among `ctx`'s ranks: seconds per round. At least 0.1 us, a cache line's trip from one
// CPU to another, which any round takes: less is noise outweighing the difference.
double round_seconds(Context& ctx) {
  constexpr double kLeast = 1e-7;
  const int n = ctx.size(), p = butterfly_size(n);
  if (n < 2) return 0;
  const double butterfly_rounds = std::log2(double(p)) + (p < n ? 2 : 0);
  const double ring_rounds = 2.0 * (n - 1);  // more than the butterfly's for every n >= 2
  const Algorithm algos[2] = {Algorithm::kRecursiveDoubling, Algorithm::kRing};
  double value = 0;
  std::vector<double> seconds[2];
  for (int i = 0; i < 3 + 15; ++i)
    for (int a = 0; a < 2; ++a) {
      const auto start = Clock::now();
      scheduled_all_reduce(ctx, algos[a], &value, 1, DType::kFloat64, ReduceOp::kMax);
      if (i >= 3) seconds[a].push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
  return std::max(kLeast,
                  (median(seconds[1]) - median(seconds[0])) / (ring_rounds - butterfly_rounds));
}

// Steps 1 and 2 among `ctx`'s ranks: alpha by the all-reduces' difference (`by_difference`) or by
// shifts. Returns the (zeroed) send buffer.
char* probe_ring(Context& ctx, bool by_difference, double* alpha_s, double* bytes_per_s) {
  constexpr size_t kFirst = 64 << 10, kLast = 4 << 20, kDrain = 512 << 10;
  constexpr double kLongEnough = 2e-3;
  char* out = ctx.scratch(kLast);
  char* in = ctx.scratch(kLast);
  std::memset(out, 0, kLast);
  *alpha_s = by_difference ? round_seconds(ctx) : median(shifts(ctx, out, in, 8, 3, 15));
  size_t bytes = kFirst;
  double t;
  while (true) {
    t = median(shifts(ctx, out, in, bytes, int(std::max<size_t>(1, kDrain / bytes)), 3));
    double slowest = t;
    recursive_doubling_all_reduce(ctx, &slowest, 1, DType::kFloat64, ReduceOp::kMax);
    if (slowest >= kLongEnough || bytes >= kLast) break;
    bytes *= 8;
  }
  // A link that moved the bytes within its round's latency is at least that fast.
  *bytes_per_s = double(bytes) / std::max(t - *alpha_s, t / 2);
  return out;
}

// Ways of doing one thing, timed in blocks in the order 0, 1, .., k-1, k-1, .., 1, 0 (drift
// weighs on all alike), each block `warm` untimed rounds of run(way) then `timed` timed ones. A
// block's figure is the median of its timed rounds, a way's the better of its two blocks (slowing
// down is all that drift and warming up do), and the result the slowest rank's figure for each.
std::vector<double> timed_ways(Context& ctx, int ways, int warm, int timed,
                               const std::function<void(int)>& run) {
  std::vector<double> slowest(size_t(ways), HUGE_VAL);  // this rank's, then the slowest rank's
  for (int block = 0; block < 2 * ways; ++block) {
    const int way = block < ways ? block : 2 * ways - 1 - block;
    std::vector<double> seconds;
    for (int round = 0; round < warm + timed; ++round) {
      const auto start = Clock::now();
      run(way);
      const double took = std::chrono::duration<double>(Clock::now() - start).count();
      if (round >= warm) seconds.push_back(took);
    }
    slowest[size_t(way)] = std::min(slowest[size_t(way)], median(seconds));
  }
  recursive_doubling_all_reduce(ctx, slowest.data(), size_t(ways), DType::kFloat64, ReduceOp::kMax);
  return slowest;
}

}  // namespace

LinkModel probe_links(Context& ctx, bool one_host, const std::vector<int>* host) {
  LinkModel m;
  constexpr size_t kReduce = 256 << 10;
  char* out = probe_ring(ctx, one_host, &m.alpha_s, &m.bytes_per_s);
  if (host) {
    Context local = ctx.view(*host);
    probe_ring(local, /*by_difference=*/false, &m.local_alpha_s, &m.local_bytes_per_s);
  } else {
    m.local_alpha_s = m.alpha_s;
    m.local_bytes_per_s = m.bytes_per_s;
  }
  char* sum = ctx.scratch(kReduce);
  std::memset(sum, 0, kReduce);
  double best = 1e9;
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    cpu::reduce(DType::kFloat32, ReduceOp::kSum, sum, sum, out, kReduce / 4);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  m.reduce_bytes_per_s = double(kReduce) / std::max(best, 1e-9);
  return m;
}

// Shifted, not only scaled: a factor from a size where a call's fixed cost is most of its time
// puts that cost on every byte of the next: scaled alone, a small size's factors can leave
// untimed at the next size the algorithm that is fastest there.
ProbePlan plan_probe(const ProbeRow& estimate, const ProbeRow& factor, const ProbeRow& missed,
                     double worth) {
  ProbePlan plan;
  for (size_t a = 0; a < estimate.size(); ++a)
    plan.guess[a] = std::min(estimate[a] * factor[a], estimate[a] + missed[a]);
  plan.cheapest = *std::min_element(plan.guess.begin(), plan.guess.end());
  for (size_t a = 0; a < estimate.size(); ++a)
    if (plan.guess[a] <= worth * plan.cheapest) plan.timed.push_back(a);
  return plan;
}

std::vector<ProbeRow> probe_algorithms(Context& ctx, const LinkModel& links) {
  constexpr double kWorth = 1.5;  // times the cheapest guess: an algorithm worth timing
  constexpr double kBlock = 5e-4;
  // Seconds one size's all-reduces may take (a guess before they run): with many ranks on few
  // CPUs the largest size would otherwise take most of the probe, which every connection pays.
  constexpr double kBudget = 0.2;
  const Selector plain(ctx.size(), links, 0, 0, ctx.has_boards() ? ctx.board_bytes() : 0);
  float* data = reinterpret_cast<float*>(ctx.scratch(kMeasuredBytes.back()));
  std::memset(data, 0, kMeasuredBytes.back());
  std::vector<ProbeRow> factors;
  // Each algorithm's factor where it was last timed, and its miss there (plan_probe). Not the
  // factor an untimed algorithm is given (kWorth times the slowest timed one, below), which
  // would keep it untimed at every larger size, where one that loses at a size can win the next.
  ProbeRow measured, missed{};
  measured.fill(1.0);
  for (size_t bytes : kMeasuredBytes) {
    ProbeRow estimate{}, row{};
    for (size_t a = 0; a < kMeasuredAlgorithms.size(); ++a)
      estimate[a] = plain.estimate(kMeasuredAlgorithms[a], double(bytes));
    const ProbePlan plan = plan_probe(estimate, measured, missed, kWorth);
    const ProbeRow& guess = plan.guess;
    const std::vector<size_t>& timed = plan.timed;  // columns
    const double cheapest = plan.cheapest;
    // Timed rounds for about kBlock seconds a block, 3 to 15: at small sizes the median of 3
    // rounds is too noisy to rank the algorithms.
    const int rounds = int(std::clamp(kBlock / cheapest, 3.0, 15.0));
    double expected = 0;  // by the guesses, the same on every rank
    for (size_t a : timed) expected += guess[a] * 2 * (1 + rounds);
    if (!factors.empty() && expected > kBudget) {
      if (ctx.rank() == 0)
        RC_LOG("algorithm probe, ", ctx.size(), " ranks: not timed from ", bytes,
               " bytes on (about ", expected * 1e3, " ms); the estimates alone from there");
      ProbeRow ones;
      ones.fill(1.0);
      factors.resize(kMeasuredBytes.size(), ones);
      break;
    }
    const auto seconds = timed_ways(ctx, int(timed.size()), 1, rounds, [&](int way) {
      all_reduce_by(ctx, kMeasuredAlgorithms[timed[size_t(way)]], HostLayout{}, data,
                    bytes / sizeof(float), DType::kFloat32, ReduceOp::kSum);
    });
    double slowest = 0;
    std::string times;
    for (size_t k = 0; k < timed.size(); ++k) {
      row[timed[k]] = measured[timed[k]] = seconds[k] / estimate[timed[k]];
      missed[timed[k]] = seconds[k] - estimate[timed[k]];
      slowest = std::max(slowest, seconds[k]);
      times += str_cat(" ", algorithm_name(kMeasuredAlgorithms[timed[k]]), " ", seconds[k] * 1e6,
                       " us (estimate ", estimate[timed[k]] * 1e6, ")");
    }
    for (size_t a = 0; a < kMeasuredAlgorithms.size(); ++a)
      if (row[a] == 0)  // an algorithm the ranks cannot run (an infinite estimate) keeps 1
        row[a] =
            std::isfinite(estimate[a]) ? std::max(guess[a], kWorth * slowest) / estimate[a] : 1.0;
    factors.push_back(row);
    if (ctx.rank() == 0)
      RC_LOG("algorithm probe, ", ctx.size(), " ranks, all-reduce of ", bytes,
             " bytes, slowest rank's better block:", times);
  }
  return factors;
}

bool probe_single_copy(Context& local, size_t message,
                       const std::function<void(bool)>& use_single_copy) {
  constexpr int kWarm = 2, kTimed = 2;
  const int n = local.size();
  // 16 MiB at least: where single copy loses, it loses as the data leaves the caches, and where
  // it wins it wins there too.
  constexpr size_t kLeast = 16 << 20;
  const size_t slice = message / sizeof(float);
  const size_t count = std::max(kLeast / sizeof(float), 2 * size_t(n) * slice);
  char* data = local.scratch(count * sizeof(float));
  std::memset(data, 0, count * sizeof(float));
  const Schedule schedule = ring_all_reduce_schedule(n, local.rank());
  const Segments blocks(count, n);
  // In blocks, each opened by kWarm untimed rounds: the first rounds after a switch pay for the
  // other way's traces, most where the CPUs share no cache; timed in alternate rounds, each way
  // would pay for the other's, and the slots lost where they were the faster way. Blocks in the
  // order slots, single copy, single copy, slots: drift weighs on both alike. A block's figure is
  // the median of its timed rounds, each way's the better of its two blocks: the first rounds
  // after connecting still warm up, for tens of rounds where the CPUs share no cache, and a median
  // over all of a way's rounds let that warm-up hand the probe to the slower way. Slowing down is
  // all that drift and warming do.
  const auto slowest = timed_ways(local, 2, kWarm, kTimed, [&](int on) {
    use_single_copy(on == 1);
    run_schedule(local, schedule, blocks, {data, data}, DType::kFloat32, ReduceOp::kSum, slice);
    local.finish();
  });
  if (local.rank() == 0)
    RC_LOG("single copy probe, ", n, " local ranks, ", count * sizeof(float) >> 20,
           " MiB ring all-reduce, slowest rank's better block: through the slots ",
           slowest[0] * 1e3, " ms, by single copy ", slowest[1] * 1e3, " ms");
  return slowest[1] < slowest[0];
}

}  // namespace ringcomm
