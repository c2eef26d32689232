// auto's all-reduce choice for large messages, decided by timing the calls themselves: once per
// size class, and again only when the chosen algorithm's own time changes for good.
//
// The probe (probe.cc) times the algorithms once, when the communicator connects, and only up to
// 16 MiB, and only where all ranks, 3 or more, share one host; larger messages take 16 MiB's
// factors, and between hosts the model has its alpha-beta figures alone, which put algorithms that
// move the same bytes (the ring and halving-doubling) within a fraction of a percent of each other.
// Either can be wrong by more than that, and the machine can change under a running job: on a
// virtual machine whose CPUs the host moves between sharing a core's caches and not, which
// algorithm is fastest at a size changes with the state (docs/performance.md).
//
// For each power-of-two size class from kLeastBytes up, auto all-reduces run, by their number in
// that class (the same on every rank: the calls of a class come in one order on every rank, or
// the collectives mismatch):
//   prelude, before the first trials only: kBlock calls by the model's choice, untimed. A size's
//            first calls pay for first touches, which would be charged to the first candidate;
//   trials:  a block of calls by each candidate in turn, kWarm untimed and kRepeats timed.
//            Candidates (Selector::all_reduce_candidates, at most kMost): the model's choice,
//            then the algorithms the alpha-beta figures alone put within kWorth of the least
//            estimate, by the model's cost. Those figures tell apart what moves more bytes (the
//            tree, recursive doubling); the probe's factors, found at connection and only up to
//            16 MiB, are what the trials check. Up to 4: at 2 ranks four algorithms move the
//            same bytes;
//   the last trial, after its all-reduce, agrees on them: one recursive-doubling all-reduce (avg)
//            of each trial's seconds, a call's mean time over the ranks. A rank's call runs from
//            its own start to its own end: back to back, one that calls early waits for the
//            others and one that calls late does not, and the mean takes these lags out. The
//            winner is the incumbent (in the first trials the model's choice) unless another's
//            median is lower by more than kMargin (judge()): 3-call trials of algorithms within
//            a few percent of each other would hand the size from one to another on noise, and
//            a candidate the model prices above the incumbent for stalls it cannot time in 3
//            calls (halving-doubling between hosts, select.cc) would win them on luck;
//   then the winner, watched: its calls' seconds in spans of `span` calls, one agreement
//            after each (a recursive-doubling all-reduce of the span's seconds, as above),
//            giving the span's mean and median. The mean is what the calls cost the caller,
//            stalls included, and becomes the winner's cost where the span lasted at least
//            kLeastSpanSeconds (shorter ones leave every cost as it was); another candidate
//            whose cost (the mean of its own last span where it ran one, else its trials'
//            median) is below it by more than kMargin in kOutpaced spans in a row, or kFar times
//            lower in one, takes over (rival()). An algorithm whose calls stall now and then
//            over TCP (halving-doubling at 256 KiB between hosts: some calls of tens of
//            milliseconds among calls of 3) wins 3-call trials on its
//            median and loses on its spans' mean. A switch needs the other's cost lower by the
//            margin, and once both ran spans both costs are measured: two candidates within the
//            margin never alternate. The median, steadier, watches for a change of the machine:
//            the first span after trials or a switch sets the reference (the calls after a
//            switch still pay for the other algorithm's traces in the caches); a span whose
//            median is off it by more than kChange, either way, is a strike, and kStrikes in a
//            row run the trials again (watch()), the spans' costs forgotten. A spell of a few
//            tens of milliseconds moves one span; a machine that changed moves them all.
// So trials cost (k-1) x kBlock calls of slower algorithms once per size class, and again only
// after a change; a rival taken on the trials' word costs at most kOutpaced spans before its own
// spans' cost decides. The watch costs one all-reduce of `span` doubles per `span` calls: at 64
// calls, 512 bytes, one latency.
#pragma once

#include <cstddef>
#include <cstdint>
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
  // A span's median off the reference by more than 25% (either way), in 3 spans in a row:
  // a TCP stream's own spread over 64 calls stays within a few percent, and one spell of a
  // loaded machine or a stalled link moves one span, not three.
  static constexpr double kChange = 0.25;
  static constexpr uint64_t kStrikes = 3;
  static constexpr uint64_t kOutpaced = 2;
  static constexpr double kFar = 1.5;  // a rival this many times cheaper takes over at once
  // Spans shorter than this do not price the winner: a rank taken off its CPU for a millisecond
  // or two, as with more ranks than CPUs, would triple the mean of 64 calls of 15 us.
  static constexpr double kLeastSpanSeconds = 0.1;
  static constexpr uint64_t kLeastSpan = 8;

  // `span`: the calls of a watch span; 0: never retune (auto keeps the model's choice).
  explicit Retuner(uint64_t span = 0);

  bool covers(size_t bytes) const { return span_ > 0 && bytes >= kLeastBytes; }
  // On the thread running operations, in their order: the algorithm of the next auto all-reduce
  // of `bytes` (covered).
  Algorithm next(const Selector& select, size_t bytes);
  // After it ran: this rank's seconds. After the last trial or the last call of a span, agrees
  // with every rank (a collective on `ctx`).
  void ran(Context& ctx, size_t bytes, double seconds);

  // The verdict on trials' agreed medians (one per candidate), the same on every rank: the
  // index of the winner from now on (the incumbent: in the first trials, the model's choice).
  static size_t judge(const std::vector<double>& medians, size_t incumbent);
  // The verdict on a span's agreed median against the reference: the strikes from now on
  // (kStrikes: trials again).
  static uint64_t watch(double median, double reference, uint64_t strikes);
  // The candidate that costs less than the winner by more than kMargin (`costs`: seconds a call,
  // one per candidate), the cheapest if several, or kNone.
  static constexpr size_t kNone = size_t(-1);
  static size_t rival(const std::vector<double>& costs, size_t winner);

  // What the trials found, for reports and tests: one entry per size class retuned so far.
  struct Report {
    size_t bytes;  // the class: bytes .. 2 x bytes - 1
    std::vector<Algorithm> candidates;
    std::vector<double> seconds;  // each candidate's median in the last trials (NaN before)
    std::vector<double> paid;     // each one's mean in its last span since them (NaN: none)
    Algorithm winner;             // what the calls outside trials run
    uint64_t rounds;              // trials agreed
    double reference;             // the winner's median in its first span since trials or a switch
    uint64_t spans;               // spans watched
  };
  std::vector<Report> report() const;
  // The algorithm an auto all-reduce of `bytes` runs outside trials: the winner, or the model's
  // choice before a class's first call.
  Algorithm current(const Selector& select, size_t bytes) const;

 private:
  struct SizeClass {
    std::vector<Algorithm> candidates;
    size_t winner = 0;            // index into candidates
    uint64_t call = 0;            // in this stretch: the trials (with the prelude) or a span
    bool trying = true;           // in trials, else watching
    uint64_t start = 0;           // the first trial's call: kBlock (the prelude) the first time
    std::vector<double> times;    // this stretch's seconds on this rank
    std::vector<double> medians;  // per candidate, from the last trials
    std::vector<double> paid;     // per candidate, its last span's mean since them (NaN: none)
    uint64_t rounds = 0;
    double reference = 0;  // 0: the next span sets it
    uint64_t strikes = 0, outpaced = 0, spans = 0;
  };
  SizeClass& size_class(const Selector& select, size_t bytes);
  static long trial_of(const SizeClass& c);  // this call's index in c.times in trials, or -1
  void agree_trials(Context& ctx, int size_log2, SizeClass& c);
  void agree_span(Context& ctx, int size_log2, SizeClass& c);

  const uint64_t span_;
  mutable std::mutex mu_;             // report() and current() may run on any thread
  std::map<int, SizeClass> classes_;  // by floor(log2(bytes))
};

}  // namespace ringcomm
