// Shared-memory transport between ranks of one host.
//
// Each rank owns one segment (a memfd: it never has a name in /dev/shm, so nothing is left
// behind when a rank is killed). The segment holds the rank's control block (doorbell, abort
// flag and reason) and one inbox per local peer: a ring of `slots` slots of `slot_bytes` payload
// each, with a head the sender advances and a tail the receiver advances, each in its own cache
// line. A message is copied into consecutive slots (the first carries its WireHeader, checked by
// the receiver before any byte is accepted) and copied out by the receiver: one copy in, one out.
// Peers map each other's segments through /proc/<pid>/fd/<fd> after a handshake over TCP; a nonce
// in the segment proves it is the one announced. Waiting: the mesh sleeps on this rank's doorbell
// (a futex); a rank that publishes a slot, frees one or aborts rings the peer's doorbell when the
// peer sleeps.
//
// The board: a region at the end of each segment that every local peer reads in place, for
// collectives whose ranks read each other's contributions where they lie (the shared-buffer
// all-reduce, algorithms/shared_buffer.cc). It holds only data: its users agree by messages
// through the inboxes when it may be written and read.
//
// Single copy: a send of at least `single_copy_bytes` from a buffer puts only the buffer's address
// in a slot; the receiver reads the bytes out of the sender's memory with process_vm_readv (into
// the receive buffer, or through a cache-sized scratch buffer into a consumer), then counts the
// message as pulled, which completes the send. A message of several ranges (post_ranges) puts the
// address of its list of ranges in the slot instead; the receiver reads the list, checks that it
// adds up to the message, and reads the ranges. Each receiver probes at mapping time whether the
// kernel lets it read its peer (containers and Yama's ptrace_scope may not) and says so in the
// inbox; senders use single copy only towards receivers that can. Whether one read beats two
// copies depends on the machine (on some hosts the kernel copies between processes far slower
// than memcpy), so when the size is left to its default the communicator times both ways once
// and keeps the faster (Communicator::calibrate, use_single_copy).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "common/fifo.h"
#include "transport/shm/huge_pages.h"
#include "transport/shm/stream_copy.h"
#include "transport/transport.h"
#include "transport/wire.h"

namespace ringcomm {
namespace shm {

struct ShmOptions {
  size_t slot_bytes = 0;  // RINGCOMM_SHM_SLOT_BYTES; 0: chosen by prepare() from the local ranks
  int slots = 8;          // RINGCOMM_SHM_SLOTS: per inbox
  // RINGCOMM_SHM_SINGLE_COPY_BYTES; 0: never; unset: 1 MiB while every local rank has a core
  // of its own, else never (with more ranks than cores, a sender waits for its receiver to be
  // scheduled to move its bytes; through the slots it moves them itself).
  int64_t single_copy_bytes = -1;
  bool huge_pages = true;                 // RINGCOMM_SHM_HUGE_PAGES (huge_pages.h)
  size_t board_bytes = 2 << 20;           // RINGCOMM_SHM_BOARD_BYTES; 0: no board
  StreamMode stream = StreamMode::kAuto;  // RINGCOMM_SHM_STREAM (stream_copy.h)
  bool unstack = true;                    // RINGCOMM_SHM_UNSTACK (ShmTransport::move_off)
  static ShmOptions from_env();
};

struct Control;
struct Inbox;
struct Address;

class ShmTransport final : public Transport, public SingleCopy, public Boards {
 public:
  ShmTransport(int rank, int world_size, ShmOptions options, PartSink& sink);
  ~ShmTransport() override;

  const char* name() const override { return "shm"; }
  // What a local peer needs to map this rank's segment and probe single copy:
  // "pid:fd:nonce:address of a word holding the nonce".
  std::string address() const override;
  // Ranks of one host that both run shared memory.
  bool can_connect(const Published& self, const Published& peer) const override {
    return self.offered && peer.offered && self.host == peer.host;
  }
  // Sizes this rank's segment for `group` (the ranks of this host that run shared memory). False,
  // with `why`, if memory is short.
  bool prepare(const std::vector<int>& group, std::string* why) override;
  // Maps `peer`'s segment from its address; false, with `why`, if this host does not allow it.
  // Then probes whether this rank can read the peer's memory (single copy from it).
  bool link(int peer, const std::string& address, std::string* why) override;
  void enable(int peer) override;

  // Single copy (transport.h). The size to probe: when RINGCOMM_SHM_SINGLE_COPY_BYTES left it to
  // its default and the default turned it on.
  SingleCopy* single_copy() override { return this; }
  size_t single_copy_to_probe() const override { return single_copy_default_; }
  size_t single_copy_bytes() const override {
    return size_t(std::max<int64_t>(0, options_.single_copy_bytes));
  }
  void use_single_copy(bool on) override {
    if (single_copy_default_) options_.single_copy_bytes = on ? int64_t(single_copy_default_) : 0;
  }
  void offer_huge_pages(const void* data, size_t bytes) override;
  // Boards (transport.h): a region at the end of every segment. Writes use plain or streamed
  // stores as the writer of the slots chooses (stream_copy.h), for readers on other CPUs.
  Boards* boards() override { return this; }
  size_t board_bytes() const override { return own_.base ? options_.board_bytes : 0; }
  const char* board(int rank) const override;
  void write_board(size_t offset, Ranges from, int readers) override;
  // Publishes the CPU this rank is on, for its peers, and says whether a local peer was on it
  // when it last began to wait: the scheduler has put both on one CPU. The higher rank of the
  // two may first move off it (move_off), and then says no.
  bool peer_on_this_cpu() override;
  uint64_t cpu_moves() const override { return cpu_moves_.load(std::memory_order_relaxed); }

  void set_current(const Signature& sig) override;
  int post(bool is_send, int peer, char* data, size_t bytes, const Signature& sig,
           int64_t op) override;
  bool can_consume() const override { return true; }
  int post_consume(int peer, size_t bytes, const Signature& sig, int64_t op,
                   Consumer consume) override;
  int post_produce(int peer, size_t bytes, const Signature& sig, int64_t op,
                   Producer produce) override;
  bool takes_ranges() const override { return true; }
  int post_ranges(bool is_send, int peer, Ranges ranges, size_t bytes, const Signature& sig,
                  int64_t op) override;
  bool progress() override;
  bool peek(int peer, Signature* sig) const override;
  bool busy() const override;
  bool waits_on(int peer) const override;
  bool has_doorbell() const override { return true; }
  void sleep(Clock::time_point until) override;
  void ring_self() override;
  void abort(const std::string& reason, ErrorKind kind) override;
  void close() override;
  uint64_t bytes_sent() const override { return bytes_sent_.load(std::memory_order_relaxed); }
  // Bytes every shared-memory transport of this process has written so far (the kernel's socket
  // counters do not see them): communicators of torch process groups and closed ones included.
  static uint64_t bytes_sent_by_process();
  // Of the bytes this process received through shared memory, those it read out of its peers'
  // memory by single copy.
  static uint64_t bytes_pulled_by_process();
  void waiting_on(std::vector<int>& peers) const override;

 private:
  struct Part {
    int64_t op;
    char* data;
    size_t bytes;
    size_t done = 0;
    bool started = false;  // first slot written (send) or checked (receive)
    WireHeader header;     // sent, or expected
    Consumer consume;      // receives only: takes the bytes instead of `data`
    Producer produce;      // sends only: writes the bytes instead of `data`
    Ranges ranges;         // the bytes lie here instead of `data` (post_ranges)
    RangeCursor cursor;    // where `done` is in `ranges`
  };
  struct Mapping {
    char* base = nullptr;
    size_t bytes = 0;
  };
  struct Peer {
    bool enabled = false;
    Mapping segment;                     // the peer's segment
    Control* control = nullptr;          // its control block
    Inbox* out = nullptr;                // my inbox in its segment: I send here
    Inbox* in = nullptr;                 // its inbox in my segment: I receive here
    uint64_t out_head = 0, in_tail = 0;  // my copies of the counters only I write
    long pid = 0;
    Fifo<Part> sends, recvs;
    Fifo<Part> pulling;  // single-copy sends waiting for the peer to read them
    uint64_t pulls_sent = 0, pulls_done = 0;
    SlotWriter writer;         // how I write into its slots
    std::vector<char> packed;  // a produced fragment, when the writer streams it
  };

  bool pump_send(int peer, Peer& p);
  bool pump_recv(int peer, Peer& p);
  bool send_by_address(Peer& p, Part& part) const;
  void pull(int peer, const Peer& p, Part& part, const Address& where);
  bool reap_pulled(int peer, Peer& p);
  bool ready() const;  // something for progress() to do
  [[noreturn]] void throw_peer_abort(int peer, const Peer& p) const;
  // Throws the peer's reason if it has aborted.
  void check_peer(int peer, const Peer& p) const;
  char* slot(Inbox* box, uint64_t index) const;
  bool move_off(int cpu);

  const int rank_, world_size_;
  ShmOptions options_;
  HugePages huge_pages_;
  size_t single_copy_default_ = 0;  // the default's size, when it turned single copy on
  PartSink& sink_;
  int fd_ = -1;
  uint64_t nonce_;
  uint64_t probe_word_;               // the nonce, read by peers probing single copy
  std::vector<char> scratch_;         // single-copy receives into a consumer go through it
  std::vector<iovec> remote_ranges_;  // a single-copy message's ranges in the sender's memory
  char gap_sink_[4096];  // what single copy reads between a sender's ranges (pull, kJoinGap)
  Mapping own_;
  Control* control_ = nullptr;
  std::vector<int> local_;  // local ranks, in rank order
  int local_index_ = -1;
  size_t inbox_bytes_ = 0;
  size_t board_offset_ = 0;  // of the board in every segment
  SlotWriter board_writer_;
  std::vector<Peer> peers_;  // by rank
  std::vector<int> active_;  // enabled peers
  std::chrono::steady_clock::time_point move_tried_{};
  std::atomic<uint64_t> cpu_moves_{0};
  Signature current_;
  bool has_current_ = false;
  bool aborted_ = false;
  std::atomic<uint64_t> bytes_sent_{0};
};

}  // namespace shm
}  // namespace ringcomm
