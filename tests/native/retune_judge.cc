// Retuner::judge, Retuner::watch and Retuner::rival (csrc/algorithms/retune.h), the verdicts
// every rank draws from agreed figures: trials keep the incumbent unless another is faster by
// more than kMargin; a span off the reference by more than kChange, either way, is a strike, and
// one within it clears them; a rival costs less than the winner by more than the margin. Prints
// "ok", or the first wrong verdict and exits 1.
//
// usage: retune_judge
#include <cstdint>
#include <cstdio>
#include <vector>

#include "algorithms/retune.h"

namespace {

using ringcomm::Retuner;

bool expect(const char* what, const std::vector<double>& medians, size_t incumbent, size_t want) {
  const size_t got = Retuner::judge(medians, incumbent);
  if (got == want) return true;
  std::printf("%s: winner %zu, want %zu\n", what, got, want);
  return false;
}

bool expect_watch(const char* what, double median, double reference, uint64_t strikes,
                  uint64_t want) {
  const uint64_t got = Retuner::watch(median, reference, strikes);
  if (got == want) return true;
  std::printf("%s: %llu strikes, want %llu\n", what, static_cast<unsigned long long>(got),
              static_cast<unsigned long long>(want));
  return false;
}

bool expect_rival(const char* what, const std::vector<double>& costs, size_t winner, size_t want) {
  const size_t got = Retuner::rival(costs, winner);
  if (got == want) return true;
  std::printf("%s: rival %zu, want %zu\n", what, got, want);
  return false;
}

}  // namespace

int main() {
  bool ok = true;
  // The incumbent (in the first trials the model's choice) stays within the margin.
  ok &= expect("within the margin", {24.3, 30.0, 24.0}, 0, 0);
  ok &= expect("at the margin", {100.0, 95.0}, 0, 0);
  // Beaten by more, it gives way, to the fastest.
  ok &= expect("beaten", {7.40, 7.45, 5.41}, 0, 2);
  ok &= expect("beaten by two", {7.40, 6.00, 5.41}, 0, 2);
  ok &= expect("incumbent fastest", {4.79, 7.45, 7.36}, 0, 0);
  ok &= expect("incumbent not first", {5.00, 7.45, 7.36}, 2, 0);
  // The watch: a span more than 25% off the reference either way is a strike.
  ok &= expect_watch("steady", 210, 200, 0, 0);
  ok &= expect_watch("slower", 251, 200, 0, 1);
  ok &= expect_watch("faster", 159, 200, 1, 2);
  ok &= expect_watch("at the edge", 250, 200, 1, 0);
  ok &= expect_watch("third in a row", 400, 200, 2, Retuner::kStrikes);
  ok &= expect_watch("back within", 205, 200, 2, 0);
  // A rival costs less than the winner by more than the margin; the cheapest of several.
  constexpr size_t kNone = Retuner::kNone;
  ok &= expect_rival("stalling winner", {9.41e-3, 3.41e-3}, 0, 1);
  ok &= expect_rival("within the margin", {3.50e-3, 3.41e-3}, 0, kNone);
  ok &= expect_rival("winner cheapest", {3.30e-3, 9.41e-3, 4.0e-3}, 0, kNone);
  ok &= expect_rival("cheapest of two", {10.0, 8.0, 6.0, 9.0}, 0, 2);
  ok &= expect_rival("winner not first", {6.0, 10.0, 9.0}, 1, 0);
  if (ok) std::printf("ok\n");
  return ok ? 0 : 1;
}
