// RINGCOMM_* environment knobs. Every knob is listed in docs/configuration.md.
#pragma once

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>

#include "common/error.h"

namespace ringcomm {

inline std::string env_string(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long long parsed = std::strtoll(v, &end, 10);
  RC_CHECK_ARG(end && *end == '\0', name, "=", v, " is not an integer");
  return parsed;
}

// CPUs this process may run on: its affinity mask (a container's cpuset, taskset, numactl), which
// is what local ranks share, not the machine's count that hardware_concurrency() reports.
inline int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace ringcomm
