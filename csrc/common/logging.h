// Minimal stderr logging, enabled with RINGCOMM_DEBUG=1.
#pragma once

#include <cstdio>

#include "common/env.h"

namespace ringcomm {

inline bool debug_enabled() {
  static const bool enabled = env_int("RINGCOMM_DEBUG", 0) != 0;
  return enabled;
}

#define RC_LOG(...)                                                              \
  do {                                                                           \
    if (::ringcomm::debug_enabled())                                             \
      std::fprintf(stderr, "[ringcomm] %s\n", ::ringcomm::str_cat(__VA_ARGS__).c_str()); \
  } while (0)

}  // namespace ringcomm
