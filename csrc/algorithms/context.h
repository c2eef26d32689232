// What an algorithm works with: the mesh of transports, its operation's signature and deadline, and
// reusable scratch memory. Algorithms post sends/receives here and never see a socket.
#pragma once

#include <sys/mman.h>

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

// A receive whose bytes land in `staging` and are handed to `apply` once it completes
// (Context::recv_apply, on transports that cannot consume in place).
struct StagedApply {
  int64_t id;
  const char* staging;
  size_t bytes;
  Transport::Consumer apply;
};

// What a communicator's operations reuse from one to the next: the lists of requests a Context
// keeps (so that posting a message allocates nothing once they have grown), and a scratch arena.
//
// The arena hands out 64-byte aligned blocks that live until the operation ends (or until the
// ScratchFrame they were taken in closes): a bump pointer over chunks kept from one operation to
// the next, so that a steady stream of operations allocates nothing. An operation that needed a
// second chunk leaves one chunk of its whole footprint behind for the next. So that one large call
// does not hold its memory for the rest of the job, every kTrimPeriod operations a chunk more than
// twice the largest footprint of that period (or unused) is freed.
class Scratch {
 public:
  static constexpr int kTrimPeriod = 64;
  static constexpr size_t kAlign = 64;

  char* take(size_t bytes) {
    bytes = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    while (current_ < chunks_.size() && chunks_[current_].bytes - used_ < bytes) {
      before_ += chunks_[current_].bytes;  // the rest of this chunk stays unused
      ++current_;
      used_ = 0;
    }
    if (current_ == chunks_.size()) {
      const size_t last = chunks_.empty() ? 0 : chunks_.back().bytes;
      chunks_.push_back(allocate(std::max(bytes, 2 * last)));
    }
    char* block = chunks_[current_].data.get() + used_;
    used_ += bytes;
    footprint_ = std::max(footprint_, before_ + used_);
    return block;
  }

  struct Mark {
    size_t chunk, used, before;
  };
  Mark mark() const { return {current_, used_, before_}; }
  void rewind(const Mark& m) {
    current_ = m.chunk;
    used_ = m.used;
    before_ = m.before;
  }

  // After every operation: every block is free again.
  void operation_done() {
    period_peak_ = std::max(period_peak_, footprint_);
    if (chunks_.size() > 1) {  // one chunk of the whole footprint, for the next operation
      release_all();
      chunks_.push_back(allocate(footprint_));
    }
    if (++operations_ >= kTrimPeriod) {
      if (!chunks_.empty() && chunks_[0].bytes > 2 * period_peak_) release_all();
      operations_ = 0;
      period_peak_ = 0;
    }
    current_ = used_ = before_ = footprint_ = 0;
  }

  std::vector<Request> sends;  // a Context's sends not yet waited for
  std::vector<StagedApply> staged;

  // Bytes of chunks held now; from any thread (statistics).
  size_t bytes() const { return held_.load(std::memory_order_relaxed); }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  struct Chunk {
    std::unique_ptr<char, Free> data;
    size_t bytes = 0;
  };
  // Chunks of 4 MiB or more start on a 2 MiB boundary and ask for huge pages (honoured where
  // transparent huge pages are "madvise" or "always"): peers read them by single copy, which
  // pins them page by page (transport/shm/huge_pages.h), and reductions walk them.
  Chunk allocate(size_t bytes) {
    constexpr size_t kHugePage = 2u << 20;
    const bool huge = bytes >= 2 * kHugePage;
    void* p = nullptr;
    if (posix_memalign(&p, huge ? kHugePage : kAlign, bytes) != 0) throw std::bad_alloc();
    if (huge) madvise(p, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint: may fail
    held_ += bytes;
    return Chunk{std::unique_ptr<char, Free>(static_cast<char*>(p)), bytes};
  }
  void release_all() {
    for (const Chunk& c : chunks_) held_ -= c.bytes;
    chunks_.clear();
  }

  std::vector<Chunk> chunks_;
  size_t current_ = 0;    // chunk the next block comes from
  size_t used_ = 0;       // bytes of it handed out
  size_t before_ = 0;     // bytes of the chunks before it, used or skipped
  size_t footprint_ = 0;  // the most of before_ + used_ in this operation
  size_t period_peak_ = 0;
  int operations_ = 0;
  std::atomic<size_t> held_{0};
};

class Context {
 public:
  Context(Mesh& mesh, const Signature& sig, Clock::time_point deadline, Scratch& scratch,
          const Selector& selector)
      : mesh_(mesh),
        sig_(sig),
        ran_(sig.algo),
        deadline_(deadline),
        scratch_(scratch),
        selector_(selector),
        sends_(scratch.sends),
        staged_(scratch.staged) {
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
  // An operation that settles its way as it runs (a coalesced all-reduce: through the boards or
  // the pipeline) names it here, for its reports (the timeline); its messages keep their
  // signatures.
  void settle_algorithm(Algorithm algo) { ran_ = algo; }
  Algorithm algorithm_ran() const { return ran_; }
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
  // Sends `bytes` to `peer` as written by `produce(offset, dst, bytes)`: straight into the peer's
  // memory as room frees up where its transport takes that (shared memory), else into `staging`
  // at once and sent from there. The send-side twin of recv_apply: packing without a copy.
  void send_produce(int peer, char* staging, size_t bytes, const Signature& sig,
                    Transport::Producer produce) {
    if (mesh_.can_consume(global(peer))) {
      sends_.push_back(mesh_.post_produce(global(peer), bytes, sig, produce));
      return;
    }
    produce(0, staging, bytes);
    send(peer, staging, bytes, sig);
  }
  // Receives `bytes` from `peer` and hands them to `apply(offset, data, bytes)`, in order. Where
  // the peer's transport consumes in place (shared memory) `apply` reads its slots as they
  // arrive; elsewhere the bytes land in `staging` and wait() applies them in one piece. The
  // receive-side primitive of the algorithms: recv_reduce below, and unpacking into the
  // caller's buffers (coalesced.cc).
  Request recv_apply(int peer, char* staging, size_t bytes, const Signature& sig,
                     Transport::Consumer apply) {
    if (mesh_.can_consume(global(peer))) return mesh_.post_consume(global(peer), bytes, sig, apply);
    Request r = recv(peer, staging, bytes, sig);
    staged_.push_back({r.id, staging, bytes, apply});
    return r;
  }
  // Sends the bytes of `ranges`, back to back: read where they lie by a transport that takes
  // ranges (shared memory: copied into its slots, or read by the peer straight out of them by
  // single copy), else gathered into `staging` (ranges.bytes() long) and sent from there.
  void send_ranges(int peer, Ranges ranges, char* staging, const Signature& sig) {
    if (mesh_.takes_ranges(global(peer))) {
      sends_.push_back(mesh_.post_ranges(true, global(peer), ranges, sig));
      return;
    }
    const size_t bytes = ranges.bytes();
    RangeCursor(ranges).gather(staging, bytes, "pack");
    send(peer, staging, bytes, sig);
  }
  // Receives into `ranges`: where the bytes lie, or into `staging` and scattered by wait().
  Request recv_ranges(int peer, Ranges ranges, char* staging, const Signature& sig) {
    if (mesh_.takes_ranges(global(peer)))
      return mesh_.post_ranges(false, global(peer), ranges, sig);
    return recv_apply(peer, staging, ranges.bytes(), sig,
                      [ranges](size_t offset, const char* data, size_t bytes) {
                        RangeCursor into(ranges);
                        into.skip(offset);
                        into.scatter(data, bytes, "unpack");
                      });
  }
  // Receives `count` elements from `peer` and stores local (op) incoming (or, with
  // `incoming_first`, incoming (op) local) into `dst` (which may be `local`), through recv_apply.
  Request recv_reduce(int peer, char* dst, const char* local, char* staging, size_t count,
                      DType dtype, ReduceOp op, bool incoming_first) {
    // Packed, so that the consumer's captures fit its inline storage.
    struct How {
      uint32_t elem;
      int peer;
      DType dtype;
      ReduceOp op;
      bool incoming_first;
    } how{uint32_t(dtype_size(dtype)), peer, dtype, op, incoming_first};
    return recv_apply(peer, staging, count * how.elem, sig_,
                      [dst, local, how](size_t offset, const char* incoming, size_t bytes) {
                        trace::Span span("reduce", bytes, how.peer);
                        const char* mine = local + offset;
                        cpu::reduce(how.dtype, how.op, dst + offset,
                                    how.incoming_first ? incoming : mine,
                                    how.incoming_first ? mine : incoming, bytes / how.elem);
                      });
  }
  // Shared memory's boards among this context's ranks (Mesh::boards_reach): whether every rank
  // has one that every other reads in place; their size; writing this rank's, from one buffer or
  // gathered from ranges, for `readers` peers to read; `bytes` of rank `peer`'s at `offset`, to
  // be read. The bytes count as the payload sent and received, as messages' do.
  bool has_boards() const {
    return members_.empty() ? mesh_.boards_everywhere() : mesh_.boards_reach(members_);
  }
  size_t board_bytes() const { return mesh_.board_bytes(); }
  void write_board(size_t offset, Ranges from, int readers) {
    mesh_.write_board(offset, from, readers);
  }
  void write_board(size_t offset, const void* src, size_t n, int readers) {
    const iovec one{const_cast<void*>(src), n};
    write_board(offset, Ranges{&one, 1}, readers);
  }
  const char* read_board(int peer, size_t offset, size_t bytes) {
    return mesh_.read_board(global(peer), offset, bytes);
  }
  void set_current(const Signature& sig) { mesh_.set_current(sig); }
  void wait(Request r) {
    mesh_.wait(r, deadline_);
    applied(r);
  }
  // Waits until any of `requests` completes and returns its position: for messages whose order
  // of arrival is not known (which rank comes last).
  size_t wait_any(const std::vector<Request>& requests) {
    const size_t i = mesh_.wait_any(requests.data(), requests.size(), deadline_);
    applied(requests[i]);
    return i;
  }
  // Sends posted so far and not yet waited for. take_sends moves those posted after `mark` (an
  // earlier sends_posted()) to `out`, for the caller to wait for: a pipeline that reuses one
  // slice's buffers waits for that slice's sends alone, not for every send posted since.
  size_t sends_posted() const { return sends_.size(); }
  void take_sends(size_t mark, std::vector<Request>& out) {
    out.insert(out.end(), sends_.begin() + long(mark), sends_.end());
    sends_.resize(mark);
  }
  void finish() {
    for (Request r : sends_) mesh_.wait(r, deadline_);
    sends_.clear();
  }
  // A 64-byte aligned block of scratch memory, valid until the operation ends or the enclosing
  // ScratchFrame closes.
  char* scratch(size_t bytes) { return scratch_.take(bytes); }
  Scratch& scratch_arena() { return scratch_; }

 private:
  int global(int peer) const { return members_.empty() ? peer : members_[size_t(peer)]; }
  // A completed receive posted by recv_apply with staging: its bytes go to its consumer now.
  void applied(Request r) {
    for (size_t i = 0; i < staged_.size(); ++i) {
      if (staged_[i].id != r.id) continue;
      const StagedApply s = staged_[i];
      staged_.erase(staged_.begin() + long(i));
      s.apply(0, s.staging, s.bytes);
      break;
    }
  }

  Mesh& mesh_;
  Signature sig_;
  Algorithm ran_;  // what the operation ran, for its reports: sig_.algo unless settled
  Clock::time_point deadline_;
  Scratch& scratch_;
  const Selector& selector_;
  std::vector<Request>& sends_;
  std::vector<StagedApply>& staged_;  // recv_apply's receives to apply once waited for
  std::vector<int> members_;          // a view's ranks (empty: all, rank r at index r)
  int index_ = -1;                    // this rank's index in members_
};

// Scratch taken while a frame is open is given back when it closes: an algorithm that runs as
// one step of another (the ring inside hierarchical, the gathers inside sparse) leaves the arena
// as it found it, so steps that follow reuse the same memory. Blocks returned to the caller must
// be taken before the frame opens.
class ScratchFrame {
 public:
  explicit ScratchFrame(Context& ctx) : scratch_(ctx.scratch_arena()), mark_(scratch_.mark()) {}
  ~ScratchFrame() { scratch_.rewind(mark_); }
  ScratchFrame(const ScratchFrame&) = delete;
  ScratchFrame& operator=(const ScratchFrame&) = delete;

 private:
  Scratch& scratch_;
  Scratch::Mark mark_;
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
  int size() const { return int(offsets_.size()) - 1; }
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

// The largest power of two <= n (n >= 1): the butterfly of recursive doubling and
// halving-doubling, which fold the other ranks into it.
inline int butterfly_size(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

// Number of pieces of at most `piece` elements covering `count` (at least 1, so that an empty
// message still travels and is checked against the peer's signature).
inline size_t piece_count(size_t count, size_t piece) {
  return count == 0 ? 1 : (count + piece - 1) / piece;
}

}  // namespace ringcomm
