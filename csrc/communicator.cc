#include "communicator.h"

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <sstream>

#include "common/crypto.h"
#include "common/knobs.h"
#include "common/logging.h"
#include "common/trace.h"

namespace ringcomm {
namespace {

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

// A failed operation's error as its Work reports it: the message followed by `where`.
Error error_at(const std::exception_ptr& error, const std::string& where) {
  return Error(message_of(error) + where, error_kind_of(error));
}

}  // namespace

namespace {
// The communicator whose progress thread this is (nullptr elsewhere).
thread_local const void* progress_thread_owner = nullptr;
// The communicator whose finished collective's completion callbacks this thread runs: the thread
// still holds the transport (executing_) but no longer uses it, so an abort() from a callback
// tells the peers at once instead of leaving it to the progress thread, which a process exiting
// right after the callback (the future it completed woke the main thread) could overtake.
thread_local const void* completing_owner = nullptr;

// Set in a child forked after a communicator was made (a DataLoader worker, say). The child
// shares the parent's sockets and shared memory but not its progress thread: it must neither
// use them nor shut them down.
std::atomic<bool> forked_child{false};
std::atomic<uint64_t> next_trace_id{0};
void watch_for_fork() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, [] { forked_child = true; }); });
}
}  // namespace

// ---- Work ----

bool Work::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!finished_ && owner_ && owner_ == progress_thread_owner)
    RC_THROW(
        "waiting for a ringcomm operation from a completion callback of the same "
        "communicator would wait forever: the callback runs on the thread that finishes it");
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return finished_; });
  } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s),
                           [&] { return finished_; })) {
    return false;
  }
  if (!error_.empty()) throw Error(error_, error_kind_);
  return true;
}

bool Work::is_completed() {
  std::lock_guard<std::mutex> lk(mu_);
  return finished_;
}

std::string Work::error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

ErrorKind Work::error_kind() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_kind_;
}

void Work::on_finished(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!finished_) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void Work::finish() { finish(nullptr); }

void Work::finish(const Error& error) { finish(&error); }

void Work::finish(const Error* error) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (finished_) return;
    finished_ = true;
    if (error) {
      error_ = error->what();
      error_kind_ = error->kind();
    }
    callbacks.swap(callbacks_);
  }
  cv_.notify_all();
  for (auto& fn : callbacks) fn();
}

// ---- Communicator ----

namespace {

// RINGCOMM_RETUNE_CALLS: auto, by default, times its candidates where the link model was probed
// for this run (RINGCOMM_TUNING unset); a model pinned in a file or "off" keeps its choices, so
// the same inputs give the same bits run after run.
uint64_t retune_span(int world_size) {
  constexpr uint64_t kSpan = 64;
  if (world_size < 2) return 0;
  const std::optional<int64_t> calls = knob_int("RINGCOMM_RETUNE_CALLS");
  if (!calls) return knob_string("RINGCOMM_TUNING").empty() ? kSpan : 0;
  RC_CHECK_ARG(*calls >= 0, "RINGCOMM_RETUNE_CALLS=", *calls, " is negative");
  return uint64_t(*calls);
}

}  // namespace

Communicator::Communicator(int rank, int world_size, double timeout_s,
                           const std::string& master_addr)
    : rank_(rank),
      world_size_(world_size),
      trace_id_(next_trace_id++),
      timeout_(
          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s))),
      selector_(world_size, LinkModel{}),
      retuner_(retune_span(world_size)) {
  RC_CHECK_ARG(world_size >= 1, "world_size must be >= 1, got ", world_size);
  RC_CHECK_ARG(rank >= 0 && rank < world_size, "rank ", rank, " out of range for world_size ",
               world_size);
  RC_CHECK_ARG(timeout_s > 0, "timeout must be positive");
  mesh_ = std::make_unique<Mesh>(rank, world_size, MeshOptions::from_env(master_addr));
  mesh_->set_trace_id(trace_id_);
  // Read once: a coalesced call asks for every buffer's algorithm.
  const std::string forced = knob_string("RINGCOMM_ALGO");
  for (Algorithm a : kAllReduceAlgorithms)
    if (forced == algorithm_name(a)) forced_all_reduce_ = a;
  if (forced_all_reduce_ == Algorithm::kAuto && forced != algorithm_name(Algorithm::kAuto)) {
    // A registered algorithm: its lists checked now, on every rank (those that differ by size,
    // for each size class at its first use).
    forced_registered_ = forced;
    registered_for(forced, Collective::kAllReduce, 0);
  }
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  watch_for_fork();
}

Communicator::~Communicator() {
  close();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Communicator::connect(const std::vector<std::string>& addresses, const std::string& token) {
  if (world_size_ > 1) {
    const Clock::time_point deadline = Clock::now() + timeout_;
    mesh_->connect(addresses, token, deadline);
    layout_ = HostLayout::of(mesh_->host_of());
    boards_ = mesh_->boards_everywhere();
    const bool uniform = layout_.uniform();
    selector_ =
        Selector(world_size_, calibrate(deadline), int(layout_.hosts.size()),
                 uniform ? int(layout_.hosts[0].size()) : 0, boards_ ? mesh_->board_bytes() : 0);
    last_choice_.store(0, std::memory_order_relaxed);  // made, if at all, by the model before
  }
  progress_thread_ = std::thread([this] {
    progress_thread_owner = this;
    pthread_setname_np(pthread_self(), "rc-progress");
    progress_loop();
  });
}

namespace {

// RINGCOMM_TOKEN_FILE: the job token, shared by every rank out of band, so that reading the
// Store is not enough to join the job (docs/security.md). Trailing whitespace is not part of it.
std::string token_from_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  RC_CHECK_ARG(file.good(), "RINGCOMM_TOKEN_FILE: cannot read '", path, "'");
  std::string token((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  token.erase(token.find_last_not_of(" \t\r\n") + 1);
  RC_CHECK_ARG(!token.empty(), "RINGCOMM_TOKEN_FILE: '", path, "' holds no token");
  return token;
}

}  // namespace

// Under torchrun, a group restarted after a failure meets in the same agent store, where the
// previous attempt's keys remain: the attempt number keeps them apart.
void Communicator::rendezvous(const KeyValueStore& store) {
  const std::string restart = knob_string("TORCHELASTIC_RESTART_COUNT");
  const std::string prefix = restart.empty() ? "" : str_cat("attempt", restart, "/");
  const std::string token_file = knob_string("RINGCOMM_TOKEN_FILE");
  std::string token = token_file.empty() ? "" : token_from_file(token_file);
  store.set(str_cat(prefix, "addr/", rank_), address());
  if (token.empty()) {
    if (rank_ == 0) {
      uint8_t secret[32];
      random_bytes(secret, sizeof secret);
      std::ostringstream hex;
      for (uint8_t b : secret) hex << std::hex << std::setw(2) << std::setfill('0') << int(b);
      store.set(prefix + "token", hex.str());
    }
    token = store.get(prefix + "token");
  }
  std::vector<std::string> addresses;
  for (int r = 0; r < world_size_; ++r) addresses.push_back(store.get(str_cat(prefix, "addr/", r)));
  connect(addresses, token);
}

void Communicator::check_rank(int r, const char* what) const {
  RC_CHECK_ARG(r >= 0 && r < world_size_, what, " ", r, " out of range for world_size ",
               world_size_);
}

Algorithm Communicator::choose_all_reduce(size_t bytes, Algorithm requested) const {
  const Algorithm wanted = requested != Algorithm::kAuto ? requested : forced_all_reduce_;
  if (wanted != Algorithm::kAuto) {
    // Checked here, on the caller's thread, before anything is sent.
    RC_CHECK_ARG(listed(kAllReduceAlgorithms, wanted), "all_reduce has no algorithm ",
                 algorithm_name(wanted));
    RC_CHECK_ARG(wanted != Algorithm::kHierarchical || layout_.uniform(),
                 "the hierarchical all_reduce needs ranks on several hosts, the same number (more "
                 "than one) on each");
    RC_CHECK_ARG(wanted != Algorithm::kSharedBuffer || boards_ || world_size_ == 1,
                 "the shared_buffer all_reduce needs every rank on one host, reaching each other "
                 "through shared memory with a board (RINGCOMM_TRANSPORT, "
                 "RINGCOMM_SHM_BOARD_BYTES)");
    return wanted;
  }
  // The same sizes come back call after call (a training step's buckets, a benchmark's loop),
  // and pricing the six algorithms again is a noticeable part of a small all-reduce between
  // ranks of one host.
  const uint64_t key = uint64_t(bytes) + 1;
  const uint64_t last = last_choice_.load(std::memory_order_relaxed);
  if (key < (uint64_t(1) << 56) && last >> 8 == key) return Algorithm(last & 0xff);
  const Algorithm algo = selector_.all_reduce(bytes);
  if (key < (uint64_t(1) << 56))
    last_choice_.store(key << 8 | uint64_t(algo), std::memory_order_relaxed);
  if (debug_enabled()) {
    int size_class = 0;
    while (size_class < 63 && (size_t(1) << (size_class + 1)) <= bytes) ++size_class;
    const uint64_t bit = uint64_t(1) << size_class;
    if (!(logged_choices_.fetch_or(bit) & bit))
      RC_LOG("rank ", rank_, ": all_reduce of ", bytes, " bytes (and others of ",
             size_t(1) << size_class, "..", (size_t(2) << size_class) - 1,
             "): ", algorithm_name(algo), "; estimates ring ",
             selector_.all_reduce_cost(Algorithm::kRing, double(bytes)) * 1e6, " us, tree ",
             selector_.all_reduce_cost(Algorithm::kTree, double(bytes)) * 1e6,
             " us, recursive doubling ",
             selector_.all_reduce_cost(Algorithm::kRecursiveDoubling, double(bytes)) * 1e6,
             " us, halving-doubling ",
             selector_.all_reduce_cost(Algorithm::kHalvingDoubling, double(bytes)) * 1e6,
             " us, shared buffer ",
             selector_.all_reduce_cost(Algorithm::kSharedBuffer, double(bytes)) * 1e6,
             " us, hierarchical ",
             selector_.all_reduce_cost(Algorithm::kHierarchical, double(bytes)) * 1e6, " us");
  }
  return algo;
}

bool Communicator::retuned(size_t bytes, Algorithm requested) const {
  return requested == Algorithm::kAuto && forced_all_reduce_ == Algorithm::kAuto &&
         retuner_.covers(bytes);
}

Algorithm Communicator::algorithm_for(size_t bytes, Algorithm requested) const {
  const Algorithm algo = choose_all_reduce(bytes, requested);
  return retuned(bytes, requested) ? retuner_.current(selector_, bytes) : algo;
}

Algorithm Communicator::choose_rooted(size_t bytes) const {
  return selector_.rooted(bytes, AlgorithmTuning::get().tree_chunk_bytes);
}

// Every rank reads RINGCOMM_TUNING alike. "off": the default model, nothing exchanged. Else the
// ranks agree first on whether all of them hold a saved model (a path naming an existing file),
// and if one does not, all probe; either way on the slowest rank's figures. Single copy between
// local ranks is probed first (the links' figures depend on it), and only if every rank with
// local peers leaves it to its default.
LinkModel Communicator::calibrate(Clock::time_point deadline) {
  const std::string tuning = knob_string("RINGCOMM_TUNING");
  LinkModel model;
  if (tuning == "off") {
    RC_LOG("rank ", rank_, ": RINGCOMM_TUNING=off, links: ", model.describe());
    return model;
  }
  LinkModel saved;
  const bool have = !tuning.empty() && load_link_model(tuning, &saved);
  const std::vector<int>& host = layout_.local(rank_);
  const size_t single_copy = mesh_->single_copy_to_probe();
  // Maxima: of "missing", alpha, seconds per byte sent and per byte reduced, inside a host alpha
  // and seconds per byte sent, "single copy set by hand", "single copy off", and the algorithms'
  // measured factors (0: not measured; a saved model holds all of them or none).
  constexpr size_t kFactors = kMeasuredBytes.size() * kMeasuredAlgorithms.size();
  double agreed[8 + kFactors] = {have ? 0.0 : 1.0,
                                 have ? saved.alpha_s : 0.0,
                                 have ? 1 / saved.bytes_per_s : 0.0,
                                 have ? 1 / saved.reduce_bytes_per_s : 0.0,
                                 have ? saved.local_alpha_s : 0.0,
                                 have ? 1 / saved.local_bytes_per_s : 0.0,
                                 host.size() > 1 && single_copy == 0 ? 1.0 : 0.0,
                                 have && !saved.single_copy ? 1.0 : 0.0};
  double* factors = agreed + 8;
  for (size_t p = 0; p < saved.factors.size(); ++p)
    std::copy(saved.factors[p].begin(), saved.factors[p].end(),
              factors + p * kMeasuredAlgorithms.size());
  auto agree = [&](double* values, size_t count) {
    connect_step(
        count,
        [&](Context& ctx) {
          recursive_doubling_all_reduce(ctx, values, count, DType::kFloat64, ReduceOp::kMax);
        },
        deadline);
  };
  agree(agreed, 8 + kFactors);
  const char* source = "loaded from RINGCOMM_TUNING";
  if (agreed[0] > 0) {
    source = "probed";
    const auto start = Clock::now();
    if (agreed[6] == 0) {
      connect_step(
          0,
          [&](Context& ctx) {
            if (host.size() < 2) return;
            Context local = ctx.view(host);
            const bool faster =
                probe_single_copy(local, single_copy, [&](bool on) { mesh_->use_single_copy(on); });
            agreed[7] = faster ? 0.0 : 1.0;
          },
          deadline);
      agree(agreed + 7, 1);
      mesh_->use_single_copy(agreed[7] == 0);
    }
    const std::vector<int>* links_host = layout_.uniform() ? &host : nullptr;
    const bool one_host = layout_.hosts.size() == 1;
    connect_step(
        0, [&](Context& ctx) { model = probe_links(ctx, one_host, links_host); }, deadline);
    agreed[1] = model.alpha_s;
    agreed[2] = 1 / model.bytes_per_s;
    agreed[3] = 1 / model.reduce_bytes_per_s;
    agreed[4] = model.local_alpha_s;
    agreed[5] = 1 / model.local_bytes_per_s;
    agree(agreed + 1, 5);
    std::fill(factors, factors + kFactors, 0.0);
    if (one_host && world_size_ >= 3) {
      // Timed against the agreed figures, on the slowest rank: every rank computes the same.
      LinkModel links;
      links.alpha_s = agreed[1];
      links.bytes_per_s = 1 / agreed[2];
      links.reduce_bytes_per_s = 1 / agreed[3];
      connect_step(
          0,
          [&](Context& ctx) {
            const auto rows = probe_algorithms(ctx, links);
            for (size_t p = 0; p < rows.size(); ++p)
              std::copy(rows[p].begin(), rows[p].end(), factors + p * kMeasuredAlgorithms.size());
          },
          deadline);
    }
    RC_LOG("rank ", rank_, ": link probe took ",
           std::chrono::duration<double>(Clock::now() - start).count() * 1e3, " ms");
  }
  model.alpha_s = agreed[1];
  model.bytes_per_s = 1 / agreed[2];
  model.reduce_bytes_per_s = 1 / agreed[3];
  model.local_alpha_s = agreed[4];
  model.local_bytes_per_s = 1 / agreed[5];
  model.single_copy = agreed[7] == 0;
  model.factors.clear();
  if (factors[0] > 0)
    for (size_t p = 0; p < kMeasuredBytes.size(); ++p) {
      model.factors.emplace_back();
      std::copy_n(factors + p * kMeasuredAlgorithms.size(), kMeasuredAlgorithms.size(),
                  model.factors.back().begin());
    }
  mesh_->use_single_copy(model.single_copy);
  if (!tuning.empty() && agreed[0] > 0 && !save_link_model(tuning, model))
    RC_LOG("rank ", rank_, ": cannot write RINGCOMM_TUNING file '", tuning, "'");
  // The file keeps the measurement; the model says from here on whether every rank with local
  // peers sends by single copy, as measured or set by hand: the coalesced collectives cut their
  // parts for it, every rank alike.
  double off = host.size() > 1 && mesh_->single_copy_bytes() == 0 ? 1.0 : 0.0;
  agree(&off, 1);
  model.single_copy = off == 0;
  RC_LOG("rank ", rank_, ": links (", source, ", slowest rank): ", model.describe());
  return model;
}

void Communicator::connect_step(size_t count, const std::function<void(Context&)>& body,
                                Clock::time_point deadline) {
  Signature sig =
      collective(Collective::kProbe, DType::kFloat64, ReduceOp::kMax, Algorithm::kDirect, count);
  sig.seq = next_seq_++;
  mesh_->set_current(sig);
  Context ctx(*mesh_, sig, deadline, scratch_, selector_);
  body(ctx);
  scratch_.operation_done();
}

Signature Communicator::collective(Collective coll, DType dtype, ReduceOp op, Algorithm algo,
                                   size_t count, int root, uint64_t aux) {
  Signature s;
  s.coll = coll;
  s.dtype = dtype;
  s.op = op;
  s.algo = algo;
  s.root = root;
  s.count = count;
  s.aux = aux;
  return s;
}

WorkPtr Communicator::all_reduce(void* buf, size_t count, DType dtype, ReduceOp op, Algorithm algo,
                                 bool async) {
  if (algo == Algorithm::kAuto && !forced_registered_.empty())
    return all_reduce_registered(buf, count, dtype, op, forced_registered_, async);
  const size_t bytes = count * dtype_size(dtype);
  const bool retune = retuned(bytes, algo);
  algo = retune ? Algorithm::kAuto : choose_all_reduce(bytes, algo);  // kAuto: settled in run()
  auto sig = collective(Collective::kAllReduce, dtype, op, algo, count);
  return submit(
      sig,
      [=](Context& ctx) {
        mesh_->offer_huge_pages(buf, bytes);
        const Clock::time_point start = Clock::now();
        all_reduce_by(ctx, ctx.signature().algo, layout_, buf, count, dtype, op);
        if (retune)
          retuner_.ran(ctx, bytes, std::chrono::duration<double>(Clock::now() - start).count());
      },
      async);
}

WorkPtr Communicator::reduce_scatter(void* out, const void* in, size_t count, DType dtype,
                                     ReduceOp op, bool async) {
  auto sig = collective(Collective::kReduceScatter, dtype, op, Algorithm::kRing, count);
  return submit(
      sig,
      [=](Context& ctx) {
        mesh_->offer_huge_pages(in, count * size_t(world_size_) * dtype_size(dtype));
        ring_reduce_scatter(ctx, in, out, count, dtype, op);
      },
      async);
}

WorkPtr Communicator::all_gather(void* out, const void* in, size_t count, DType dtype, bool async) {
  return all_gatherv(out, in, std::vector<size_t>(world_size_, count), dtype, async);
}

WorkPtr Communicator::all_gatherv(void* out, const void* in, const std::vector<size_t>& counts,
                                  DType dtype, bool async) {
  RC_CHECK_ARG(int(counts.size()) == world_size_, "all_gatherv needs ", world_size_,
               " counts, got ", counts.size());
  size_t total = 0, offset = 0;
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) offset = total;
    total += counts[r];
  }
  bool uniform =
      std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == counts[0]; });
  auto sig =
      collective(uniform ? Collective::kAllGather : Collective::kAllGatherV, dtype, ReduceOp::kSum,
                 Algorithm::kRing, total, -1, hash_counts(counts.data(), counts.size()));
  const size_t e = dtype_size(dtype);
  return submit(
      sig,
      [=](Context& ctx) {
        char* dst = static_cast<char*>(out) + offset * e;
        if (dst != in && counts[rank_] > 0) std::memmove(dst, in, counts[rank_] * e);
        mesh_->offer_huge_pages(out, total * e);
        ring_all_gather(ctx, out, counts, dtype);
      },
      async);
}

WorkPtr Communicator::gather(const void* in, const std::vector<void*>& outputs, size_t count,
                             DType dtype, int root, bool async) {
  check_rank(root, "gather dst");
  RC_CHECK_ARG(rank_ != root || int(outputs.size()) == world_size_, "gather needs ", world_size_,
               " outputs on the root, got ", outputs.size());
  auto sig =
      collective(Collective::kGather, dtype, ReduceOp::kSum, Algorithm::kDirect, count, root);
  const size_t bytes = count * dtype_size(dtype);
  return submit(sig, [=](Context& ctx) { direct_gather(ctx, in, outputs, bytes, root); }, async);
}

WorkPtr Communicator::scatter(const std::vector<const void*>& inputs, void* out, size_t count,
                              DType dtype, int root, bool async) {
  check_rank(root, "scatter src");
  RC_CHECK_ARG(rank_ != root || int(inputs.size()) == world_size_, "scatter needs ", world_size_,
               " inputs on the root, got ", inputs.size());
  auto sig =
      collective(Collective::kScatter, dtype, ReduceOp::kSum, Algorithm::kDirect, count, root);
  const size_t bytes = count * dtype_size(dtype);
  return submit(sig, [=](Context& ctx) { direct_scatter(ctx, inputs, out, bytes, root); }, async);
}

// The signature cannot carry per-pair sizes (each rank knows only its own), so it carries none:
// each message's size is checked against its receive instead.
WorkPtr Communicator::all_to_all(const std::vector<const void*>& inputs,
                                 const std::vector<size_t>& in_counts,
                                 const std::vector<void*>& outputs,
                                 const std::vector<size_t>& out_counts, DType dtype, bool async) {
  RC_CHECK_ARG(int(inputs.size()) == world_size_ && int(in_counts.size()) == world_size_ &&
                   int(outputs.size()) == world_size_ && int(out_counts.size()) == world_size_,
               "all_to_all needs ", world_size_, " inputs, outputs and counts of each");
  auto sig = collective(Collective::kAllToAll, dtype, ReduceOp::kSum, Algorithm::kDirect, 0);
  const size_t e = dtype_size(dtype);
  std::vector<size_t> in_bytes(world_size_), out_bytes(world_size_);
  for (int q = 0; q < world_size_; ++q) {
    in_bytes[q] = in_counts[q] * e;
    out_bytes[q] = out_counts[q] * e;
  }
  RC_CHECK_ARG(in_bytes[rank_] == out_bytes[rank_], "all_to_all: rank ", rank_, " sends itself ",
               in_counts[rank_], " elements but expects ", out_counts[rank_]);
  return submit(
      sig, [=](Context& ctx) { pairwise_all_to_all(ctx, inputs, in_bytes, outputs, out_bytes); },
      async);
}

WorkPtr Communicator::broadcast(void* buf, size_t count, DType dtype, int root, bool async) {
  check_rank(root, "broadcast src");
  size_t bytes = count * dtype_size(dtype);
  Algorithm shape = choose_rooted(bytes);
  auto sig = collective(Collective::kBroadcast, dtype, ReduceOp::kSum, shape, count, root);
  return submit(
      sig,
      [=](Context& ctx) {
        mesh_->offer_huge_pages(buf, bytes);
        tree_broadcast(ctx, buf, bytes, root, shape);
      },
      async);
}

WorkPtr Communicator::reduce(void* buf, size_t count, DType dtype, ReduceOp op, int root,
                             bool async) {
  check_rank(root, "reduce dst");
  Algorithm shape = choose_rooted(count * dtype_size(dtype));
  auto sig = collective(Collective::kReduce, dtype, op, shape, count, root);
  return submit(
      sig,
      [=](Context& ctx) {
        mesh_->offer_huge_pages(buf, count * dtype_size(dtype));
        tree_reduce(ctx, buf, count, dtype, op, root, shape);
      },
      async);
}

WorkPtr Communicator::barrier(bool async) {
  auto sig =
      collective(Collective::kBarrier, DType::kUInt8, ReduceOp::kSum, Algorithm::kDissemination, 0);
  return submit(sig, [](Context& ctx) { dissemination_barrier(ctx); }, async);
}

std::shared_ptr<const AlgorithmLists> Communicator::registered_for(const std::string& name,
                                                                   Collective coll, size_t bytes) {
  std::shared_ptr<const AlgorithmLists> lists = registered_lists(name, coll, world_size_, bytes);
  RC_CHECK_ARG(lists, collective_name(coll), " has no algorithm '", name,
               "': none built in, and none registered under that name (ringcomm.algorithms)");
  if (debug_enabled()) {
    std::lock_guard<std::mutex> lk(logged_lists_mu_);
    if (logged_lists_.insert(lists->id).second)
      RC_LOG("rank ", rank_, ": ", collective_name(coll), " by registered algorithm '", name,
             "' (lists ", std::hex, lists->id, std::dec, ", checked for ", world_size_, " ranks",
             lists->sized ? str_cat(" and messages from ", lists->size_class, " bytes") : "",
             "); this rank's steps: ", lists->schedules[size_t(rank_)].describe());
  }
  return lists;
}

WorkPtr Communicator::all_reduce_registered(void* buf, size_t count, DType dtype, ReduceOp op,
                                            const std::string& algorithm, bool async) {
  std::shared_ptr<const AlgorithmLists> lists =
      registered_for(algorithm, Collective::kAllReduce, count * dtype_size(dtype));
  auto sig =
      collective(Collective::kAllReduce, dtype, op, Algorithm::kRegistered, count, -1, lists->id);
  return submit(
      sig,
      [=](Context& ctx) {
        mesh_->offer_huge_pages(buf, count * dtype_size(dtype));
        registered_all_reduce(ctx, *lists, buf, count, dtype, op);
      },
      async);
}

WorkPtr Communicator::reduce_scatter_registered(void* out, const void* in, size_t count,
                                                DType dtype, ReduceOp op,
                                                const std::string& algorithm, bool async) {
  std::shared_ptr<const AlgorithmLists> lists = registered_for(
      algorithm, Collective::kReduceScatter, count * size_t(world_size_) * dtype_size(dtype));
  auto sig = collective(Collective::kReduceScatter, dtype, op, Algorithm::kRegistered, count, -1,
                        lists->id);
  return submit(
      sig,
      [=](Context& ctx) {
        mesh_->offer_huge_pages(in, count * size_t(world_size_) * dtype_size(dtype));
        registered_reduce_scatter(ctx, *lists, in, out, count, dtype, op);
      },
      async);
}

WorkPtr Communicator::all_gather_registered(void* out, const void* in, size_t count, DType dtype,
                                            const std::string& algorithm, bool async) {
  std::shared_ptr<const AlgorithmLists> lists = registered_for(
      algorithm, Collective::kAllGather, count * size_t(world_size_) * dtype_size(dtype));
  auto sig = collective(Collective::kAllGather, dtype, ReduceOp::kSum, Algorithm::kRegistered,
                        count * size_t(world_size_), -1, lists->id);
  const size_t e = dtype_size(dtype);
  return submit(
      sig,
      [=](Context& ctx) {
        char* dst = static_cast<char*>(out) + count * size_t(rank_) * e;
        if (dst != in && count > 0) std::memmove(dst, in, count * e);
        mesh_->offer_huge_pages(out, count * size_t(world_size_) * e);
        registered_all_gather(ctx, *lists, out, count, dtype);
      },
      async);
}

WorkPtr Communicator::broadcast_registered(void* buf, size_t count, DType dtype, int root,
                                           const std::string& algorithm, bool async) {
  check_rank(root, "broadcast src");
  std::shared_ptr<const AlgorithmLists> lists =
      registered_for(algorithm, Collective::kBroadcast, count * dtype_size(dtype));
  auto sig = collective(Collective::kBroadcast, dtype, ReduceOp::kSum, Algorithm::kRegistered,
                        count, root, lists->id);
  return submit(
      sig,
      [=](Context& ctx) {
        mesh_->offer_huge_pages(buf, count * dtype_size(dtype));
        registered_broadcast(ctx, *lists, buf, count * dtype_size(dtype), root);
      },
      async);
}

WorkPtr Communicator::reduce_registered(void* buf, size_t count, DType dtype, ReduceOp op, int root,
                                        const std::string& algorithm, bool async) {
  check_rank(root, "reduce dst");
  std::shared_ptr<const AlgorithmLists> lists =
      registered_for(algorithm, Collective::kReduce, count * dtype_size(dtype));
  auto sig =
      collective(Collective::kReduce, dtype, op, Algorithm::kRegistered, count, root, lists->id);
  return submit(
      sig,
      [=](Context& ctx) {
        mesh_->offer_huge_pages(buf, count * dtype_size(dtype));
        registered_reduce(ctx, *lists, buf, count, dtype, op, root);
      },
      async);
}

WorkPtr Communicator::sparse_all_reduce(const int32_t* indices, const void* values, size_t k,
                                        DType value_dtype, void* out, size_t numel, DType out_dtype,
                                        ReduceOp op, Algorithm algo, bool async) {
  auto sparse_type = [](DType t) {
    return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16;
  };
  RC_CHECK_ARG(sparse_type(value_dtype) && sparse_type(out_dtype),
               "sparse_all_reduce supports float32, float16 and bfloat16 values and output, got ",
               dtype_name(value_dtype), " and ", dtype_name(out_dtype));
  RC_CHECK_ARG(op == ReduceOp::kSum || op == ReduceOp::kAvg,
               "sparse_all_reduce supports op sum and avg, got ", op_name(op));
  RC_CHECK_ARG(numel <= size_t(INT32_MAX), "sparse_all_reduce: numel ", numel,
               " exceeds int32 indices");
  RC_CHECK_ARG(k <= size_t(INT32_MAX), "sparse_all_reduce: ", k, " pairs, more than 2^31 - 1");
  RC_CHECK_ARG(algo == Algorithm::kAuto || listed(kSparseAllReduceAlgorithms, algo),
               "sparse_all_reduce algorithm must be auto, sparse_gather, sparse_ranges or ring");
  for (size_t i = 0; i < k; ++i)
    RC_CHECK_ARG(indices[i] >= 0 && size_t(indices[i]) < numel, "index ", indices[i],
                 " at position ", i, " is outside [0, ", numel, ")");
  auto sig = collective(Collective::kSparseAllReduce, value_dtype, op, algo, numel, -1,
                        uint64_t(out_dtype));
  return submit(
      sig,
      [=](Context& ctx) {
        sparse_all_reduce_steps(ctx, indices, values, k, value_dtype, out, numel, out_dtype, op,
                                algo);
      },
      async);
}

WorkPtr Communicator::send(const void* buf, size_t count, DType dtype, int peer, bool async,
                           uint32_t tag) {
  return point_to_point(true, const_cast<void*>(buf), count, dtype, peer, async, tag);
}

WorkPtr Communicator::recv(void* buf, size_t count, DType dtype, int peer, bool async,
                           uint32_t tag) {
  return point_to_point(false, buf, count, dtype, peer, async, tag);
}

// The k-th send from a to b pairs with the k-th receive at b from a: their signatures carry that
// k (per direction and peer) and the sender's rank, so sizes and types are checked on arrival.
WorkPtr Communicator::point_to_point(bool is_send, void* buf, size_t count, DType dtype, int peer,
                                     bool async, uint32_t tag) {
  check_rank(peer, is_send ? "send dst" : "recv src");
  RC_CHECK_ARG(peer != rank_, "send/recv with self (rank ", rank_, ") is not supported");
  auto sig = collective(Collective::kSendRecv, dtype, ReduceOp::kSum, Algorithm::kDirect, count,
                        is_send ? rank_ : peer, tag);
  sig.p2p = true;
  const size_t bytes = count * dtype_size(dtype);
  check_may_block(async, is_send ? "send" : "recv");
  auto work = std::make_shared<Work>(this);
  if (!is_send) work->set_source(peer);
  Task task;
  task.work = work;
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_usable_locked();
    sig.seq = (is_send ? send_seq_ : recv_seq_)[peer]++;
  }
  task.sig = sig;
  task.post = [this, is_send, buf, bytes, peer, sig, work] {
    count_point_to_point(is_send, bytes);
    auto deadline = Clock::now() + timeout_;
    int64_t id;
    {
      std::lock_guard<std::mutex> lk(mu_);
      id = next_p2p_id_++;
      // The peer in words: the abort carries this text to ranks that know nothing of the pair.
      p2p_deadlines_[id] = {deadline,
                            str_cat(sig.describe(), is_send ? " to rank " : " from rank ", peer)};
    }
    auto done = [this, id, work, peer](const std::exception_ptr& error) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        p2p_deadlines_.erase(id);
      }
      if (error)
        work->finish(error_at(error, str_cat(" [rank ", rank_, ", peer ", peer, "]")));
      else
        work->finish();
    };
    if (is_send)
      mesh_->post_send(peer, buf, bytes, sig, done);
    else
      mesh_->post_recv(peer, buf, bytes, sig, done);
  };
  enqueue(std::move(task), /*inline_ok=*/false);
  if (!async) work->wait(-1);
  return work;
}

WorkPtr Communicator::recv_any(void* buf, size_t count, DType dtype, bool async, uint32_t tag) {
  RC_CHECK_ARG(world_size_ > 1, "a receive from any source needs another rank");
  check_may_block(async, "recv from any source");
  auto work = std::make_shared<Work>(this);
  Task task;
  task.work = work;
  task.sig =
      collective(Collective::kSendRecv, dtype, ReduceOp::kSum, Algorithm::kDirect, count, -1, tag);
  task.sig.p2p = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_usable_locked();
  }
  task.post = [this, buf, count, dtype, tag, work] {
    count_point_to_point(false, count * dtype_size(dtype));
    std::lock_guard<std::mutex> lk(mu_);
    int64_t id = next_p2p_id_++;
    p2p_deadlines_[id] = {Clock::now() + timeout_, "recv from any source"};
    any_source_.push_back({buf, count, dtype, tag, work, id});
  };
  enqueue(std::move(task), /*inline_ok=*/false);
  if (!async) work->wait(-1);
  return work;
}

// A peer qualifies when the next message waiting from it is its next send to this rank; the
// receive posted for it then checks size, dtype and tag like any receive.
void Communicator::match_any_source() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!any_source_.empty()) {
    int found = -1;
    for (int step = 1; step <= world_size_ && found < 0; ++step) {
      int q = (last_any_source_ + step) % world_size_;
      Signature theirs;
      if (q != rank_ && mesh_->peek(q, &theirs) && theirs.p2p &&
          theirs.coll == Collective::kSendRecv && theirs.root == q && theirs.seq == recv_seq_[q])
        found = q;
    }
    if (found < 0) return;
    last_any_source_ = found;
    AnySource a = std::move(any_source_.front());
    any_source_.pop_front();
    auto sig = collective(Collective::kSendRecv, a.dtype, ReduceOp::kSum, Algorithm::kDirect,
                          a.count, found, a.tag);
    sig.p2p = true;
    sig.seq = recv_seq_[found]++;
    p2p_deadlines_[a.id].second = str_cat(sig.describe(), " from rank ", found);
    lk.unlock();
    WorkPtr work = a.work;
    int64_t id = a.id;
    work->set_source(found);
    mesh_->post_recv(
        found, a.buf, a.count * dtype_size(a.dtype), sig,
        [this, id, work, found](const std::exception_ptr& error) {
          {
            std::lock_guard<std::mutex> guard(mu_);
            p2p_deadlines_.erase(id);
          }
          if (error)
            work->finish(error_at(error, str_cat(" [rank ", rank_, ", peer ", found, "]")));
          else
            work->finish();
        });
    lk.lock();
  }
}

bool Communicator::on_progress_thread() const { return progress_thread_owner == this; }

void Communicator::check_may_block(bool async, const char* what) const {
  if (forked_child)
    RC_THROW(what,
             " in a process forked from the one that made this communicator (a DataLoader "
             "worker?): the connections are the parent's; create a communicator in the child");
  if (!async && on_progress_thread())
    RC_THROW("blocking ", what,
             " called from a completion callback (the progress thread) would "
             "wait for itself: use async_op=True, or call it from another thread");
}

void Communicator::check_usable_locked() const {
  if (!broken_.empty()) throw Error("communicator is broken: " + broken_, broken_kind_);
  RC_CHECK_ARG(!stopping_, "communicator is closed");
}

WorkPtr Communicator::finished_work() {
  check_may_block(/*async=*/true, "a call");
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_usable_locked();
  }
  auto work = std::make_shared<Work>();
  work->finish();
  return work;
}

WorkPtr Communicator::submit(Signature sig, std::function<void(Context&)> body, bool async,
                             uint64_t operations) {
  check_may_block(async, collective_name(sig.coll));
  Task task;
  task.work = std::make_shared<Work>(this);
  task.body = std::move(body);
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_usable_locked();
    sig.seq = next_seq_;
    next_seq_ += operations;
  }
  task.sig = sig;
  WorkPtr work = task.work;
  enqueue(std::move(task), /*inline_ok=*/!async);
  if (!async) work->wait(-1);
  return work;
}

// A blocking call with nothing queued ahead of it runs on the caller's thread: no hand-off to the
// progress thread, which matters for small-message latency.
void Communicator::enqueue(Task task, bool inline_ok) {
  std::unique_lock<std::mutex> lk(mu_);
  if (inline_ok && queue_.empty() && !executing_ && p2p_deadlines_.empty()) {
    executing_ = true;
    lk.unlock();
    run(task);
    lk.lock();
    executing_ = false;
    // Only the progress thread waits on cv_; waking it for nothing costs a context switch per
    // call, on the cores the peers need.
    if (!queue_.empty() || !p2p_deadlines_.empty() || stopping_) cv_.notify_all();
    return;
  }
  task.queued_ns = trace::now_ns();
  queue_.push_back(std::move(task));
  cv_.notify_all();
  lk.unlock();
  wake();
}

void Communicator::wake() {
  uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof one) < 0) { /* counter saturated: already awake */
  }
  mesh_->wake();
}

void Communicator::run(Task& task) {
  try {
    if (task.post) {
      task.post();
      return;
    }
    const Clock::time_point begin = Clock::now();
    const int64_t begin_ns = trace::ns_of(begin);
    const uint64_t sent0 = mesh_->payload_sent(), received0 = mesh_->payload_received();
    const int64_t idle0 = mesh_->idle_ns();
    // Here, in the order operations run (the same on every rank), before the signature that
    // names it goes on the wire.
    if (task.sig.coll == Collective::kAllReduce && task.sig.algo == Algorithm::kAuto)
      task.sig.algo = retuner_.next(selector_, task.sig.count * dtype_size(task.sig.dtype));
    mesh_->set_current(task.sig);
    Context ctx(*mesh_, task.sig, begin + timeout_, scratch_, selector_);
    task.body(ctx);
    task.sig.algo = ctx.algorithm_ran();
    scratch_.operation_done();
    account(task, begin_ns, sent0, received0, idle0);
    trace::Span span("callbacks", 0);
    struct Completing {  // restores the outer one: a callback may run another communicator's call
      const void* outer = completing_owner;
      explicit Completing(const void* owner) { completing_owner = owner; }
      ~Completing() { completing_owner = outer; }
    } completing(this);
    task.work->finish();
  } catch (const std::exception& e) {
    std::string reason = str_cat(e.what(), " [rank ", rank_, ", during ", task.sig.describe(), "]");
    RC_LOG(reason);
    fail(reason, std::current_exception());
    task.work->finish(Error(reason, error_kind_of(std::current_exception())));
  }
}

void Communicator::account(const Task& task, int64_t begin_ns, uint64_t sent0, uint64_t received0,
                           int64_t idle0) {
  const int64_t end_ns = trace::now_ns();
  OpStats op;
  op.calls = 1;
  op.bytes_sent = mesh_->payload_sent() - sent0;
  op.bytes_received = mesh_->payload_received() - received0;
  op.queued_ns = task.queued_ns ? begin_ns - task.queued_ns : 0;
  op.run_ns = end_ns - begin_ns;
  op.idle_ns = mesh_->idle_ns() - idle0;
  op.algorithm = algorithm_name(task.sig);
  task.work->set_stats(op);
  totals_[size_t(task.sig.coll)].add(op);
  if (!trace::enabled()) return;
  const int32_t thread = trace::thread_id();
  if (op.queued_ns > 0) {
    trace::Event queued{"queued", nullptr, task.queued_ns, begin_ns, thread};
    queued.seq = int64_t(task.sig.seq);
    queued.comm = trace_id_;
    trace::record(queued);
  }
  trace::Event e{collective_name(task.sig.coll), op.algorithm, begin_ns, end_ns, thread};
  e.seq = int64_t(task.sig.seq);
  e.bytes = task.sig.count * dtype_size(task.sig.dtype);
  e.comm = trace_id_;
  trace::record(e);
}

void Communicator::count_point_to_point(bool is_send, size_t bytes) {
  OpStats op;
  op.calls = 1;
  (is_send ? op.bytes_sent : op.bytes_received) = bytes;
  totals_[size_t(Collective::kSendRecv)].add(op);
}

std::map<std::string, OpStats> Communicator::stats() const {
  std::map<std::string, OpStats> named;
  for (size_t c = 0; c < totals_.size(); ++c) {
    OpStats op = totals_[c].load();
    if (op.calls) named[collective_name(Collective(c))] = op;
  }
  return named;
}

void Communicator::fail(const std::string& reason, const std::exception_ptr& error) {
  std::deque<Task> dropped;
  std::deque<AnySource> unmatched;
  const ErrorKind kind = error_kind_of(error);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_.empty()) {
      broken_ = reason;
      broken_kind_ = kind;
    }
    dropped.swap(queue_);
    unmatched.swap(any_source_);
    for (const AnySource& a : unmatched) p2p_deadlines_.erase(a.id);
  }
  mesh_->abort(reason, error);
  {
    // abort() returns only now, with the peers told. It used to return once broken_ was set, and
    // a process exiting right after left its peers a bare close (the flaky PowerSGD test's
    // [prepare] case, which aborts from the calling thread).
    std::lock_guard<std::mutex> lk(mu_);
    peers_told_ = true;
  }
  cv_.notify_all();
  for (Task& t : dropped) t.work->finish(Error("communicator is broken: " + reason, kind));
  for (AnySource& a : unmatched) a.work->finish(Error(reason, kind));
}

void Communicator::abort(const std::string& reason) {
  const std::string why = reason.empty() ? "aborted" : reason;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!broken_.empty() || closed_) return;
    abort_reason_ = why;
  }
  mesh_->interrupt(why);  // the thread inside an operation throws out of its wait
  wake();
  cv_.notify_all();
  std::unique_lock<std::mutex> lk(mu_);
  const bool completing = completing_owner == this;
  if (completing || on_progress_thread() || !progress_thread_.joinable()) {
    // No thread to hand it to (a callback, or never connected): fail here, outside the mesh
    // only if nobody is inside it. Otherwise the progress thread does once the mesh is free.
    if ((completing || !executing_) && broken_.empty()) {
      lk.unlock();
      fail_aborted(why);
    }
    return;
  }
  cv_.wait_for(lk, std::chrono::seconds(1), [&] { return peers_told_; });
}

void Communicator::fail_aborted(const std::string& why) {
  const std::string reason = str_cat("aborted: ", why, " [rank ", rank_, "]");
  fail(reason, std::make_exception_ptr(Error(reason, ErrorKind::kAborted)));
}

void Communicator::progress_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  // While only sends and receives are outstanding, this thread announces on whom it waits, as a
  // collective's wait does (Mesh::wait_any): a peer blocked on this rank can then follow the
  // chain past it. Unset until such a wait begins.
  Clock::time_point next_notice;
  while (true) {
    if (p2p_deadlines_.empty()) next_notice = Clock::time_point();
    cv_.wait(lk, [&] {
      return !executing_ && (stopping_ || !queue_.empty() || !p2p_deadlines_.empty() ||
                             (!abort_reason_.empty() && broken_.empty()));
    });
    if (!abort_reason_.empty() && broken_.empty()) {
      // Nothing was running to notice the interrupt: tell the peers and fail what is queued.
      const std::string why = abort_reason_;
      executing_ = true;
      lk.unlock();
      fail_aborted(why);
      lk.lock();
      executing_ = false;
      cv_.notify_all();
      continue;
    }
    if (!queue_.empty()) {
      Task task = std::move(queue_.front());
      queue_.pop_front();
      executing_ = true;
      lk.unlock();
      run(task);
      lk.lock();
      executing_ = false;
      cv_.notify_all();
      continue;
    }
    if (p2p_deadlines_.empty()) break;  // stopping, nothing left
    // Only sends/receives are outstanding: progress them until one finishes, new work arrives
    // (wake_fd_) or the earliest of their deadlines passes.
    auto earliest =
        std::min_element(p2p_deadlines_.begin(), p2p_deadlines_.end(),
                         [](auto& a, auto& b) { return a.second.first < b.second.first; });
    auto deadline = earliest->second.first;
    std::string what = earliest->second.second;
    if (stopping_ || Clock::now() >= deadline) {
      const bool timed_out = !stopping_;
      executing_ = true;  // the mesh is this thread's while it follows the waiting notices
      lk.unlock();
      std::string reason;
      std::exception_ptr error;
      try {
        // A peer that does not answer may itself wait on another (blocked in a collective): its
        // waiting notices lead to the rank that holds everything up, as a collective's timeout
        // says (Mesh::describe_chains). Reading them, a peer's abort may arrive: it says more.
        reason = timed_out ? str_cat("Timed out waiting for ", what,
                                     mesh_->describe_chains(mesh_->waiting_on(),
                                                            Mesh::notice_period(timeout_)))
                           : str_cat("communicator closed with ", what, " unfinished");
        reason += str_cat(" [rank ", rank_, "]");
        error = std::make_exception_ptr(
            Error(reason, timed_out ? ErrorKind::kTimeout : ErrorKind::kAborted));
      } catch (const std::exception& e) {
        reason = str_cat(e.what(), " [rank ", rank_, ", during send/recv]");
        error = std::current_exception();
      }
      fail(reason, error);
      lk.lock();
      executing_ = false;
      cv_.notify_all();
      continue;
    }
    // A receive from any source looks at its peers every millisecond: a shared-memory peer's
    // message does not wake a thread that is not sleeping on the doorbell for a posted receive.
    const auto nap = any_source_.empty() ? Clock::duration(std::chrono::seconds(1))
                                         : Clock::duration(std::chrono::milliseconds(1));
    const Clock::time_point now = Clock::now();
    if (next_notice == Clock::time_point()) next_notice = now + Mesh::notice_period(timeout_);
    executing_ = true;
    lk.unlock();
    uint64_t drained;
    while (read(wake_fd_, &drained, sizeof drained) > 0) {
    }
    try {
      if (now >= next_notice) {
        mesh_->announce_waiting();
        next_notice = now + Mesh::notice_period(timeout_);
      }
      match_any_source();
      mesh_->progress_until_event(wake_fd_, std::min({deadline, now + nap, next_notice}));
      match_any_source();
    } catch (const std::exception& e) {
      std::string reason = str_cat(e.what(), " [rank ", rank_, ", during send/recv]");
      fail(reason, std::current_exception());
    }
    lk.lock();
    executing_ = false;
  }
}

std::string Communicator::broken_reason() {
  std::lock_guard<std::mutex> lk(mu_);
  return broken_;
}

void Communicator::close() {
  if (forked_child) {
    // The progress thread did not survive the fork (it cannot be joined), and shutting the
    // sockets down would cut the parent's connections: leave both alone.
    if (progress_thread_.joinable()) new std::thread(std::move(progress_thread_));
    return;
  }
  std::unique_lock<std::mutex> lk(mu_);
  stopping_ = true;
  cv_.notify_all();
  if (on_progress_thread()) {
    lk.unlock();
    wake();
    return;
  }
  if (closing_) {
    cv_.wait(lk, [&] { return closed_; });
    return;
  }
  closing_ = true;
  lk.unlock();
  wake();
  if (progress_thread_.joinable()) progress_thread_.join();
  mesh_->close();
  lk.lock();
  closed_ = true;
  cv_.notify_all();
}

}  // namespace ringcomm
