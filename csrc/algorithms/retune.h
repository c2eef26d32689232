// auto's all-reduce choice for large messages, kept up to date by timing the calls themselves.
//
// The probe (probe.cc) times the algorithms once, when the communicator connects, and only up to
// 16 MiB; larger messages take 16 MiB's factors. Both go wrong where the machine changes under a
// running job. On the 2-vCPU guest of docs/performance.md, which flips between two states (its
// vCPUs sharing a core's caches or not), 4 ranks at 64 MiB: the shared buffer took 0.83-0.88x
// the ring's time in 5 runs in one state, 0.75-0.82x in 2 in the other, 1.00x in a run that
// flipped; the probe, run in whichever state the connection met, handed 64 MiB to the ring or
// to halving-doubling in 5 runs of 8, at 1.11-1.23x the shared buffer's time.
//
// For each power-of-two size class from kLeastBytes up, auto all-reduces run, by their number in
// that class's current round (the same on every rank: the calls of a class come in one order on
// every rank, or the collectives mismatch):
//   prelude, in the first round only: kBlock calls by the model's choice, untimed. A size's first
//            calls pay for first touches: in one bench run the shared buffer's trials, the first
//            64 MiB calls of the process, took 25.1 ms, where it then took 18.2 over 7 samples;
//   trials:  a block of calls by each candidate in turn, kWarm untimed and kRepeats timed.
//            Candidates (Selector::all_reduce_candidates, at most kMost): the model's choice,
//            then the algorithms the alpha-beta figures alone put within kWorth of the least
//            estimate, by the model's cost. Those figures tell apart what moves more bytes (the
//            tree, recursive doubling: 1.38x the ring's estimate at 4 ranks and 64 MiB); the
//            probe's factors, measured at connection and only up to 16 MiB, are what the trials
//            check. Taken from the model's costs instead, the shared buffer, untimed by a probe
//            at 16 MiB and so priced at 1.5x the slowest algorithm timed there, was never tried.
//            Up to 4: at 2 ranks four algorithms move the same bytes, and with 3 the shared
//            buffer, priced last by the probe, was left out at 16 MiB where it was the fastest
//            (1.27x in auto's row);
//   the last trial, after its all-reduce, agrees on them: one recursive-doubling all-reduce (avg)
//            of each trial's seconds, a call's mean time over the ranks. A rank's call runs from
//            its own start to its own end: back to back, one that calls early waits for the
//            others and one that calls late does not, and the mean takes these lags out. The
//            fastest rank's time (min) measured the work left after the last arrival: at 16 KiB
//            and 4 ranks, recursive doubling 4 us a call where it took 15; at 256 KiB the ring
//            44 us against halving-doubling's 71, which forced took 57 against the ring's 62.
//            The slowest's (max) measured the lags: at 4 MiB halving-doubling 2055 us where
//            forced it took 912. The winner is the candidate with the least median (judge());
//            the first round's trials decide alone (in one run a first round that favoured the
//            model's halving-doubling kept it, 24.3 ms, over the shared buffer's 24.0, which
//            then measured 21.3 ms against its 24.0 over 7 samples). After it the winner stays
//            unless another is faster by more than kMargin in two trials in a row: the one that
//            beats it is checked by trials at once, the round cut short. A spell of a few tens
//            of milliseconds hits one trial: in one bench run (4 ranks, 16 MiB) the first two
//            blocks of a second round timed the shared buffer at 7.40 ms and the ring at 7.45,
//            and halving-doubling's 5.41 took the size for the rest of the run at 1.51x the
//            shared buffer's 4.79 forced beside it. The margin is 5%: 2 ranks at 4 MiB, the
//            ring, halving-doubling and the shared buffer forced within 5% of each other (210,
//            204, 213 us), a 2% margin let 3-call trials hand the size from one to another (9
//            rounds agreed in one bench run), each change cutting the next round back to
//            `period` calls of which a block per candidate are trials;
//   then the winner, to the end of the round: `period` calls, doubled (up to kLongest x) each
//            time a round keeps its winner, back to `period` when it changes.
// Trials cost at most (k-1) * kBlock calls of slower algorithms a round: in the first round of
// 64 calls, with candidates 1.25x the winner's time, 12 x 0.25 / 64 = 5 % of the round. The
// model's estimates can be far off, and a far loser costs more: 2 ranks at 4 MiB, recursive
// doubling (each rank reduces the whole message, the ring half) took 423 us forced against the
// ring's 211, its estimate 1.11x the ring's; its block alone cost 4 x 1.0 / 64 = 6 % of a first
// round, and each recheck and change of winner, which shortens the next round, runs it again. So
// a candidate whose median is more than kSitOut x the winner's in two agreed rounds in a row sits
// out the trials of the next kSitOutRounds rounds. The guest's states moved the algorithms' times
// against each other by 12-25%, not 50%: a far loser stays one, and is checked again after those
// rounds. Once is not enough: 4 ranks at 256 KiB, one round's trials timed halving-doubling at
// 176 us against the ring's 71, where forced it took 73 against the ring's 78 (a rank taken off
// one of the 2 CPUs for a few calls, as happens with 4 ranks on them).
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
  // From 4 KiB: the probe's choice, made in the state the connection met, lost by 1.33-1.46x at
  // 4, 16 and 64 KiB in runs where the guest flipped after it (4 ranks: the shared buffer 18.3
  // and 21.5 us against recursive doubling's 13.8 and 14.7; the ring 53.4 against
  // halving-doubling's 36.5). Below, the agreement (5-20 us on shared memory, 50-100 over TCP)
  // would weigh on calls of a microsecond or two, and recursive doubling, the model's choice
  // there, was the fastest in every run.
  static constexpr size_t kLeastBytes = 4 << 10;
  // A block per candidate, not calls of each in turn: the first call after a switch pays for the
  // other's traces in the caches. 4 ranks at 4 MiB, medians of 12 calls (each call's time on its
  // fastest rank): the shared buffer took 961 and 1452 us in turn with halving-doubling and the
  // ring, 853 and 962 in blocks (halving-doubling 1089 and 1607, 1066 and 1536).
  static constexpr size_t kWarm = 1, kRepeats = 3, kBlock = kWarm + kRepeats;
  static constexpr size_t kMost = 4;           // candidates
  static constexpr double kWorth = 1.25;       // times the least estimate
  static constexpr double kMargin = 0.05;
  static constexpr double kSitOut = 1.5;       // times the winner's median
  static constexpr uint64_t kSitOutRounds = 4;
  static constexpr uint64_t kLongest = 16;     // rounds grow to 16x `period`
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
    size_t bytes;                      // the class: bytes .. 2 x bytes - 1
    std::vector<Algorithm> candidates;
    std::vector<double> seconds;       // each candidate's median in the last trials it ran in
    Algorithm winner;                  // what the calls outside trials run
    uint64_t rounds;                   // rounds of trials agreed
    std::vector<Algorithm> sitting_out;  // candidates left out of this round's trials
  };
  std::vector<Report> report() const;
  // The algorithm an auto all-reduce of `bytes` runs outside trials: the winner, or the model's
  // choice before a class's first call.
  Algorithm current(const Selector& select, size_t bytes) const;

 private:
  struct SizeClass {
    std::vector<Algorithm> candidates;
    size_t winner = 0;                 // index into candidates
    uint64_t call = 0;                 // in this round
    uint64_t start = 0;                // the round's first trial: kBlock (a prelude) in the first
    uint64_t period = 0;               // this round's calls
    std::vector<size_t> contenders;    // this round's trials, a block each: indices into candidates
    std::vector<double> trials;        // this round's seconds on this rank
    std::vector<double> medians;       // per candidate, from the last trials it ran in
    std::vector<Rest> rests;           // per candidate
    uint64_t rounds = 0;
    size_t challenger = kNone;         // beat the winner in the last trials
  };
  SizeClass& size_class(const Selector& select, size_t bytes);
  static void start_round(SizeClass& c);  // call 0 of a round: who runs its trials
  static long trial_of(const SizeClass& c);  // this call's index in c.trials, or -1
  void agree(Context& ctx, int size_log2, SizeClass& c);

  const uint64_t period_;
  mutable std::mutex mu_;  // report() and current() may run on any thread
  std::map<int, SizeClass> classes_;  // by floor(log2(bytes))
};

}  // namespace ringcomm
