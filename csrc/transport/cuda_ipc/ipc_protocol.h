// The CUDA IPC transport's signals (ipc_transport.h), as plain functions over host memory that
// the transport, its watchdog and tests/native/ipc_protocol.cc share; no CUDA call here.
//
// Where the signals live. One segment of host memory (a memfd) for all ranks, mapped by every
// rank's process and registered with CUDA, so that it is written three ways: by a rank's stream
// (cuStreamWriteValue32 to a peer's slot, after the work before it), waited on by a rank's stream
// (cuStreamWaitValue32 on its own slot), and read and written by every rank's host threads with
// plain loads and stores. A segment has a header (the abort word) and one RankFlags per rank:
// slot signal[c][p] of rank q's flags holds the count of signals rank p has sent q on channel c.
//
// Sequence numbers. Every signal from p to q on a channel brings the count one up and writes the
// new count, never adds to the old; a wait for the k-th signal holds until the slot reaches k,
// compared cyclically (reached(): the comparison cuStreamWaitValue32 makes by default), so the
// count a slot still holds from the last operation (k - 1) never satisfies the next, and counts
// wrap at 2^32 without harm. Both sides derive k from the same plan
// (algorithms/window_plan.h), so no count ever crosses the wire but in its slot.
//
// Agreement. Before a rank enqueues an operation it posts the operation's signature, numbered,
// into the ring of posts in its flags, then reads its peers' posts of the same number: a post
// that differs is a mismatch, which the rank reports by giving up (below), so that every rank
// raises it. Posts are written and read by host threads only. Of two ranks that post the same
// operation at once, at least one sees the other's post: each writes its own before it reads
// (with a full fence between), the pattern of Dekker's lock. A peer more than kPosts operations
// ahead has written over the post; that operation is not compared, and a mismatch there ends in
// the timeout of the wait it leaves unmatched. Messages are agreed the same way between the two
// ranks alone, on each lane apart (device::Windows::Lane): the k-th send from p to q posts into
// p's ring of sends to q, the k-th receive at q from p into q's ring of receives from p, and each
// reads the other's.
//
// Abort. The header's abort word is 0 while every rank is well; the first rank that gives up
// (its timeout, a dead peer, abort()) writes why into its flags' reason and sets the word to
// 1 + its rank. Every rank's watchdog watches the word, and then releases its own stream's
// waits by storing into its slots the counts they wait for (release()): a stream never waits
// for a peer that will not come, and each rank raises naming the rank that gave up and why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "transport/device.h"

#if defined(__CUDACC__)
#define RC_IPC_HD __host__ __device__ __forceinline__
#else
#define RC_IPC_HD inline
#endif

namespace ringcomm {
namespace ipc {

constexpr int kMaxRanks = 64;
// Channels of signals: the window plans' (algorithms/window_plan.h), then the one the transport
// proves its peers' writes with when it starts.
constexpr int kProofChannel = device::Windows::kChannels;
constexpr int kChannels = kProofChannel + 1;
constexpr uint32_t kMagic = 0x72634950;  // "rcIP"
constexpr size_t kReasonBytes = 256;

struct alignas(64) SegmentHeader {
  uint32_t magic;
  uint32_t world;
  uint64_t nonce;  // rank 0's, checked by every rank that maps the segment
  uint32_t abort;  // 0, or 1 + the rank that gave up first
};

// The operations a rank's posts cover, and the words of one: an operation's signature, which the
// transport packs and this file compares as words.
constexpr int kPosts = 64;
constexpr int kPostWords = 5;
struct Post {
  uint64_t stamp;  // 1 + the operation's number once written, 0 while it is written
  uint64_t words[kPostWords];
};

constexpr int kMessagePosts = 8;

struct alignas(64) RankFlags {
  uint32_t signal[kChannels][kMaxRanks];  // [channel][sender]: the sender's count
  Post posts[kPosts];                     // operation k's in posts[k % kPosts]
  // On each lane, the k-th send to rank q in sends[lane][q][k % kMessagePosts], the k-th receive
  // from q in recvs[lane][q].
  Post sends[device::Windows::kLanes][kMaxRanks][kMessagePosts];
  Post recvs[device::Windows::kLanes][kMaxRanks][kMessagePosts];
  uint32_t kind;  // when this rank gave up: the ErrorKind, and why
  char reason[kReasonBytes];
};

// The byte size of a segment for `world` ranks, and where a slot lies in it.
constexpr size_t segment_bytes(int world) {
  return sizeof(SegmentHeader) + size_t(world) * sizeof(RankFlags);
}
constexpr size_t slot_offset(int receiver, int channel, int sender) {
  return sizeof(SegmentHeader) + size_t(receiver) * sizeof(RankFlags) +
         offsetof(RankFlags, signal) +
         (size_t(channel) * kMaxRanks + size_t(sender)) * sizeof(uint32_t);
}

// Whether a slot holding `value` has reached `target`: the cyclic comparison
// (int32_t)(value - target) >= 0 of CU_STREAM_WAIT_VALUE_GEQ.
RC_IPC_HD bool reached(uint32_t value, uint32_t target) { return int32_t(value - target) >= 0; }

// What a rank's start-up proof kernel writes into peer `to`'s window for `from`, and what `to`
// expects there: nothing a window holds by chance.
RC_IPC_HD uint64_t proof_token(uint64_t nonce, int from, int to) {
  return (nonce ^ (uint64_t(uint32_t(from)) << 32 | uint32_t(to))) * 0x9e3779b97f4a7c15ull | 1;
}

inline uint32_t load(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// A wait for the `count`-th signal from `peer` on `channel`.
struct Await {
  int channel;
  int peer;
  uint32_t count;
};

// A segment as one process maps it.
class Segment {
 public:
  Segment() = default;
  Segment(void* base, int world) : base_(static_cast<char*>(base)), world_(world) {}

  // Writes a new segment's header (the memory is zeroed: every count 0, no abort).
  void init(uint64_t nonce) {
    SegmentHeader* h = header();
    h->world = uint32_t(world_);
    h->nonce = nonce;
    store(&h->magic, kMagic);
  }
  // Whether the memory holds the segment `init(nonce)` made for this many ranks.
  bool matches(uint64_t nonce) const {
    const SegmentHeader* h = header();
    return load(&h->magic) == kMagic && h->world == uint32_t(world_) && h->nonce == nonce;
  }

  int world() const { return world_; }
  uint32_t* slot(int receiver, int channel, int sender) const {
    return reinterpret_cast<uint32_t*>(base_ + slot_offset(receiver, channel, sender));
  }
  // Rank `from`'s count-th signal to `to`, from a host thread.
  void signal(int from, int to, int channel, uint32_t count) const {
    store(slot(to, channel, from), count);
  }
  // The first of `waits` (rank `rank`'s) whose signal has not come, or -1 when all have.
  int first_missing(int rank, const Await* waits, size_t n) const {
    for (size_t i = 0; i < n; ++i)
      if (!reached(load(slot(rank, waits[i].channel, waits[i].peer)), waits[i].count))
        return int(i);
    return -1;
  }
  // Stores into `rank`'s slots the counts `waits` hold out for, wherever they have not come:
  // the waits, a stream's included, pass.
  void release(int rank, const Await* waits, size_t n) const {
    for (size_t i = 0; i < n; ++i) {
      uint32_t* s = slot(rank, waits[i].channel, waits[i].peer);
      if (!reached(load(s), waits[i].count)) store(s, waits[i].count);
    }
  }

  // Rank `rank` posts the signature of its operation number `op`.
  void post(int rank, uint64_t op, const uint64_t (&words)[kPostWords]) const {
    write(flags(rank)->posts[op % kPosts], op, words);
  }
  // Rank `peer`'s post of operation `op` into *words; false while the peer has not posted it,
  // is writing that slot, or has posted kPosts operations past it.
  bool posted(int peer, uint64_t op, uint64_t (&words)[kPostWords]) const {
    return read(flags(peer)->posts[op % kPosts], op, words);
  }
  // After rank `rank` posted operation `op` as `mine`: the first peer whose post of it differs,
  // its words in *theirs, or -1 where every post of it found there agrees.
  int differing(int rank, uint64_t op, const uint64_t (&mine)[kPostWords],
                uint64_t (&theirs)[kPostWords]) const {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  // this rank's post is seen before it reads
    for (int q = 0; q < world_; ++q) {
      if (q == rank || !posted(q, op, theirs)) continue;
      if (!same(mine, theirs)) return q;
    }
    return -1;
  }
  // Rank `rank` posts its k-th send to `peer` (`send`) or receive from it on `lane`, as `mine`;
  // then whether the peer's post of the matching receive or send differs, its words in *theirs
  // (false where it agrees or is not there yet).
  bool message_differs(int rank, int peer, bool send, int lane, uint64_t k,
                       const uint64_t (&mine)[kPostWords], uint64_t (&theirs)[kPostWords]) const {
    Post* own = send ? flags(rank)->sends[lane][peer] : flags(rank)->recvs[lane][peer];
    write(own[k % kMessagePosts], k, mine);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  // as in differing()
    const Post* other = send ? flags(peer)->recvs[lane][rank] : flags(peer)->sends[lane][rank];
    return read(other[k % kMessagePosts], k, theirs) && !same(mine, theirs);
  }

  // The rank that gave up first, or -1.
  int aborted_by() const { return int(load(&header()->abort)) - 1; }
  const char* reason(int rank) const { return flags(rank)->reason; }
  uint32_t kind(int rank) const { return flags(rank)->kind; }
  // Rank `rank` gives up because of `why` (an error of `kind`); true if it is the first, whose
  // kind and reason every rank reports.
  bool abort(int rank, uint32_t kind, const char* why) const {
    // The reason is written before the word can name this rank, and only read once it does.
    flags(rank)->kind = kind;
    char* reason = flags(rank)->reason;
    std::strncpy(reason, why, kReasonBytes - 1);
    reason[kReasonBytes - 1] = '\0';
    uint32_t none = 0;
    return __atomic_compare_exchange_n(&header()->abort, &none, uint32_t(rank + 1), false,
                                       __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  }

 private:
  // A post is a seqlock: one writer, the stamp cleared while the words change.
  static void write(Post& p, uint64_t op, const uint64_t (&words)[kPostWords]) {
    __atomic_store_n(&p.stamp, uint64_t(0), __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int i = 0; i < kPostWords; ++i) __atomic_store_n(&p.words[i], words[i], __ATOMIC_RELAXED);
    __atomic_store_n(&p.stamp, op + 1, __ATOMIC_RELEASE);
  }
  static bool read(const Post& p, uint64_t op, uint64_t (&words)[kPostWords]) {
    if (__atomic_load_n(&p.stamp, __ATOMIC_ACQUIRE) != op + 1) return false;
    for (int i = 0; i < kPostWords; ++i) words[i] = __atomic_load_n(&p.words[i], __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(&p.stamp, __ATOMIC_RELAXED) == op + 1;
  }
  static bool same(const uint64_t (&a)[kPostWords], const uint64_t (&b)[kPostWords]) {
    for (int i = 0; i < kPostWords; ++i)
      if (a[i] != b[i]) return false;
    return true;
  }

  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }
  RankFlags* flags(int rank) const {
    return reinterpret_cast<RankFlags*>(base_ + sizeof(SegmentHeader)) + rank;
  }

  char* base_ = nullptr;
  int world_ = 0;
};

enum class WaitResult { kReady, kTimeout, kAborted };

// Polls until every one of `waits` (rank `rank`'s) has come, the abort word is set or
// `expired()` says the time is up; `pause()` runs between polls. On kTimeout, *missing is the
// index of a wait that had not come.
template <typename Expired, typename Pause>
WaitResult wait_for(const Segment& segment, int rank, const Await* waits, size_t n, Expired expired,
                    Pause pause, int* missing) {
  for (;;) {
    if (segment.aborted_by() >= 0) return WaitResult::kAborted;
    const int first = segment.first_missing(rank, waits, n);
    if (first < 0) return WaitResult::kReady;
    if (expired()) {
      *missing = first;
      return WaitResult::kTimeout;
    }
    pause();
  }
}

}  // namespace ipc
}  // namespace ringcomm
