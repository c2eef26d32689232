// Device transports: how bytes move between the CUDA buffers of ranks, in the order of a CUDA
// stream. A device transport knows peers, device ranges and signals, never a collective: the
// device executor (device/executor.h) runs the algorithms' step lists over it with ringcomm's
// kernels, as the host algorithms run over the mesh's transports (transport/mesh.h).
//
// A transport offers one or both of two ways of moving bytes:
//   Messages: sends and receives of a device range to or from a peer, posted on a stream in
//     groups whose messages complete together (algorithms/stream_plan.h makes the groups).
//     NCCL's ncclSend/ncclRecv (transport/nccl/).
//   Windows: every rank's window, a device buffer, addressable by this rank's kernels, and
//     signals on a stream that say when what one rank wrote there may be read, or overwritten
//     (algorithms/window_plan.h orders the writes, reads and signals). CUDA IPC
//     (transport/cuda_ipc/).
//
// No CUDA header here: the core's window plans (plain C++) use WindowSync, and a stream is the
// runtime's cudaStream_t under its own name.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/signature.h"

struct CUstream_st;

namespace ringcomm {
namespace device {

using Stream = CUstream_st*;  // cudaStream_t

class Messages {
 public:
  // Messages posted between group_start() and group_end() complete together (a receive may
  // pair with a send of the same group on the peer); each call enqueues on `stream` only.
  virtual void group_start() = 0;
  virtual void send(const void* data, size_t bytes, int peer, Stream stream) = 0;
  virtual void recv(void* data, size_t bytes, int peer, Stream stream) = 0;
  virtual void group_end() = 0;

 protected:
  ~Messages() = default;
};

// A signal to a peer, or a wait for one. Rank p's signals to rank q on a channel are counted;
// a signal carries the count it brings the total to, and a wait holds the stream until the
// total from that peer on that channel reaches `count` (cyclically: counts wrap at 2^32).
struct WindowSync {
  bool wait;
  uint8_t channel;
  int peer;
  uint32_t count;
};

class Windows {
 public:
  static constexpr int kChannels = 5;
  virtual size_t window_bytes() const = 0;
  // Rank r's window, as this rank's device addresses it.
  virtual char* window(int rank) const = 0;
  // Enqueues `n` signals and waits on `stream`, in order. A signal lands after every write of
  // the work before it on the stream; work after a wait sees every write the peer made before
  // its signal.
  virtual void sync(const WindowSync* syncs, size_t n, Stream stream) = 0;
  // Called by every rank before each operation it runs over the windows, in the same order:
  // compares `sig` (its seq is the transport's to number) with what the peers that have reached
  // this operation called it with. Where one differs, gives up, so that every rank raises, and
  // raises an ErrorKind::kMismatch naming the peer and both operations.
  virtual void agree(Signature sig) = 0;
  // Messages numbered apart: sends and receives (kPointToPoint), and the parts of collectives'
  // exchanges (kCollective), which follow the collectives' order.
  enum Lane : uint8_t { kPointToPoint = 0, kCollective = 1 };
  static constexpr int kLanes = 2;
  // Called before each send to `peer` (`send`) or receive from it, in the order of the sends to
  // it, or of the receives from it, on `lane`: compares `sig` (its seq is the transport's to
  // number, per peer, way and lane) with what the peer called its matching receive or send with;
  // where they differ, gives up as agree() does.
  virtual void agree_message(int peer, bool send, Lane lane, Signature sig) = 0;

 protected:
  ~Windows() = default;
};

class DeviceTransport {
 public:
  virtual ~DeviceTransport() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int device() const = 0;
  // Whether this transport reaches `peer`.
  virtual bool can_connect(int peer) const = 0;
  // The ways it moves bytes; nullptr where it does not offer that one.
  virtual Messages* messages() { return nullptr; }
  virtual Windows* windows() { return nullptr; }
  // Raises if the transport can no longer be used (closed, aborted, failed): called before work
  // is enqueued.
  virtual void check_usable() = 0;
  // Waits for the work enqueued on `stream`. Raises if the transport failed meanwhile or
  // `timeout_s` passes, aborting it first.
  virtual void synchronize(Stream stream, double timeout_s) = 0;
  // Releases the transport once its work is done; abort() drops it at once, releasing every
  // stream waiting on a peer. Neither may be used after; abort() never throws.
  virtual void close() = 0;
  virtual void abort() noexcept = 0;
};

}  // namespace device
}  // namespace ringcomm
