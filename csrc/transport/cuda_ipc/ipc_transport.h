// CUDA IPC as a device transport (transport/device.h): windows between the processes of one
// host, several of them on one GPU if need be (which NCCL refuses). Each rank allocates its
// window with cudaMalloc and exports it (cudaIpcGetMemHandle); every peer maps it
// (cudaIpcOpenMemHandle), so that the window plans' kernels read and write any rank's window.
// The signals between ranks live in host memory that every rank maps and registers with CUDA
// (ipc_protocol.h has the layout and the rules).
//
// Why signals in host memory, waited on by stream memory operations. Ranks that share a GPU
// without MPS do not run at once: the GPU gives each process a time slice. A kernel that spins
// on a peer's flag holds the GPU for the rest of its slice while the peer cannot run, and one
// that can finish only when a peer's kernel runs beside it may never finish. So no kernel here
// waits for anything: a wait is a cuStreamWaitValue32 on this rank's slot, held in the stream's
// front end, which occupies no SM, and a signal is a cuStreamWriteValue32 into the peer's slot,
// which lands after the work before it on the stream. Every kernel then runs to its end on its
// own, whatever the GPU schedules when, with MPS or without. The slots are in host memory, not
// device memory, so that the host can read and write them directly: the watchdog sees which
// peer a stream waits for, and it releases a wait with a plain store. A release written
// through the GPU could queue behind the very wait it should release (streams share a
// process's few hardware queues).
//
// Every wait is bounded. The watchdog thread holds each wait enqueued with its deadline (the
// communicator's timeout from when it was enqueued). When one passes, or a peer's process
// exits, or any rank sets the abort word, this rank sets the word (if it is the first, with its
// reason), releases its own stream's waits, and every later call raises, naming the rank that
// gave up and why. Peers do the same on seeing the word. What the released operations wrote is
// undefined; nothing hangs.
//
// Before a transport is used, every rank proves that its peers' writes arrive: a kernel writes a
// token into every peer's window and a stream signal follows it; each rank waits for every
// peer's signal and checks every token (a driver that reports peer access which then never
// delivers fails here, not in a collective). Any failure on any rank, in setting up or in the
// proof, refuses the transport on every rank with the same reason.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "transport/cuda_ipc/ipc_protocol.h"
#include "transport/device.h"

namespace ringcomm {
namespace ipc {

// Every rank's bytes, in rank order, for this rank's `mine`: one round of an all-gather through
// whatever channel the ranks share (ringcomm/device.py: the torch Store). Every rank calls it
// the same number of times.
using Exchange = std::function<std::vector<std::string>(const std::string& mine)>;

class IpcTransport final : public device::DeviceTransport, public device::Windows {
 public:
  // Connects `rank` of `size` on CUDA device `device`, with windows of `window_bytes`; waits and
  // signals time out after `timeout_s`. Returns nullptr and sets *refused when the transport
  // cannot serve these ranks (the same reason on every rank); raises only if an exchange fails.
  static std::unique_ptr<IpcTransport> connect(int rank, int size, int device, size_t window_bytes,
                                               double timeout_s, const Exchange& exchange,
                                               std::string* refused);
  ~IpcTransport() override;
  IpcTransport(const IpcTransport&) = delete;
  IpcTransport& operator=(const IpcTransport&) = delete;

  const char* name() const override { return "cuda_ipc"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const override { return device_; }
  // Every rank of the communicator: connect() refuses unless all are reached.
  bool can_connect(int peer) const override { return peer >= 0 && peer < size_; }
  device::Windows* windows() override { return this; }
  void check_usable() override;
  void synchronize(cudaStream_t stream, double timeout_s) override;
  void close() override;
  void abort() noexcept override;

  size_t window_bytes() const override { return window_bytes_; }
  char* window(int rank) const override { return windows_[size_t(rank)] + kProofBytes; }
  void sync(const device::WindowSync* syncs, size_t n, cudaStream_t stream) override;
  void agree(Signature sig) override;
  void agree_message(int peer, bool send, Lane lane, Signature sig) override;

 private:
  // A window starts with the proof's words, one per writer; the plans' window follows.
  static constexpr size_t kProofBytes = 4096;
  struct Watched {
    Await wait;
    std::chrono::steady_clock::time_point deadline;
  };

  IpcTransport(int rank, int size, int device, size_t window_bytes, double timeout_s);
  // The steps of connect(): each returns "" or why this rank cannot go on.
  std::string prepare(uint64_t nonce, std::string* info);
  std::string attach(const std::vector<std::string>& infos);
  struct Info;  // what each rank tells the others in the first exchange
  std::string map_windows(const std::vector<Info>& all);
  std::string prove();
  std::string prove_writes();
  // Gives up for `why` (once): sets the abort word, releases this rank's waits.
  void fail(ErrorKind kind, const std::string& why) noexcept;
  void watch();  // the watchdog thread
  void stop_watching() noexcept;
  void release_all() noexcept;  // this rank's watched waits, released (mutex_ held)
  void free_resources() noexcept;
  // The device address of a slot, for stream memory operations.
  uint64_t slot_address(int receiver, int channel, int sender) const;

  const int rank_, size_, device_;
  const size_t window_bytes_;
  const double timeout_s_;
  std::vector<char*> windows_;  // every rank's, as this process maps it; own first allocated
  std::vector<long> pids_;      // every rank's process
  Segment segment_;             // the signals, mapped in this process
  void* segment_base_ = nullptr;
  size_t segment_mapped_ = 0;
  bool segment_registered_ = false;
  char* segment_device_ = nullptr;       // the segment as the device addresses it
  int segment_fd_ = -1;                  // rank 0's memfd
  uint64_t nonce_ = 0;                   // rank 0's, in the segment's header and the proof's tokens
  cudaStream_t own_stream_ = nullptr;    // the proof's
  void* batch_mem_op_ = nullptr;         // cuStreamBatchMemOp, from the driver
  uint64_t operations_ = 0;              // agree()'s calls: the number of the next post
  std::vector<uint64_t> sends_, recvs_;  // agree_message()'s calls, per lane and peer

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Watched> watched_;
  bool stopping_ = false, closed_ = false;
  ErrorKind failed_kind_ = ErrorKind::kOther;
  std::string failed_;  // why this transport can no longer be used; "" while it can
  std::thread watchdog_;
};

}  // namespace ipc
}  // namespace ringcomm
