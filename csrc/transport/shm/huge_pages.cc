#include "transport/shm/huge_pages.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/logging.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older kernels answer EINVAL
#endif

namespace ringcomm {
namespace shm {
namespace {

constexpr uintptr_t kRegion = 2u << 20;  // x86-64's and arm64's (4 KiB granule) huge page

}  // namespace

void HugePages::offer(const void* data, size_t bytes) {
  if (!enabled_ || bytes < kLeastBytes) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  auto it = std::find_if(seen_.begin(), seen_.end(),
                         [&](const Seen& s) { return s.begin == begin && s.bytes == bytes; });
  if (it == seen_.end()) {
    if (seen_.size() == kRemembered) seen_.erase(seen_.begin());
    seen_.push_back({begin, bytes, false});
    return;
  }
  Seen seen = *it;
  seen_.erase(it);
  seen_.push_back({begin, bytes, true});
  if (seen.tried) return;
  const uintptr_t first = (begin + kRegion - 1) & ~(kRegion - 1);
  const uintptr_t last = (begin + bytes) & ~(kRegion - 1);
  if (last <= first) return;
  // Failures leave the pages as they were: EINVAL where the kernel has no MADV_COLLAPSE or the
  // memory cannot be collapsed (not private anonymous memory, or marked MADV_NOHUGEPAGE),
  // EAGAIN or ENOMEM where no huge page was free.
  if (madvise(reinterpret_cast<void*>(first), last - first, MADV_COLLAPSE) != 0)
    RC_LOG("huge pages: madvise(MADV_COLLAPSE) of ", (last - first) >> 20, " MiB at ",
           reinterpret_cast<void*>(first), ": ", strerror(errno), "; the buffer keeps its pages");
}

}  // namespace shm
}  // namespace ringcomm
