// Coalesced collectives (coalesced.cc): many buffers moved as a few fused operations, the
// buckets, each pipelined in slices through pack -> exchange -> unpack.
#pragma once

#include <vector>

#include "algorithms/context.h"
#include "algorithms/reduction_order.h"
#include "kernels/cpu/pack.h"

namespace ringcomm {

// One operation on the wire: the bucket's elements of the caller's buffers (whole buffers, or
// pieces of one at the bucket's edges), fused back to back. Bucket i of a call travels under
// `sig` with sequence number (the call's first) + i; sig.dtype is the dtype on the wire and
// sig.count the number of elements.
struct FusedBucket {
  Signature sig;
  cpu::PackList buffers;               // all_gather: this rank's inputs
  std::vector<cpu::PackList> outputs;  // all_gather: rank q's inputs land in outputs[q]
  // all_reduce: the reduction order of each element is ranges[order_group], in the coordinates
  // of its dtype group, where the bucket starts at order_base.
  size_t order_group = 0, order_base = 0;
};

struct CoalescedAllReduce {
  std::vector<FusedBucket> buckets;
  ReduceOp op = ReduceOp::kSum;
  cpu::Scaling pack_scaling, unpack_scaling;
  // The communicator's, as they were when this call was planned: later calls may add to them
  // while this one runs.
  std::shared_ptr<const ReductionOrders> orders;
  std::vector<std::vector<OrderedRange>> ranges;  // per dtype group, sorted
  bool one_host = false;  // every rank on one host (the communicator's layout)
  // The buffers' memory as runs of buffers that lie together (kJoinGap, transport.h), those
  // large enough to hold a huge page: the communicator offers them for huge pages, as it offers
  // a flat all-reduce's buffer, since single copy reads such runs as one.
  std::vector<iovec> runs;
  // Set by finish_plan once the buckets are planned:
  size_t largest_bucket_bytes = 0;  // on the wire (Communicator::coalesced_through_boards)
  // Every bucket holds elements (an empty one is checked against the peers' signatures by the
  // pipeline's messages) that need no cast or scaling either way: the buckets can go through
  // shared memory's boards where the ranks reach each other's.
  bool fits_boards = false;
};

// Fills in what the plan's buckets decide (the fields after `runs`).
void finish_plan(CoalescedAllReduce& plan);

// Every element is reduced at one rank from all contributions, in plan.orders' order, and the
// results are unpacked (with plan.unpack_scaling) into the buffers on every rank. With `boards`
// the buckets go through the boards if they can (every rank reaching every board, no cast or
// scaling), else through the pipeline. Every rank must pass the same.
void coalesced_all_reduce(Context& ctx, const CoalescedAllReduce& plan, bool boards);
// The root's buffers are copied into every other rank's; each bucket's sig.algo picks a binomial
// tree or a chain.
void coalesced_broadcast(Context& ctx, const std::vector<FusedBucket>& buckets, int root);
// Every rank's buffers land in outputs[rank] on every rank.
void coalesced_all_gather(Context& ctx, const std::vector<FusedBucket>& buckets);

}  // namespace ringcomm
