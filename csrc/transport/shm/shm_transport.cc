#include "transport/shm/shm_transport.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <new>
#include <random>

#include "common/error.h"
#include "common/knobs.h"
#include "common/logging.h"
#include "kernels/cpu/pack.h"

namespace ringcomm {
namespace shm {

constexpr uint64_t kSegmentMagic = 0x52434d53484d3031;  // "RCMSHM01"
constexpr size_t kLine = 64;

struct Control {
  uint64_t magic;
  uint64_t nonce;
  uint32_t locals;
  uint32_t slots;
  uint64_t slot_bytes;
  uint64_t board_bytes;
  alignas(kLine) std::atomic<uint32_t> doorbell;  // futex word: bumped to wake the owner
  alignas(kLine) std::atomic<uint32_t> sleeping;  // the owner sleeps (or is about to)
  // The CPU the owner was on when it last began to wait (peer_on_this_cpu); -1 before.
  alignas(kLine) std::atomic<int32_t> cpu;
  // 0; once `reason` is written, 1 + the reason's ErrorKind.
  alignas(kLine) std::atomic<uint32_t> aborted;
  char reason[kMaxAbortText];
};

struct Inbox {
  alignas(kLine) std::atomic<uint64_t> head;  // slots published by the sender
  alignas(kLine) std::atomic<uint64_t> tail;  // slots consumed by the receiver
  // Written by the receiver: single-copy messages read so far, and whether it can read the
  // sender's memory at all.
  alignas(kLine) std::atomic<uint64_t> pulled;
  std::atomic<uint32_t> can_pull;
};

struct SlotHeader {
  WireHeader header;        // of the whole message; checked on its first slot
  uint64_t fragment_bytes;  // payload in this slot
  uint32_t first;           // 1 on a message's first slot
  uint32_t by_address;      // 1: the payload is an Address, the message stays in the sender
};

// A single-copy message's one slot: where the sender's bytes are, in the sender's memory. With
// `ranges` 0, `bytes` bytes at `address`; else `address` holds a list of `ranges` iovecs, read
// first, whose lengths add up to `bytes` (a message gathered from several buffers).
struct Address {
  uint64_t address;
  uint64_t bytes;
  uint64_t ranges;
};

// Single-copy receives into a consumer read this much of the sender's memory at a time: large
// enough that a system call moves plenty, small enough to stay in cache for the consumer.
constexpr size_t kPullChunk = 256 << 10;
// Ranges per process_vm_readv call on either side.
constexpr size_t kPullBatch = 256;
// Messages of several ranges go by single copy only where their ranges, joined (kJoinGap), hold
// kSingleCopyRangeBytes each on average (transport.h), and where the list has at most
// kMaxRanges entries: a receiver takes no longer list, so a peer's word cannot make it allocate
// more than 16 MiB for one.
constexpr size_t kMaxRanges = 1 << 20;

namespace {

// Ranges of `r` once those that join their predecessor are counted with it.
size_t joined_ranges(Ranges r) {
  size_t count = 0;
  const char* end = nullptr;
  for (size_t i = 0; i < r.count; ++i) {
    const char* at = static_cast<const char*>(r.list[i].iov_base);
    if (!end || !joins(end, at)) ++count;
    end = at + r.list[i].iov_len;
  }
  return count;
}

}  // namespace
// The default threshold: the ring's slice (ring.cc), 1 MiB with 2 local ranks and 512 KiB with
// more, so that large all-reduces move every slice by single copy while a 2-rank ring's 1 MiB
// all-reduce (512 KiB halves) stays in the slots. The communicator keeps it only where it measured
// it faster.
constexpr int64_t single_copy_default(size_t local_ranks) {
  return local_ranks == 2 ? 1 << 20 : 512 << 10;
}
// The default slot size: inboxes of 8 slots of 256 KiB hold a ring's 1 MiB slice and the next
// one, so a sender fills its receiver's inbox while the receiver empties it rather than waiting
// on every slot it frees, as it does with slots of 64 KiB. With many local ranks, less, so
// that a rank's segment (local ranks x slots x slot bytes) stays within kSegmentBudget, down to
// kMinAutoSlotBytes.
constexpr size_t kMaxAutoSlotBytes = 256 << 10;
constexpr size_t kMinAutoSlotBytes = 64 << 10;
constexpr size_t kSegmentBudget = 16 << 20;
static_assert(sizeof(SlotHeader) == kLine, "a slot's payload starts on a cache line");
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "the doorbell must be a plain 32-bit futex word");

namespace {

std::atomic<uint64_t> process_bytes_sent{0};
std::atomic<uint64_t> process_bytes_pulled{0};

constexpr size_t kControlBytes = (sizeof(Control) + kLine - 1) / kLine * kLine;

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Wakes the owner of `control` if it sleeps. The fence pairs with the one in sleep(): either the
// sleeper sees what was published before this call, or this call sees it sleeping.
void ring(Control* control) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (control->sleeping.load(std::memory_order_relaxed)) {
    control->doorbell.fetch_add(1, std::memory_order_seq_cst);
    futex(&control->doorbell, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

size_t auto_slot_bytes(size_t locals, int slots) {
  size_t bytes = kMaxAutoSlotBytes;
  while (bytes > kMinAutoSlotBytes && locals * size_t(slots) * bytes > kSegmentBudget) bytes /= 2;
  return bytes;
}

}  // namespace

ShmOptions ShmOptions::from_env() {
  ShmOptions o;
  const std::optional<int64_t> slot_bytes = knob_int("RINGCOMM_SHM_SLOT_BYTES");
  RC_CHECK_ARG(
      !slot_bytes || (*slot_bytes >= 4096 && *slot_bytes <= (64 << 20) && *slot_bytes % kLine == 0),
      "RINGCOMM_SHM_SLOT_BYTES must be a multiple of 64 in [4096, 64 MiB], got ", *slot_bytes);
  o.slot_bytes = size_t(slot_bytes.value_or(0));
  o.slots = int(knob_int("RINGCOMM_SHM_SLOTS").value());
  RC_CHECK_ARG(o.slots >= 2 && o.slots <= 1024, "RINGCOMM_SHM_SLOTS must be in [2, 1024], got ",
               o.slots);
  o.single_copy_bytes = knob_int("RINGCOMM_SHM_SINGLE_COPY_BYTES").value_or(-1);
  o.huge_pages = knob_on("RINGCOMM_SHM_HUGE_PAGES");
  const std::string stream = knob_string("RINGCOMM_SHM_STREAM");
  o.stream = stream == "auto" ? StreamMode::kAuto
             : stream == "1"  ? StreamMode::kAlways
                              : StreamMode::kNever;
  const int64_t board = knob_int("RINGCOMM_SHM_BOARD_BYTES").value();
  RC_CHECK_ARG(board == 0 || (board >= (64 << 10) && board <= (1 << 30) && board % 4096 == 0),
               "RINGCOMM_SHM_BOARD_BYTES must be 0 or a multiple of 4096 in [64 KiB, 1 GiB], got ",
               board);
  o.board_bytes = size_t(board);
  o.unstack = knob_on("RINGCOMM_SHM_UNSTACK");
  return o;
}

ShmTransport::ShmTransport(int rank, int world_size, ShmOptions options, PartSink& sink)
    : rank_(rank),
      world_size_(world_size),
      options_(options),
      huge_pages_(options.huge_pages),
      sink_(sink),
      peers_(world_size) {
  fd_ = int(syscall(SYS_memfd_create, "ringcomm-shm", unsigned(MFD_CLOEXEC)));
  std::random_device random;
  nonce_ = (uint64_t(random()) << 32) ^ random();
  probe_word_ = nonce_;
}

ShmTransport::~ShmTransport() { close(); }

std::string ShmTransport::address() const {
  return fd_ < 0 ? ""
                 : str_cat(getpid(), ":", fd_, ":", nonce_, ":",
                           reinterpret_cast<uintptr_t>(&probe_word_));
}

bool ShmTransport::prepare(const std::vector<int>& local, std::string* why) {
  local_ = local;
  if (options_.single_copy_bytes < 0) {
    options_.single_copy_bytes = single_copy_default(local.size());
    single_copy_default_ = size_t(options_.single_copy_bytes);
  }
  local_index_ = int(std::find(local.begin(), local.end(), rank_) - local.begin());
  if (options_.slot_bytes == 0) options_.slot_bytes = auto_slot_bytes(local.size(), options_.slots);
  inbox_bytes_ =
      sizeof(Inbox) + size_t(options_.slots) * (sizeof(SlotHeader) + options_.slot_bytes);
  board_offset_ = (kControlBytes + local.size() * inbox_bytes_ + 4095) / 4096 * 4096;
  size_t total = board_offset_ + options_.board_bytes;
  if (fd_ < 0) {
    *why = str_cat("memfd_create failed: ", strerror(errno));
    return false;
  }
  // fallocate reserves the pages now: a full tmpfs fails here, not with SIGBUS mid-collective.
  if (ftruncate(fd_, off_t(total)) != 0 || fallocate(fd_, 0, 0, off_t(total)) != 0) {
    *why = str_cat("cannot reserve ", total, " bytes of shared memory: ", strerror(errno));
    return false;
  }
  // MAP_POPULATE here and for the peers' segments: mapped now, not page by page on first use.
  // Faults on first use slow the first slot writes either way, and the slot writer
  // (stream_copy.h) would choose on those timings until newer ones outvoted them; they slow the
  // first rounds of the single-copy probe too, which could then hand it to the slower way.
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, 0);
  if (base == MAP_FAILED) {
    *why = str_cat("mmap of ", total, " bytes failed: ", strerror(errno));
    return false;
  }
  own_ = {static_cast<char*>(base), total};
  control_ = new (own_.base) Control();
  control_->cpu.store(-1, std::memory_order_relaxed);
  control_->magic = kSegmentMagic;
  control_->nonce = nonce_;
  control_->locals = uint32_t(local.size());
  control_->slots = uint32_t(options_.slots);
  control_->slot_bytes = options_.slot_bytes;
  control_->board_bytes = options_.board_bytes;
  board_writer_ = SlotWriter(options_.stream);
  for (size_t i = 0; i < local.size(); ++i)
    new (own_.base + kControlBytes + i * inbox_bytes_) Inbox();
  return true;
}

bool ShmTransport::link(int peer, const std::string& address, std::string* why) {
  long pid = 0, fd = 0;
  unsigned long long nonce = 0, probe_address = 0;
  if (sscanf(address.c_str(), "%ld:%ld:%llu:%llu", &pid, &fd, &nonce, &probe_address) != 4) {
    *why = str_cat("rank ", peer, " has no shared-memory segment");
    return false;
  }
  std::string path = str_cat("/proc/", pid, "/fd/", fd);
  int peer_fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (peer_fd < 0) {
    *why = str_cat("cannot open rank ", peer, "'s segment ", path, ": ", strerror(errno));
    return false;
  }
  struct stat st{};
  void* base = MAP_FAILED;
  if (fstat(peer_fd, &st) == 0 && size_t(st.st_size) == own_.bytes)
    base = mmap(nullptr, own_.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, peer_fd, 0);
  ::close(peer_fd);
  if (base == MAP_FAILED) {
    *why = str_cat("cannot map rank ", peer, "'s segment (", st.st_size, " bytes, expected ",
                   own_.bytes, ")");
    return false;
  }
  auto* control = static_cast<Control*>(base);
  if (control->magic != kSegmentMagic || control->nonce != nonce ||
      control->locals != local_.size() || control->slots != uint32_t(options_.slots) ||
      control->slot_bytes != options_.slot_bytes || control->board_bytes != options_.board_bytes) {
    munmap(base, own_.bytes);
    *why = str_cat("rank ", peer, "'s segment is not the one it announced (another process at pid ",
                   pid, ", or other RINGCOMM_SHM_* settings)");
    return false;
  }
  int peer_index = int(std::find(local_.begin(), local_.end(), peer) - local_.begin());
  Peer& p = peers_[peer];
  p.segment = {static_cast<char*>(base), own_.bytes};
  p.control = control;
  p.out = reinterpret_cast<Inbox*>(p.segment.base + kControlBytes + local_index_ * inbox_bytes_);
  p.in = reinterpret_cast<Inbox*>(own_.base + kControlBytes + peer_index * inbox_bytes_);
  p.pid = pid;
  // The probe reads the word the peer announced; only its nonce proves the read reached the
  // peer's memory.
  uint64_t word = 0;
  iovec local{&word, sizeof word};
  iovec remote{reinterpret_cast<void*>(uintptr_t(probe_address)), sizeof word};
  ssize_t got = process_vm_readv(pid_t(pid), &local, 1, &remote, 1, 0);
  bool can_pull = got == ssize_t(sizeof word) && word == nonce;
  if (!can_pull && debug_enabled())
    RC_LOG("rank ", rank_, ": no single copy from rank ", peer, ": ",
           got < 0 ? str_cat("process_vm_readv: ", strerror(errno)) : std::string("wrong word"));
  p.in->can_pull.store(can_pull ? 1 : 0, std::memory_order_release);
  return true;
}

void ShmTransport::enable(int peer) {
  peers_[peer].enabled = true;
  peers_[peer].writer = SlotWriter(options_.stream);
  active_.push_back(peer);
}

const char* ShmTransport::board(int rank) const {
  if (board_bytes() == 0) return nullptr;
  if (rank == rank_) return own_.base + board_offset_;
  const Peer& p = peers_.at(size_t(rank));
  return p.enabled ? p.segment.base + board_offset_ : nullptr;
}

void ShmTransport::write_board(size_t offset, Ranges from, int readers) {
  const size_t n = from.bytes();
  if (offset > board_bytes() || n > board_bytes() - offset)
    RC_THROW("board write of ", n, " bytes at ", offset, " beyond its ", board_bytes());
  board_writer_.write(own_.base + board_offset_ + offset, n, [&](SlotOut& out) {
    for (size_t i = 0; i < from.count; ++i) {
      if (i + 1 < from.count)  // the caller's tensors, in no order: kernels/cpu/pack.h
        cpu::fetch_head(from.list[i + 1].iov_base, from.list[i + 1].iov_len);
      out.append(from.list[i].iov_base, from.list[i].iov_len);
    }
  });
  bytes_sent_.fetch_add(n * size_t(readers), std::memory_order_relaxed);
  process_bytes_sent.fetch_add(n * size_t(readers), std::memory_order_relaxed);
}

bool ShmTransport::waits_on(int peer) const {
  const Peer& p = peers_[peer];
  return !p.sends.empty() || !p.recvs.empty() || !p.pulling.empty();
}

void ShmTransport::set_current(const Signature& sig) {
  current_ = sig;
  has_current_ = true;
}

char* ShmTransport::slot(Inbox* box, uint64_t index) const {
  return reinterpret_cast<char*>(box) + sizeof(Inbox) +
         (index % uint64_t(options_.slots)) * (sizeof(SlotHeader) + options_.slot_bytes);
}

int ShmTransport::post(bool is_send, int peer, char* data, size_t bytes, const Signature& sig,
                       int64_t op) {
  Peer& p = peers_[peer];
  (is_send ? p.sends : p.recvs)
      .push_back(Part{op, data, bytes, 0, false, make_header(sig, bytes), nullptr});
  return 1;
}

int ShmTransport::post_consume(int peer, size_t bytes, const Signature& sig, int64_t op,
                               Consumer consume) {
  peers_[peer].recvs.push_back(
      Part{op, nullptr, bytes, 0, false, make_header(sig, bytes), std::move(consume)});
  return 1;
}

int ShmTransport::post_ranges(bool is_send, int peer, Ranges ranges, size_t bytes,
                              const Signature& sig, int64_t op) {
  Part part{op, nullptr, bytes, 0, false, make_header(sig, bytes), nullptr};
  part.ranges = ranges;
  part.cursor = RangeCursor(ranges);
  (is_send ? peers_[peer].sends : peers_[peer].recvs).push_back(part);
  return 1;
}

int ShmTransport::post_produce(int peer, size_t bytes, const Signature& sig, int64_t op,
                               Producer produce) {
  Part part{op, nullptr, bytes, 0, false, make_header(sig, bytes), nullptr};
  part.produce = produce;
  peers_[peer].sends.push_back(part);
  return 1;
}

bool ShmTransport::pump_send(int peer, Peer& p) {
  (void)peer;
  bool moved = false;
  while (!p.sends.empty()) {
    Part& part = p.sends.front();
    if (p.out_head - p.out->tail.load(std::memory_order_acquire) >= uint64_t(options_.slots)) break;
    char* s = slot(p.out, p.out_head);
    auto* sh = reinterpret_cast<SlotHeader*>(s);
    sh->header = part.header;
    sh->first = part.started ? 0 : 1;
    if (send_by_address(p, part)) {
      Address where{reinterpret_cast<uintptr_t>(part.data), part.bytes, 0};
      if (part.ranges.count == 1)
        where.address = reinterpret_cast<uintptr_t>(part.ranges.list[0].iov_base);
      else if (part.ranges.list)
        where = {reinterpret_cast<uintptr_t>(part.ranges.list), part.bytes, part.ranges.count};
      sh->fragment_bytes = sizeof where;
      sh->by_address = 1;
      memcpy(s + sizeof(SlotHeader), &where, sizeof where);
      p.out->head.store(++p.out_head, std::memory_order_release);
      ++p.pulls_sent;
      p.pulling.push_back(std::move(part));
      p.sends.pop_front();
      moved = true;
      continue;
    }
    size_t len = std::min(options_.slot_bytes, part.bytes - part.done);
    sh->fragment_bytes = len;
    sh->by_address = 0;
    char* dst = s + sizeof(SlotHeader);
    if (len && part.produce)
      p.writer.write(dst, len, [&](SlotOut& out) {
        // Packing kernels store plainly: to stream, pack into this rank's cache, then append.
        if (!out.streaming()) return part.produce(part.done, dst, len);
        if (p.packed.size() < len) p.packed.resize(options_.slot_bytes);
        part.produce(part.done, p.packed.data(), len);
        out.append(p.packed.data(), len);
      });
    else if (len && part.ranges.list)
      p.writer.write(dst, len, [&](SlotOut& out) {
        part.cursor.read(len, "pack", [&out](const char* data, size_t n) { out.append(data, n); });
      });
    else if (len)
      p.writer.write(dst, len, [&](SlotOut& out) { out.append(part.data + part.done, len); });
    p.out->head.store(++p.out_head, std::memory_order_release);
    part.started = true;
    part.done += len;
    moved = true;
    bytes_sent_.fetch_add(len + sizeof(SlotHeader), std::memory_order_relaxed);
    process_bytes_sent.fetch_add(len + sizeof(SlotHeader), std::memory_order_relaxed);
    if (part.done < part.bytes) continue;
    int64_t op = part.op;
    p.sends.pop_front();
    sink_.part_done(op);
  }
  if (moved) ring(p.control);
  return moved;
}

bool ShmTransport::send_by_address(Peer& p, Part& part) const {
  return !part.started && (part.data || part.ranges.list) && !part.produce &&
         options_.single_copy_bytes > 0 && part.bytes >= uint64_t(options_.single_copy_bytes) &&
         p.out->can_pull.load(std::memory_order_relaxed) &&
         (part.ranges.count < 2 ||
          (part.ranges.count <= kMaxRanges &&
           part.bytes / joined_ranges(part.ranges) >= kSingleCopyRangeBytes));
}

void ShmTransport::offer_huge_pages(const void* data, size_t bytes) {
  // No message out of a buffer smaller than the single-copy size goes by single copy.
  if (!huge_pages_.enabled() || bytes < HugePages::kLeastBytes || options_.single_copy_bytes <= 0 ||
      bytes < uint64_t(options_.single_copy_bytes))
    return;
  for (const Peer& p : peers_)
    if (p.enabled && p.out->can_pull.load(std::memory_order_relaxed)) {
      huge_pages_.offer(data, bytes);
      return;
    }
}

// Reads a single-copy message out of `peer`'s memory. The kernel checks every range against the
// peer's mappings: a bad address fails here, it cannot reach anything but the peer's own memory.
void ShmTransport::pull(int peer, const Peer& p, Part& part, const Address& where) {
  // Moves `bytes` bytes from the sender's ranges at `from` to this rank's at `to`, as many
  // ranges per call as fit. The kernel pins the sender's pages range by range, which for a
  // thousand small tensors cost a fifth more than reading their bytes: ranges that join the
  // previous one (kJoinGap) are read as one with it, and the bytes between them (other data of
  // the sender's) go to gap_sink_.
  auto read = [&](RangeCursor& to, RangeCursor& from, size_t bytes) {
    iovec local[kPullBatch], remote[kPullBatch];
    while (bytes) {
      size_t n_local = 0, n_remote = 0, moved = 0, asked = 0;
      while (moved < bytes && n_remote < kPullBatch && n_local + 2 <= kPullBatch) {
        iovec next;
        size_t one;
        if (from.peek(bytes - moved, &next, 1, &one) == 0) break;
        const char* at = static_cast<const char*>(next.iov_base);
        const char* end = n_remote ? static_cast<const char*>(remote[n_remote - 1].iov_base) +
                                         remote[n_remote - 1].iov_len
                                   : nullptr;
        const bool joined = end && joins(end, at);
        const size_t gap = joined ? size_t(at - end) : 0, sink = gap ? 1 : 0;
        size_t used = 0;
        const size_t len =
            to.peek(next.iov_len, local + n_local + sink, kPullBatch - n_local - sink, &used);
        if (len == 0) break;
        if (sink) local[n_local] = {gap_sink_, gap};
        n_local += sink + used;
        if (joined)
          remote[n_remote - 1].iov_len += gap + len;
        else
          remote[n_remote++] = {next.iov_base, len};
        to.skip(len);
        from.skip(len);
        moved += len;
        asked += gap + len;
      }
      ssize_t got = process_vm_readv(pid_t(p.pid), local, n_local, remote, n_remote, 0);
      if (got != ssize_t(asked) || asked == 0) {
        const int error = errno;
        // A sender that failed (a mismatch another peer reported, a timeout) releases its
        // buffers after setting its flag: its reason is the one to report, not the bad address.
        check_peer(peer, p);
        const void* stopped = nullptr;  // where the kernel stopped: the range it refused
        for (size_t i = 0, skip = size_t(std::max<ssize_t>(got, 0)); i < n_remote; ++i) {
          if (skip < remote[i].iov_len) {
            stopped = static_cast<const char*>(remote[i].iov_base) + skip;
            break;
          }
          skip -= remote[i].iov_len;
        }
        // The peer has not aborted: it is gone (ESRCH), or it offered memory it does not have.
        const std::string why =
            got < 0 ? strerror(error) : str_cat("read ", got, " of ", asked, " bytes");
        throw Error(str_cat("cannot read rank ", peer, "'s message of ", part.bytes, " bytes at ",
                            stopped, ": ", why),
                    got < 0 && error == ESRCH ? ErrorKind::kPeerLost : ErrorKind::kProtocol);
      }
      bytes -= moved;
    }
  };
  iovec whole{reinterpret_cast<void*>(uintptr_t(where.address)), size_t(where.bytes)};
  Ranges sender{&whole, 1};
  if (where.ranges) {
    // The list is the peer's word too: at most one range per byte and kMaxRanges in all, and
    // lengths that add up.
    if (where.ranges > std::min<uint64_t>(kMaxRanges, std::max<uint64_t>(1, part.bytes)))
      RC_THROW_AS(kProtocol, "protocol error: rank ", peer, " offered ", where.ranges,
                  " ranges for a message of ", part.bytes, " bytes");
    remote_ranges_.resize(size_t(where.ranges));
    iovec list{remote_ranges_.data(), remote_ranges_.size() * sizeof(iovec)};
    iovec theirs{whole.iov_base, list.iov_len};
    RangeCursor to(Ranges{&list, 1}), from(Ranges{&theirs, 1});
    read(to, from, list.iov_len);
    uint64_t total = 0;
    for (const iovec& r : remote_ranges_)
      if (__builtin_add_overflow(total, uint64_t(r.iov_len), &total)) total = UINT64_MAX;
    if (total != part.bytes)
      RC_THROW_AS(kProtocol, "protocol error: rank ", peer, "'s ranges hold ", total,
                  " bytes of a message of ", part.bytes);
    sender = {remote_ranges_.data(), remote_ranges_.size()};
  }
  RangeCursor from(sender);
  if (part.consume) {
    if (scratch_.empty()) scratch_.resize(kPullChunk);
    for (size_t done = 0; done < part.bytes; done += kPullChunk) {
      size_t len = std::min(kPullChunk, part.bytes - done);
      iovec chunk{scratch_.data(), len};
      RangeCursor to(Ranges{&chunk, 1});
      read(to, from, len);
      part.consume(done, scratch_.data(), len);
    }
  } else if (part.ranges.list) {
    read(part.cursor, from, part.bytes);
  } else {
    iovec into{part.data, part.bytes};
    RangeCursor to(Ranges{&into, 1});
    read(to, from, part.bytes);
  }
  part.done = part.bytes;
  process_bytes_pulled.fetch_add(part.bytes, std::memory_order_relaxed);
}

// A single-copy send completes once the receiver has counted it pulled.
bool ShmTransport::reap_pulled(int peer, Peer& p) {
  uint64_t pulled = p.out->pulled.load(std::memory_order_acquire);
  if (pulled == p.pulls_done) return false;
  if (pulled < p.pulls_done || pulled > p.pulls_sent)
    RC_THROW_AS(kProtocol, "protocol error: rank ", peer, " counts ", pulled, " messages read of ",
                p.pulls_sent, " sent");
  for (; p.pulls_done < pulled; ++p.pulls_done) {
    int64_t op = p.pulling.front().op;
    size_t bytes = p.pulling.front().bytes;
    p.pulling.pop_front();
    bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
    process_bytes_sent.fetch_add(bytes, std::memory_order_relaxed);
    sink_.part_done(op);
  }
  return true;
}

// Everything in a slot is the peer's word: checked before it is used.
bool ShmTransport::pump_recv(int peer, Peer& p) {
  bool moved = false;
  while (true) {
    uint64_t head = p.in->head.load(std::memory_order_acquire);
    if (head == p.in_tail) break;
    if (head - p.in_tail > uint64_t(options_.slots))
      RC_THROW_AS(kProtocol, "protocol error: rank ", peer, " published ", head - p.in_tail,
                  " slots into an inbox of ", options_.slots);
    const char* s = slot(p.in, p.in_tail);
    SlotHeader sh;
    memcpy(&sh, s, sizeof sh);
    if (sh.header.magic != kMessageMagic || sh.header.kind != kDataMessage)
      RC_THROW_AS(kProtocol, "protocol error: garbage from rank ", peer, " (bad message magic)");
    Signature theirs = header_signature(sh.header);
    if (p.recvs.empty()) {
      if (sh.first && has_current_ && stray_mismatch(theirs, current_))
        RC_THROW_AS(kMismatch, "mismatched operations: rank ", peer, " issued ", theirs.describe(),
                    " but rank ", rank_, " issued ", current_.describe());
      break;  // held until a receive is posted
    }
    Part& part = p.recvs.front();
    if (!part.started) {
      Signature ours = header_signature(part.header);
      if (!sh.first || theirs != ours)
        RC_THROW_AS(kMismatch, "mismatched operations: rank ", peer, " issued ", theirs.describe(),
                    " but rank ", rank_, " issued ", ours.describe());
      if (sh.header.payload_bytes != part.bytes)
        RC_THROW_AS(kProtocol, "protocol error: rank ", peer, " sent ", sh.header.payload_bytes,
                    " bytes for ", theirs.describe(), ", rank ", rank_, " expected ", part.bytes);
    }
    if (sh.by_address) {
      Address where;
      if (!sh.first || part.started || sh.by_address != 1 || sh.fragment_bytes != sizeof where ||
          !p.in->can_pull.load(std::memory_order_relaxed))
        RC_THROW_AS(kProtocol, "protocol error: rank ", peer,
                    " sent a malformed single-copy slot for ", theirs.describe());
      memcpy(&where, s + sizeof(SlotHeader), sizeof where);
      if (where.bytes != part.bytes)
        RC_THROW_AS(kProtocol, "protocol error: rank ", peer, " offered ", where.bytes,
                    " bytes for ", theirs.describe(), ", rank ", rank_, " expected ", part.bytes);
      p.in->tail.store(++p.in_tail, std::memory_order_release);
      ring(p.control);  // the slot is free: a sender waiting for one need not wait for the pull
      pull(peer, p, part, where);
      // A sender that failed meanwhile may have handed its buffer back: what was read may be
      // stale, so it is not used. It sets the flag before any buffer is released.
      check_peer(peer, p);
      p.in->pulled.fetch_add(1, std::memory_order_release);
      moved = true;
      int64_t op = part.op;
      p.recvs.pop_front();
      sink_.part_done(op);
      break;  // a pull is long: let the caller publish sends and reap before the next
    }
    if ((sh.first != 0) == part.started || sh.fragment_bytes > options_.slot_bytes ||
        sh.fragment_bytes > part.bytes - part.done || (sh.fragment_bytes == 0 && part.bytes != 0))
      RC_THROW_AS(kProtocol, "protocol error: rank ", peer, " sent a slot of ", sh.fragment_bytes,
                  " bytes where ", part.bytes - part.done, " were left of ", theirs.describe());
    if (part.consume)
      part.consume(part.done, s + sizeof(SlotHeader), sh.fragment_bytes);
    else if (part.ranges.list)
      part.cursor.scatter(s + sizeof(SlotHeader), sh.fragment_bytes, "unpack");
    else if (sh.fragment_bytes)  // an empty message's buffer may be null
      cpu::copy_bytes(part.data + part.done, s + sizeof(SlotHeader), sh.fragment_bytes);
    part.done += sh.fragment_bytes;
    part.started = true;
    p.in->tail.store(++p.in_tail, std::memory_order_release);
    moved = true;
    if (part.done < part.bytes) continue;
    int64_t op = part.op;
    p.recvs.pop_front();
    sink_.part_done(op);
  }
  if (moved) ring(p.control);  // the sender may be waiting for free slots
  return moved;
}

uint64_t ShmTransport::bytes_sent_by_process() {
  return process_bytes_sent.load(std::memory_order_relaxed);
}

uint64_t ShmTransport::bytes_pulled_by_process() {
  return process_bytes_pulled.load(std::memory_order_relaxed);
}

bool ShmTransport::peek(int peer, Signature* sig) const {
  const Peer& p = peers_[peer];
  if (!p.in || !p.recvs.empty() || p.in->head.load(std::memory_order_acquire) == p.in_tail)
    return false;
  SlotHeader sh;
  memcpy(&sh, slot(p.in, p.in_tail), sizeof sh);
  if (!sh.first || sh.header.magic != kMessageMagic || sh.header.kind != kDataMessage)
    return false;  // pump_recv reports it once a receive is posted
  *sig = header_signature(sh.header);
  return true;
}

[[noreturn]] void ShmTransport::throw_peer_abort(int peer, const Peer& p) const {
  char text[kMaxAbortText];
  memcpy(text, p.control->reason, sizeof text);
  text[sizeof text - 1] = '\0';
  throw_remote_abort(peer, text, p.control->aborted.load(std::memory_order_acquire) - 1u);
}

void ShmTransport::check_peer(int peer, const Peer& p) const {
  // The fence keeps reads of the peer's memory made before this check from moving after it.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (p.control->aborted.load(std::memory_order_acquire)) throw_peer_abort(peer, p);
}

bool ShmTransport::progress() {
  bool moved = false;
  for (int peer : active_) {
    Peer& p = peers_[peer];
    // What a peer published in its slots before it aborted is taken first: an operation whose
    // data has all arrived completes, and only one that still needs the peer fails, with its
    // reason (single-copy reads check the flag themselves: the peer may release its buffers).
    if (!p.sends.empty()) moved |= pump_send(peer, p);
    if (!p.pulling.empty()) moved |= reap_pulled(peer, p);
    moved |= pump_recv(peer, p);
    if (waits_on(peer)) check_peer(peer, p);
  }
  return moved;
}

bool ShmTransport::busy() const {
  for (int peer : active_)
    if (waits_on(peer)) return true;
  return false;
}

bool ShmTransport::ready() const {
  for (int peer : active_) {
    const Peer& p = peers_[peer];
    // An aborted peer counts only while something is owed by it, as in progress(): else every
    // sleep would return at once (its abort frame on the socket fails the rest).
    if (waits_on(peer) && p.control->aborted.load(std::memory_order_acquire)) return true;
    if (!p.recvs.empty() && p.in->head.load(std::memory_order_acquire) != p.in_tail) return true;
    if (!p.sends.empty() &&
        p.out_head - p.out->tail.load(std::memory_order_acquire) < uint64_t(options_.slots))
      return true;
    if (!p.pulling.empty() && p.out->pulled.load(std::memory_order_acquire) != p.pulls_done)
      return true;
  }
  return false;
}

void ShmTransport::sleep(Clock::time_point until) {
  if (!control_) return;
  uint32_t seen = control_->doorbell.load(std::memory_order_acquire);
  control_->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  auto left = until - Clock::now();
  if (!ready() && left > Clock::duration::zero()) {
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{time_t(ns / 1000000000), long(ns % 1000000000)};
    futex(&control_->doorbell, FUTEX_WAIT, seen, &ts);
  }
  control_->sleeping.store(0, std::memory_order_relaxed);
}

bool ShmTransport::peer_on_this_cpu() {
  if (!control_) return false;
  const int cpu = sched_getcpu();
  // Written only when it changes: peers read this line at every wait, and a store each time
  // would take it from their caches on the small-message path.
  if (control_->cpu.load(std::memory_order_relaxed) != cpu)
    control_->cpu.store(cpu, std::memory_order_relaxed);
  if (cpu < 0) return false;
  for (int peer : active_)
    if (peers_[size_t(peer)].control->cpu.load(std::memory_order_relaxed) == cpu)
      return !(options_.unstack && rank_ > peer && move_off(cpu));
  return false;
}

// With a CPU for every local rank, the scheduler still puts two ranks that wake each other on
// one CPU for spells (a woken thread tends to go where its waker ran), and they then take turns
// on it while the other CPU idles, and small calls take several times as long. The higher rank
// of the two moves its waiting thread to a CPU of its set where no local rank last waited, then
// gives the thread its whole set back: the scheduler leaves it there until it stacks them again.
// At most once every kMoveEvery, and only while there are at least as many CPUs in the set as
// local ranks (with fewer, some share one anyway, and moving one only stacks it elsewhere).
bool ShmTransport::move_off(int cpu) {
  constexpr std::chrono::milliseconds kMoveEvery{10};
  const auto now = std::chrono::steady_clock::now();
  if (now - move_tried_ < kMoveEvery) return false;
  move_tried_ = now;
  cpu_set_t allowed, taken, only;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 ||
      CPU_COUNT(&allowed) < int(active_.size()) + 1)
    return false;
  CPU_ZERO(&taken);
  CPU_SET(cpu, &taken);
  for (int peer : active_) {
    const int at = peers_[size_t(peer)].control->cpu.load(std::memory_order_relaxed);
    if (at >= 0 && at < CPU_SETSIZE) CPU_SET(at, &taken);
  }
  int target = 0;
  while (target < CPU_SETSIZE && !(CPU_ISSET(target, &allowed) && !CPU_ISSET(target, &taken)))
    ++target;
  if (target == CPU_SETSIZE) return false;
  CPU_ZERO(&only);
  CPU_SET(target, &only);
  // The first call migrates the thread before it returns; the second does not move it back.
  if (sched_setaffinity(0, sizeof only, &only) != 0) return false;
  if (sched_setaffinity(0, sizeof allowed, &allowed) != 0) {
    // Not seen; said always, not only under RINGCOMM_DEBUG: it leaves the caller's thread pinned.
    options_.unstack = false;
    log_line(str_cat("ringcomm: rank ", rank_, " moved its waiting thread to CPU ", target,
                     " and could not give it its CPU set back (", strerror(errno),
                     "): it stays there; no more moves (RINGCOMM_SHM_UNSTACK)"));
  }
  control_->cpu.store(sched_getcpu(), std::memory_order_relaxed);
  cpu_moves_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void ShmTransport::ring_self() {
  if (!control_) return;
  control_->doorbell.fetch_add(1, std::memory_order_seq_cst);
  futex(&control_->doorbell, FUTEX_WAKE, INT_MAX, nullptr);
}

void ShmTransport::abort(const std::string& reason, ErrorKind kind) {
  if (aborted_) return;
  aborted_ = true;
  if (control_) {
    size_t n = std::min(reason.size(), sizeof(control_->reason) - 1);
    memcpy(control_->reason, reason.data(), n);
    control_->reason[n] = '\0';
    control_->aborted.store(1u + uint32_t(kind), std::memory_order_release);
  }
  for (int peer : active_) {
    Peer& p = peers_[peer];
    p.control->doorbell.fetch_add(1, std::memory_order_seq_cst);
    futex(&p.control->doorbell, FUTEX_WAKE, INT_MAX, nullptr);
    p.sends.clear();
    p.recvs.clear();
    p.pulling.clear();
  }
}

void ShmTransport::close() {
  for (Peer& p : peers_) {
    if (p.segment.base) munmap(p.segment.base, p.segment.bytes);
    p = Peer();
  }
  active_.clear();
  if (own_.base) munmap(own_.base, own_.bytes);
  own_ = Mapping();
  control_ = nullptr;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void ShmTransport::waiting_on(std::vector<int>& peers) const {
  for (int peer : active_)
    if (waits_on(peer)) peers.push_back(peer);
}

}  // namespace shm
}  // namespace ringcomm
