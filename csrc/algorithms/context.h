// What an algorithm works with: the mesh of transports, its operation's signature and deadline, and
// reusable scratch memory. Algorithms post sends/receives here and never see a socket.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <vector>

#include "common/dtype.h"
#include "common/trace.h"
#include "algorithms/select.h"
#include "kernels/cpu/reduce.h"
#include "transport/mesh.h"

namespace ringcomm {

// A receive whose bytes land in `staging` and are reduced into `dst` once it completes
// (Context::recv_reduce).
struct StagedReduce {
  int64_t id;
  char* dst;
  const char* local;
  const char* staging;
  size_t count;
  DType dtype;
  ReduceOp op;
};

// What a communicator's operations reuse from one to the next: the lists of requests a Context
// keeps (so that posting a message allocates nothing once they have grown), and 64-byte aligned
// scratch buffers, indexed by slot. A buffer grows to
// what an operation asks of it and is kept for the next; so that one large call does not hold its
// memory for the rest of the job, every kTrimPeriod operations a buffer more than twice the
// largest size asked of it in that period (or not used at all) is freed, and reallocated at the
// size the next operation asks for.
class Scratch {
 public:
  static constexpr int kTrimPeriod = 64;

  char* get(int slot, size_t bytes) {
    if (slot >= int(buffers_.size())) buffers_.resize(slot + 1);
    Buffer& b = buffers_[slot];
    b.peak = std::max(b.peak, bytes);
    if (b.bytes < bytes) {
      release(b);  // before the new one: the old and the new never coexist
      void* p = nullptr;
      if (posix_memalign(&p, 64, bytes) != 0) throw std::bad_alloc();
      b.data.reset(static_cast<char*>(p));
      b.bytes = bytes;
      held_ += bytes;
    }
    return b.data.get();
  }

  // After every operation.
  void operation_done() {
    if (++operations_ < kTrimPeriod) return;
    operations_ = 0;
    for (Buffer& b : buffers_) {
      if (b.bytes > 2 * b.peak) release(b);
      b.peak = 0;
    }
  }

  std::vector<Request> sends;  // a Context's sends not yet waited for
  std::vector<StagedReduce> staged;

  // Bytes of buffers held now; from any thread (statistics).
  size_t bytes() const { return held_.load(std::memory_order_relaxed); }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  struct Buffer {
    std::unique_ptr<char, Free> data;
    size_t bytes = 0;
    size_t peak = 0;  // the most asked of it since the last trim
  };
  void release(Buffer& b) {
    held_ -= b.bytes;
    b.data.reset();
    b.bytes = 0;
  }
  std::vector<Buffer> buffers_;
  int operations_ = 0;
  std::atomic<size_t> held_{0};
};

class Context {
 public:
  Context(Mesh& mesh, const Signature& sig, Clock::time_point deadline, Scratch& scratch,
          const Selector& selector)
      : mesh_(mesh), sig_(sig), deadline_(deadline), scratch_(scratch), selector_(selector),
        sends_(scratch.sends), staged_(scratch.staged) {
    sends_.clear();  // what a failed operation left
    staged_.clear();
  }

  // A view of some ranks (`members`, global ranks in view order, this rank among them): rank(),
  // size() and every peer are indices into the view. It shares this context's sends, so finish()
  // on either waits for all of them.
  Context view(const std::vector<int>& members) const {
    Context v(*this);
    v.members_ = members;
    v.index_ = int(std::find(members.begin(), members.end(), mesh_.rank()) - members.begin());
    RC_CHECK_ARG(v.index_ < int(members.size()), "rank ", mesh_.rank(), " is not in the view");
    return v;
  }
  int rank() const { return members_.empty() ? mesh_.rank() : index_; }
  int size() const { return members_.empty() ? mesh_.world_size() : int(members_.size()); }
  const Signature& signature() const { return sig_; }
  // The cost model, for algorithms that choose their way once they know the sizes.
  const Selector& selector() const { return selector_; }

  // Sends complete in the background; finish() waits for all of them.
  void send(int peer, const void* data, size_t bytes) { send(peer, data, bytes, sig_); }
  Request recv(int peer, void* data, size_t bytes) { return recv(peer, data, bytes, sig_); }
  // A task made of several operations (the buckets of a coalesced collective, each with its own
  // sequence number) posts each one's messages under that operation's signature, and names the
  // oldest one still in flight as current: messages of later ones may arrive early.
  void send(int peer, const void* data, size_t bytes, const Signature& sig) {
    sends_.push_back(mesh_.post_send(global(peer), data, bytes, sig));
  }
  Request recv(int peer, void* data, size_t bytes, const Signature& sig) {
    return mesh_.post_recv(global(peer), data, bytes, sig);
  }
  // Receives `count` elements from `peer` and stores local (op) incoming into `dst` (which may
  // be `local`). Where the peer's transport consumes in place (shared memory) the reduction reads
  // its slots as they arrive; elsewhere the bytes land in `staging` and are reduced by wait().
  Request recv_reduce(int peer, char* dst, const char* local, char* staging, size_t count,
                      DType dtype, ReduceOp op) {
    if (mesh_.can_consume(global(peer))) {
      const size_t e = dtype_size(dtype);
      return mesh_.post_consume(global(peer), count * e, sig_,
                                [=](size_t offset, const char* incoming, size_t bytes) {
                                  trace::Span span("reduce", bytes, peer);
                                  cpu::reduce(dtype, op, dst + offset, local + offset, incoming,
                                              bytes / e);
                                });
    }
    Request r = recv(peer, staging, count * dtype_size(dtype));
    staged_.push_back({r.id, dst, local, staging, count, dtype, op});
    return r;
  }
  void set_current(const Signature& sig) { mesh_.set_current(sig); }
  void wait(Request r) {
    mesh_.wait(r, deadline_);
    for (size_t i = 0; i < staged_.size(); ++i) {
      const StagedReduce& s = staged_[i];
      if (s.id != r.id) continue;
      trace::Span span("reduce", s.count * dtype_size(s.dtype));
      cpu::reduce(s.dtype, s.op, s.dst, s.local, s.staging, s.count);
      staged_.erase(staged_.begin() + long(i));
      break;
    }
  }
  void finish() {
    for (Request r : sends_) mesh_.wait(r, deadline_);
    sends_.clear();
  }
  char* scratch(int slot, size_t bytes) { return scratch_.get(slot, bytes); }

 private:
  int global(int peer) const { return members_.empty() ? peer : members_[size_t(peer)]; }

  Mesh& mesh_;
  Signature sig_;
  Clock::time_point deadline_;
  Scratch& scratch_;
  const Selector& selector_;
  std::vector<Request>& sends_;
  std::vector<StagedReduce>& staged_;  // recv_reduce's receives to reduce once waited for
  std::vector<int> members_;  // a view's ranks (empty: all, rank r at index r)
  int index_ = -1;            // this rank's index in members_
};

// Pieces of `count` elements, one per rank: balanced (the first count % n get one more) or
// given explicitly (all_gatherv).
class Segments {
 public:
  Segments(size_t count, int n) : offsets_(n + 1) {
    for (int i = 0; i < n; ++i)
      offsets_[i + 1] = offsets_[i] + count / n + (size_t(i) < count % n ? 1 : 0);
  }
  explicit Segments(const std::vector<size_t>& counts) : offsets_(counts.size() + 1) {
    for (size_t i = 0; i < counts.size(); ++i) offsets_[i + 1] = offsets_[i] + counts[i];
  }
  size_t offset(int i) const { return offsets_[i]; }
  size_t count(int i) const { return offsets_[i + 1] - offsets_[i]; }
  size_t max_count() const {
    size_t m = 0;
    for (size_t i = 0; i + 1 < offsets_.size(); ++i) m = std::max(m, count(int(i)));
    return m;
  }

 private:
  std::vector<size_t> offsets_;
};

inline int mod(int a, int n) { return ((a % n) + n) % n; }

// Number of pieces of at most `piece` elements covering `count` (at least 1, so that an empty
// message still travels and is checked against the peer's signature).
inline size_t piece_count(size_t count, size_t piece) {
  return count == 0 ? 1 : (count + piece - 1) / piece;
}

}  // namespace ringcomm
