// The transports of one rank, and which one carries the data to each peer.
//
// The transports are held in order of preference: shared memory (shm/), then TCP (tcp/). Each
// peer's is the first whose can_connect admits the pair, decided alike on both sides from what
// both published, and whose set-up succeeded on both sides, which they learn from each other in
// two one-byte exchanges. TCP admits every pair and needs no set-up, so it takes the rest.
//
// TCP is also the control plane, and the mesh holds it by its type as well: it must be up
// before any other transport can be set up (it carries those exchanges), and it is the one
// connection every pair has whichever transport carries its data, so it carries the handshake,
// abort notices and waiting notices, and its closed connection is how a lost peer is seen.
//
// Sends and receives go to the peer's transport; waiting is transport-neutral: spin briefly, then
// block on the transports' file descriptors and, while a transport with a doorbell has work
// pending, sleep on that. What only some transports can do (single copy, boards) is offered
// through calls that name the capability, not the transport, and reach the first transport that
// has it (transport.h).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace ringcomm {
namespace tcp {
class TcpTransport;
}

struct MeshOptions {
  std::string master_addr;  // picks the TCP bind address (tcp::choose_bind_host)
  // RINGCOMM_TRANSPORT: auto (default), shm or tcp. shm: ranks of one host must reach each
  // other through shared memory (an error where they cannot); tcp: TCP only.
  std::string transport;
  // RINGCOMM_SPIN_US: busy-poll this long before blocking. -1 (default): 5 us when this host
  // has at least as many CPUs as local ranks, else 0 (spinning would steal the CPU the peer
  // needs to answer).
  int spin_us = -1;
  // RINGCOMM_YIELD_US: then poll with sched_yield() this long before sleeping; -1: 1000 us.
  int yield_us = -1;
  static MeshOptions from_env(const std::string& master_addr);
};

// This host's identity for choosing shared memory: RINGCOMM_HOST_ID, else a hash of the boot id,
// the host name and the network namespace (ranks in other containers or namespaces differ).
std::string host_identity();

class Mesh final : public PartSink {
 public:
  Mesh(int rank, int world_size, MeshOptions options);
  ~Mesh();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // What the other ranks need to reach this one ("host=...;cpus=...;tcp=...;shm=...": the host
  // identity, the CPUs this rank may run on and each transport's address under its name), to
  // publish before connect().
  std::string address() const;
  // Connects to every peer through TCP, then chooses each peer's transport.
  void connect(const std::vector<std::string>& addresses, const std::string& token,
               Clock::time_point deadline);
  // Single copy (SingleCopy, transport.h), where a transport has it: the size to probe, else 0;
  // turning it off or back on; the size from which sends go by it, 0: never (or no transport
  // has it); a buffer about to be sent to peers that may read it by single copy.
  size_t single_copy_to_probe() const {
    return single_copy_ ? single_copy_->single_copy_to_probe() : 0;
  }
  void use_single_copy(bool on) {
    if (single_copy_) single_copy_->use_single_copy(on);
  }
  size_t single_copy_bytes() const { return single_copy_ ? single_copy_->single_copy_bytes() : 0; }
  void offer_huge_pages(const void* data, size_t bytes) {
    if (single_copy_) single_copy_->offer_huge_pages(data, bytes);
  }
  // Boards (Boards, transport.h): whether this rank and every rank of `ranks` but itself (every
  // rank: boards_everywhere) reach each other through the transport that has them, each with a
  // board; their size (0: no transport has them).
  bool boards_reach(const std::vector<int>& ranks) const;
  bool boards_everywhere() const;
  size_t board_bytes() const { return boards_ ? boards_->board_bytes() : 0; }
  // The payload through the boards, counted as messages' is: what `readers` peers read of this
  // rank's board as sent, what this rank reads of a peer's (`bytes` at `offset`) as received.
  void write_board(size_t offset, Ranges from, int readers);
  const char* read_board(int rank, size_t offset, size_t bytes);
  // Name of the transport that carries data to `peer` ("tcp", "shm"; "self" for this rank).
  const char* transport_of(int peer) const;
  // After connect(): each rank's host, as the lowest rank on that host (same on every rank).
  const std::vector<int>& host_of() const { return host_of_; }

  void set_current(const Signature& sig);
  using Callback = std::function<void(const std::exception_ptr&)>;
  // Post a send/receive of `bytes` bytes. Buffers must stay valid until the request completes.
  // `on_done` (optional) runs on completion or failure (with the error).
  Request post_send(int peer, const void* data, size_t bytes, const Signature& sig,
                    Callback on_done = nullptr);
  Request post_recv(int peer, void* data, size_t bytes, const Signature& sig,
                    Callback on_done = nullptr);
  // Whether messages with `peer` can be consumed and produced in place (Transport::post_consume,
  // Transport::post_produce).
  bool can_consume(int peer) const {
    return route_.at(size_t(peer)) && route_[peer]->can_consume();
  }
  Request post_consume(int peer, size_t bytes, const Signature& sig, Transport::Consumer consume);
  Request post_produce(int peer, size_t bytes, const Signature& sig, Transport::Producer produce);
  // Whether messages with `peer` can lie in several ranges of memory (Transport::post_ranges).
  bool takes_ranges(int peer) const {
    return route_.at(size_t(peer)) && route_[peer]->takes_ranges();
  }
  Request post_ranges(bool is_send, int peer, Ranges ranges, const Signature& sig);
  // Progress everything until `req` completes; throws ringcomm::Error on a mismatch, a lost peer,
  // a remote abort or when `deadline` passes.
  void wait(Request req, Clock::time_point deadline) { wait_any(&req, 1, deadline); }
  // The same until any of `count` requests completes; returns the position of one that has.
  size_t wait_any(const Request* reqs, size_t count, Clock::time_point deadline);
  bool done(Request req) const { return find(req.id) == nullptr; }
  // Transport::peek for `peer`'s transport.
  bool peek(int peer, Signature* sig) const {
    return route_.at(size_t(peer)) && route_[peer]->peek(peer, sig);
  }
  // Progress posted operations until one completes, `wake_fd` (if >= 0) is readable, wake() is
  // called, or `deadline` passes; never throws on timeout.
  void progress_until_event(int wake_fd, Clock::time_point deadline);
  // Interrupts progress_until_event from another thread (with a write to its wake_fd).
  void wake();
  // From any thread: every wait, now or later, throws ringcomm::Error("aborted: <reason>") at
  // once, so that the thread running an operation fails it (and calls abort()) without waiting
  // for a peer or the timeout.
  void interrupt(const std::string& reason);

  // The ranks this rank's pending messages wait on, sorted, once each.
  std::vector<int> waiting_on() const;
  // "; rank A waits on rank B; nothing from rank(s) B: stuck or slow": where the waiting notices
  // heard from the ranks in `waited`, and from the ranks they wait on, lead; "" when the ranks
  // in `waited` have said nothing. May wait a little (two notice periods, at most a second) for
  // notices from ranks that have only just started waiting. `notice_every`: the period of the
  // notices this rank expects (notice_period of the timeout).
  std::string describe_chains(const std::vector<int>& waited, Clock::duration notice_every);
  // How often a rank blocked in a wait of `timeout` announces on whom it waits.
  static Clock::duration notice_period(Clock::duration timeout);
  // Tells every peer that this rank waits on the first rank waiting_on() names (a waiting
  // notice, sent with the next progress), so that their timeouts can follow the chain here.
  void announce_waiting();

  // After an error: tell every peer why and the error's kind (best effort), stop sending, and
  // fail every posted operation's callback with `error`.
  void abort(const std::string& reason, const std::exception_ptr& error);
  // Closes every transport (idempotent).
  void close();
  uint64_t bytes_sent() const;
  // Bytes written through one transport ("tcp", "shm"), headers included.
  uint64_t bytes_sent(const std::string& transport) const;
  // Payload bytes of the sends and receives completed so far (no headers), from any thread.
  uint64_t payload_sent() const { return payload_sent_.load(std::memory_order_relaxed); }
  uint64_t payload_received() const { return payload_received_.load(std::memory_order_relaxed); }
  // Time wait() spent with nothing to move: spinning, yielding or asleep until a peer's bytes
  // came (the rest of a wait moves bytes and reduces them).
  int64_t idle_ns() const { return idle_ns_.load(std::memory_order_relaxed); }
  // Times a transport moved this rank's waiting thread off a CPU a peer waited on
  // (Transport::peer_on_this_cpu).
  uint64_t cpu_moves() const;
  // Timeline spans (common/trace.h) of the sends and receives carry this communicator's number.
  void set_trace_id(uint64_t id) { trace_id_ = id; }

 private:
  // Posted operations live in a table of slots reused as they complete (no allocation per
  // message once it has grown); an id is the slot plus a serial number, so a finished
  // operation's id never matches the slot's next occupant.
  struct Op {
    int64_t id = -1;  // -1: free slot
    int parts_left = 0;
    Callback on_done;
    int32_t peer = -1;
    bool is_send = false;
    uint64_t bytes = 0;
    int64_t posted_ns = 0;  // with the timeline on
  };
  static constexpr int kSlotBits = 24;
  int64_t add_op(Callback on_done, bool is_send, int peer, size_t bytes);
  // post_consume, post_produce and post_ranges: checks (`takes`: the peer's transport takes
  // messages that `what`), the op, then `post(id)` hands it to the transport and returns its
  // number of parts.
  template <typename PostToTransport>
  Request post_in_place(int peer, bool is_send, size_t bytes, bool takes, const char* what,
                        PostToTransport post);
  Op* find(int64_t id);
  const Op* find(int64_t id) const;
  void remove(Op& op);
  void part_done(int64_t op) override;
  Request post(bool is_send, int peer, char* data, size_t bytes, const Signature& sig,
               Callback on_done);
  bool progress();
  // Blocks until a transport may progress, wake_fd is readable or `deadline`; false on timeout.
  // With sleep false, only looks: polls the sockets without waiting.
  bool block(int wake_fd, Clock::time_point deadline, bool sleep = true);
  void check_usable() const;
  void throw_if_interrupted() const;
  // Appends them as the transports list them (repeats possible).
  void append_waited(std::vector<int>& peers) const;
  // Whether every rank waiting_on() would name is on another host (false when it names none).
  bool waits_only_on_other_hosts();
  std::string describe_waiting() const;
  // Why a wait timed out: what it waited for, on whom, and describe_chains of those.
  std::string describe_timeout(Clock::duration notice_every);
  // Sets `route_` (connect()). `fields`: each rank's address, parsed.
  void choose_routes(const std::vector<std::map<std::string, std::string>>& fields,
                     Clock::time_point deadline);
  // Sets up `transport` with the peers in `peers` (the rest of `group`, by prepare() and link())
  // and gives it those that both sides linked and no transport before it took; records why the
  // others did not link in `why_not`.
  void set_up(Transport& transport, const std::vector<int>& group, const std::vector<int>& peers,
              const std::vector<std::string>& addresses, std::vector<std::string>& why_not,
              Clock::time_point deadline);
  // The transport with a doorbell that has work pending, if any (block() sleeps on it).
  Transport* doorbell_to_sleep_on() const;

  const int rank_, world_size_;
  MeshOptions options_;
  std::string host_;
  // In order of preference; control_ last.
  std::vector<std::unique_ptr<Transport>> transports_;
  tcp::TcpTransport* control_ = nullptr;
  SingleCopy* single_copy_ = nullptr;  // of the first transport that has it
  Boards* boards_ = nullptr;           // the same
  std::vector<Transport*> route_;      // by peer; nullptr for this rank
  std::vector<int> host_of_;
  std::vector<int> waited_;  // waits_only_on_other_hosts()'s list
  std::vector<Op> ops_;
  std::vector<uint32_t> free_slots_;
  size_t live_ops_ = 0;
  uint64_t next_serial_ = 0;
  Signature current_;
  bool has_current_ = false;
  std::string abort_reason_;
  ErrorKind abort_kind_ = ErrorKind::kOther;  // of the error that aborted
  std::vector<pollfd> fds_;                   // reused by block()
  // interrupt(): the flag is read in every wait loop; the eventfd wakes a ppoll, the shared
  // memory doorbell a futex sleep.
  std::atomic<bool> interrupted_{false};
  mutable std::mutex interrupt_mu_;
  std::string interrupt_reason_;
  int interrupt_fd_ = -1;
  std::atomic<uint64_t> payload_sent_{0}, payload_received_{0};
  std::atomic<int64_t> idle_ns_{0};
  uint64_t trace_id_ = 0;
};

}  // namespace ringcomm
