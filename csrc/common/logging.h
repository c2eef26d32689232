// What the core reports when RINGCOMM_DEBUG is set (to anything but 0): choices, fallbacks,
// failures. Lines go to stderr, or to the sink Python installs (ringcomm's `logging` logger).
#pragma once

#include <functional>
#include <string>

#include "common/error.h"
#include "common/knobs.h"

namespace ringcomm {

inline bool debug_enabled() {
  static const bool enabled = knob_on("RINGCOMM_DEBUG");
  return enabled;
}

// Writes one line to the sink, or to stderr without one.
void log_line(const std::string& line);
// Replaces the sink (nullptr: stderr). The sink may be called from any thread.
void set_log_sink(std::function<void(const std::string&)> sink);

#define RC_LOG(...)                                                                          \
  do {                                                                                       \
    if (::ringcomm::debug_enabled()) ::ringcomm::log_line(::ringcomm::str_cat(__VA_ARGS__)); \
  } while (0)

}  // namespace ringcomm
