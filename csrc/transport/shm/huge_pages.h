// Huge pages for buffers that peers read by single copy.
//
// A single-copy receiver's process_vm_readv pins the sender's pages one by one. With 4 KiB pages
// and several readers of one buffer the page-table walks and page reference counts
// (follow_page_pte, __get_user_pages, try_grab_folio, ...) take much of the CPU, where buffers
// backed by huge pages (numpy's, as Open MPI reads them) cost almost nothing there; collapsed as
// below, large all-reduces by single copy run markedly faster (docs/algorithms.md).
//
// So a buffer offered a second time (a caller's gradient bucket or benchmark tensor, used again)
// has the 2 MiB regions that lie wholly inside it collapsed into huge pages
// (madvise(MADV_COLLAPSE), Linux 6.1): the same bytes, the same addresses, copied once into
// huge pages by the kernel. Once per buffer: a buffer that comes back collapsed is left alone,
// and one that failed is not tried again. A buffer seen once (a temporary) is never touched, so
// its cost (the kernel's copy of every region, once) is paid only by buffers that are
// used again. Memory outside what is offered (a buffer, or a run of buffers that lie together:
// communicator_coalesced.cc) is never collapsed. RINGCOMM_SHM_HUGE_PAGES=0 turns it off.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ringcomm {
namespace shm {

class HugePages {
 public:
  // Buffers of fewer bytes are left alone: they hold at most one whole 2 MiB region.
  static constexpr size_t kLeastBytes = 4u << 20;

  explicit HugePages(bool enabled) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }
  // [data, data + bytes) is about to be read by peers: collapsed if offered once before.
  void offer(const void* data, size_t bytes);

 private:
  struct Seen {
    uintptr_t begin;
    size_t bytes;
    bool tried;  // collapsed, or the kernel refused
  };
  // The buffers offered last, most recent last: enough for a model's gradient buckets.
  static constexpr size_t kRemembered = 32;

  bool enabled_;
  std::vector<Seen> seen_;
};

}  // namespace shm
}  // namespace ringcomm
