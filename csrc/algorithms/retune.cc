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

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return sum / double(v.size());
}

// Each call's seconds averaged over the ranks (see the header: the mean takes the lags out).
std::vector<double> averaged(Context& ctx, std::vector<double> seconds) {
  recursive_doubling_all_reduce(ctx, seconds.data(), seconds.size(), DType::kFloat64,
                                ReduceOp::kAvg);
  return seconds;
}

}  // namespace

Retuner::Retuner(uint64_t span) : span_(span) {
  RC_CHECK_ARG(span == 0 || span >= kLeastSpan, "RINGCOMM_RETUNE_CALLS=", span,
               ": 0 (never) or at least ", kLeastSpan,
               " (calls of a span, of which the median counts)");
}

Retuner::SizeClass& Retuner::size_class(const Selector& select, size_t bytes) {
  auto [it, added] = classes_.try_emplace(log2_floor(bytes));
  SizeClass& c = it->second;
  if (added) {
    // Priced at the class's first call: every rank makes it with the same bytes.
    c.candidates = select.all_reduce_candidates(bytes, kWorth, kMost);
    c.start = kBlock;                    // the prelude
    c.trying = c.candidates.size() > 1;  // one candidate has nothing to try against
    c.times.assign(c.trying ? c.candidates.size() * kBlock : 0, 0.0);
    c.medians.assign(c.candidates.size(), std::nan(""));
    c.paid = c.medians;
    if (debug_enabled()) {
      std::string names;
      for (Algorithm a : c.candidates)
        names += str_cat(names.empty() ? "" : ", ", algorithm_name(a), " (model ",
                         select.all_reduce_cost(a, double(bytes)) * 1e6, " us)");
      RC_LOG("auto all_reduce of ", size_t(1) << log2_floor(bytes),
             " bytes and more, timed as it runs (RINGCOMM_RETUNE_CALLS): ", names);
    }
  }
  return c;
}

long Retuner::trial_of(const SizeClass& c) {
  if (!c.trying) return -1;
  const long t = long(c.call) - long(c.start);
  return t >= 0 && t < long(c.times.size()) ? t : -1;
}

Algorithm Retuner::next(const Selector& select, size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  SizeClass& c = size_class(select, bytes);
  const long t = trial_of(c);
  return c.candidates[t >= 0 ? size_t(t) / kBlock : c.winner];
}

void Retuner::ran(Context& ctx, size_t bytes, double seconds) {
  std::unique_lock<std::mutex> lk(mu_);
  const int size_log2 = log2_floor(bytes);
  SizeClass& c = classes_.at(size_log2);
  if (c.trying) {
    const long t = trial_of(c);
    ++c.call;
    if (t < 0) return;  // the prelude
    c.times[size_t(t)] = seconds;
    if (size_t(t) + 1 < c.times.size()) return;
    lk.unlock();  // the agreement waits for the other ranks; report() must not
    agree_trials(ctx, size_log2, c);
    return;
  }
  if (c.candidates.size() < 2) return;  // nothing to switch to: nothing to watch
  c.times.push_back(seconds);
  if (++c.call < span_) return;
  lk.unlock();
  agree_span(ctx, size_log2, c);
}

size_t Retuner::judge(const std::vector<double>& medians, size_t incumbent) {
  const size_t best = size_t(std::min_element(medians.begin(), medians.end()) - medians.begin());
  return medians[best] < medians[incumbent] * (1 - kMargin) ? best : incumbent;
}

size_t Retuner::rival(const std::vector<double>& costs, size_t winner) {
  size_t best = kNone;
  for (size_t a = 0; a < costs.size(); ++a)
    if (a != winner && costs[a] < costs[winner] * (1 - kMargin) &&
        (best == kNone || costs[a] < costs[best]))
      best = a;
  return best;
}

uint64_t Retuner::watch(double median, double reference, uint64_t strikes) {
  const bool off = median > reference * (1 + kChange) || median * (1 + kChange) < reference;
  return off ? strikes + 1 : 0;
}

void Retuner::agree_trials(Context& ctx, int size_log2, SizeClass& c) {
  const std::vector<double> trials = averaged(ctx, c.times);
  std::vector<double> medians(c.candidates.size());
  for (size_t i = 0; i < c.candidates.size(); ++i)
    medians[i] = median(
        {trials.begin() + long(i * kBlock + kWarm), trials.begin() + long((i + 1) * kBlock)});
  const size_t winner = judge(medians, c.winner);
  if (ctx.rank() == 0) {
    std::string timed;
    for (size_t i = 0; i < c.candidates.size(); ++i)
      timed +=
          str_cat(i ? ", " : "", algorithm_name(c.candidates[i]), " ", medians[i] * 1e6, " us");
    RC_LOG("all_reduce of ", size_t(1) << size_log2,
           " bytes and more: ", algorithm_name(c.candidates[winner]),
           c.rounds == 0 ? "" : " from now on", " (trials: ", timed, ")");
  }
  std::lock_guard<std::mutex> lk(mu_);
  c.medians = medians;
  c.paid.assign(medians.size(), std::nan(""));  // what came before them no longer holds
  c.winner = winner;
  ++c.rounds;
  c.trying = false;
  c.call = 0;
  c.times.clear();
  c.reference = 0;
  c.strikes = c.outpaced = 0;
}

void Retuner::agree_span(Context& ctx, int size_log2, SizeClass& c) {
  const std::vector<double> times = averaged(ctx, c.times);
  const double now = median(times);
  std::lock_guard<std::mutex> lk(mu_);
  ++c.spans;
  c.call = 0;
  c.times.clear();
  const double paid = mean(times);
  // A span shorter than kLeastSpanSeconds says little by its mean: one descheduled rank's
  // milliseconds outweigh its calls. Its median still watches.
  const bool priced = paid * double(times.size()) >= kLeastSpanSeconds;
  if (priced) c.paid[c.winner] = paid;
  std::vector<double> costs = c.paid;
  for (size_t a = 0; a < costs.size(); ++a)
    if (std::isnan(costs[a])) costs[a] = c.medians[a];
  const size_t other = priced ? rival(costs, c.winner) : kNone;
  c.outpaced = other == kNone ? 0 : c.outpaced + 1;
  if (c.outpaced >= kOutpaced || (other != kNone && costs[c.winner] > kFar * costs[other])) {
    if (ctx.rank() == 0)
      RC_LOG("all_reduce of ", size_t(1) << size_log2,
             " bytes and more: ", algorithm_name(c.candidates[other]), " from now on, not ",
             algorithm_name(c.candidates[c.winner]), " (", costs[c.winner] * 1e6,
             " us a call over its last span, against ", costs[other] * 1e6, " us ",
             std::isnan(c.paid[other]) ? "in trials" : "over its last span", ")");
    c.winner = other;
    c.reference = 0;
    c.strikes = c.outpaced = 0;
    return;
  }
  if (c.reference == 0) {
    c.reference = now;
    return;
  }
  c.strikes = watch(now, c.reference, c.strikes);
  if (c.strikes < kStrikes) return;
  if (ctx.rank() == 0)
    RC_LOG("all_reduce of ", size_t(1) << size_log2,
           " bytes and more: ", algorithm_name(c.candidates[c.winner]), " took ", now * 1e6,
           " us a call against ", c.reference * 1e6, " us in its first span, in ", kStrikes,
           " spans in a row: trials again");
  c.trying = true;
  c.start = 0;
  c.times.assign(c.candidates.size() * kBlock, 0.0);
}

std::vector<Retuner::Report> Retuner::report() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<Report> out;
  for (const auto& [log2, c] : classes_)
    out.push_back({size_t(1) << log2, c.candidates, c.medians, c.paid, c.candidates[c.winner],
                   c.rounds, c.reference > 0 ? c.reference : std::nan(""), c.spans});
  return out;
}

Algorithm Retuner::current(const Selector& select, size_t bytes) const {
  std::lock_guard<std::mutex> lk(mu_);
  const auto it = classes_.find(log2_floor(bytes));
  return it == classes_.end() ? select.all_reduce(bytes) : it->second.candidates[it->second.winner];
}

}  // namespace ringcomm
