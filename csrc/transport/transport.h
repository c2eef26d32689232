// The transport interface: how bytes move between ranks. A transport knows peers, byte ranges
// and the tag each message carries, nothing of collectives.
//
// A rank holds its transports in order of preference (transport/mesh.h), each in its own folder
// (shm/, tcp/). Each publishes an address in the rank's and decides, from what two ranks
// published, whether it can connect them (can_connect); the mesh gives each peer the first
// transport that both sides can connect and set up. TCP comes last and reaches every peer: it is
// also the control plane, carrying the other transports' set-up, abort notices and waiting
// notices, and its connections tell when a peer is gone, whichever transport carries the data.
//
// A transport gives each of its peers an ordered, reliable channel. Algorithms post non-blocking
// sends and receives of byte ranges and wait for them; the mesh progresses every posted operation
// while any wait is in progress, so sends, receives and the caller's reductions overlap. Every
// message carries a Signature (common/signature.h), an opaque tag to the transport: it sends it
// with the bytes, compares it with what the receive expects and describes both when they differ,
// so a receive whose incoming signature differs from the expected one fails on both sides, which
// is how mismatched collectives are reported instead of hanging.
//
// What only some transports can do beyond messages is a capability (SingleCopy, Boards): an
// interface the transport also implements and returns from its query, nullptr elsewhere. The mesh
// offers each through its own transport-neutral calls.
#pragma once

#include <poll.h>
#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/inplace_function.h"
#include "common/signature.h"

namespace ringcomm {

using Clock = std::chrono::steady_clock;

// A message's bytes where they lie in the caller's memory: `count` ranges (the system's iovec),
// back to back. The list and the memory it names stay valid until the operation completes.
struct Ranges {
  const iovec* list = nullptr;
  size_t count = 0;
  size_t bytes() const;
};

// Below this many bytes per range on average, a message of several ranges moves faster through
// a transport's own buffers than read in place: the kernel pins a single-copy sender's pages
// range by range: many small tensors spread over the heap go slower by single copy than through
// the slots, where one range (views of one buffer) goes faster by single copy.
constexpr size_t kSingleCopyRangeBytes = 64 << 10;
// A range that starts less than this after the previous one ends lies together with it: single
// copy reads the two as one (the bytes between lie on pages the two share, which are mapped),
// and the communicator offers such runs for huge pages as one buffer.
constexpr size_t kJoinGap = 4096;
inline bool joins(const char* end, const char* at) {
  return at >= end && size_t(at - end) < kJoinGap;
}

// A position in Ranges, moved forward as bytes are copied out of or into them.
class RangeCursor {
 public:
  RangeCursor() = default;
  explicit RangeCursor(Ranges ranges) : ranges_(ranges) {}
  // Copies the next `bytes` bytes of the ranges to `to`, or `from` into them, or hands them to
  // take(data, n) a range at a time, in order; recorded on the timeline (common/trace.h) as
  // `span`.
  void gather(char* to, size_t bytes, const char* span);
  void scatter(const char* from, size_t bytes, const char* span);
  void read(size_t bytes, const char* span, InplaceFunction<void(const char*, size_t)> take);
  // The next bytes as at most `max` iovecs in `out` (their number in `*used`), covering at most
  // `bytes`; returns the bytes covered. The cursor does not move.
  size_t peek(size_t bytes, iovec* out, size_t max, size_t* used) const;
  void skip(size_t bytes);

 private:
  template <typename Copy>
  void walk(size_t bytes, Copy copy);
  Ranges ranges_;
  size_t index_ = 0, offset_ = 0;  // byte `offset_` of range `index_`
};

// Handle of one posted send or receive (transport/mesh.h).
struct Request {
  int64_t id = -1;
};

// Where a transport reports progress: each posted message is split into parts the transport
// moves on its own (TCP stripes large messages over sockets); an operation completes when all of
// its parts have.
class PartSink {
 public:
  virtual void part_done(int64_t op) = 0;

 protected:
  ~PartSink() = default;
};

// What a rank published for one transport (Mesh::address): its host identity and the field the
// transport's address() gave there; `offered` is false where the rank runs without the transport.
struct Published {
  std::string host;
  bool offered = false;
  std::string address;
};

// Single copy: a send's receiver reads the bytes out of the sender's memory, one copy instead of
// one into the transport's buffers and one out (shm/shm_transport.h).
class SingleCopy {
 public:
  // The size from which sends go by single copy when its default turned it on (a measurement may
  // then turn it off), else 0.
  virtual size_t single_copy_to_probe() const = 0;
  // The size from which sends go by single copy; 0: never.
  virtual size_t single_copy_bytes() const = 0;
  // Single copy from single_copy_to_probe() on, or never; only while that is not 0. Between
  // operations: a receiver takes either kind at any time.
  virtual void use_single_copy(bool on) = 0;
  // `data` is about to be sent to peers that may read it by single copy: a buffer sent again may
  // be collapsed into huge pages (shm/huge_pages.h).
  virtual void offer_huge_pages(const void* data, size_t bytes) = 0;

 protected:
  ~SingleCopy() = default;
};

// Boards: a region of each rank's memory that the transport's peers read in place where it lies,
// for collectives whose ranks read each other's contributions there (algorithms/shared_buffer.cc).
// Only data: its users agree by messages when it may be written and read.
class Boards {
 public:
  // The size of every rank's board; 0: none.
  virtual size_t board_bytes() const = 0;
  // Rank `rank`'s board: this rank's or an enabled peer's; nullptr for none.
  virtual const char* board(int rank) const = 0;
  // Writes the bytes of `from`, back to back, at `offset` of this rank's board, for `readers`
  // peers to read: counted as sent to each of them.
  virtual void write_board(size_t offset, Ranges from, int readers) = 0;

 protected:
  ~Boards() = default;
};

// One way of moving bytes between this rank and some of its peers (tcp/, shm/). It knows peers,
// byte ranges and the signature each message is tagged with; the mesh (transport/mesh.h) gives
// each peer the transport that can reach it and waits on all of them.
class Transport {
 public:
  virtual ~Transport() = default;
  // Also the key of its field in the rank's address, and what Mesh::transport_of reports.
  virtual const char* name() const = 0;

  // Joining (Mesh::connect). What peers need to reach this rank through this transport.
  virtual std::string address() const = 0;
  // Whether this transport can carry data between the ranks that published `self` (this rank)
  // and `peer`. Decided from the two published addresses alone, so that both sides of a pair
  // answer alike without asking each other.
  virtual bool can_connect(const Published& self, const Published& peer) const = 0;
  // Setting up, between exchanges with the peers over the control plane: prepare() for `group`
  // (this rank and the peers can_connect admitted, in rank order, the same list on every rank
  // of it), then link() each peer whose prepare() succeeded, by the address it published; a pair
  // that both sides linked may then be enabled: data to `peer` goes through this transport from
  // then on. False, with `why`, where it cannot. Nothing to set up by default.
  virtual bool prepare(const std::vector<int>& group, std::string* why) {
    (void)group, (void)why;
    return true;
  }
  virtual bool link(int peer, const std::string& address, std::string* why) {
    (void)peer, (void)address, (void)why;
    return true;
  }
  virtual void enable(int peer) { (void)peer; }

  // The collective now running. Messages that arrive for it with another signature are reported
  // as a mismatch even while no receive is posted on their channel.
  virtual void set_current(const Signature& sig) = 0;
  // Posts a send or a receive of `bytes` bytes as operation `op`; returns the number of parts,
  // each reported to the sink once done. Buffers stay valid until then.
  virtual int post(bool is_send, int peer, char* data, size_t bytes, const Signature& sig,
                   int64_t op) = 0;
  // Messages read or written where the transport keeps them (a peer's shared memory) instead of
  // being copied from or to a buffer: a receive hands its bytes to `consume(offset, data, bytes)`
  // where they arrive, in order, so a reduction reads the peer's memory in place; a send has
  // `produce(offset, dst, bytes)` write its bytes into the transport's memory as room frees up,
  // so packing writes there directly. Only transports whose can_consume() is true take these.
  using Consumer = InplaceFunction<void(size_t offset, const char* data, size_t bytes)>;
  using Producer = InplaceFunction<void(size_t offset, char* dst, size_t bytes)>;
  virtual bool can_consume() const { return false; }
  virtual int post_consume(int peer, size_t bytes, const Signature& sig, int64_t op,
                           Consumer consume) {
    (void)peer, (void)bytes, (void)sig, (void)op, (void)consume;
    throw std::logic_error("this transport cannot consume in place");
  }
  virtual int post_produce(int peer, size_t bytes, const Signature& sig, int64_t op,
                           Producer produce) {
    (void)peer, (void)bytes, (void)sig, (void)op, (void)produce;
    throw std::logic_error("this transport cannot produce in place");
  }
  // Messages whose bytes lie in several ranges of the caller's memory: sent without gathering
  // them into one buffer first (the receiver may read them in place, shm's single copy) and
  // received without a scatter afterwards. Only transports whose takes_ranges() is true.
  virtual bool takes_ranges() const { return false; }
  virtual int post_ranges(bool is_send, int peer, Ranges ranges, size_t bytes, const Signature& sig,
                          int64_t op) {
    (void)is_send, (void)peer, (void)ranges, (void)bytes, (void)sig, (void)op;
    throw std::logic_error("this transport cannot move ranges");
  }
  // The signature of the next message from `peer` if its header has arrived and no receive is
  // posted for it (a receive from any source picks its peer by this).
  virtual bool peek(int peer, Signature* sig) const {
    (void)peer, (void)sig;
    return false;
  }
  // Moves whatever can move without blocking; true if anything did. Throws ringcomm::Error on a
  // mismatch, a lost peer or a remote abort.
  virtual bool progress() = 0;
  // True while a posted send or receive is unfinished; waits_on: one to or from `peer`.
  virtual bool busy() const = 0;
  virtual bool waits_on(int peer) const {
    std::vector<int> peers;
    waiting_on(peers);
    return std::find(peers.begin(), peers.end(), peer) != peers.end();
  }

  // Waiting. A transport either has file descriptors to poll (fds/on_poll: TCP) or a doorbell it
  // sleeps on (has_doorbell, sleep/ring_self: shared memory); the mesh combines them.
  virtual void add_poll_fds(std::vector<pollfd>& fds) { (void)fds; }
  virtual void on_poll(const pollfd* fds) { (void)fds; }
  virtual bool has_doorbell() const { return false; }
  // Sleeps until a peer rings this rank's doorbell, ring_self() is called, or `until`.
  virtual void sleep(Clock::time_point until) { (void)until; }
  virtual void ring_self() {}
  // Whether a peer waits on the CPU this rank is on, where the transport can tell (shared memory:
  // each local rank publishes its CPU): the mesh then does not spin, which would keep the CPU from
  // that peer. The transport may first move this rank's thread off the CPU (counted by
  // cpu_moves()) and then say no.
  virtual bool peer_on_this_cpu() { return false; }
  virtual uint64_t cpu_moves() const { return 0; }

  // Capabilities beyond messages; nullptr where the transport has none.
  virtual SingleCopy* single_copy() { return nullptr; }
  virtual Boards* boards() { return nullptr; }

  // After an error: tell the peers why and its kind (best effort; they raise the same kind),
  // stop sending, drop posted operations.
  virtual void abort(const std::string& reason, ErrorKind kind) = 0;
  // Releases connections and memory; idempotent.
  virtual void close() = 0;
  virtual uint64_t bytes_sent() const = 0;
  // Appends the peers with unfinished sends or receives (each once, in rank order).
  virtual void waiting_on(std::vector<int>& peers) const = 0;
};

}  // namespace ringcomm
