#include "transport/tcp/tcp_transport.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "common/error.h"
#include "common/knobs.h"
#include "common/logging.h"
#include "transport/tcp/handshake.h"

namespace ringcomm {
namespace tcp {

TcpOptions TcpOptions::from_env(const std::string& master_addr) {
  TcpOptions o;
  o.master_addr = master_addr;
  o.sockets_per_peer = int(knob_int("RINGCOMM_SOCKETS_PER_PEER").value());
  o.socket_buffer_bytes = int(knob_int("RINGCOMM_SOCKET_BUFFER").value());
  o.stripe_min_bytes = size_t(knob_int("RINGCOMM_STRIPE_MIN_BYTES").value());
  RC_CHECK_ARG(o.sockets_per_peer >= 1 && o.sockets_per_peer <= 64,
               "RINGCOMM_SOCKETS_PER_PEER must be in [1, 64], got ", o.sockets_per_peer);
  return o;
}

TcpTransport::TcpTransport(int rank, int world_size, TcpOptions options, PartSink& sink)
    : rank_(rank),
      world_size_(world_size),
      options_(std::move(options)),
      sink_(sink),
      sockets_(options_.sockets_per_peer) {
  channels_.resize(size_t(world_size) * sockets_);
  if (world_size > 1) listen_fd_ = listen_on(choose_bind_host(options_.master_addr), &bound_);
}

TcpTransport::~TcpTransport() { close(); }

void TcpTransport::close() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  // After an abort, peers may still be writing into our sockets until they read our reason.
  // Closing a socket with unread data resets the connection, and a reset can overtake the reason
  // on its way, so read until each peer has closed its side or a short deadline passes.
  if (!abort_reason_.empty()) {
    auto deadline = Clock::now() + std::chrono::milliseconds(250);
    std::vector<char> sink(64 << 10);
    for (Channel& ch : channels_) {
      if (ch.fd < 0) continue;
      while (true) {
        ssize_t n = recv(ch.fd, sink.data(), sink.size(), MSG_DONTWAIT);
        if (n > 0) continue;
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
          pollfd p{ch.fd, POLLIN, 0};
          auto left =
              std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
          if (left.count() <= 0 || poll(&p, 1, int(left.count())) <= 0) break;
          continue;
        }
        break;  // end of stream or error
      }
    }
  }
  // Not read here otherwise: a process forked from this one shares the sockets, and its close
  // must not take the parent's bytes. A peer's unread waiting notices make this close a reset;
  // the peer takes a reset on a connection it needs nothing from as an end (pump_recv).
  for (Channel& ch : channels_) {
    if (ch.fd >= 0) ::close(ch.fd);
    ch.fd = -1;
  }
}

void TcpTransport::connect(const std::vector<std::string>& addresses, const std::string& token,
                           Clock::time_point deadline) {
  RC_CHECK_ARG(int(addresses.size()) == world_size_, "expected ", world_size_, " addresses");
  RC_CHECK_ARG(!token.empty(), "the job token is empty");
  ensure_descriptors(size_t(world_size_ - 1) * size_t(sockets_));

  // Lower ranks accept, higher ranks connect: rank r dials 0..r-1, then accepts r+1..n-1.
  for (int peer = 0; peer < rank_; ++peer) {
    for (int s = 0; s < sockets_; ++s) {
      int fd = connect_with_retry(Endpoint::parse(addresses[peer]), deadline);
      set_nonblocking(fd);
      try {
        introduce(fd, peer, s, addresses[peer], token, deadline);
      } catch (...) {
        ::close(fd);
        throw;
      }
      configure_data_socket(fd, options_.socket_buffer_bytes);
      channel(peer, s).fd = fd;
      channel(peer, s).peer = peer;
    }
  }
  accept_higher_ranks(token, deadline);
}

// The connector's side of the handshake (transport/tcp/handshake.h) on a fresh connection to
// `peer`; throws with the reason when the peer refuses or is not who it should be.
void TcpTransport::introduce(int fd, int peer, int socket, const std::string& address,
                             const std::string& token, Clock::time_point deadline) {
  const Hello hello = make_hello(world_size_, rank_, socket, sockets_);
  Challenge challenge{};
  bool answered = write_fully(fd, &hello, sizeof hello, deadline) &&
                  read_fully(fd, &challenge.reply, sizeof challenge.reply, deadline) &&
                  challenge.reply.magic == kHandshakeMagic;
  if (!answered)
    RC_THROW_AS(kProtocol, "rank ", peer, " at ", address,
                " dropped the handshake (not a ringcomm rank of this job at that address?)");
  if (challenge.reply.version != kProtocolVersion)
    RC_THROW_AS(kProtocol, "rank ", peer, " runs ringcomm protocol version ",
                challenge.reply.version, ", rank ", rank_, " version ", kProtocolVersion,
                ": every rank must run the same ringcomm");
  if (!challenge.reply.accepted)
    RC_THROW_AS(kProtocol, "rank ", peer, " at ", address, " refused the connection (different ",
                "world size or RINGCOMM_SOCKETS_PER_PEER? its log says why)");
  const size_t rest = sizeof challenge - sizeof challenge.reply;
  if (!read_fully(fd, reinterpret_cast<char*>(&challenge) + sizeof challenge.reply, rest, deadline))
    RC_THROW_AS(kProtocol, "rank ", peer, " at ", address, " dropped the handshake");
  if (!challenge_valid(token, hello, challenge, peer)) {
    // A proof of nothing, so that a real rank of another job logs why it was turned down.
    const Proof none{};
    write_fully(fd, &none, sizeof none, deadline);
    RC_THROW_AS(kProtocol, "the process at ", address, " is not rank ", peer,
                " of this job: it cannot prove that it knows the job token");
  }
  const Proof proof = make_proof(token, hello, challenge);
  Reply verdict{};
  if (!write_fully(fd, &proof, sizeof proof, deadline) ||
      !read_fully(fd, &verdict, sizeof verdict, deadline) || !verdict.accepted)
    RC_THROW_AS(kProtocol, "rank ", peer, " at ", address,
                " refused this rank's proof of the job token (started with another token? ",
                "RINGCOMM_TOKEN_FILE differs?)");
}

// The acceptor's side: until every (higher rank, socket) slot is filled. Each pending connection
// gets a few seconds to complete the handshake; strangers, wrong tokens and wrong fields are
// refused and closed without effect, and the last reason is in the error if the deadline passes.
void TcpTransport::accept_higher_ranks(const std::string& token, Clock::time_point deadline) {
  int missing = (world_size_ - 1 - rank_) * sockets_;
  struct Pending {
    int fd;
    Clock::time_point deadline;
    bool challenged;  // the Hello was read and answered; the Proof is being read
    Hello hello;
    Challenge challenge;
    Proof proof;
    size_t got;
  };
  std::vector<Pending> pending;
  std::string last_refusal;
  const auto handshake_time = std::chrono::seconds(5);
  auto refuse = [&](const Pending& p, const std::string& why) {
    Reply refusal{kHandshakeMagic, 0, kProtocolVersion};
    write_fully(p.fd, &refusal, sizeof refusal, Clock::now() + std::chrono::milliseconds(100));
    RC_LOG("rank ", rank_, ": refused a connection: ", why);
    last_refusal = why;
    ::close(p.fd);
  };
  // Connections still in their handshake, at most: room for every expected one and some
  // strangers; beyond that the oldest is dropped, so a port scan cannot take every descriptor.
  const size_t max_pending = size_t(missing) + 64;
  while (missing > 0) {
    auto now = Clock::now();
    if (now >= deadline) {
      for (auto& p : pending) ::close(p.fd);
      RC_THROW_AS(kTimeout, "rank ", rank_, ": Timed out waiting for ", missing,
                  " connection(s) from higher ranks",
                  last_refusal.empty() ? "" : "; the last one refused: ", last_refusal);
    }
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
    for (auto& p : pending) fds.push_back({p.fd, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    if (fds[0].revents & POLLIN) {
      int fd;
      while ((fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
        if (pending.size() >= max_pending) {
          RC_LOG("rank ", rank_, ": ", pending.size(),
                 " connections in their handshake; "
                 "dropping the oldest");
          ::close(pending.front().fd);
          pending.erase(pending.begin());
        }
        pending.push_back({fd, Clock::now() + handshake_time, false, {}, {}, {}, 0});
      }
      if (errno == EMFILE || errno == ENFILE) {
        for (auto& p : pending) ::close(p.fd);
        RC_THROW("rank ", rank_, ": out of file descriptors accepting connections (",
                 errno_string(errno), "); raise the limit (ulimit -n), the mesh needs ",
                 (world_size_ - 1) * sockets_, " sockets");
      }
    }
    for (size_t i = 0; i < pending.size();) {
      Pending& p = pending[i];
      char* into =
          p.challenged ? reinterpret_cast<char*>(&p.proof) : reinterpret_cast<char*>(&p.hello);
      const size_t wanted = p.challenged ? sizeof p.proof : sizeof p.hello;
      ssize_t n = recv(p.fd, into + p.got, wanted - p.got, MSG_DONTWAIT);
      if (n > 0) p.got += size_t(n);
      bool closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
      if (p.got < wanted) {
        if (closed || Clock::now() >= p.deadline) {
          refuse(p, closed ? "closed during the handshake" : "handshake not completed in time");
          pending.erase(pending.begin() + long(i));
        } else {
          ++i;
        }
        continue;
      }
      const Hello& h = p.hello;
      if (!p.challenged) {
        std::string problem = hello_problem(h, world_size_, rank_, sockets_);
        if (problem.empty() && channel(h.rank, h.socket).fd >= 0)
          problem = str_cat("rank ", h.rank, " socket ", h.socket, " connected twice");
        if (problem.empty()) {
          p.challenge = make_challenge(token, h, rank_);
          p.challenged = true;
          p.got = 0;
          if (write_fully(p.fd, &p.challenge, sizeof p.challenge, p.deadline)) {
            ++i;
            continue;
          }
          problem = "closed during the handshake";
        }
        refuse(p, problem);
      } else if (!proof_valid(token, h, p.challenge, p.proof)) {
        refuse(p, str_cat("a connection claiming rank ", h.rank,
                          " has no proof of the job token (another job, or another token)"));
      } else if (channel(h.rank, h.socket).fd >= 0) {
        refuse(p, str_cat("rank ", h.rank, " socket ", h.socket, " connected twice"));
      } else {
        Reply accepted{kHandshakeMagic, 1, kProtocolVersion};
        if (write_fully(p.fd, &accepted, sizeof accepted, p.deadline)) {
          configure_data_socket(p.fd, options_.socket_buffer_bytes);
          channel(h.rank, h.socket).fd = p.fd;
          channel(h.rank, h.socket).peer = h.rank;
          --missing;
        } else {
          refuse(p, "closed during the handshake");
        }
      }
      pending.erase(pending.begin() + long(i));
    }
  }
  for (auto& p : pending) ::close(p.fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

// A full mesh needs a descriptor per (peer, socket): raise the soft limit to the hard one if
// that is short, and say so plainly if even that is not enough.
void TcpTransport::ensure_descriptors(size_t sockets) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t needed = rlim_t(sockets) + 64;  // the mesh, plus what a process has open anyway
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < needed &&
      (limit.rlim_max == RLIM_INFINITY || limit.rlim_max > limit.rlim_cur)) {
    rlimit raised = limit;
    raised.rlim_cur =
        limit.rlim_max == RLIM_INFINITY ? needed : std::min(limit.rlim_max, needed * 2);
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < needed)
    RC_THROW("rank ", rank_, ": the mesh needs ", sockets, " sockets (", world_size_ - 1,
             " peers x ", sockets_, ") but this process may open only ", limit.rlim_cur,
             " files (hard limit ", limit.rlim_max,
             "): raise it (ulimit -n) or lower "
             "RINGCOMM_SOCKETS_PER_PEER");
}

void TcpTransport::exchange(const std::vector<int>& peers, const std::vector<char>& out,
                            std::vector<char>& in, Clock::time_point deadline) {
  in.assign(peers.size(), 0);
  for (size_t i = 0; i < peers.size(); ++i)
    if (!write_fully(channel(peers[i], 0).fd, &out[i], 1, deadline))
      RC_THROW_AS(kPeerLost, "rank ", rank_, ": connection to rank ", peers[i],
                  " lost while setting up");
  for (size_t i = 0; i < peers.size(); ++i)
    if (!read_fully(channel(peers[i], 0).fd, &in[i], 1, deadline))
      RC_THROW_AS(kPeerLost, "rank ", rank_, ": connection to rank ", peers[i],
                  " lost while setting up");
}

bool TcpTransport::peer_closed(int peer) const {
  for (int s = 0; s < sockets_; ++s)
    if (channels_[size_t(peer) * sockets_ + s].hung_up) return true;
  return false;
}

void TcpTransport::throw_if_peer_aborted(int peer) {
  for (int s = 0; s < sockets_; ++s) {
    Channel& ch = channels_[size_t(peer) * sockets_ + s];
    if (ch.fd >= 0) throw_if_peer_aborted(ch);
  }
}

void TcpTransport::set_current(const Signature& sig) {
  current_ = sig;
  has_current_ = true;
}

// Messages of at least stripe_min_bytes are split evenly over the peer's sockets; both sides
// compute the same split from the byte count, so parts pair up in each socket's FIFO order.
int TcpTransport::post(bool is_send, int peer, char* data, size_t bytes, const Signature& sig,
                       int64_t op) {
  int parts = bytes >= options_.stripe_min_bytes ? sockets_ : 1;
  size_t offset = 0;
  for (int s = 0; s < parts; ++s) {
    size_t len = bytes / parts + (size_t(s) < bytes % parts ? 1 : 0);
    Part part{op, data + offset, len, 0, make_header(sig, len), 0};
    Channel& ch = channel(peer, s);
    (is_send ? ch.sends : ch.recvs).push_back(part);
    offset += len;
  }
  return parts;
}

bool TcpTransport::pump_send(Channel& ch) {
  bool moved = pump_notice(ch);
  while (!ch.sends.empty()) {
    if (ch.notice_pending) {
      moved |= pump_notice(ch);
      if (ch.notice_pending && ch.notice_done > 0) return moved;  // the notice's rest first
    }
    Part& p = ch.sends.front();
    iovec iov[2];
    int n_iov = 0;
    if (p.header_done < sizeof(WireHeader))
      iov[n_iov++] = {reinterpret_cast<char*>(&p.header) + p.header_done,
                      sizeof(WireHeader) - p.header_done};
    if (p.done < p.bytes) iov[n_iov++] = {p.data + p.done, p.bytes - p.done};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n_iov;
    ssize_t n = sendmsg(ch.fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return moved;
      int err = errno;
      throw_if_peer_aborted(ch);
      RC_THROW_AS(kPeerLost, "connection to rank ", ch.peer,
                  " lost while sending: ", errno_string(err));
    }
    moved = true;
    size_t sent = size_t(n);
    bytes_sent_.fetch_add(sent, std::memory_order_relaxed);
    size_t to_header = std::min(sent, sizeof(WireHeader) - p.header_done);
    p.header_done += to_header;
    p.done += sent - to_header;
    if (p.header_done < sizeof(WireHeader) || p.done < p.bytes) return moved;
    int64_t op = p.op;
    ch.sends.pop_front();
    sink_.part_done(op);
  }
  return moved;
}

[[noreturn]] void TcpTransport::read_abort_and_throw(Channel& ch) {
  std::string text(std::min<uint64_t>(ch.incoming.payload_bytes, kMaxAbortText), '\0');
  if (!read_fully(ch.fd, text.data(), text.size(), Clock::now() + std::chrono::seconds(1)))
    text = "(reason not received)";
  throw_remote_abort(ch.peer, text, ch.incoming.aux);
}

// A peer that aborts closes its sockets after writing its reason; if our data was still unread in
// its socket, that close resets the connection and our next send fails with EPIPE/ECONNRESET. What
// the peer sent before the reset stays readable (Linux keeps the receive queue), so read past any
// messages nobody will receive now and throw the peer's reason if it is there.
void TcpTransport::throw_if_peer_aborted(Channel& ch) {
  constexpr uint64_t kMaxSkipped = uint64_t(1) << 30;  // bounds the work on a peer that lies
  uint64_t skipped = 0;
  std::vector<char> sink(64 << 10);
  auto read_now = [&](char* dst, size_t len) {
    size_t got = 0;
    while (got < len) {
      ssize_t n = recv(ch.fd, dst + got, len - got, MSG_DONTWAIT);
      if (n <= 0) break;
      got += size_t(n);
    }
    return got;
  };
  // A receive in progress: the rest of its payload comes first.
  uint64_t payload_left = 0;
  if (ch.incoming_got == sizeof(WireHeader) && ch.incoming_matched && !ch.recvs.empty()) {
    const Part& p = ch.recvs.front();
    payload_left = p.bytes - p.done;
  } else if (ch.incoming_got == sizeof(WireHeader)) {
    payload_left = ch.incoming.kind == kAbortMessage ? 0 : ch.incoming.payload_bytes;
    if (ch.incoming.kind == kAbortMessage && ch.incoming.magic == kMessageMagic)
      read_abort_and_throw(ch);
  }
  while (skipped <= kMaxSkipped) {
    while (payload_left > 0) {
      size_t got = read_now(sink.data(), size_t(std::min<uint64_t>(payload_left, sink.size())));
      if (got == 0) return;
      payload_left -= got;
      skipped += got;
    }
    if (ch.incoming_got == sizeof(WireHeader)) ch.incoming_got = 0;
    ch.incoming_got += read_now(reinterpret_cast<char*>(&ch.incoming) + ch.incoming_got,
                                sizeof(WireHeader) - ch.incoming_got);
    if (ch.incoming_got < sizeof(WireHeader) || ch.incoming.magic != kMessageMagic) return;
    if (ch.incoming.kind == kAbortMessage) read_abort_and_throw(ch);
    payload_left = ch.incoming.payload_bytes;
  }
}

// Called once a whole header has arrived: an abort, a mismatch against the posted receive, or
// (with nothing posted) a message of the running collective with another signature all throw.
void TcpTransport::check_incoming(Channel& ch) {
  const WireHeader& h = ch.incoming;
  if (h.magic != kMessageMagic)
    RC_THROW_AS(kProtocol, "protocol error: garbage from rank ", ch.peer, " (bad message magic)");
  if (h.kind == kAbortMessage) read_abort_and_throw(ch);
  if (h.kind != kDataMessage)
    RC_THROW_AS(kProtocol, "protocol error: rank ", ch.peer, " sent a message of unknown kind ",
                int(h.kind));
  Signature theirs = header_signature(h);
  auto mismatch = [&](const Signature& ours) {
    RC_THROW_AS(kMismatch, "mismatched operations: rank ", ch.peer, " issued ", theirs.describe(),
                " but rank ", rank_, " issued ", ours.describe());
  };
  if (!ch.recvs.empty()) {
    const Part& p = ch.recvs.front();
    Signature ours = header_signature(p.header);
    if (theirs != ours) mismatch(ours);
    if (h.payload_bytes != p.bytes)
      RC_THROW_AS(kProtocol, "protocol error: rank ", ch.peer, " sent ", h.payload_bytes,
                  " bytes for ", theirs.describe(), ", rank ", rank_, " expected ", p.bytes);
    ch.incoming_matched = true;
  } else if (has_current_ && stray_mismatch(theirs, current_)) {
    mismatch(current_);
  }
}

bool TcpTransport::pump_recv(Channel& ch, bool eager) {
  bool moved = false;
  while (true) {
    if (ch.incoming_got < sizeof(WireHeader)) {
      if (ch.recvs.empty() && !eager) return moved;
      ssize_t n = recv(ch.fd, reinterpret_cast<char*>(&ch.incoming) + ch.incoming_got,
                       sizeof(WireHeader) - ch.incoming_got, MSG_DONTWAIT);
      if (n == 0 && ch.recvs.empty() && ch.incoming_got == 0) {
        // A peer may finish and exit while others still work; only a receive that needs it fails.
        ch.hung_up = true;
        return moved;
      }
      if (n < 0 && (errno == ECONNRESET || errno == EPIPE) && ch.recvs.empty() &&
          ch.incoming_got == 0) {
        // The same, closed with bytes of ours unread (our waiting notices): a reset, not an end.
        ch.hung_up = true;
        return moved;
      }
      if (n == 0)
        RC_THROW_AS(kPeerLost, "Connection closed by peer (rank ", ch.peer, " exited or aborted)");
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return moved;
        RC_THROW_AS(kPeerLost, "connection to rank ", ch.peer, " lost: ", errno_string(errno));
      }
      moved = true;
      ch.incoming_got += size_t(n);
      if (ch.incoming_got < sizeof(WireHeader)) continue;
      if (ch.incoming.magic == kMessageMagic && ch.incoming.kind == kWaitingMessage) {
        if (ch.incoming.root < 0 || ch.incoming.root >= world_size_)
          RC_THROW_AS(kProtocol, "protocol error: rank ", ch.peer, " says it waits on rank ",
                      ch.incoming.root);
        ch.heard_waiting_on = ch.incoming.root;
        ch.heard_at = Clock::now();
        ch.incoming_got = 0;
        continue;
      }
      ch.heard_waiting_on = -1;  // it moved on: what it said no longer holds
      ch.incoming_matched = false;
      check_incoming(ch);
    }
    if (ch.recvs.empty()) return moved;  // header held until a receive is posted
    if (!ch.incoming_matched) check_incoming(ch);
    Part& p = ch.recvs.front();
    while (p.done < p.bytes) {
      ssize_t n = recv(ch.fd, p.data + p.done, p.bytes - p.done, MSG_DONTWAIT);
      if (n == 0)
        RC_THROW_AS(kPeerLost, "Connection closed by peer (rank ", ch.peer, " exited or aborted)");
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return moved;
        RC_THROW_AS(kPeerLost, "connection to rank ", ch.peer, " lost: ", errno_string(errno));
      }
      moved = true;
      p.done += size_t(n);
    }
    int64_t op = p.op;
    ch.recvs.pop_front();
    ch.incoming_got = 0;
    sink_.part_done(op);
    moved = true;
  }
}

bool TcpTransport::progress() {
  bool moved = false;
  for (Channel& ch : channels_) {
    if (ch.fd < 0) continue;
    if (!ch.sends.empty() || ch.notice_pending) moved |= pump_send(ch);
    if (!ch.recvs.empty()) moved |= pump_recv(ch, false);
  }
  return moved;
}

bool TcpTransport::busy() const {
  for (const Channel& ch : channels_)
    if (!ch.sends.empty() || !ch.recvs.empty()) return true;
  return false;
}

// A message's first part travels on socket 0; its header is read (and held) as soon as it
// arrives, the idle channel being polled.
bool TcpTransport::peek(int peer, Signature* sig) const {
  const Channel& ch = channels_[size_t(peer) * sockets_];
  if (!ch.recvs.empty() || ch.incoming_got < sizeof(WireHeader) ||
      ch.incoming.magic != kMessageMagic || ch.incoming.kind != kDataMessage)
    return false;
  *sig = header_signature(ch.incoming);
  return true;
}

void TcpTransport::add_poll_fds(std::vector<pollfd>& fds) {
  polled_.clear();
  first_fd_ = fds.size();
  for (Channel& ch : channels_) {
    if (ch.fd < 0 || ch.hung_up) continue;
    short events = 0;
    if (!ch.sends.empty() || ch.notice_pending) events |= POLLOUT;
    // Idle channels are watched too, so a peer's abort, a mismatched header or a lost peer is
    // seen at once.
    if (!ch.recvs.empty() || ch.incoming_got < sizeof(WireHeader)) events |= POLLIN;
    if (!events) continue;
    fds.push_back({ch.fd, events, 0});
    polled_.push_back(&ch);
  }
}

void TcpTransport::on_poll(const pollfd* fds) {
  for (size_t i = 0; i < polled_.size(); ++i) {
    Channel& ch = *polled_[i];
    short ev = fds[first_fd_ + i].revents;
    if (!ev) continue;
    // Reads first: a peer's abort frame explains a send that would fail on its reset.
    if (ev & (POLLIN | POLLHUP | POLLERR)) {
      bool header_waiting = ch.incoming_got == sizeof(WireHeader) && ch.recvs.empty();
      if (header_waiting) {
        // Data (or the peer's close) sits behind a held header: nothing to read for now.
        if (ev & (POLLHUP | POLLERR)) ch.hung_up = true;
      } else {
        pump_recv(ch, true);
      }
    }
    if (ev & POLLOUT) pump_send(ch);
  }
  polled_.clear();
}

void TcpTransport::waiting_on(std::vector<int>& peers) const {
  int last = -1;
  for (const Channel& ch : channels_) {  // ordered by peer
    if (ch.fd < 0 || (ch.sends.empty() && ch.recvs.empty()) || ch.peer == last) continue;
    peers.push_back(ch.peer);
    last = ch.peer;
  }
}

void TcpTransport::announce_waiting(int on) {
  const WireHeader notice = make_waiting_header(on);
  for (int peer = 0; peer < world_size_; ++peer) {
    Channel& ch = channel(peer, 0);
    if (ch.fd < 0 || ch.hung_up || ch.notice_done > 0) continue;  // a half-sent one goes first
    ch.notice = notice;
    ch.notice_pending = true;
  }
}

int TcpTransport::reported_wait(int peer, Clock::time_point since) const {
  const Channel& ch = channel(peer, 0);
  return ch.heard_at >= since ? ch.heard_waiting_on : -1;
}

// A notice goes out between messages: after the part being written, before the next.
bool TcpTransport::pump_notice(Channel& ch) {
  if (!ch.notice_pending) return false;
  if (!ch.sends.empty() && (ch.sends.front().header_done > 0 || ch.sends.front().done > 0))
    return false;
  ssize_t n = send(ch.fd, reinterpret_cast<char*>(&ch.notice) + ch.notice_done,
                   sizeof(WireHeader) - ch.notice_done, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;
  if (n <= 0) {  // the connection is lost: the data path reports that, if it needs the peer
    ch.notice_pending = false;
    ch.notice_done = 0;
    return false;
  }
  bytes_sent_.fetch_add(size_t(n), std::memory_order_relaxed);
  ch.notice_done += size_t(n);
  if (ch.notice_done == sizeof(WireHeader)) {
    ch.notice_pending = false;
    ch.notice_done = 0;
  }
  return true;
}

void TcpTransport::abort(const std::string& reason, ErrorKind kind) {
  if (!abort_reason_.empty()) return;
  abort_reason_ = reason.empty() ? "aborted" : reason;
  std::string text = abort_reason_.substr(0, kMaxAbortText);
  auto deadline = Clock::now() + std::chrono::milliseconds(200);
  for (Channel& ch : channels_) {
    if (ch.fd < 0) continue;
    // A frame can only be written between messages: finish a half-sent one first (usually one
    // slice, which fits in the socket buffer), so the peer reads the reason, not just a close.
    if (ch.notice_done > 0)
      write_fully(ch.fd, reinterpret_cast<char*>(&ch.notice) + ch.notice_done,
                  sizeof(WireHeader) - ch.notice_done, deadline);
    ch.notice_pending = false;
    bool between_messages = ch.sends.empty() || ch.sends.front().header_done == 0;
    if (!between_messages) {
      Part& p = ch.sends.front();
      between_messages = write_fully(ch.fd, reinterpret_cast<char*>(&p.header) + p.header_done,
                                     sizeof(WireHeader) - p.header_done, deadline) &&
                         write_fully(ch.fd, p.data + p.done, p.bytes - p.done, deadline);
    }
    if (between_messages) {
      WireHeader h = make_abort_header(text.size(), kind);
      if (write_fully(ch.fd, &h, sizeof h, deadline))
        write_fully(ch.fd, text.data(), text.size(), deadline);
    }
    // Half-close: the peer reads the frame, then end-of-stream. A full close could reset the
    // connection and discard the frame before the peer reads it.
    shutdown(ch.fd, SHUT_WR);
  }
  for (Channel& ch : channels_) {
    ch.sends.clear();
    ch.recvs.clear();
  }
}

}  // namespace tcp
}  // namespace ringcomm
