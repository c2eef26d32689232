// plan_probe (csrc/algorithms/algorithms.h): the algorithms the probe times at a size, by
// guesses carried from where each was last timed. Prints "ok", or the first wrong plan and exits
// 1.
//
// usage: probe_plan
#include <cstdio>
#include <vector>

#include "algorithms/algorithms.h"

namespace {

using ringcomm::ProbeRow;

// Columns of kMeasuredAlgorithms.
enum : size_t { kRing, kRecursiveDoubling, kTree, kHalvingDoubling, kSharedBuffer };

bool expect(const char* what, const ProbeRow& estimate, const ProbeRow& factor,
            const ProbeRow& missed, const std::vector<size_t>& want) {
  const std::vector<size_t> got = ringcomm::plan_probe(estimate, factor, missed, 1.5).timed;
  if (got == want) return true;
  std::printf("%s: timed", what);
  for (size_t a : got) std::printf(" %zu", a);
  std::printf("; want");
  for (size_t a : want) std::printf(" %zu", a);
  std::printf("\n");
  return false;
}

}  // namespace

int main() {
  bool ok = true;
  const double us = 1e-6;
  const ProbeRow unmeasured_factor = {1, 1, 1, 1, 1}, unmeasured_miss = {0, 0, 0, 0, 0};
  // A first size: the estimates alone.
  ok &= expect("first size", {16.8 * us, 7.8 * us, 15.2 * us, 16.0 * us, 7.2 * us},
               unmeasured_factor, unmeasured_miss, {kRecursiveDoubling, kSharedBuffer});
  // 4 ranks on 2 vCPUs: at 4 KiB recursive doubling took 11.4 us (estimate 7.84) and the shared
  // buffer 12.4 (7.19), a call's fixed cost more than its bytes. At 64 KiB (estimates below)
  // scaled by those factors they came to 65 and 59 us, beyond 1.5x halving-doubling's 39.4;
  // shifted by what they missed by, 48 and 40: both timed, with the three never timed yet.
  const ProbeRow after_4k_factor = {1, 11.4 / 7.84, 1, 1, 12.4 / 7.19};
  const ProbeRow after_4k_miss = {0, (11.4 - 7.84) * us, 0, 0, (12.4 - 7.19) * us};
  ok &= expect("64 KiB after 4 KiB", {44.8 * us, 44.7 * us, 50.1 * us, 39.4 * us, 34.3 * us},
               after_4k_factor, after_4k_miss,
               {kRing, kRecursiveDoubling, kTree, kHalvingDoubling, kSharedBuffer});
  // Where the bytes are what cost: recursive doubling 2.0x its estimate at 4 MiB (2.5 ms more),
  // at 16 MiB 20 ms scaled and 12.5 shifted, both beyond 1.5x the shared buffer's 7 ms.
  ok &= expect("16 MiB, a far loser stays out", {7.2e-3, 10e-3, 12e-3, 7.1e-3, 7.3e-3},
               {1, 2.0, 1.6, 1, 0.96}, {0, 2.5e-3, 1.2e-3, 0, -0.1e-3},
               {kRing, kHalvingDoubling, kSharedBuffer});
  if (ok) std::printf("ok\n");
  return ok ? 0 : 1;
}
