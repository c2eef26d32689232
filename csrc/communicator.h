// A communicator: one rank's view of a group of world_size processes. It owns the transports, a
// progress thread that runs operations in issue order, sequence numbers, timeouts, and the
// broken state after an error.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "algorithms/algorithms.h"
#include "algorithms/reduction_order.h"
#include "algorithms/registered.h"
#include "algorithms/retune.h"
#include "transport/mesh.h"

namespace ringcomm {

struct CoalescedAllReduce;  // algorithms/coalesced.h

// What one operation cost (Work::stats) or all operations of one kind (Communicator::stats).
// Sends and receives are counted where they are posted and take no time of their own here.
struct OpStats {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;  // payload, no headers
  int64_t queued_ns = 0;                        // from the call until a thread began running it
  int64_t run_ns = 0;                           // running it
  int64_t idle_ns = 0;              // of run_ns: waiting with nothing to move (for peers, mostly)
  const char* algorithm = nullptr;  // what one operation ran (none in a kind's totals)
  void add(const OpStats& o) {
    calls += o.calls;
    bytes_sent += o.bytes_sent;
    bytes_received += o.bytes_received;
    queued_ns += o.queued_ns;
    run_ns += o.run_ns;
    idle_ns += o.idle_ns;
  }
};

// Totals of one kind of operation. Written only by the thread running operations (one at a
// time), read from any: relaxed loads and stores, no lock or read-modify-write on every call.
class OpTotals {
 public:
  void add(const OpStats& o) {
    bump(calls_, o.calls);
    bump(bytes_sent_, o.bytes_sent);
    bump(bytes_received_, o.bytes_received);
    bump(queued_ns_, o.queued_ns);
    bump(run_ns_, o.run_ns);
    bump(idle_ns_, o.idle_ns);
  }
  OpStats load() const {
    OpStats o;
    o.calls = calls_.load(std::memory_order_relaxed);
    o.bytes_sent = bytes_sent_.load(std::memory_order_relaxed);
    o.bytes_received = bytes_received_.load(std::memory_order_relaxed);
    o.queued_ns = queued_ns_.load(std::memory_order_relaxed);
    o.run_ns = run_ns_.load(std::memory_order_relaxed);
    o.idle_ns = idle_ns_.load(std::memory_order_relaxed);
    return o;
  }

 private:
  template <typename T>
  static void bump(std::atomic<T>& total, T by) {
    total.store(total.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }
  std::atomic<uint64_t> calls_{0}, bytes_sent_{0}, bytes_received_{0};
  std::atomic<int64_t> queued_ns_{0}, run_ns_{0}, idle_ns_{0};
};

// Completion handle of one operation.
class Work {
 public:
  // `progress_thread_of`: the communicator whose progress thread finishes this operation.
  explicit Work(const void* progress_thread_of = nullptr) : owner_(progress_thread_of) {}
  // Waits; returns false if `timeout_s` (negative: forever) passes first. Throws ringcomm::Error
  // if the operation failed, or at once if called from the thread that would finish it.
  bool wait(double timeout_s);
  bool is_completed();
  std::string error();  // empty unless failed
  ErrorKind error_kind();
  // Runs `fn` once the operation has finished (at once if it already has), on whichever thread
  // finishes it.
  void on_finished(std::function<void()> fn);
  // The rank a receive from any source took its message from (-1 before, or for other work).
  int source() const { return source_; }
  void set_source(int rank) { source_ = rank; }

  void finish();                    // succeeded
  void finish(const Error& error);  // failed
  // A collective's cost, set before it finishes (zero for sends and receives).
  OpStats stats() const { return stats_; }
  void set_stats(const OpStats& stats) { stats_ = stats; }

 private:
  void finish(const Error* error);  // null: succeeded
  const void* owner_;
  OpStats stats_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::atomic<int> source_{-1};
  std::string error_;
  ErrorKind error_kind_ = ErrorKind::kOther;
  std::vector<std::function<void()>> callbacks_;
};
using WorkPtr = std::shared_ptr<Work>;

// Name of the PyCapsule that carries a std::shared_ptr<Communicator>* between the extensions.
constexpr const char* kCommunicatorCapsule = "ringcomm.Communicator";

class Communicator {
 public:
  // Listens at once; the address must be published to the other ranks before connect().
  Communicator(int rank, int world_size, double timeout_s, const std::string& master_addr);
  ~Communicator();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::string address() const { return mesh_->address(); }
  // The transport that carries data to `peer` ("tcp", "shm", "self").
  const char* transport_of(int peer) const { return mesh_->transport_of(peer); }
  void connect(const std::vector<std::string>& addresses, const std::string& token);
  // connect() through a key-value store shared by the ranks (torch's Store, behind a prefix
  // private to this communicator): each rank publishes its address under "addr/<rank>", rank 0
  // a random token under "token" (both under "attempt<N>/" when TORCHELASTIC_RESTART_COUNT is
  // N); `get` waits until its key exists, or throws.
  struct KeyValueStore {
    std::function<void(const std::string& key, const std::string& value)> set;
    std::function<std::string(const std::string& key)> get;
  };
  void rendezvous(const KeyValueStore& store);

  WorkPtr all_reduce(void* buf, size_t count, DType dtype, ReduceOp op, Algorithm algo, bool async);
  WorkPtr reduce_scatter(void* out, const void* in, size_t count, DType dtype, ReduceOp op,
                         bool async);
  WorkPtr all_gather(void* out, const void* in, size_t count, DType dtype, bool async);
  WorkPtr all_gatherv(void* out, const void* in, const std::vector<size_t>& counts, DType dtype,
                      bool async);
  WorkPtr broadcast(void* buf, size_t count, DType dtype, int root, bool async);
  WorkPtr reduce(void* buf, size_t count, DType dtype, ReduceOp op, int root, bool async);
  WorkPtr barrier(bool async);
  // The same collectives by an algorithm registered by name (algorithms/registered.h): its lists
  // for this world size, checked on the caller's thread before anything is sent.
  WorkPtr all_reduce_registered(void* buf, size_t count, DType dtype, ReduceOp op,
                                const std::string& algorithm, bool async);
  WorkPtr reduce_scatter_registered(void* out, const void* in, size_t count, DType dtype,
                                    ReduceOp op, const std::string& algorithm, bool async);
  WorkPtr all_gather_registered(void* out, const void* in, size_t count, DType dtype,
                                const std::string& algorithm, bool async);
  WorkPtr broadcast_registered(void* buf, size_t count, DType dtype, int root,
                               const std::string& algorithm, bool async);
  WorkPtr reduce_registered(void* buf, size_t count, DType dtype, ReduceOp op, int root,
                            const std::string& algorithm, bool async);
  // Rooted exchanges of `count` elements per rank; `outputs` (gather) and `inputs` (scatter) hold
  // one buffer per rank and are used only on the root.
  WorkPtr gather(const void* in, const std::vector<void*>& outputs, size_t count, DType dtype,
                 int root, bool async);
  WorkPtr scatter(const std::vector<const void*>& inputs, void* out, size_t count, DType dtype,
                  int root, bool async);
  // inputs[q] (in_counts[q] elements) goes to rank q; outputs[q] receives rank q's block.
  WorkPtr all_to_all(const std::vector<const void*>& inputs, const std::vector<size_t>& in_counts,
                     const std::vector<void*>& outputs, const std::vector<size_t>& out_counts,
                     DType dtype, bool async);
  // Dense sum/average of every rank's k (index, value) pairs into `out` (algorithms/sparse.cc).
  WorkPtr sparse_all_reduce(const int32_t* indices, const void* values, size_t k, DType value_dtype,
                            void* out, size_t numel, DType out_dtype, ReduceOp op, Algorithm algo,
                            bool async);
  // The k-th send from a to b pairs with the k-th receive at b from a; `tag` travels in the
  // signature, so a pair whose tags differ fails with both described (tags order nothing).
  WorkPtr send(const void* buf, size_t count, DType dtype, int peer, bool async, uint32_t tag = 0);
  WorkPtr recv(void* buf, size_t count, DType dtype, int peer, bool async, uint32_t tag = 0);
  // A receive from whichever peer's next message arrives first (Work::source() names it): the
  // first peer whose next send to this rank has arrived, looked at in turn after the last one
  // chosen. It takes that peer's next message in order, like a receive naming it would; a
  // receive naming a peer, issued while this one waits, takes that peer's next message first.
  WorkPtr recv_any(void* buf, size_t count, DType dtype, bool async, uint32_t tag = 0);

  // Coalesced collectives (communicator_coalesced.cc, algorithms/coalesced.cc): the buffers are
  // grouped by dtype (in order of first appearance), laid back to back, cut into buckets of at
  // most `bucket_bytes` (one operation on the wire each) and pipelined. Results are those of one
  // collective per buffer, bitwise (docs/algorithms.md). Buffers must not overlap; an empty list
  // moves nothing.
  struct BufferRef {
    void* data;
    size_t count;
    DType dtype;
  };
  // How all_reduce_coalesced packs: float32 buffers travel as `float32_wire` (float16 or bfloat16
  // compress them), and every value is multiplied by `prescale` as it is packed (the 1/world_size
  // of an average taken before the sum, as DDP does).
  struct FusedReduceOptions {
    DType float32_wire = DType::kFloat32;
    double prescale = 1.0;
  };
  WorkPtr all_reduce_coalesced(const std::vector<BufferRef>& buffers, ReduceOp op,
                               size_t bucket_bytes, const FusedReduceOptions& options, bool async);
  WorkPtr broadcast_coalesced(const std::vector<BufferRef>& buffers, int root, size_t bucket_bytes,
                              bool async);
  // outputs[q][i] (shaped like inputs[i]) receives rank q's inputs[i].
  WorkPtr all_gather_coalesced(const std::vector<std::vector<BufferRef>>& outputs,
                               const std::vector<BufferRef>& inputs, size_t bucket_bytes,
                               bool async);

  // The algorithm the cost model picks for all_reduce (RINGCOMM_ALGO overrides kAuto), which
  // all_reduce_coalesced reduces in the order of.
  Algorithm choose_all_reduce(size_t bytes, Algorithm requested) const;
  // The algorithm all_reduce runs now outside trials: as above, or where auto times its calls
  // (RINGCOMM_RETUNE_CALLS) what its trials and spans chose.
  Algorithm algorithm_for(size_t bytes, Algorithm requested) const;
  // The registered algorithm RINGCOMM_ALGO names, which auto all_reduce calls run ("" for none).
  const std::string& forced_registered() const { return forced_registered_; }
  // Whether an all_reduce of `bytes` asked for `requested` is one auto retunes.
  bool retuned(size_t bytes, Algorithm requested) const;
  // What auto's trials found, one entry per size class retuned so far (algorithms/retune.h).
  std::vector<Retuner::Report> auto_trials() const { return retuner_.report(); }
  // Broadcast's and reduce's shape for `bytes`: binomial tree or chain.
  Algorithm choose_rooted(size_t bytes) const;
  // The cost model every rank agreed on when connecting.
  const Selector& selector() const { return selector_; }
  // Which ranks share a host (RINGCOMM_HOST_ID or the derived host identity).
  const HostLayout& layout() const { return layout_; }
  // Bytes this rank has written to its connections (headers included).
  uint64_t bytes_sent() const { return mesh_->bytes_sent(); }
  size_t scratch_bytes() const { return scratch_.bytes(); }
  uint64_t bytes_sent(const std::string& transport) const { return mesh_->bytes_sent(transport); }
  // Per collective (by its name: "all_reduce", "send", ...), everything this communicator ran.
  std::map<std::string, OpStats> stats() const;
  // Idle time of every wait so far, collectives and sends/receives alike.
  int64_t idle_ns() const { return mesh_->idle_ns(); }
  // Times this rank moved off a CPU where a local peer waited (RINGCOMM_SHM_UNSTACK).
  uint64_t cpu_moves() const { return mesh_->cpu_moves(); }
  // Empty unless an error has broken this communicator.
  std::string broken_reason();
  // The sequence number the next collective takes. Collectives are numbered in issue order from
  // 0 (a coalesced one takes one per bucket), the same on every rank that issued the same ones;
  // sends and receives are numbered per peer instead.
  uint64_t sequence_number() {
    std::lock_guard<std::mutex> lk(mu_);
    return next_seq_;
  }
  // Fails the operation in progress and every queued one at once with "aborted: <reason>",
  // tells the peers (their operations with this rank fail with the reason too) and leaves this
  // communicator broken. From any thread; returns once that is done (a second of grace for the
  // thread running an operation to notice), also from a collective's completion callback. From a
  // send's or receive's callback, which runs inside the transport, the progress thread tells the
  // peers as soon as the callback returns. close() afterwards does not wait for anything.
  void abort(const std::string& reason);
  // Finishes queued work, stops the progress thread and closes connections. A second caller
  // waits for the first. From the progress thread (a completion callback) it only asks the
  // thread to stop: the thread cannot join itself; a later close() from elsewhere finishes.
  void close();
  // True on this communicator's progress thread, where completion callbacks run.
  bool on_progress_thread() const;

 private:
  // all_reduce_coalesced's plan for these arguments: the checks, each buffer's reduction order,
  // the buckets and their signatures (the sequence numbers come when it runs).
  std::shared_ptr<const CoalescedAllReduce> plan_all_reduce_coalesced(
      const std::vector<BufferRef>& buffers, ReduceOp op, size_t bucket_bytes,
      const FusedReduceOptions& options);
  // Whether the plan's call asks for shared memory's boards (else the pipeline: coalesced.cc);
  // on the thread running operations, in their order.
  bool coalesced_through_boards(const CoalescedAllReduce& plan) const;
  struct Task {
    // An all-reduce's algorithm kAuto: one auto retunes, settled by run() (Retuner::next).
    Signature sig;
    std::function<void(Context&)> body;  // collectives: runs to completion
    std::function<void()> post;          // send/recv: posts to the transport and returns
    WorkPtr work;
    // When it was queued for the progress thread (trace::now_ns()); 0 when it ran at once on the
    // caller's thread.
    int64_t queued_ns = 0;
  };
  // `operations`: sequence numbers the task takes (a coalesced call: one per bucket), the first
  // in sig.seq.
  WorkPtr submit(Signature sig, std::function<void(Context&)> body, bool async,
                 uint64_t operations = 1);
  // For calls with nothing to move: a finished Work, or the error a call would raise now.
  WorkPtr finished_work();
  void check_usable_locked() const;  // with mu_ held: throws if broken or closed
  // Errors for calls that cannot work: a blocking call from the progress thread (it would wait
  // for itself), any call from a forked child (the connections are the parent's).
  void check_may_block(bool async, const char* what) const;
  WorkPtr point_to_point(bool is_send, void* buf, size_t count, DType dtype, int peer, bool async,
                         uint32_t tag);
  void enqueue(Task task, bool inline_ok);
  // On the progress thread: gives waiting receives from any source the messages that arrived.
  void match_any_source();
  void run(Task& task);
  void fail(const std::string& reason, const std::exception_ptr& error);
  void fail_aborted(const std::string& why);  // fail() with "aborted: <why> [rank r]"
  void progress_loop();
  void wake();
  void check_rank(int r, const char* what) const;
  Signature collective(Collective coll, DType dtype, ReduceOp op, Algorithm algo, size_t count,
                       int root = -1, uint64_t aux = 0);

  // After a collective ran (on the thread that ran it): its cost into its Work, the totals and
  // the timeline.
  void account(const Task& task, int64_t begin_ns, uint64_t sent0, uint64_t received0,
               int64_t idle0);
  // Sends and receives, when posted (on the thread running operations): number and bytes.
  void count_point_to_point(bool is_send, size_t bytes);

  // While connecting: the link model from RINGCOMM_TUNING or the probe, agreed by all ranks.
  LinkModel calibrate(Clock::time_point deadline);
  // Runs one step of it as an operation of its own (its own sequence number) on this thread.
  void connect_step(size_t count, const std::function<void(Context&)>& body,
                    Clock::time_point deadline);

  const int rank_, world_size_;
  const uint64_t trace_id_;  // this communicator's number in this process, for the timeline
  const Clock::duration timeout_;
  Algorithm forced_all_reduce_ = Algorithm::kAuto;  // RINGCOMM_ALGO
  std::string forced_registered_;                   // RINGCOMM_ALGO naming a registered algorithm
  // The lists of registered algorithm `name` for this world size and a message of `bytes`,
  // written for `coll`; the first use of each logged (RINGCOMM_DEBUG).
  std::shared_ptr<const AlgorithmLists> registered_for(const std::string& name, Collective coll,
                                                       size_t bytes);
  std::mutex logged_lists_mu_;
  std::set<uint64_t> logged_lists_;
  std::unique_ptr<Mesh> mesh_;
  Scratch scratch_;
  Selector selector_;
  Retuner retuner_;
  HostLayout layout_;    // ranks by host, from connect()
  bool boards_ = false;  // every rank reaches every other through shared memory with a board
  // RINGCOMM_DEBUG: the power-of-two size classes whose all-reduce choice was logged
  mutable std::atomic<uint64_t> logged_choices_{0};
  // The model's last all-reduce choice: (bytes + 1) << 8 | algorithm, 0 before the first.
  mutable std::atomic<uint64_t> last_choice_{0};
  // all_reduce_coalesced's reduction orders, built once per algorithm and shared with the
  // operations planned from them; a call that needs one more algorithm swaps in a grown copy.
  // `algorithms`: a bit (1 << Algorithm) for each the call chose.
  std::shared_ptr<const ReductionOrders> reduction_orders(uint32_t algorithms);
  std::mutex orders_mu_;
  std::shared_ptr<const ReductionOrders> orders_;
  // all_reduce_coalesced's last few plans and the calls they were planned for, most recent
  // first. A plan depends only on the call's arguments (and this communicator's fixed cost
  // model), and callers pass the same lists step after step (DDP's buckets, an optimizer's
  // parameters): a call with the same buffers, op, bucket size and options reuses its plan,
  // skipping the planning (about 0.1 us a buffer).
  struct CoalescedCall {
    std::vector<BufferRef> buffers;
    ReduceOp op;
    size_t bucket_bytes;
    FusedReduceOptions options;
    std::shared_ptr<const CoalescedAllReduce> plan;
    bool same(const std::vector<BufferRef>& b, ReduceOp o, size_t bytes,
              const FusedReduceOptions& opt) const;
  };
  static constexpr size_t kCoalescedPlansKept = 4;
  std::mutex coalesced_mu_;
  std::deque<CoalescedCall> coalesced_calls_;

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool executing_ = false;  // a thread is inside the transport
  bool stopping_ = false;
  std::string abort_reason_;               // abort() asked; the progress thread fails what is left
  bool closing_ = false, closed_ = false;  // a thread outside the progress thread is closing / done
  std::string broken_;
  ErrorKind broken_kind_ = ErrorKind::kOther;
  bool peers_told_ = false;  // fail() has told the peers why: what abort() waits for
  uint64_t next_seq_ = 0;
  std::map<int, uint64_t> send_seq_, recv_seq_;  // per peer, for send/recv
  // Posted sends/receives not yet finished: deadline and description, by id.
  std::map<int64_t, std::pair<Clock::time_point, std::string>> p2p_deadlines_;
  int64_t next_p2p_id_ = 0;
  struct AnySource {
    void* buf;
    size_t count;
    DType dtype;
    uint32_t tag;
    WorkPtr work;
    int64_t id;  // its entry in p2p_deadlines_
  };
  std::deque<AnySource> any_source_;  // receives from any source not yet given a peer
  int last_any_source_ = 0;           // the peer the last one took its message from
  int wake_fd_ = -1;
  std::thread progress_thread_;
  std::array<OpTotals, 32> totals_;  // by Collective
};

}  // namespace ringcomm
