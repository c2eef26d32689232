// Retuner::judge (csrc/algorithms/retune.h), the verdict every rank draws from a round's agreed
// medians: the first round takes its fastest; later a candidate must beat the winner by more
// than kMargin in two trials in a row, the second run at once (a challenger); one that lost by
// far twice in a row sits out the next rounds (Retuner::sit_out). Prints "ok", or the first
// wrong verdict and exits 1.
//
// usage: retune_judge
#include <cstdint>
#include <cstdio>
#include <vector>

#include "algorithms/retune.h"

namespace {

using ringcomm::Retuner;
constexpr size_t kNone = Retuner::kNone;

bool expect(const char* what, const std::vector<double>& medians, size_t winner, size_t challenger,
            uint64_t rounds, Retuner::Verdict want) {
  const Retuner::Verdict got = Retuner::judge(medians, winner, challenger, rounds);
  if (got.winner == want.winner && got.challenger == want.challenger) return true;
  std::printf("%s: winner %zu, challenger %zu; want %zu, %zu\n", what, got.winner, got.challenger,
              want.winner, want.challenger);
  return false;
}

bool expect_rest(const char* what, const std::vector<double>& medians, size_t winner,
                 const std::vector<Retuner::Rest>& rests, const std::vector<Retuner::Rest>& want) {
  const std::vector<Retuner::Rest> got = Retuner::sit_out(medians, winner, rests);
  bool same = got.size() == want.size();
  for (size_t a = 0; same && a < got.size(); ++a)
    same = got[a].lost_far == want[a].lost_far && got[a].rounds == want[a].rounds;
  if (same) return true;
  std::printf("%s: standings", what);
  for (const Retuner::Rest& r : got)
    std::printf(" (%d, %llu)", int(r.lost_far), static_cast<unsigned long long>(r.rounds));
  std::printf("\n");
  return false;
}

}  // namespace

int main() {
  bool ok = true;
  // The first round trusts its trials, however close: the incumbent is the model's guess.
  ok &= expect("first round", {24.3, 30.0, 24.0}, 0, kNone, 0, {2, kNone});
  // Later, within the margin the winner stays.
  ok &= expect("within the margin", {24.3, 30.0, 24.0}, 0, kNone, 3, {0, kNone});
  // Beaten by more: trials again at once, the winner kept until then.
  ok &= expect("beaten once", {7.40, 7.45, 5.41}, 0, kNone, 1, {0, 2});
  // Beaten again by the same one: it takes over.
  ok &= expect("beaten twice", {7.40, 7.45, 5.41}, 0, 2, 2, {2, kNone});
  // The check clears it: the winner stays and nothing waits.
  ok &= expect("cleared", {4.79, 7.45, 7.36}, 0, 2, 2, {0, kNone});
  ok &= expect("cleared within the margin", {5.50, 7.45, 5.41}, 0, 2, 2, {0, kNone});
  // Another one beats it in the check: that one is checked next.
  ok &= expect("another challenger", {7.40, 5.00, 7.36}, 0, 2, 2, {0, 1});
  // The winner fastest: any challenger is dropped.
  ok &= expect("winner fastest", {4.79, 7.45, 7.36}, 0, 1, 5, {0, kNone});
  // Sitting out (Retuner::sit_out): more than 1.5x the winner's median in two trials in a row,
  // then 4 rounds; one that sat this round out (kUnmeasured) keeps its standing.
  using Rest = Retuner::Rest;
  const double out_of_round = Retuner::kUnmeasured;
  const Rest fresh{false, 0}, once{true, 0}, out{false, Retuner::kSitOutRounds};
  ok &= expect_rest("far loser, once", {210, 204, 213, 423}, 1, {fresh, fresh, fresh, fresh},
                    {fresh, fresh, fresh, once});
  ok &= expect_rest("far loser, twice", {210, 204, 213, 423}, 1, {fresh, fresh, fresh, once},
                    {fresh, fresh, fresh, out});
  ok &= expect_rest("near again", {200, 250, 301}, 0, {fresh, once, once}, {fresh, fresh, out});
  ok &= expect_rest("at 1.5x, not far", {200, 300}, 0, {fresh, once}, {fresh, fresh});
  ok &= expect_rest("resting", {200, out_of_round, 250}, 0, {fresh, {false, 2}, once},
                    {fresh, {false, 2}, fresh});
  if (ok) std::printf("ok\n");
  return ok ? 0 : 1;
}
