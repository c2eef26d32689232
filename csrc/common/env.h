// RINGCOMM_* environment knobs. Every knob is listed in docs/configuration.md.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

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

}  // namespace ringcomm
