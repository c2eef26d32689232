// Collectives written outside the core: step lists (schedule.h) registered by name
// (ringcomm.algorithms builds them in Python), checked by running every rank's list symbolically
// before a byte is sent, and run by the same executor as the built-in lists.
//
// A registered algorithm is one collective's lists for a number of ranks (and, where it asks, for
// a size class: the messages of 2^k .. 2^(k+1)-1 bytes), all over `blocks` blocks of the buffer,
// cut as Segments cuts them (all_reduce, broadcast, reduce: the buffer into `blocks`;
// reduce_scatter, all_gather: each rank's share into blocks / n, rank r's share being blocks
// r * blocks / n onwards). Broadcast and reduce lists are written for root 0 and run with every
// rank renumbered from the root.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "algorithms/context.h"
#include "algorithms/schedule.h"

namespace ringcomm {

// The collectives a registered algorithm may be written for.
constexpr Collective kRegisteredCollectives[] = {Collective::kAllReduce, Collective::kReduceScatter,
                                                 Collective::kAllGather, Collective::kBroadcast,
                                                 Collective::kReduce};

struct AlgorithmLists {
  std::string name;
  Collective coll = Collective::kAllReduce;
  int blocks = 1;
  Pipeline pipeline = Pipeline::kByStep;
  // The slice each block travels in: -1 the pipeline's own (by step the ring's,
  // RINGCOMM_RING_SLICE_BYTES; by slice the tree's, RINGCOMM_TREE_CHUNK_BYTES), 0 whole blocks.
  int64_t slice_bytes = -1;
  std::vector<Schedule> schedules;  // by rank
  // The lists differ by size class: these are for one (its lower bound, set by the registry);
  // else they serve every size.
  bool sized = false;
  size_t size_class = 0;
  // Set by check_lists: a hash of everything above, the same on every rank that built the same
  // lists (it travels in the signature's aux, so ranks whose lists differ fail as a mismatch).
  uint64_t id = 0;
};

// Checks `lists` and completes them: throws std::invalid_argument, naming the algorithm and the
// rank, step and block at fault, unless every step names a block and another rank; the lists
// fit together as they run (run_symbolically: no deadlock, every message received as the block
// its receiver expects, no block written while a send of it may still be read), also block by
// slice where they are pipelined by slice (blocks in 1, 2 and 3 slices, and in uneven numbers);
// every block ends where the collective puts it (all_reduce: on every rank; reduce_scatter: on
// its share's rank; reduce: on the root) holding every rank's contribution once, combined in the
// same order wherever it ends complete; and the collectives that only move blocks (all_gather,
// broadcast) reduce nothing and leave every rank with the block of its owner (or the root). Marks
// the steps that complete a block (avg divides there) and sets the id. Returns each block's
// order of combination, "((0 1) 2)" (none for the collectives that only move blocks).
std::vector<std::string> check_lists(AlgorithmLists& lists);

// Where registered lists come from: the lists of `name` for `world_size` ranks and messages of
// the size class `size_class` (a power of two, or 0), unchecked, or nullopt where it knows no
// such name; `world_size` 0 asks only whether it knows the name (ringcomm.algorithms, through
// the bindings).
using ListsSource = std::function<std::optional<AlgorithmLists>(const std::string& name,
                                                                int world_size, size_t size_class)>;
void set_lists_source(ListsSource source);
// The size class of a message of `bytes`: the largest power of two <= bytes, or 0.
size_t size_class_of(size_t bytes);
// The checked lists of `name` for `coll` among `world_size` ranks, for a message of `bytes`
// (the collective's buffer; reduce_scatter's input, all_gather's output), from the source at
// their first use (on the caller's thread, before anything is sent): once per world size, or per
// size class for lists that differ by size, kept until forget_lists(name); nullptr where the
// source knows no such name. Throws what check_lists throws, or where the lists are another
// collective's. One rank moves nothing: its lists are one empty list, whatever the source would
// build.
std::shared_ptr<const AlgorithmLists> registered_lists(const std::string& name, Collective coll,
                                                       int world_size, size_t bytes);
// Whether the source knows `name`.
bool lists_known(const std::string& name);
// Drops the lists kept for `name` (registered again, or no longer).
void forget_lists(const std::string& name);

// The collectives by registered lists, on this rank's list; their buffers as the built-ins'
// (algorithms.h): reduce_scatter's `in` holds every rank's share of `count`, all_gather's `out`
// every rank's share with this rank's in place.
void registered_all_reduce(Context& ctx, const AlgorithmLists& lists, void* buf, size_t count,
                           DType dtype, ReduceOp op);
void registered_reduce_scatter(Context& ctx, const AlgorithmLists& lists, const void* in, void* out,
                               size_t count, DType dtype, ReduceOp op);
void registered_all_gather(Context& ctx, const AlgorithmLists& lists, void* out, size_t count,
                           DType dtype);
void registered_broadcast(Context& ctx, const AlgorithmLists& lists, void* buf, size_t bytes,
                          int root);
void registered_reduce(Context& ctx, const AlgorithmLists& lists, void* buf, size_t count,
                       DType dtype, ReduceOp op, int root);

}  // namespace ringcomm
