#include "transport/mesh.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sched.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <thread>
#include <utility>

#include "common/error.h"
#include "common/knobs.h"
#include "common/logging.h"
#include "common/trace.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace ringcomm {
namespace {

// Spinning without a pause starves a sibling hyperthread, which may be the peer we wait for.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

constexpr char kHexDigits[] = "0123456789abcdef";

// The CPUs this process may run on (its affinity mask: a container's cpuset, taskset, a
// launcher's per-rank binding), in hex, four CPUs per digit, lowest first; "" if unknown.
std::string cpu_mask() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return "";
  std::string hex;
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu += 4) {
    int digit = 0;
    for (int b = 0; b < 4; ++b) digit |= CPU_ISSET(cpu + b, &set) ? 1 << b : 0;
    hex += kHexDigits[digit];
  }
  return hex.substr(0, hex.find_last_not_of('0') + 1);
}

// CPUs in the union of `masks` (cpu_mask()'s, from the ranks of one host): what those ranks
// share, whether each is bound to CPUs of its own or all may use all. The machine's count if a
// mask is unknown.
int cpus_in(const std::vector<std::string>& masks) {
  std::vector<unsigned> all;  // one hex digit's four CPUs each
  for (const std::string& m : masks) {
    if (m.empty()) return int(std::max(1u, std::thread::hardware_concurrency()));
    if (m.size() > all.size()) all.resize(m.size(), 0);
    for (size_t i = 0; i < m.size(); ++i) {
      const char* at = m[i] ? strchr(kHexDigits, m[i]) : nullptr;
      RC_CHECK_ARG(at, "bad CPU mask '", m, "' in a rank address");
      all[i] |= unsigned(at - kHexDigits);
    }
  }
  int count = 0;
  for (unsigned digit : all) count += __builtin_popcount(digit);
  return std::max(1, count);
}

// "host=...;tcp=...;shm=..." -> {"host": ..., "tcp": ..., "shm": ...}
std::map<std::string, std::string> parse_address(const std::string& text) {
  std::map<std::string, std::string> fields;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(';', start);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(start, end - start);
    size_t eq = item.find('=');
    if (eq != std::string::npos) fields[item.substr(0, eq)] = item.substr(eq + 1);
    start = end + 1;
  }
  return fields;
}

// The payload counters: only the thread running operations writes them (messages done, boards
// written and read), so no read-modify-write is needed; other threads read them (statistics).
void add_payload(std::atomic<uint64_t>& counter, uint64_t bytes) {
  counter.store(counter.load(std::memory_order_relaxed) + bytes, std::memory_order_relaxed);
}

}  // namespace

std::string host_identity() {
  std::string forced = knob_string("RINGCOMM_HOST_ID");
  if (!forced.empty()) return forced;
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  char netns[128] = {0};
  ssize_t n = readlink("/proc/self/ns/net", netns, sizeof netns - 1);
  std::string id = read_first_line("/proc/sys/kernel/random/boot_id") + "/" + name + "/" +
                   (n > 0 ? std::string(netns, size_t(n)) : "");
  uint64_t h = 1469598103934665603ull;  // FNV-1a: the address stays short and free of ';'
  for (unsigned char c : id) h = (h ^ c) * 1099511628211ull;
  return str_cat(std::hex, h);
}

MeshOptions MeshOptions::from_env(const std::string& master_addr) {
  MeshOptions o;
  o.master_addr = master_addr;
  o.transport = knob_string("RINGCOMM_TRANSPORT");
  o.spin_us = int(knob_int("RINGCOMM_SPIN_US").value_or(o.spin_us));
  o.yield_us = int(knob_int("RINGCOMM_YIELD_US").value());
  return o;
}

Mesh::Mesh(int rank, int world_size, MeshOptions options)
    : rank_(rank),
      world_size_(world_size),
      options_(std::move(options)),
      host_(host_identity()),
      route_(world_size, nullptr) {
  RC_CHECK_ARG(host_.find(';') == std::string::npos && host_.find('=') == std::string::npos,
               "RINGCOMM_HOST_ID must not contain ';' or '='");
  if (options_.transport != "tcp" && world_size > 1)
    transports_.push_back(
        std::make_unique<shm::ShmTransport>(rank, world_size, shm::ShmOptions::from_env(), *this));
  auto control = std::make_unique<tcp::TcpTransport>(
      rank, world_size, tcp::TcpOptions::from_env(options_.master_addr), *this);
  control_ = control.get();
  transports_.push_back(std::move(control));
  for (auto& t : transports_) {
    if (!single_copy_) single_copy_ = t->single_copy();
    if (!boards_) boards_ = t->boards();
  }
  interrupt_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (interrupt_fd_ < 0) RC_THROW("eventfd failed: ", strerror(errno));
}

Mesh::~Mesh() {
  close();
  ::close(interrupt_fd_);
}

void Mesh::interrupt(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(interrupt_mu_);
    if (interrupted_) return;
    interrupt_reason_ = reason.empty() ? "aborted" : reason;
    interrupted_ = true;
  }
  uint64_t one = 1;
  if (write(interrupt_fd_, &one, sizeof one) < 0) { /* counter saturated: already readable */
  }
  for (auto& t : transports_) t->ring_self();
}

void Mesh::throw_if_interrupted() const {
  if (!interrupted_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lk(interrupt_mu_);
  RC_THROW_AS(kAborted, "aborted: ", interrupt_reason_);
}

std::string Mesh::address() const {
  std::string text = str_cat("host=", host_, ";cpus=", cpu_mask());
  text += str_cat(";", control_->name(), "=", control_->address());
  for (auto& t : transports_)
    if (t.get() != control_) text += str_cat(";", t->name(), "=", t->address());
  return text;
}

void Mesh::connect(const std::vector<std::string>& addresses, const std::string& token,
                   Clock::time_point deadline) {
  RC_CHECK_ARG(int(addresses.size()) == world_size_, "expected ", world_size_, " addresses");
  std::vector<std::map<std::string, std::string>> fields;
  std::vector<std::string> hosts, endpoints, masks;
  for (const std::string& a : addresses) {
    fields.push_back(parse_address(a));
    auto& f = fields.back();
    RC_CHECK_ARG(f.count("host") && f.count(control_->name()), "bad rank address '", a, "'");
    hosts.push_back(f["host"]);
    endpoints.push_back(f[control_->name()]);
    masks.push_back(f.count("cpus") ? f["cpus"] : "");
  }
  host_of_.clear();
  for (const std::string& h : hosts)
    host_of_.push_back(int(std::find(hosts.begin(), hosts.end(), h) - hosts.begin()));
  control_->connect(endpoints, token, deadline);
  // More ranks on this host than CPUs they may run on between them. Every local rank computes
  // the same answer from the same addresses.
  std::vector<std::string> local_masks;
  for (int r = 0; r < world_size_; ++r)
    if (hosts[r] == host_) local_masks.push_back(masks[r]);
  const bool oversubscribed = local_masks.size() > size_t(cpus_in(local_masks));
  choose_routes(fields, deadline);
  if (options_.spin_us < 0) options_.spin_us = oversubscribed ? 0 : 5;
  if (options_.yield_us < 0) options_.yield_us = 1000;
  if (debug_enabled()) {
    std::string table;
    for (int peer = 0; peer < world_size_; ++peer)
      table += str_cat(peer ? " " : "", peer, ":", transport_of(peer));
    RC_LOG("rank ", rank_, " transports by peer: ", table);
  }
}

// Each transport in turn, in order of preference, with the peers its can_connect admits: both
// sides of a pair compute the same answer from the same two addresses, and learn the other's
// outcome of each set-up step from the exchanges, so both give the pair the same transport. TCP,
// last, admits every pair and was set up by connect(). A local peer left on TCP is an error
// under RINGCOMM_TRANSPORT=shm.
void Mesh::choose_routes(const std::vector<std::map<std::string, std::string>>& fields,
                         Clock::time_point deadline) {
  std::vector<std::string> why_not(static_cast<size_t>(world_size_));
  for (auto& t : transports_) {
    std::vector<Published> published(static_cast<size_t>(world_size_));
    std::vector<std::string> addresses(static_cast<size_t>(world_size_));
    for (int r = 0; r < world_size_; ++r) {
      Published& p = published[size_t(r)];
      p.host = fields[size_t(r)].at("host");
      auto field = fields[size_t(r)].find(t->name());
      p.offered = field != fields[size_t(r)].end();
      if (p.offered) p.address = addresses[size_t(r)] = field->second;
    }
    std::vector<int> group, peers;
    for (int r = 0; r < world_size_; ++r) {
      if (r != rank_ && !t->can_connect(published[size_t(rank_)], published[size_t(r)])) continue;
      group.push_back(r);
      if (r != rank_) peers.push_back(r);
    }
    if (t.get() == control_) {
      for (int peer : peers)
        if (!route_[peer]) route_[peer] = control_;
    } else if (!peers.empty()) {
      set_up(*t, group, peers, addresses, why_not, deadline);
    }
  }
  for (int peer = 0; peer < world_size_; ++peer) {
    if (route_[peer] != control_ || host_of_[size_t(peer)] != host_of_[size_t(rank_)]) continue;
    const std::string why = why_not[size_t(peer)].empty()
                                ? str_cat("rank ", peer, " runs without shared memory")
                                : why_not[size_t(peer)];
    if (options_.transport == "shm")
      RC_THROW("RINGCOMM_TRANSPORT=shm but rank ", rank_, " and rank ", peer,
               " (same host) cannot share memory: ", why);
    RC_LOG("rank ", rank_, ": rank ", peer, " stays on TCP: ", why);
  }
}

// Two one-byte exchanges over TCP with every peer admitted: "I am ready" (prepare()), then "I
// linked you" (link()). A pair that both sides linked takes the transport.
void Mesh::set_up(Transport& transport, const std::vector<int>& group,
                  const std::vector<int>& peers, const std::vector<std::string>& addresses,
                  std::vector<std::string>& why_not, Clock::time_point deadline) {
  std::string why;
  const char ready = transport.prepare(group, &why) ? 1 : 0;
  std::vector<char> theirs;
  control_->exchange(peers, std::vector<char>(peers.size(), ready), theirs, deadline);
  std::vector<char> linked(peers.size(), 0);
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!ready) break;
    if (!theirs[i]) {
      why = str_cat("rank ", peers[i], " could not set up ", transport.name());
      continue;
    }
    linked[i] = transport.link(peers[i], addresses[size_t(peers[i])], &why) ? 1 : 0;
  }
  control_->exchange(peers, linked, theirs, deadline);
  for (size_t i = 0; i < peers.size(); ++i) {
    const int peer = peers[i];
    if (!linked[i] || !theirs[i]) {
      why_not[size_t(peer)] = why.empty() ? "the peer failed" : why;
    } else if (!route_[peer]) {
      transport.enable(peer);
      route_[peer] = &transport;
    }
  }
}

bool Mesh::boards_reach(const std::vector<int>& ranks) const {
  if (board_bytes() == 0) return false;
  for (int r : ranks)
    if (r != rank_ && (route_.at(size_t(r))->boards() != boards_ || !boards_->board(r)))
      return false;
  return true;
}

bool Mesh::boards_everywhere() const {
  std::vector<int> all(static_cast<size_t>(world_size_));
  for (int r = 0; r < world_size_; ++r) all[size_t(r)] = r;
  return boards_reach(all);
}

void Mesh::write_board(size_t offset, Ranges from, int readers) {
  boards_->write_board(offset, from, readers);
  add_payload(payload_sent_, from.bytes() * size_t(readers));
}

const char* Mesh::read_board(int rank, size_t offset, size_t bytes) {
  add_payload(payload_received_, bytes);
  return boards_->board(rank) + offset;
}

const char* Mesh::transport_of(int peer) const {
  return peer == rank_ ? "self" : route_.at(size_t(peer)) ? route_[peer]->name() : "none";
}

void Mesh::set_current(const Signature& sig) {
  current_ = sig;
  has_current_ = true;
  for (auto& t : transports_) t->set_current(sig);
}

void Mesh::check_usable() const {
  if (!abort_reason_.empty()) throw Error("transport aborted: " + abort_reason_, abort_kind_);
}

Request Mesh::post_send(int peer, const void* data, size_t bytes, const Signature& sig,
                        Callback on_done) {
  return post(true, peer, static_cast<char*>(const_cast<void*>(data)), bytes, sig,
              std::move(on_done));
}

Request Mesh::post_recv(int peer, void* data, size_t bytes, const Signature& sig,
                        Callback on_done) {
  return post(false, peer, static_cast<char*>(data), bytes, sig, std::move(on_done));
}

Request Mesh::post(bool is_send, int peer, char* data, size_t bytes, const Signature& sig,
                   Callback on_done) {
  check_usable();
  RC_CHECK_ARG(peer >= 0 && peer < world_size_ && peer != rank_ && route_[peer],
               "invalid peer rank ", peer);
  int64_t id = add_op(std::move(on_done), is_send, peer, bytes);
  int parts = route_[peer]->post(is_send, peer, data, bytes, sig, id);
  find(id)->parts_left = parts;
  return Request{id};
}

Request Mesh::post_consume(int peer, size_t bytes, const Signature& sig,
                           Transport::Consumer consume) {
  return post_in_place(peer, false, bytes, can_consume(peer), "consume in place", [&](int64_t id) {
    return route_[peer]->post_consume(peer, bytes, sig, id, std::move(consume));
  });
}

Request Mesh::post_produce(int peer, size_t bytes, const Signature& sig,
                           Transport::Producer produce) {
  return post_in_place(peer, true, bytes, can_consume(peer), "produce in place", [&](int64_t id) {
    return route_[peer]->post_produce(peer, bytes, sig, id, std::move(produce));
  });
}

Request Mesh::post_ranges(bool is_send, int peer, Ranges ranges, const Signature& sig) {
  const size_t bytes = ranges.bytes();
  return post_in_place(peer, is_send, bytes, takes_ranges(peer), "move ranges", [&](int64_t id) {
    return route_[peer]->post_ranges(is_send, peer, ranges, bytes, sig, id);
  });
}

template <typename PostToTransport>
Request Mesh::post_in_place(int peer, bool is_send, size_t bytes, bool takes, const char* what,
                            PostToTransport post) {
  check_usable();
  RC_CHECK_ARG(takes, "rank ", peer, "'s transport cannot ", what);
  int64_t id = add_op(nullptr, is_send, peer, bytes);
  find(id)->parts_left = post(id);
  return Request{id};
}

int64_t Mesh::add_op(Callback on_done, bool is_send, int peer, size_t bytes) {
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    RC_CHECK_ARG(ops_.size() < (size_t(1) << kSlotBits), "more than ", size_t(1) << kSlotBits,
                 " messages in flight");
    slot = uint32_t(ops_.size());
    ops_.emplace_back();
  }
  Op& op = ops_[slot];
  // 39 bits of serial (wrapping after 5e11 messages; a stale Request never lives that long).
  op.id = int64_t(((next_serial_++ & ((uint64_t(1) << 39) - 1)) << kSlotBits) | slot);
  op.parts_left = 0;
  op.on_done = std::move(on_done);
  op.peer = peer;
  op.is_send = is_send;
  op.bytes = bytes;
  op.posted_ns = trace::enabled() ? trace::now_ns() : 0;
  ++live_ops_;
  return op.id;
}

const Mesh::Op* Mesh::find(int64_t id) const {
  size_t slot = size_t(id) & ((size_t(1) << kSlotBits) - 1);
  return id >= 0 && slot < ops_.size() && ops_[slot].id == id ? &ops_[slot] : nullptr;
}

Mesh::Op* Mesh::find(int64_t id) { return const_cast<Op*>(std::as_const(*this).find(id)); }

void Mesh::remove(Op& op) {
  op.id = -1;
  op.on_done = nullptr;
  free_slots_.push_back(uint32_t(&op - ops_.data()));
  --live_ops_;
}

void Mesh::part_done(int64_t id) {
  Op* op = find(id);
  if (--op->parts_left > 0) return;
  add_payload(op->is_send ? payload_sent_ : payload_received_, op->bytes);
  if (op->posted_ns && trace::enabled()) {
    // From posted to done as this thread saw it: a message's span includes waiting for its peer.
    trace::Event e{op->is_send ? "send" : "recv", nullptr, op->posted_ns, trace::now_ns(),
                   trace::thread_id()};
    e.peer = op->peer;
    e.bytes = op->bytes;
    e.comm = trace_id_;
    trace::record(e);
  }
  Callback cb = std::move(op->on_done);
  remove(*op);
  if (cb) cb(nullptr);
}

bool Mesh::progress() {
  bool moved = false;
  for (auto& t : transports_) moved |= t->progress();
  return moved;
}

bool Mesh::block(int wake_fd, Clock::time_point deadline, bool sleep) {
  auto now = Clock::now();
  if (now >= deadline) return false;
  fds_.clear();
  for (auto& t : transports_) t->add_poll_fds(fds_);
  if (wake_fd >= 0) fds_.push_back({wake_fd, POLLIN, 0});
  fds_.push_back({interrupt_fd_, POLLIN, 0});
  auto poll_for = std::min<Clock::duration>(deadline - now, std::chrono::seconds(1));
  if (!sleep) {
    poll_for = Clock::duration::zero();
  } else if (Transport* bell = doorbell_to_sleep_on()) {
    // Sleep on the doorbell; sockets (a lost peer, an abort notice, TCP peers' data) are looked
    // at between naps: often while work is pending on sockets too, every 50 ms otherwise.
    const bool polled_busy = std::any_of(transports_.begin(), transports_.end(),
                                         [](auto& t) { return !t->has_doorbell() && t->busy(); });
    auto nap = polled_busy ? std::chrono::microseconds(500) : std::chrono::microseconds(50000);
    bell->sleep(std::min(deadline, now + nap));
    poll_for = Clock::duration::zero();
  }
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(poll_for).count();
  timespec ts{time_t(ns / 1000000000), long(ns % 1000000000)};
  int n = ppoll(fds_.data(), fds_.size(), &ts, nullptr);
  if (n < 0 && errno != EINTR) RC_THROW("ppoll failed: ", strerror(errno));
  for (auto& t : transports_) t->on_poll(fds_.data());
  // A peer reached through another transport that has exited is seen as its closed TCP
  // connection; what it wrote before (the data we wait for, or an abort reason, in its
  // transport or on the socket behind a message this rank has not taken yet) is taken first.
  for (int peer = 0; peer < world_size_; ++peer) {
    Transport* t = route_[peer];
    if (!t || t == control_ || !t->waits_on(peer) || !control_->peer_closed(peer)) continue;
    t->progress();
    if (!t->waits_on(peer)) continue;
    control_->throw_if_peer_aborted(peer);
    RC_THROW_AS(kPeerLost, "Connection closed by peer (rank ", peer, " exited or aborted)");
  }
  return true;
}

Transport* Mesh::doorbell_to_sleep_on() const {
  for (auto& t : transports_)
    if (t->has_doorbell() && t->busy()) return t.get();
  return nullptr;
}

void Mesh::append_waited(std::vector<int>& peers) const {
  for (auto& t : transports_) t->waiting_on(peers);
}

bool Mesh::waits_only_on_other_hosts() {
  waited_.clear();  // kept from wait to wait: posting and waiting allocate nothing
  append_waited(waited_);
  return !waited_.empty() && std::none_of(waited_.begin(), waited_.end(), [&](int peer) {
    return host_of_[size_t(peer)] == host_of_[size_t(rank_)];
  });
}

std::vector<int> Mesh::waiting_on() const {
  std::vector<int> peers;
  append_waited(peers);
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

std::string Mesh::describe_waiting() const {
  std::string text;
  for (int peer : waiting_on()) text += str_cat(text.empty() ? "rank(s) " : ", ", peer);
  return text.empty() ? "nothing" : text;
}

void Mesh::announce_waiting() {
  std::vector<int> waited = waiting_on();
  if (!waited.empty()) control_->announce_waiting(waited[0]);
}

Clock::duration Mesh::notice_period(Clock::duration timeout) {
  return std::clamp<Clock::duration>(timeout / 20, std::chrono::milliseconds(100),
                                     std::chrono::seconds(10));
}

std::string Mesh::describe_timeout(Clock::duration notice_every) {
  return str_cat("Timed out during ", has_current_ ? current_.describe() : "an operation",
                 " waiting on ", describe_waiting(), describe_chains(waiting_on(), notice_every));
}

// A rank waited on may itself be waiting on another (a ring neighbour of the rank that is
// stuck): its waiting notices say on whom, and so on down each chain to ranks that say nothing.
// Those are named, so that every rank's error (the others read this one in its abort) names the
// same culprit, not only the rank each waited on directly.
std::string Mesh::describe_chains(const std::vector<int>& waited, Clock::duration notice_every) {
  const Clock::time_point fresh = Clock::now() - 3 * notice_every;
  std::string chain, quiet;
  bool cycle = false;
  // Follows every chain from the ranks waited on; `quiet` lists where they end in silence.
  auto follow = [&] {
    std::vector<bool> seen(size_t(world_size_), false), silent(size_t(world_size_), false);
    seen[size_t(rank_)] = true;
    chain.clear();
    quiet.clear();
    cycle = false;
    for (int start : waited) {
      if (seen[size_t(start)]) continue;
      seen[size_t(start)] = true;
      int at = start;
      for (int next; (next = control_->reported_wait(at, fresh)) >= 0; at = next) {
        chain += str_cat("; rank ", at, " waits on rank ", next);
        if (seen[size_t(next)]) {
          cycle |= next == rank_ || next == start;
          break;
        }
        seen[size_t(next)] = true;
      }
      if (control_->reported_wait(at, fresh) < 0) silent[size_t(at)] = true;
    }
    for (int r = 0; r < world_size_; ++r)
      if (silent[size_t(r)]) quiet += str_cat(quiet.empty() ? "" : ", ", r);
  };
  // A rank that has only just started waiting has not said so yet: the silent ones get a little
  // longer (two notice periods, at most a second) before they are named.
  const auto until =
      Clock::now() + std::min<Clock::duration>(2 * notice_every, std::chrono::seconds(1));
  for (follow(); !waited.empty() && !quiet.empty() && Clock::now() < until; follow())
    block(-1, std::min(until, Clock::now() + std::chrono::milliseconds(10)));
  if (chain.empty()) return "";  // the ranks waited on are the ones that say nothing
  std::string why = chain;
  if (!quiet.empty()) why += "; nothing from rank(s) " + quiet + ": stuck or slow";
  return cycle ? why + " (a cycle: they wait on each other)" : why;
}

size_t Mesh::wait_any(const Request* reqs, size_t count, Clock::time_point deadline) {
  size_t found = 0;
  auto any_done = [&] {
    for (found = 0; found < count; ++found)
      if (done(reqs[found])) return true;
    return false;
  };
  check_usable();
  const Clock::time_point start = Clock::now();
  const auto spin_end = start + std::chrono::microseconds(std::max(options_.spin_us, 0));
  unsigned idle_polls = 0;
  // Not while a local peer waits on this CPU: spinning keeps from it the CPU it needs to answer,
  // and each side then spins out its spin time before yielding, on every small call.
  // Asked without spinning too: the higher rank of two on one CPU moves off it there.
  const bool stacked = std::any_of(transports_.begin(), transports_.end(),
                                   [](auto& t) { return t->peer_on_this_cpu(); });
  bool spinning = options_.spin_us > 0 && !stacked;
  const auto yield_for = std::chrono::microseconds(std::max(options_.yield_us, 0));
  Clock::time_point yield_until;
  // Waiting notices: every 1/20 of the time left (100 ms to 10 s), from one period in.
  const Clock::duration notice_every = notice_period(deadline - start);
  Clock::time_point next_notice = start + notice_every;
  // Since when nothing has moved. Taken from the clock reads the loop makes anyway, so an idle
  // stretch counts from its 32nd poll while spinning: idle_ns() may miss a microsecond of each.
  Clock::time_point idle_since;
  auto end_idle = [&] {
    if (idle_since == Clock::time_point()) return;
    idle_ns_.store(
        idle_ns_.load(std::memory_order_relaxed) +
            std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - idle_since).count(),
        std::memory_order_relaxed);
    idle_since = Clock::time_point();
  };
  while (!any_done()) {
    throw_if_interrupted();
    if (progress()) {
      end_idle();
      continue;
    }
    if (any_done()) break;
    // The clock is read every 32 idle polls: reading it each time cost more than the poll.
    if (spinning) {
      if (++idle_polls % 32 != 0) {
        cpu_relax();
        continue;
      }
      const Clock::time_point now = Clock::now();
      if (idle_since == Clock::time_point()) idle_since = now;
      if (now < spin_end) {
        cpu_relax();
        continue;
      }
    }
    spinning = false;
    const Clock::time_point now = Clock::now();
    if (idle_since == Clock::time_point()) idle_since = now;
    // The rank we wait for may need this CPU (more local ranks than CPUs, or the scheduler put
    // both on one): yielding hands it over at once, while a futex sleep costs a wake-up of
    // tens of microseconds on each side, and one rank waking late makes the other sleep next
    // time. Ranks on other hosts cannot use this CPU: waiting only on them, a yielding rank looks
    // busy to the scheduler, which then keeps this CPU from the work of other processes.
    if (yield_until == Clock::time_point())
      yield_until = waits_only_on_other_hosts() ? now : now + yield_for;
    if (now < yield_until) {
      // Idle sockets are read only when polled: now and then, so that a peer's abort, a stray
      // mismatched message or a lost peer is seen while everything else completes in this loop.
      if (++idle_polls % 8 == 0)
        block(-1, deadline, /*sleep=*/false);
      else
        sched_yield();
      continue;
    }
    // Blocked for a while: tell every peer on whom, so that a peer that times out waiting on
    // this rank can name the rank that holds everything up.
    if (now >= next_notice) {
      announce_waiting();
      next_notice = Clock::now() + notice_every;
    }
    block(-1, std::min(deadline, next_notice));
    if (Clock::now() >= deadline && !any_done() && !progress() && !any_done())
      RC_THROW_AS(kTimeout, describe_timeout(notice_every));
  }
  end_idle();
  return found;
}

void Mesh::progress_until_event(int wake_fd, Clock::time_point deadline) {
  check_usable();
  throw_if_interrupted();
  size_t before = live_ops_;
  if (progress() && live_ops_ < before) return;
  block(wake_fd, deadline);
}

void Mesh::wake() {
  for (auto& t : transports_) t->ring_self();
}

void Mesh::abort(const std::string& reason, const std::exception_ptr& error) {
  if (!abort_reason_.empty()) return;
  abort_reason_ = reason.empty() ? "aborted" : reason;
  abort_kind_ = error_kind_of(error);
  for (auto& t : transports_) t->abort(abort_reason_, abort_kind_);
  std::vector<Callback> callbacks;
  for (Op& op : ops_) {
    if (op.id < 0) continue;
    if (op.on_done) callbacks.push_back(std::move(op.on_done));
    remove(op);
  }
  for (auto& cb : callbacks) cb(error);
}

void Mesh::close() {
  for (auto& t : transports_) t->close();
}

uint64_t Mesh::bytes_sent() const {
  uint64_t bytes = 0;
  for (auto& t : transports_) bytes += t->bytes_sent();
  return bytes;
}

uint64_t Mesh::bytes_sent(const std::string& transport) const {
  for (auto& t : transports_)
    if (transport == t->name()) return t->bytes_sent();
  return 0;
}

uint64_t Mesh::cpu_moves() const {
  uint64_t moves = 0;
  for (auto& t : transports_) moves += t->cpu_moves();
  return moves;
}

}  // namespace ringcomm
