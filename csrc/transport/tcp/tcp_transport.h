// TCP transport: a full mesh of connections (RINGCOMM_SOCKETS_PER_PEER sockets per peer pair),
// progressed by non-blocking sendmsg/recv on the caller's thread; the mesh polls its sockets.
// It connects every pair of ranks, so the mesh also makes it the control plane (transport.h):
// the one-byte exchanges that set up the other transports, abort and waiting notices, and a
// closed connection as the sign of a lost peer.
#pragma once

#include <atomic>
#include <cstdint>
#include <poll.h>
#include <string>
#include <vector>

#include "common/fifo.h"
#include "transport/tcp/socket.h"
#include "transport/transport.h"
#include "transport/wire.h"

namespace ringcomm {
namespace tcp {

struct TcpOptions {
  std::string master_addr;            // used to pick the bind address (see choose_bind_host)
  int sockets_per_peer = 1;           // RINGCOMM_SOCKETS_PER_PEER
  int socket_buffer_bytes = 0;        // RINGCOMM_SOCKET_BUFFER; 0 keeps kernel autotuning
  size_t stripe_min_bytes = 1 << 20;  // RINGCOMM_STRIPE_MIN_BYTES: split larger messages
  static TcpOptions from_env(const std::string& master_addr);
};

class TcpTransport final : public Transport {
 public:
  // Binds and listens; address() is what the other ranks must connect to.
  TcpTransport(int rank, int world_size, TcpOptions options, PartSink& sink);
  ~TcpTransport() override;

  const char* name() const override { return "tcp"; }
  std::string address() const override { return bound_.str(); }
  // Every pair: connect() reaches each rank.
  bool can_connect(const Published& self, const Published& peer) const override {
    (void)self, (void)peer;
    return true;
  }
  // Builds the mesh: connects to lower ranks, accepts higher ranks. Connections that cannot
  // prove they know `token` (transport/tcp/handshake.h) or claim a wrong rank are refused and
  // closed.
  void connect(const std::vector<std::string>& addresses, const std::string& token,
               Clock::time_point deadline);
  // Before any message: writes one byte to every peer in `peers` and reads one from each
  // (`out`, `in`: by position). Used to agree on other transports.
  void exchange(const std::vector<int>& peers, const std::vector<char>& out, std::vector<char>& in,
                Clock::time_point deadline);
  // True once the peer has closed its connection (it exited or aborted).
  bool peer_closed(int peer) const;
  // For a closed peer: throws its abort reason if it sent one before closing, reading past any
  // messages nobody will receive now (a held header stops reads until a receive is posted).
  void throw_if_peer_aborted(int peer);
  // Tells every peer that this rank is waiting on rank `on` (a kWaitingMessage, sent between
  // messages).
  void announce_waiting(int on);
  // The rank `peer` last said it waits on, if it said so at or after `since`; else -1.
  int reported_wait(int peer, Clock::time_point since) const;

  void set_current(const Signature& sig) override;
  int post(bool is_send, int peer, char* data, size_t bytes, const Signature& sig,
           int64_t op) override;
  bool progress() override;
  bool peek(int peer, Signature* sig) const override;
  bool busy() const override;
  void add_poll_fds(std::vector<pollfd>& fds) override;
  void on_poll(const pollfd* fds) override;
  void abort(const std::string& reason, ErrorKind kind) override;
  // After an abort, first reads what peers still send, for a short while, so that they get our
  // reason rather than a reset.
  void close() override;
  uint64_t bytes_sent() const override { return bytes_sent_.load(std::memory_order_relaxed); }
  void waiting_on(std::vector<int>& peers) const override;

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
    Fifo<Part> sends, recvs;
    WireHeader incoming{};
    size_t incoming_got = 0;        // header bytes read so far
    bool incoming_matched = false;  // header checked against recvs.front()
    bool hung_up = false;           // peer closed; reported once a receive needs data
    WireHeader notice{};            // a waiting notice to send (socket 0 only)
    bool notice_pending = false;
    size_t notice_done = 0;
    int heard_waiting_on = -1;  // the peer's last waiting notice, and when it came
    Clock::time_point heard_at{};
  };

  Channel& channel(int peer, int socket) { return channels_[size_t(peer) * sockets_ + socket]; }
  const Channel& channel(int peer, int socket) const {
    return channels_[size_t(peer) * sockets_ + socket];
  }
  bool pump_notice(Channel& ch);
  void ensure_descriptors(size_t sockets);
  void introduce(int fd, int peer, int socket, const std::string& address, const std::string& token,
                 Clock::time_point deadline);
  void accept_higher_ranks(const std::string& token, Clock::time_point deadline);
  bool pump_send(Channel& ch);
  bool pump_recv(Channel& ch, bool eager);
  void check_incoming(Channel& ch);
  [[noreturn]] void read_abort_and_throw(Channel& ch);
  void throw_if_peer_aborted(Channel& ch);

  int rank_, world_size_;
  TcpOptions options_;
  PartSink& sink_;
  int sockets_;
  int listen_fd_ = -1;
  Endpoint bound_;
  std::vector<Channel> channels_;  // [peer * sockets_ + socket]; own entries stay unused
  std::vector<Channel*> polled_;   // channels add_poll_fds added, in order
  size_t first_fd_ = 0;            // their first position in the fds
  Signature current_;
  bool has_current_ = false;
  std::string abort_reason_;
  std::atomic<uint64_t> bytes_sent_{0};  // read from other threads for statistics
};

}  // namespace tcp
}  // namespace ringcomm
