#include "transport/cuda_ipc/ipc_transport.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "kernels/cuda/check.h"
#include "kernels/cuda/window.h"

namespace ringcomm {
namespace ipc {
namespace {

using Clock = std::chrono::steady_clock;
using cuda::DeviceScope;

std::string host_identity() {
  std::string boot;
  std::getline(std::ifstream("/proc/sys/kernel/random/boot_id"), boot);
  char ns[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  return boot + "/" + (n > 0 ? std::string(ns, size_t(n)) : "");
}

std::string gpu_name(const unsigned char* uuid) {
  static const char* hex = "0123456789abcdef";
  std::string s = "GPU-";
  for (int i = 0; i < 16; ++i) {
    s += hex[uuid[i] >> 4];
    s += hex[uuid[i] & 15];
    if (i == 3 || i == 5 || i == 7 || i == 9) s += '-';
  }
  return s;
}

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Waits for `stream` until `deadline`: "" once its work is done, else why not.
std::string drain(cudaStream_t stream, Clock::time_point deadline, const char* what) {
  for (;;) {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return "";
    if (status != cudaErrorNotReady)
      return str_cat(what, " failed: ", cudaGetErrorName(status), ": ", cudaGetErrorString(status));
    if (Clock::now() > deadline) return str_cat(what, " did not finish in time");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

#define RC_CUDA_REASON(call)                                                \
  do {                                                                      \
    const cudaError_t rc_status = (call);                                   \
    if (rc_status != cudaSuccess)                                           \
      return str_cat(#call, " failed: ", cudaGetErrorName(rc_status), ": ", \
                     cudaGetErrorString(rc_status));                        \
  } while (0)

// The kind a peer wrote into the segment, as an ErrorKind.
ErrorKind kind_of(uint32_t kind) {
  return kind < uint32_t(kErrorKinds) ? ErrorKind(kind) : ErrorKind::kOther;
}

constexpr size_t kBatch = 128;  // stream memory operations per cuStreamBatchMemOp (< 256)

}  // namespace

// What each rank tells the others when it starts (the first exchange), as raw bytes.
struct IpcTransport::Info {
  char host[128];  // boot id and pid namespace: peers' /proc/<pid> paths resolve to them
  int64_t pid;
  unsigned char gpu[16];  // the device's UUID
  cudaIpcMemHandle_t window;
  uint64_t window_bytes;
  int32_t segment_fd;         // rank 0's
  uint64_t nonce;             // rank 0's
  char reason[kReasonBytes];  // why this rank cannot go on, or ""
};

IpcTransport::IpcTransport(int rank, int size, int device, size_t window_bytes, double timeout_s)
    : rank_(rank),
      size_(size),
      device_(device),
      window_bytes_(window_bytes),
      timeout_s_(timeout_s),
      windows_(size_t(size), nullptr),
      pids_(size_t(size), 0),
      sends_(size_t(kLanes) * size_t(size), 0),
      recvs_(size_t(kLanes) * size_t(size), 0) {}

std::unique_ptr<IpcTransport> IpcTransport::connect(int rank, int size, int device,
                                                    size_t window_bytes, double timeout_s,
                                                    const Exchange& exchange,
                                                    std::string* refused) {
  RC_CHECK_ARG(size >= 1 && size <= kMaxRanks, "CUDA IPC connects 1 to ", kMaxRanks, " ranks, not ",
               size);
  RC_CHECK_ARG(rank >= 0 && rank < size, "rank ", rank, " of ", size);
  RC_CHECK_ARG(timeout_s > 0, "timeout must be positive, got ", timeout_s);
  std::unique_ptr<IpcTransport> t(new IpcTransport(rank, size, device, window_bytes, timeout_s));
  auto all = [&](const std::string& mine) {
    std::vector<std::string> got = exchange(mine);
    RC_CHECK_ARG(int(got.size()) == size, "the exchange gave ", got.size(), " entries for ", size,
                 " ranks");
    return got;
  };
  // Each step's outcome is exchanged whatever it is, so that every rank takes the same
  // decision from the same list.
  auto agree = [&](const std::string& why) {
    const std::vector<std::string> whys = all(why);
    for (int q = 0; q < size; ++q)
      if (!whys[size_t(q)].empty()) return str_cat("rank ", q, ": ", whys[size_t(q)]);
    return std::string();
  };
  std::random_device random;
  std::string info;
  t->prepare((uint64_t(random()) << 32) ^ random(), &info);  // a failure travels in `info`
  std::string why = agree(t->attach(all(info)));
  if (why.empty()) why = agree(t->prove());
  if (!why.empty()) {
    *refused = why;
    return nullptr;
  }
  t->watchdog_ = std::thread([p = t.get()] { p->watch(); });
  return t;
}

std::string IpcTransport::prepare(uint64_t nonce, std::string* info) {
  Info mine{};
  const std::string host = host_identity();
  std::strncpy(mine.host, host.c_str(), sizeof mine.host - 1);
  mine.pid = getpid();
  mine.window_bytes = window_bytes_;
  mine.segment_fd = -1;
  auto done = [&](const std::string& why) {
    std::strncpy(mine.reason, why.c_str(), sizeof mine.reason - 1);
    info->assign(reinterpret_cast<const char*>(&mine), sizeof mine);
    return why;
  };
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || device_ < 0 || device_ >= devices)
    return done(str_cat("no CUDA device ", device_, " (", devices, " visible)"));
  try {
    DeviceScope scope(device_);
    cudaDeviceProp prop{};
    RC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    std::memcpy(mine.gpu, prop.uuid.bytes, sizeof mine.gpu);
    cudaDriverEntryPointQueryResult found{};
    RC_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &batch_mem_op_, 11070,
                                                   cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || batch_mem_op_ == nullptr)
      return done("the CUDA driver offers no cuStreamBatchMemOp");
    RC_CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
    void* window = nullptr;
    RC_CUDA_CHECK(cudaMalloc(&window, kProofBytes + window_bytes_));
    windows_[size_t(rank_)] = static_cast<char*>(window);
    RC_CUDA_CHECK(cudaMemsetAsync(window, 0, kProofBytes + window_bytes_, own_stream_));
    const std::string cleared = drain(own_stream_, after(timeout_s_), "clearing the window");
    if (!cleared.empty()) return done(cleared);
    RC_CUDA_CHECK(cudaIpcGetMemHandle(&mine.window, window));
  } catch (const std::exception& e) {
    return done(e.what());
  }
  if (rank_ == 0) {
    segment_fd_ = int(syscall(SYS_memfd_create, "ringcomm-cuda-ipc", unsigned(MFD_CLOEXEC)));
    segment_mapped_ = (segment_bytes(size_) + 4095) / 4096 * 4096;
    if (segment_fd_ < 0 || ftruncate(segment_fd_, off_t(segment_mapped_)) != 0)
      return done(str_cat("cannot make the signal segment: ", strerror(errno)));
    void* base = mmap(nullptr, segment_mapped_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                      segment_fd_, 0);
    if (base == MAP_FAILED)
      return done(str_cat("cannot map the signal segment: ", strerror(errno)));
    segment_base_ = base;
    segment_ = Segment(base, size_);
    segment_.init(nonce);
    mine.segment_fd = segment_fd_;
    mine.nonce = nonce;
  }
  return done("");
}

std::string IpcTransport::attach(const std::vector<std::string>& infos) {
  std::vector<Info> all(static_cast<size_t>(size_));
  for (int q = 0; q < size_; ++q) {
    if (infos[size_t(q)].size() != sizeof(Info))
      return str_cat("rank ", q, " sent ", infos[size_t(q)].size(), " bytes of set-up, not ",
                     sizeof(Info), " (another ringcomm build)");
    std::memcpy(&all[size_t(q)], infos[size_t(q)].data(), sizeof(Info));
    all[size_t(q)].reason[kReasonBytes - 1] = '\0';
    all[size_t(q)].host[sizeof all[0].host - 1] = '\0';
  }
  // A rank that could not prepare says so in the next exchange, in its own words; the others
  // go no further.
  const Info& me = all[size_t(rank_)];
  for (int q = 0; q < size_; ++q)
    if (all[size_t(q)].reason[0] != '\0') return me.reason;
  for (int q = 0; q < size_; ++q) {
    const Info& peer = all[size_t(q)];
    if (std::strcmp(peer.host, me.host) != 0)
      return str_cat("rank ", q, " runs on another host or in another pid namespace");
    if (peer.window_bytes != window_bytes_)
      return str_cat("rank ", q, " asks for windows of ", peer.window_bytes, " bytes, rank ", rank_,
                     " for ", window_bytes_);
    pids_[size_t(q)] = long(peer.pid);
  }
  nonce_ = all[0].nonce;
  if (rank_ != 0) {
    const std::string path = str_cat("/proc/", all[0].pid, "/fd/", all[0].segment_fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return str_cat("cannot open rank 0's signal segment ", path, ": ", strerror(errno));
    segment_mapped_ = (segment_bytes(size_) + 4095) / 4096 * 4096;
    struct stat st{};
    void* base = MAP_FAILED;
    if (fstat(fd, &st) == 0 && size_t(st.st_size) == segment_mapped_)
      base =
          mmap(nullptr, segment_mapped_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    ::close(fd);
    if (base == MAP_FAILED) return str_cat("cannot map rank 0's signal segment ", path);
    segment_base_ = base;
    segment_ = Segment(base, size_);
    if (!segment_.matches(nonce_))
      return str_cat(path, " is not rank 0's signal segment (another process has its pid)");
  }
  try {
    return map_windows(all);
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::string IpcTransport::map_windows(const std::vector<Info>& all) {
  const Info& me = all[size_t(rank_)];
  DeviceScope scope(device_);
  RC_CUDA_REASON(cudaHostRegister(segment_base_, segment_mapped_,
                                  cudaHostRegisterMapped | cudaHostRegisterPortable));
  segment_registered_ = true;
  void* device_address = nullptr;
  RC_CUDA_REASON(cudaHostGetDevicePointer(&device_address, segment_base_, 0));
  segment_device_ = static_cast<char*>(device_address);
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    void* window = nullptr;
    const cudaError_t opened =
        cudaIpcOpenMemHandle(&window, all[size_t(q)].window, cudaIpcMemLazyEnablePeerAccess);
    if (opened != cudaSuccess) {
      cudaGetLastError();
      return str_cat("cannot map rank ", q, "'s window (", gpu_name(all[size_t(q)].gpu),
                     ", process ", all[size_t(q)].pid, ") on ", gpu_name(me.gpu), ": ",
                     cudaGetErrorName(opened), ": ", cudaGetErrorString(opened));
    }
    windows_[size_t(q)] = static_cast<char*>(window);
  }
  return "";
}

uint64_t IpcTransport::slot_address(int receiver, int channel, int sender) const {
  return reinterpret_cast<uint64_t>(segment_device_ + slot_offset(receiver, channel, sender));
}

std::string IpcTransport::prove() {
  try {
    return prove_writes();
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::string IpcTransport::prove_writes() {
  DeviceScope scope(device_);
  std::vector<uint64_t*> at;
  std::vector<uint64_t> tokens;
  std::vector<CUstreamBatchMemOpParams> signals;
  std::vector<Await> waits;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    at.push_back(reinterpret_cast<uint64_t*>(windows_[size_t(q)]) + rank_);
    tokens.push_back(proof_token(nonce_, rank_, q));
    CUstreamBatchMemOpParams op{};
    op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    op.writeValue.address = slot_address(q, kProofChannel, rank_);
    op.writeValue.value = 1;
    op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    signals.push_back(op);
    waits.push_back({kProofChannel, q, 1});
  }
  const auto deadline = after(timeout_s_);
  cuda::write_words(at.data(), tokens.data(), int(at.size()), own_stream_);
  const auto batch = reinterpret_cast<PFN_cuStreamBatchMemOp_v11070>(batch_mem_op_);
  for (size_t i = 0; i < signals.size(); i += kBatch) {
    const CUresult r =
        batch(own_stream_, unsigned(std::min(kBatch, signals.size() - i)), signals.data() + i, 0);
    if (r != CUDA_SUCCESS)
      return str_cat("cuStreamBatchMemOp (signals into host memory) failed: CUresult ", int(r));
  }
  const std::string sent = drain(own_stream_, deadline, "writing into the peers' windows");
  if (!sent.empty()) return sent;
  int missing = -1;
  const WaitResult got = wait_for(
      segment_, rank_, waits.data(), waits.size(), [&] { return Clock::now() > deadline; },
      [] { std::this_thread::sleep_for(std::chrono::microseconds(50)); }, &missing);
  if (got == WaitResult::kTimeout)
    return str_cat("rank ", waits[size_t(missing)].peer, "'s signal did not arrive within ",
                   timeout_s_, " s");
  if (got == WaitResult::kAborted) return "a rank gave up while starting";
  std::vector<uint64_t> words(static_cast<size_t>(size_));
  RC_CUDA_REASON(cudaMemcpyAsync(words.data(), windows_[size_t(rank_)], words.size() * 8,
                                 cudaMemcpyDeviceToHost, own_stream_));
  const std::string read = drain(own_stream_, deadline, "reading the proof");
  if (!read.empty()) return read;
  for (int q = 0; q < size_; ++q)
    if (q != rank_ && words[size_t(q)] != proof_token(nonce_, q, rank_))
      return str_cat("rank ", q, "'s write into rank ", rank_,
                     "'s window did not arrive although its signal did (peer access that the "
                     "driver reports but that does not deliver)");
  return "";
}

void IpcTransport::sync(const device::WindowSync* syncs, size_t n, cudaStream_t stream) {
  check_usable();
  std::vector<CUstreamBatchMemOpParams> ops(n);
  std::vector<Watched> waits;
  const auto deadline = after(timeout_s_);
  for (size_t i = 0; i < n; ++i) {
    const device::WindowSync& s = syncs[i];
    RC_CHECK_ARG(
        s.peer >= 0 && s.peer < size_ && s.peer != rank_ && s.channel < device::Windows::kChannels,
        "a signal on channel ", int(s.channel), " with rank ", s.peer);
    CUstreamBatchMemOpParams& op = ops[i];
    if (s.wait) {
      op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      op.waitValue.address = slot_address(rank_, s.channel, s.peer);
      op.waitValue.value = s.count;
      op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
      waits.push_back({{s.channel, s.peer, s.count}, deadline});
    } else {
      op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      op.writeValue.address = slot_address(s.peer, s.channel, rank_);
      op.writeValue.value = s.count;
      op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
  }
  // Watched before they are enqueued: from the moment a wait can hold the stream.
  if (!waits.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    watched_.insert(watched_.end(), waits.begin(), waits.end());
    wake_.notify_one();
  }
  DeviceScope scope(device_);
  const auto batch = reinterpret_cast<PFN_cuStreamBatchMemOp_v11070>(batch_mem_op_);
  for (size_t i = 0; i < n; i += kBatch) {
    const CUresult r = batch(stream, unsigned(std::min(kBatch, n - i)), ops.data() + i, 0);
    if (r != CUDA_SUCCESS) RC_THROW("cuStreamBatchMemOp failed: CUresult ", int(r));
  }
}

namespace {

void pack(const Signature& s, uint64_t (&words)[kPostWords]) {
  words[0] = uint64_t(s.coll) | uint64_t(s.dtype) << 8 | uint64_t(s.op) << 16 |
             uint64_t(s.algo) << 24 | uint64_t(s.p2p) << 32;
  words[1] = uint64_t(uint32_t(s.root));
  words[2] = s.seq;
  words[3] = s.count;
  words[4] = s.aux;
}

// A peer's words, shown as what they say: a peer that wrote garbage there is reported with it.
Signature unpack(const uint64_t (&words)[kPostWords]) {
  Signature s;
  s.coll = Collective(words[0] & 0xff);
  s.dtype = DType(words[0] >> 8 & 0xff);
  s.op = ReduceOp(words[0] >> 16 & 0xff);
  s.algo = Algorithm(words[0] >> 24 & 0xff);
  s.p2p = (words[0] >> 32 & 1) != 0;
  s.root = int32_t(uint32_t(words[1]));
  s.seq = words[2];
  s.count = words[3];
  s.aux = words[4];
  return s;
}

}  // namespace

void IpcTransport::agree(Signature sig) {
  check_usable();
  sig.seq = operations_++;
  uint64_t mine[kPostWords], theirs[kPostWords];
  pack(sig, mine);
  segment_.post(rank_, sig.seq, mine);
  const int peer = segment_.differing(rank_, sig.seq, mine, theirs);
  if (peer < 0) return;
  fail(ErrorKind::kMismatch,
       str_cat("mismatched operations: rank ", peer, " issued ", unpack(theirs).describe(),
               " but rank ", rank_, " issued ", sig.describe()));
  check_usable();  // raises this rank's reason, or that of a rank that gave up first
}

void IpcTransport::agree_message(int peer, bool send, Lane lane, Signature sig) {
  check_usable();
  RC_CHECK_ARG(peer >= 0 && peer < size_ && peer != rank_, "rank ", rank_, " has no peer ", peer);
  sig.seq = (send ? sends_ : recvs_)[size_t(lane) * size_t(size_) + size_t(peer)]++;
  uint64_t mine[kPostWords], theirs[kPostWords];
  pack(sig, mine);
  if (!segment_.message_differs(rank_, peer, send, lane, sig.seq, mine, theirs)) return;
  const int sender = send ? rank_ : peer, receiver = send ? peer : rank_;
  fail(ErrorKind::kMismatch,
       str_cat("mismatched messages: rank ", sender, " sent ",
               (send ? sig : unpack(theirs)).describe(), " to rank ", receiver, ", which received ",
               (send ? unpack(theirs) : sig).describe()));
  check_usable();
}

void IpcTransport::check_usable() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) RC_THROW_AS(kAborted, "the CUDA IPC transport is closed");
  if (failed_.empty()) {
    const int by = segment_.aborted_by();
    if (by < 0) return;
    failed_kind_ = kind_of(segment_.kind(by));
    failed_ = str_cat("rank ", by, " gave up: ", segment_.reason(by));
    release_all();
  }
  throw Error(failed_, failed_kind_);
}

void IpcTransport::fail(ErrorKind kind, const std::string& why) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failed_.empty()) return;
  if (segment_.abort(rank_, uint32_t(kind), why.c_str())) {
    failed_kind_ = kind;
    failed_ = why;
  } else {
    const int by = segment_.aborted_by();
    failed_kind_ = kind_of(segment_.kind(by));
    failed_ = str_cat("rank ", by, " gave up: ", segment_.reason(by));
  }
  release_all();
  wake_.notify_one();
}

void IpcTransport::release_all() noexcept {
  for (const Watched& w : watched_) segment_.release(rank_, &w.wait, 1);
}

void IpcTransport::watch() {
  auto peers_checked = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    // After a failure the released waits stay watched: a peer's signal still on its way may
    // lower a released slot below what a wait not yet reached holds out for.
    if (failed_.empty())
      watched_.erase(std::remove_if(watched_.begin(), watched_.end(),
                                    [&](const Watched& w) {
                                      return segment_.first_missing(rank_, &w.wait, 1) < 0;
                                    }),
                     watched_.end());
    if (watched_.empty()) {
      wake_.wait_for(lock, std::chrono::milliseconds(100));
      continue;
    }
    if (!failed_.empty()) {
      release_all();
    } else {
      const auto now = Clock::now();
      std::string why;
      ErrorKind kind = ErrorKind::kTimeout;
      const int by = segment_.aborted_by();
      if (by >= 0) {
        why = str_cat("rank ", by, " gave up: ", segment_.reason(by));
        kind = kind_of(segment_.kind(by));
      }
      for (const Watched& w : watched_)
        if (why.empty() && now > w.deadline)
          why = str_cat("rank ", w.wait.peer, " did not signal rank ", rank_, " within ",
                        timeout_s_, " s (signal ", w.wait.count, " on channel ", w.wait.channel,
                        ": it may have failed, or be running other collectives)");
      if (why.empty() && now - peers_checked > std::chrono::milliseconds(100)) {
        peers_checked = now;
        for (int q = 0; q < size_ && why.empty(); ++q)
          if (q != rank_ && kill(pid_t(pids_[size_t(q)]), 0) != 0 && errno == ESRCH) {
            why = str_cat("rank ", q, " (process ", pids_[size_t(q)], ") exited");
            kind = ErrorKind::kPeerLost;
          }
      }
      if (!why.empty()) {
        lock.unlock();
        fail(kind, why);
        lock.lock();
        continue;
      }
    }
    wake_.wait_for(lock, std::chrono::milliseconds(1));
  }
}

void IpcTransport::synchronize(cudaStream_t stream, double timeout_s) {
  DeviceScope scope(device_);
  const auto deadline = after(timeout_s);
  for (;;) {
    check_usable();
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) {
      check_usable();  // work released by a failure finished, but did not run as it should
      return;
    }
    if (status != cudaErrorNotReady) {
      cudaGetLastError();
      const std::string why = str_cat("the stream failed: ", cudaGetErrorName(status), ": ",
                                      cudaGetErrorString(status));
      fail(ErrorKind::kOther, why);
      check_usable();
    }
    if (Clock::now() > deadline) {
      fail(ErrorKind::kTimeout, str_cat("CUDA IPC work did not finish within ", timeout_s, " s"));
      check_usable();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void IpcTransport::abort() noexcept { fail(ErrorKind::kAborted, "aborted"); }

void IpcTransport::stop_watching() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    wake_.notify_one();
  }
  if (watchdog_.joinable()) watchdog_.join();
}

void IpcTransport::close() {
  {
    // After a failure nothing is released: see the destructor.
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_ || !failed_.empty()) return;
  }
  // Peers read this rank's window until their last collective ends: every rank says it is done
  // (a second signal on the proof's channel, from the host) and waits for the others before
  // its window goes.
  std::vector<Await> waits;
  for (int q = 0; q < size_; ++q)
    if (q != rank_) {
      segment_.signal(rank_, q, kProofChannel, 2);
      waits.push_back({kProofChannel, q, 2});
    }
  const auto deadline = after(timeout_s_);
  int missing = -1;
  const WaitResult got = wait_for(
      segment_, rank_, waits.data(), waits.size(), [&] { return Clock::now() > deadline; },
      [] { std::this_thread::sleep_for(std::chrono::microseconds(100)); }, &missing);
  if (got == WaitResult::kTimeout)
    fail(ErrorKind::kTimeout,
         str_cat("rank ", waits[size_t(missing)].peer, " did not close within ", timeout_s_, " s"));
  check_usable();  // raises if a rank gave up meanwhile
  stop_watching();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Watched& w : watched_)
      if (segment_.first_missing(rank_, &w.wait, 1) >= 0)
        RC_THROW("close() with work still waiting on rank ", w.wait.peer,
                 ": synchronize the streams first");
    closed_ = true;
  }
  free_resources();
}

void IpcTransport::free_resources() noexcept {
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  for (int q = 0; q < size_; ++q)
    if (windows_[size_t(q)] != nullptr) {
      if (q == rank_)
        cudaFree(windows_[size_t(q)]);
      else
        cudaIpcCloseMemHandle(windows_[size_t(q)]);
      windows_[size_t(q)] = nullptr;
    }
  if (segment_registered_) cudaHostUnregister(segment_base_);
  segment_registered_ = false;
  if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
  own_stream_ = nullptr;
  if (previous >= 0) cudaSetDevice(previous);
  if (segment_base_ != nullptr) munmap(segment_base_, segment_mapped_);
  segment_base_ = nullptr;
  if (segment_fd_ >= 0) ::close(segment_fd_);
  segment_fd_ = -1;
}

IpcTransport::~IpcTransport() {
  bool closed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed = closed_;
  }
  if (closed) return;
  const bool started = watchdog_.joinable();
  if (started) fail(ErrorKind::kAborted, "its communicator was dropped without close()");
  stop_watching();
  // A stream released by the abort may not have passed its waits yet, nor a peer's kernels
  // their reads of this window: the device memory and the registered segment stay until the
  // process exits. A transport refused before it started has neither in use.
  if (!started) free_resources();
}

}  // namespace ipc
}  // namespace ringcomm
