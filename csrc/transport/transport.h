// The transport interface: the only way algorithms move bytes.
//
// A transport connects every pair of ranks with an ordered, reliable channel. Algorithms post
// non-blocking sends and receives of byte ranges and wait for them; the transport progresses every
// posted operation while any wait is in progress, so sends, receives and the caller's reductions
// overlap. Every message carries a Signature (which operation, sequence number, dtype, count, ...);
// a receive whose incoming signature differs from the expected one fails on both sides with a
// description of each, which is how mismatched collectives are reported instead of hanging.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "common/dtype.h"

namespace ringcomm {

using Clock = std::chrono::steady_clock;

enum class Collective : uint8_t {
  kAllReduce = 1,
  kReduceScatter = 2,
  kAllGather = 3,
  kAllGatherV = 4,
  kBroadcast = 5,
  kReduce = 6,
  kBarrier = 7,
  kSendRecv = 8,
  kSparseAllReduce = 9,
  // One bucket of a coalesced call each (algorithms/coalesced.cc).
  kAllReduceCoalesced = 10,
  kBroadcastCoalesced = 11,
  kAllGatherCoalesced = 12,
};
const char* collective_name(Collective c);

enum class Algorithm : uint8_t {
  kAuto = 0,
  kRing = 1,
  kTree = 2,
  kRecursiveDoubling = 3,
  kChain = 4,
  kBinomial = 5,
  kDissemination = 6,
  kDirect = 7,
  kSparseGather = 8,
  kSparseRanges = 9,
};
const char* algorithm_name(Algorithm a);

// What a message belongs to. Two ranks agree on an operation iff their signatures are equal.
struct Signature {
  Collective coll = Collective::kBarrier;
  DType dtype = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  Algorithm algo = Algorithm::kAuto;
  bool p2p = false;     // send/recv: sequence numbers count per peer pair, not per communicator
  int32_t root = -1;    // src/dst of rooted collectives, -1 otherwise
  uint64_t seq = 0;
  uint64_t count = 0;   // elements
  uint64_t aux = 0;     // e.g. a hash of all_gatherv's per-rank counts

  bool operator==(const Signature& o) const;
  bool operator!=(const Signature& o) const { return !(*this == o); }
  std::string describe() const;
};

// Handle of one posted send or receive.
struct Request {
  int64_t id = -1;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // The collective now running. Messages that arrive for it with another signature are reported
  // as a mismatch even while no receive is posted on their channel.
  virtual void set_current(const Signature& sig) = 0;

  // Post a send/receive of `bytes` bytes. Buffers must stay valid until the request completes.
  // `on_done` (optional) runs on completion or failure (with the error).
  using Callback = std::function<void(const std::exception_ptr&)>;
  virtual Request post_send(int peer, const void* data, size_t bytes, const Signature& sig,
                            Callback on_done = nullptr) = 0;
  virtual Request post_recv(int peer, void* data, size_t bytes, const Signature& sig,
                            Callback on_done = nullptr) = 0;

  // Progress everything until `req` completes; throws ringcomm::Error on a mismatch, a lost peer,
  // a remote abort or when `deadline` passes.
  virtual void wait(Request req, Clock::time_point deadline) = 0;
  virtual bool done(Request req) const = 0;
  // True while any posted operation is incomplete.
  virtual bool busy() const = 0;
  // Progress posted operations until one completes, `wake_fd` (if >= 0) is readable, or
  // `deadline` passes; never throws on timeout.
  virtual void progress_until_event(int wake_fd, Clock::time_point deadline) = 0;

  // After an error: tell every peer why (best effort), stop sending, and fail every posted
  // operation's callback with `error`.
  virtual void abort(const std::string& reason, const std::exception_ptr& error) = 0;
};

}  // namespace ringcomm
