// The transport interface: how bytes move between ranks (algorithms see it through the mesh,
// transport/mesh.h, which gives each peer the transport that reaches it).
//
// A transport gives each of its peers an ordered, reliable channel. Algorithms post non-blocking
// sends and receives of byte ranges and wait for them; the mesh progresses every posted operation
// while any wait is in progress, so sends, receives and the caller's reductions overlap. Every
// message carries a Signature (common/signature.h), an opaque tag to the transport: it sends it
// with the bytes, compares it with what the receive expects and describes both when they differ,
// so a receive whose incoming signature differs from the expected one fails on both sides, which
// is how mismatched collectives are reported instead of hanging.
#pragma once

#include <poll.h>
#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
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

// One way of moving bytes between this rank and some of its peers (tcp/, shm/). It knows peers,
// byte ranges and the signature each message is tagged with; the mesh (transport/mesh.h) gives
// each peer the transport that can reach it and waits on all of them.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;

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
  virtual int post_ranges(bool is_send, int peer, Ranges ranges, size_t bytes,
                          const Signature& sig, int64_t op) {
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
  // True while a posted send or receive is unfinished.
  virtual bool busy() const = 0;

  // Waiting. A transport either has file descriptors to poll (fds/on_poll: TCP) or a doorbell it
  // sleeps on (sleep/ring_self: shared memory); the mesh combines them.
  virtual void add_poll_fds(std::vector<pollfd>& fds) { (void)fds; }
  virtual void on_poll(const pollfd* fds) { (void)fds; }
  // Sleeps until a peer rings this rank's doorbell, ring_self() is called, or `until`.
  virtual void sleep(Clock::time_point until) { (void)until; }
  virtual void ring_self() {}

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
