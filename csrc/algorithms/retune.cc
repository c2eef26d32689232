#include "algorithms/retune.h"

#include <algorithm>
#include <cmath>

#include "algorithms/algorithms.h"
#include "common/error.h"
#include "common/logging.h"

namespace ringcomm {
namespace {

int log2_floor(size_t bytes) { return 63 - __builtin_clzll(uint64_t(bytes)); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

Retuner::Retuner(uint64_t period) : period_(period) {
  RC_CHECK_ARG(period == 0 || period >= kLeastPeriod, "RINGCOMM_RETUNE_CALLS=", period,
               ": 0 (never) or at least ", kLeastPeriod,
               " (the first round's opening calls, a block per candidate and a call more)");
}

Retuner::SizeClass& Retuner::size_class(const Selector& select, size_t bytes) {
  auto [it, added] = classes_.try_emplace(log2_floor(bytes));
  SizeClass& c = it->second;
  if (added) {
    // Priced at the class's first call: every rank makes it with the same bytes.
    c.candidates = select.all_reduce_candidates(bytes, kWorth, kMost);
    c.period = period_;
    c.rests.assign(c.candidates.size(), Rest{});
    start_round(c);
    c.start = kBlock;  // the first round opens with the prelude
    if (debug_enabled()) {
      std::string names;
      for (Algorithm a : c.candidates)
        names += str_cat(names.empty() ? "" : ", ", algorithm_name(a), " (model ",
                         select.all_reduce_cost(a, double(bytes)) * 1e6, " us)");
      RC_LOG("auto all_reduce of ", size_t(1) << log2_floor(bytes),
             " bytes and more, retuned as it runs (RINGCOMM_RETUNE_CALLS): ", names);
    }
  }
  return c;
}

void Retuner::start_round(SizeClass& c) {
  c.call = c.start = 0;
  c.contenders.clear();
  for (size_t a = 0; a < c.candidates.size(); ++a) {
    if (c.rests[a].rounds == 0)
      c.contenders.push_back(a);
    else
      --c.rests[a].rounds;
  }
  c.trials.assign(c.contenders.size() * kBlock, 0.0);
}

long Retuner::trial_of(const SizeClass& c) {
  const long t = long(c.call) - long(c.start);
  return t >= 0 && t < long(c.trials.size()) ? t : -1;
}

Algorithm Retuner::next(const Selector& select, size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  SizeClass& c = size_class(select, bytes);
  const long t = trial_of(c);
  return c.candidates[t >= 0 ? c.contenders[size_t(t) / kBlock] : c.winner];
}

void Retuner::ran(Context& ctx, size_t bytes, double seconds) {
  std::unique_lock<std::mutex> lk(mu_);
  const int size_log2 = log2_floor(bytes);
  SizeClass& c = classes_.at(size_log2);
  const long t = trial_of(c);
  if (t >= 0) c.trials[size_t(t)] = seconds;
  // One contender has nothing to try against: its trials are plain calls.
  const bool agreed = c.contenders.size() > 1 && t + 1 == long(c.trials.size());
  if (agreed) {
    lk.unlock();  // the agreement waits for the other ranks; report() must not
    agree(ctx, size_log2, c);
    lk.lock();
  }
  // A challenger left by the agreement is checked at once: the round ends here.
  if (++c.call >= c.period || (agreed && c.challenger != kNone)) start_round(c);
}

Retuner::Verdict Retuner::judge(const std::vector<double>& medians, size_t winner,
                                size_t challenger, uint64_t rounds) {
  const size_t best = size_t(std::min_element(medians.begin(), medians.end()) - medians.begin());
  // The first round's winner is what its trials measured: the incumbent is then only the
  // model's guess.
  if (rounds == 0 || best == winner) return {best, kNone};
  if (medians[best] >= medians[winner] * (1 - kMargin)) return {winner, kNone};
  if (best == challenger) return {best, kNone};  // beaten in two trials in a row
  return {winner, best};
}

std::vector<Retuner::Rest> Retuner::sit_out(const std::vector<double>& medians, size_t winner,
                                            std::vector<Rest> rests) {
  for (size_t a = 0; a < medians.size(); ++a) {
    if (medians[a] == kUnmeasured) continue;  // sat this round out
    const bool far = medians[a] > medians[winner] * kSitOut;
    rests[a] = far && rests[a].lost_far ? Rest{false, kSitOutRounds} : Rest{far, 0};
  }
  return rests;
}

void Retuner::agree(Context& ctx, int size_log2, SizeClass& c) {
  std::vector<double> trials = c.trials;
  recursive_doubling_all_reduce(ctx, trials.data(), trials.size(), DType::kFloat64, ReduceOp::kAvg);
  // Those that sat the round out count as unmeasured: infinite here, never faster in judge().
  std::vector<double> medians(c.candidates.size(), kUnmeasured);
  for (size_t i = 0; i < c.contenders.size(); ++i)
    medians[c.contenders[i]] = median(
        {trials.begin() + long(i * kBlock + kWarm), trials.begin() + long((i + 1) * kBlock)});
  const Verdict v = judge(medians, c.winner, c.challenger, c.rounds);
  const bool recheck = v.challenger != kNone;
  const size_t beaten_by = recheck ? v.challenger : v.winner;
  if (beaten_by != c.winner && ctx.rank() == 0)
    RC_LOG("all_reduce of ", size_t(1) << size_log2,
           " bytes and more: ", algorithm_name(c.candidates[beaten_by]),
           recheck ? " beat " : " from now on, not ", algorithm_name(c.candidates[c.winner]),
           " (trials: ", medians[beaten_by] * 1e6, " us against ", medians[c.winner] * 1e6,
           recheck ? "): trials again" : ")");
  std::vector<Rest> rests = sit_out(medians, v.winner, c.rests);
  if (ctx.rank() == 0 && debug_enabled())
    for (size_t a = 0; a < rests.size(); ++a)
      if (rests[a].rounds == kSitOutRounds)
        RC_LOG("all_reduce of ", size_t(1) << size_log2,
               " bytes and more: ", algorithm_name(c.candidates[a]), " sits out the next ",
               kSitOutRounds, " rounds of trials (", medians[a] * 1e6, " us against ",
               algorithm_name(c.candidates[v.winner]), "'s ", medians[v.winner] * 1e6, ")");
  std::lock_guard<std::mutex> lk(mu_);
  if (!recheck)
    c.period = v.winner == c.winner ? std::min(c.period * 2, period_ * kLongest) : period_;
  c.medians.resize(medians.size(), std::nan(""));  // reported: NaN before a first trial
  for (size_t a = 0; a < medians.size(); ++a)
    if (medians[a] != kUnmeasured) c.medians[a] = medians[a];
  c.rests = std::move(rests);
  c.winner = v.winner;
  c.challenger = v.challenger;
  ++c.rounds;
}

std::vector<Retuner::Report> Retuner::report() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<Report> out;
  for (const auto& [log2, c] : classes_) {
    std::vector<Algorithm> sitting_out;
    for (size_t a = 0; a < c.candidates.size(); ++a)
      if (std::find(c.contenders.begin(), c.contenders.end(), a) == c.contenders.end())
        sitting_out.push_back(c.candidates[a]);
    out.push_back({size_t(1) << log2, c.candidates, c.medians, c.candidates[c.winner], c.rounds,
                   std::move(sitting_out)});
  }
  return out;
}

Algorithm Retuner::current(const Selector& select, size_t bytes) const {
  std::lock_guard<std::mutex> lk(mu_);
  const auto it = classes_.find(log2_floor(bytes));
  return it == classes_.end() ? select.all_reduce(bytes) : it->second.candidates[it->second.winner];
}

}  // namespace ringcomm
