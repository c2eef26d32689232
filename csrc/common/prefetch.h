// Cache hints shared by the core and the torch shim.
#pragma once

#include <cstddef>

namespace ringcomm {

// Starts loading [p, p + bytes) into the cache, a line at a time: a hint, never a fault.
inline void prefetch_lines(const void* p, size_t bytes) {
  for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at);
}

}  // namespace ringcomm
