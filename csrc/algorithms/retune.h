// auto's all-reduce choice for large messages, kept up to date by timing the calls themselves.
//
// The probe (probe.cc) times the algorithms once, when the communicator connects, and only up to
// 16 MiB; larger messages take 16 MiB's factors. Both go wrong where the machine changes under a
// running job: on a virtual machine whose CPUs the host moves between sharing a core's caches
// and not, which algorithm is fastest at a size changes with the state, and the probe's choice
// follows whichever state the connection met (docs/performance.md).
//
// For each power-of-two size class from kLeastBytes up, auto all-reduces run, by their number in
// that class's current round (the same on every rank: the calls of a class come in one order on
// every rank, or the collectives mismatch):
//   prelude, in the first round only: kBlock calls by the model's choice, untimed. A size's first
//            calls pay for first touches, which would be charged to the first candidate's trials;
//   trials:  a block of calls by each candidate in turn, kWarm untimed and kRepeats timed.
//            Candidates (Selector::all_reduce_candidates, at most kMost): the model's choice,
//            then the algorithms the alpha-beta figures alone put within kWorth of the least
//            estimate, by the model's cost. Those figures tell apart what moves more bytes (the
//            tree, recursive doubling); the probe's factors, found at connection and only up to
//            16 MiB, are what the trials check: by the model's costs, an algorithm the probe left
//            untimed, and so priced above the slowest one timed, would never be tried.
//            Up to 4: at 2 ranks four algorithms move the same bytes, and with 3 the one the
//            probe priced last, which can be the fastest, would be left out;
//   the last trial, after its all-reduce, agrees on them: one recursive-doubling all-reduce (avg)
//            of each trial's seconds, a call's mean time over the ranks. A rank's call runs from
//            its own start to its own end: back to back, one that calls early waits for the
//            others and one that calls late does not, and the mean takes these lags out. The
//            fastest rank's time (min) counts only the work left after the last arrival, the
//            slowest's (max) the lags: either ranks the algorithms otherwise than their times
//            when forced. The winner is the candidate with the least median (judge()); the first
//            round's trials decide alone: favouring the model's choice there kept it where
//            another was faster. After it the winner stays unless another is faster by more than
//            kMargin in two trials in a row: the one that beats it is checked by trials at once,
//            the round cut short. A spell of a few tens of milliseconds hits one trial, and one
//            trial alone could hand a size to a slower algorithm for the rest of a run. The
//            margin is 5%: where algorithms run within a few percent of each other, a smaller
//            one lets 3-call trials hand the size from one to another, each change cutting the
//            next round back to `period` calls of which a block per candidate are trials;
//   then the winner, to the end of the round: `period` calls, doubled (up to kLongest x) each
//            time a round keeps its winner, back to `period` when it changes.
// Trials cost at most (k-1) * kBlock calls of slower algorithms a round: in the first round of
// 64 calls, with candidates a quarter slower than the winner, 12 x 0.25 / 64 = 5 % of the round.
// The model's estimates can be far off, and a far loser costs more: at 2 ranks recursive doubling
// (each rank reduces the whole message, the ring's half) can take twice the ring's time where
// its estimate is close to the ring's; its block alone then costs 4 x 1.0 / 64 = 6 % of a first
// round, and each recheck and change of winner, which shortens the next round, runs it again. So
// a candidate whose median is more than kSitOut x the winner's in two agreed rounds in a row sits
// out the trials of the next kSitOutRounds rounds. A change of the machine's state moves the
// algorithms' times against each other by less than kSitOut: a far loser stays one, and is
// checked again after those rounds. Once is not enough: a rank taken off its CPU for a few calls,
// as happens with more ranks than CPUs, can make one round's trials of the faster algorithm take
// twice the other's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <vector>

#include "algorithms/select.h"
#include "common/signature.h"

namespace ringcomm {

class Context;

class Retuner {
 public:
  // From 4 KiB: from there up, the probe's choice, made in the state the connection met, can lose
  // once the machine's state changes. Below, the agreement, an all-reduce as long as several such
  // calls, would weigh on calls of a microsecond or two, and recursive doubling, the model's
  // choice there, was the fastest wherever timed (docs/performance.md).
  static constexpr size_t kLeastBytes = 4 << 10;
  // A block per candidate, not calls of each in turn: the first call after a switch pays for the
  // other's traces in the caches, which calls in turn would charge to every candidate.
  static constexpr size_t kWarm = 1, kRepeats = 3, kBlock = kWarm + kRepeats;
  static constexpr size_t kMost = 4;      // candidates
  static constexpr double kWorth = 1.25;  // times the least estimate
  static constexpr double kMargin = 0.05;
  static constexpr double kSitOut = 1.5;  // times the winner's median
  static constexpr uint64_t kSitOutRounds = 4;
  static constexpr uint64_t kLongest = 16;  // rounds grow to 16x `period`
  static constexpr uint64_t kLeastPeriod = (kMost + 1) * kBlock + 1;

  // `period`: the calls of a round at first; 0: never retune (auto keeps the model's choice).
  explicit Retuner(uint64_t period = 0);

  bool covers(size_t bytes) const { return period_ > 0 && bytes >= kLeastBytes; }
  // On the thread running operations, in their order: the algorithm of the next auto all-reduce
  // of `bytes` (covered).
  Algorithm next(const Selector& select, size_t bytes);
  // After it ran: this rank's seconds. After the last trial of a round, agrees on the winner with
  // every rank (a collective on `ctx`).
  void ran(Context& ctx, size_t bytes, double seconds);

  // The agreement's verdict on a round's medians (one per candidate), the same on every rank:
  // the winner from now on, and a candidate that beat the winner once, to be checked by trials
  // at once, or kNone.
  static constexpr size_t kNone = size_t(-1);
  struct Verdict {
    size_t winner, challenger;
  };
  static Verdict judge(const std::vector<double>& medians, size_t winner, size_t challenger,
                       uint64_t rounds);
  // A candidate's standing in the trials.
  struct Rest {
    bool lost_far = false;  // its last trials took more than kSitOut x the winner's median
    uint64_t rounds = 0;    // rounds of trials it still sits out
  };
  // A median of a candidate that sat the round out.
  static constexpr double kUnmeasured = std::numeric_limits<double>::infinity();
  // After a verdict: each candidate's standing from the next round on. `medians` holds this
  // round's (kUnmeasured for those that sat it out), `rests` the standings it began with.
  static std::vector<Rest> sit_out(const std::vector<double>& medians, size_t winner,
                                   std::vector<Rest> rests);

  // What the trials found, for reports and tests: one entry per size class retuned so far.
  struct Report {
    size_t bytes;  // the class: bytes .. 2 x bytes - 1
    std::vector<Algorithm> candidates;
    std::vector<double> seconds;         // each candidate's median in the last trials it ran in
    Algorithm winner;                    // what the calls outside trials run
    uint64_t rounds;                     // rounds of trials agreed
    std::vector<Algorithm> sitting_out;  // candidates left out of this round's trials
  };
  std::vector<Report> report() const;
  // The algorithm an auto all-reduce of `bytes` runs outside trials: the winner, or the model's
  // choice before a class's first call.
  Algorithm current(const Selector& select, size_t bytes) const;

 private:
  struct SizeClass {
    std::vector<Algorithm> candidates;
    size_t winner = 0;               // index into candidates
    uint64_t call = 0;               // in this round
    uint64_t start = 0;              // the round's first trial: kBlock (a prelude) in the first
    uint64_t period = 0;             // this round's calls
    std::vector<size_t> contenders;  // this round's trials, a block each: indices into candidates
    std::vector<double> trials;      // this round's seconds on this rank
    std::vector<double> medians;     // per candidate, from the last trials it ran in
    std::vector<Rest> rests;         // per candidate
    uint64_t rounds = 0;
    size_t challenger = kNone;  // beat the winner in the last trials
  };
  SizeClass& size_class(const Selector& select, size_t bytes);
  static void start_round(SizeClass& c);     // call 0 of a round: who runs its trials
  static long trial_of(const SizeClass& c);  // this call's index in c.trials, or -1
  void agree(Context& ctx, int size_log2, SizeClass& c);

  const uint64_t period_;
  mutable std::mutex mu_;             // report() and current() may run on any thread
  std::map<int, SizeClass> classes_;  // by floor(log2(bytes))
};

}  // namespace ringcomm
