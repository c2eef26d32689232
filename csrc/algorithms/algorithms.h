// Collective algorithms over a Context. Buffers are raw bytes of `count` elements of `dtype`.
// Files: ring.cc, tree.cc (pipelined trees: double binary tree all-reduce, binomial and chain
// broadcast/reduce), recursive_doubling.cc, halving_doubling.cc, shared_buffer.cc,
// hierarchical.cc, barrier.cc, gather.cc, scatter.cc, alltoall.cc.
#pragma once

#include <array>
#include <functional>
#include <vector>

#include "algorithms/context.h"
#include "algorithms/host_layout.h"
#include "algorithms/schedule.h"

namespace ringcomm {

// Tunables read once from RINGCOMM_* (docs/configuration.md).
struct AlgorithmTuning {
  size_t ring_slice_bytes;    // RINGCOMM_RING_SLICE_BYTES
  size_t tree_chunk_bytes;    // RINGCOMM_TREE_CHUNK_BYTES
  size_t fusion_slice_bytes;  // RINGCOMM_FUSION_SLICE_BYTES: message size of coalesced collectives
  static const AlgorithmTuning& get();
};

// RINGCOMM_TUNING=path: the link model saved there (alpha_us, bytes_per_s, reduce_bytes_per_s,
// and optionally local_alpha_us and local_bytes_per_s, else the same as the first two, and
// single_copy, 1 or 0, else 1; one "name value" per line), if the file exists and holds the
// first three.
bool load_link_model(const std::string& path, LinkModel* model);
// Writes it (whole: through a temporary file renamed over it). False if it cannot.
bool save_link_model(const std::string& path, const LinkModel& model);

// The links' alpha, beta and this rank's reduction rate, measured around the ring of all ranks
// (`one_host`: all of them on one host), and, given `host` (this rank's host's ranks, when the
// layout is uniform), around each host's ring for the links inside a host (probe.cc); every rank
// must call it at once.
LinkModel probe_links(Context& ctx, bool one_host, const std::vector<int>* host);

// Whether messages of `message` bytes between the ranks of `local` (one host's) go faster by
// single copy than through shared memory's slots: a ring all-reduce of 16 MiB timed both ways,
// switched by `use_single_copy(on)`; true on the slowest rank's figures (probe.cc). Every rank
// of `local` must call it at once.
bool probe_single_copy(Context& local, size_t message,
                       const std::function<void(bool)>& use_single_copy);

// The probe's plan at one size (probe_algorithms), for each of kMeasuredAlgorithms: its guess,
// the estimate (by the figures without factors) scaled by the factor measured where it was last
// timed or shifted by the seconds it missed that estimate by, whichever is less; and the columns
// worth timing, those whose guess is within `worth` x the cheapest. Before an algorithm is first
// timed, its factor is 1 and its miss 0.
using ProbeRow = std::array<double, kMeasuredAlgorithms.size()>;
struct ProbePlan {
  ProbeRow guess;
  double cheapest;  // the least guess
  std::vector<size_t> timed;
};
ProbePlan plan_probe(const ProbeRow& estimate, const ProbeRow& factor, const ProbeRow& missed,
                     double worth);

// What the all-reduce algorithms take among all of `ctx`'s ranks (one host's, 3 or more) over
// their estimates by `links` (figures without factors), on the slowest rank: LinkModel::factors,
// a row for each of kMeasuredBytes (probe.cc). Every rank must call it at once.
std::vector<ProbeRow> probe_algorithms(Context& ctx, const LinkModel& links);

// Rank `rank`'s steps (schedule.h) among n ranks. Ring schedules run over Segments(count, n);
// the double binary tree over tree_halves(count); recursive doubling over the whole buffer;
// halving-doubling over Segments(count, p), p the largest power of two <= n.
Schedule ring_all_reduce_schedule(int n, int rank);
Schedule ring_reduce_scatter_schedule(int n, int rank);
Schedule ring_all_gather_schedule(int n, int rank);
Schedule double_tree_all_reduce_schedule(int n, int rank);
Segments tree_halves(size_t count);
Schedule recursive_doubling_schedule(int n, int rank);
Schedule halving_doubling_schedule(int n, int rank);
// Slice lengths in elements of `elem` bytes: RINGCOMM_RING_SLICE_BYTES (for a ring of n ranks),
// RINGCOMM_TREE_CHUNK_BYTES.
size_t ring_slice(size_t elem, int n);
size_t tree_slice(size_t elem);

// How all_reduce by `algo` (ring, tree, recursive doubling or halving-doubling) runs on rank
// `rank` of n over `count` elements of `elem` bytes: its step list, the blocks it runs over, and
// the slice length in elements (schedule.cc).
struct AllReduceSchedule {
  Schedule schedule;
  Segments blocks;
  size_t slice;
};
AllReduceSchedule all_reduce_schedule(Algorithm algo, int n, int rank, size_t count, size_t elem);
// all_reduce of `buf` in place by that step list (ring, tree, recursive doubling or
// halving-doubling).
void scheduled_all_reduce(Context& ctx, Algorithm algo, void* buf, size_t count, DType dtype,
                          ReduceOp op);
// all_reduce of `buf` in place by any algorithm of kAllReduceAlgorithms (hierarchical over
// `layout`'s hosts).
void all_reduce_by(Context& ctx, Algorithm algo, const HostLayout& layout, void* buf, size_t count,
                   DType dtype, ReduceOp op);
// Its blocks alone, without building the step list (the coalesced planner asks for a thousand
// buffers' a call).
Segments all_reduce_blocks(Algorithm algo, int n, size_t count);

// all_reduce
void ring_all_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op);
// Reduce-scatter in place: `count` elements cut into size() balanced segments (Segments); after
// it, segment rank() holds the reduction over all ranks, the others partial results.
void ring_reduce_scatter_in_place(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op);
void hierarchical_all_reduce(Context& ctx, const HostLayout& layout, void* buf, size_t count,
                             DType dtype, ReduceOp op);
void recursive_doubling_all_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op);
// Every rank reduces its slice from every rank's board (shared_buffer.cc): ranks of one host
// that all reach each other through shared memory (Context::has_boards).
void shared_buffer_all_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op);
// The elements a shared-buffer all-reduce works on, where they lie: one buffer, or a coalesced
// bucket's pieces of the caller's buffers (coalesced.cc).
class BoardElements {
 public:
  virtual ~BoardElements() = default;
  // This rank's elements [first, first + count), onto its board at `offset`, for the one peer
  // that reduces them.
  virtual void copy_in(Context& ctx, size_t first, size_t count, size_t offset) = 0;
  // Reduces elements [first, first + count) from rank p's contributions at inputs[p] and this
  // rank's where it lies (inputs[rank] is not read); the result replaces this rank's, and goes
  // onto its board at `offset`, for every peer.
  virtual void reduce(Context& ctx, size_t first, size_t count, const char* const* inputs,
                      size_t offset) = 0;
  // Elements [first, first + count) of the result, from `src` (a peer's board).
  virtual void copy_out(size_t first, size_t count, const char* src) = 0;
};
// shared_buffer_all_reduce's rounds over `count` elements of `dtype`, its messages under `sig`.
void shared_buffer_rounds(Context& ctx, BoardElements& elements, size_t count, DType dtype,
                          const Signature& sig);

// reduce_scatter: `in` holds size() blocks of `count` elements; block rank() of the result
// lands in `out`.
void ring_reduce_scatter(Context& ctx, const void* in, void* out, size_t count, DType dtype,
                         ReduceOp op);
// all_gather(v): `out` holds every rank's block back to back (sizes `counts`); this rank's block
// must already be in place.
void ring_all_gather(Context& ctx, void* out, const std::vector<size_t>& counts, DType dtype);

// A rank's place in a tree: parent (-1 at the root) and children.
struct TreeLinks {
  int parent = -1;
  std::vector<int> children;  // in the order their partial results are combined
};
// The binomial tree (shape kBinomial) or chain (kChain) rooted at `root` (tree.cc).
TreeLinks rooted_tree(int n, int rank, int root, Algorithm shape);

// Rooted collectives, by a binomial tree (small) or a pipelined chain (large).
void tree_broadcast(Context& ctx, void* buf, size_t bytes, int root, Algorithm shape);
void tree_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op, int root,
                 Algorithm shape);

void dissemination_barrier(Context& ctx);

// Rooted exchanges of equal blocks of `bytes`: `outputs`/`inputs` have one pointer per rank and
// are read only at the root.
void direct_gather(Context& ctx, const void* in, const std::vector<void*>& outputs, size_t bytes,
                   int root);
void direct_scatter(Context& ctx, const std::vector<const void*>& inputs, void* out, size_t bytes,
                    int root);
// One block per (sender, receiver) pair, of any size (alltoall.cc).
void pairwise_all_to_all(Context& ctx, const std::vector<const void*>& inputs,
                         const std::vector<size_t>& in_bytes, const std::vector<void*>& outputs,
                         const std::vector<size_t>& out_bytes);

// Dense sum (or average) into `out` (numel elements of out_dtype, float types) of every rank's k
// (index, value) pairs (sparse.cc). `algo`: kSparseGather, kSparseRanges, kRing (dense) or kAuto
// (cheapest estimate, the same on every rank). Returns the algorithm used.
Algorithm sparse_all_reduce_steps(Context& ctx, const int32_t* indices, const void* values,
                                  size_t k, DType value_dtype, void* out, size_t numel,
                                  DType out_dtype, ReduceOp op, Algorithm algo);

}  // namespace ringcomm
