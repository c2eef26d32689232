// TCP transport: a full mesh of connections (RINGCOMM_SOCKETS_PER_PEER sockets per peer pair),
// driven by one non-blocking progress engine (sendmsg/recv + ppoll) on the caller's thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/tcp/socket.h"
#include "transport/transport.h"

namespace ringcomm {
namespace tcp {

struct TcpOptions {
  std::string master_addr;          // used to pick the bind address (see choose_bind_host)
  int sockets_per_peer = 1;         // RINGCOMM_SOCKETS_PER_PEER
  int socket_buffer_bytes = 0;      // RINGCOMM_SOCKET_BUFFER; 0 keeps kernel autotuning
  // RINGCOMM_SPIN_US: busy-poll this long before blocking in ppoll. -1 (default): 30 us when
  // this host has at least as many CPUs as local ranks, else 0 (spinning would steal the CPU
  // the peer needs to answer).
  int spin_us = -1;
  size_t stripe_min_bytes = 1 << 20;  // RINGCOMM_STRIPE_MIN_BYTES: split larger messages
  static TcpOptions from_env(const std::string& master_addr);
};

// On the wire before every message. Little-endian hosts only (checked in the handshake).
struct WireHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t coll;
  uint8_t dtype;
  uint8_t op;
  uint8_t algo;
  uint8_t p2p;
  uint16_t reserved;
  int32_t root;
  uint64_t seq;
  uint64_t count;
  uint64_t aux;
  uint64_t payload_bytes;
};
static_assert(sizeof(WireHeader) == 48, "WireHeader must be 48 bytes");

class TcpTransport final : public Transport {
 public:
  // Binds and listens; address() is what the other ranks must connect to.
  TcpTransport(int rank, int world_size, TcpOptions options);
  ~TcpTransport() override;

  std::string address() const { return bound_.str(); }
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  // Builds the mesh: connects to lower ranks, accepts higher ranks. Connections that do not
  // present `token` and a valid rank are refused and closed.
  void connect(const std::vector<std::string>& addresses, const std::string& token,
               Clock::time_point deadline);

  // Closes every connection (idempotent). After an abort, first reads what peers still send, for
  // a short while, so that they get our reason rather than a reset.
  void close();

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  void set_current(const Signature& sig) override;
  Request post_send(int peer, const void* data, size_t bytes, const Signature& sig,
                    Callback on_done) override;
  Request post_recv(int peer, void* data, size_t bytes, const Signature& sig,
                    Callback on_done) override;
  void wait(Request req, Clock::time_point deadline) override;
  bool done(Request req) const override { return ops_.count(req.id) == 0; }
  bool busy() const override { return !ops_.empty(); }
  void progress_until_event(int wake_fd, Clock::time_point deadline) override;
  void abort(const std::string& reason, const std::exception_ptr& error) override;

 private:
  struct Part {
    int64_t op;
    char* data;
    size_t bytes;
    size_t done = 0;
    WireHeader header;       // sent, or expected
    size_t header_done = 0;  // sends only
  };
  struct Channel {
    int fd = -1;
    int peer = -1;
    std::deque<Part> sends, recvs;
    WireHeader incoming{};
    size_t incoming_got = 0;   // header bytes read so far
    bool incoming_matched = false;  // header checked against recvs.front()
    bool hung_up = false;      // peer closed; reported once a receive needs data
  };
  struct Op {
    int parts_left;
    Callback on_done;
  };

  Request post(bool is_send, int peer, char* data, size_t bytes, const Signature& sig,
               Callback on_done);
  Channel& channel(int peer, int socket) { return channels_[size_t(peer) * sockets_ + socket]; }
  bool pump_send(Channel& ch);
  bool pump_recv(Channel& ch, bool eager);
  void check_incoming(Channel& ch);
  [[noreturn]] void read_abort_and_throw(Channel& ch);
  void throw_if_peer_aborted(Channel& ch);
  void complete_part(int64_t op);
  bool pump_posted();
  // Blocks in ppoll until a channel or wake_fd is ready, or `deadline`; returns false on timeout.
  bool block(int wake_fd, Clock::time_point deadline);
  void check_usable() const;
  std::string describe_waiting() const;

  int rank_, world_size_;
  TcpOptions options_;
  int sockets_;
  int listen_fd_ = -1;
  Endpoint bound_;
  std::vector<Channel> channels_;  // [peer * sockets_ + socket]; own entries stay unused
  std::unordered_map<int64_t, Op> ops_;
  int64_t next_op_ = 0;
  Signature current_;
  bool has_current_ = false;
  std::string abort_reason_;
  std::atomic<uint64_t> bytes_sent_{0};  // read from other threads for statistics
};

}  // namespace tcp
}  // namespace ringcomm
