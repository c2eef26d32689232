// The Communicator's coalesced collectives: argument checks, grouping by dtype, buckets and their
// signatures. The pipelines themselves are in algorithms/coalesced.cc.
//
// Each bucket's signature carries a hash of its layout (the sizes of the buffers it covers and
// where it cuts them, its index and the number of buckets; for all_reduce also each buffer's
// reduction order), so ranks that pass different lists disagree on the first message and both
// raise a mismatch, as they would with one collective per buffer.
#include <algorithm>
#include <memory>

#include "algorithms/coalesced.h"
#include "communicator.h"

namespace ringcomm {
namespace {

using BufferRef = Communicator::BufferRef;

// A word at a time (a call may hold thousands of buffers): multiply-xorshift mixing.
struct LayoutHash {
  uint64_t value = 1469598103934665603ull;
  void add(uint64_t word) {
    value = (value ^ word) * 0x9e3779b97f4a7c15ull;
    value ^= value >> 29;
  }
};

// Elements [first, first + count) of buffer `index` of the call.
struct Piece {
  size_t index, first, count;
};
using Bucket = std::vector<Piece>;

// The pieces of each bucket: the group's buffers back to back, cut every `bucket_elems` (a
// buffer may straddle buckets). Empty buffers join the bucket they fall in; a group of empty
// buffers only is one empty bucket.
std::vector<Bucket> cut_into_buckets(const std::vector<BufferRef>& buffers,
                                     const std::vector<size_t>& members, size_t bucket_elems) {
  std::vector<Bucket> buckets(1);
  size_t room = bucket_elems;
  for (size_t index : members) {
    size_t first = 0, left = buffers[index].count;
    if (left == 0) buckets.back().push_back({index, 0, 0});
    while (left > 0) {
      if (room == 0) {
        buckets.emplace_back();
        room = bucket_elems;
      }
      size_t take = std::min(room, left);
      buckets.back().push_back({index, first, take});
      first += take;
      left -= take;
      room -= take;
    }
  }
  return buckets;
}

// Runs of buffers, in call order, that lie together (each starts less than kJoinGap after the
// previous one ends), those of at least one huge page (2 MiB): smaller ones hold none.
std::vector<iovec> runs_together(const std::vector<BufferRef>& buffers) {
  constexpr size_t kHugePage = 2 << 20;
  std::vector<iovec> runs;
  const char *begin = nullptr, *end = nullptr;
  auto close = [&] {
    if (begin && size_t(end - begin) >= kHugePage)
      runs.push_back({const_cast<char*>(begin), size_t(end - begin)});
  };
  for (const BufferRef& b : buffers) {
    if (b.count == 0) continue;
    const char* at = static_cast<const char*>(b.data);
    if (!begin || !joins(end, at)) {
      close();
      begin = at;
    }
    end = at + b.count * dtype_size(b.dtype);
  }
  close();
  return runs;
}

// Buffers of each dtype, in call order; dtypes in order of first appearance.
std::vector<std::vector<size_t>> group_by_dtype(const std::vector<BufferRef>& buffers) {
  std::vector<DType> seen;
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto it = std::find(seen.begin(), seen.end(), buffers[i].dtype);
    if (it == seen.end()) {
      seen.push_back(buffers[i].dtype);
      groups.emplace_back();
      it = seen.end() - 1;
    }
    groups[size_t(it - seen.begin())].push_back(i);
  }
  return groups;
}

// Every buffer's bytes must belong to it alone: one written twice, or read after another's result
// landed on it, would not give what one collective per buffer gives.
void check_disjoint(const std::vector<const BufferRef*>& buffers, const char* what) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const BufferRef* b : buffers) {
    if (b->count == 0) continue;
    auto begin = reinterpret_cast<uintptr_t>(b->data);
    spans.emplace_back(begin, begin + b->count * dtype_size(b->dtype));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    RC_CHECK_ARG(spans[i].first >= spans[i - 1].second, what,
                 " overlap in memory (the same tensor twice, or views sharing elements)");
}

std::vector<const BufferRef*> pointers(const std::vector<BufferRef>& buffers) {
  std::vector<const BufferRef*> out;
  for (const BufferRef& b : buffers) out.push_back(&b);
  return out;
}

// The pack list of a bucket's pieces of `buffers`.
cpu::PackList pack_list(DType dtype, const Bucket& bucket, const std::vector<BufferRef>& buffers) {
  cpu::PackList list(dtype);
  for (const Piece& p : bucket)
    list.add(static_cast<char*>(buffers[p.index].data) + p.first * dtype_size(dtype), p.count);
  return list;
}

struct PlannedBucket {
  FusedBucket fused;
  Bucket pieces;
};

// The call's buckets: `buffers` grouped by dtype, each group laid back to back as it travels
// (dtype wire_of(dtype)) and cut every bucket_bytes. Fills in each bucket's pack list, order
// group and base, and signature dtype, count and layout hash (extra(hash, buffer index) adds
// per-buffer words); the caller completes the signature.
template <typename WireOf, typename Extra>
std::vector<PlannedBucket> plan_buckets(const std::vector<BufferRef>& buffers, size_t bucket_bytes,
                                        WireOf wire_of, Extra extra) {
  RC_CHECK_ARG(bucket_bytes > 0, "bucket_bytes must be positive");
  std::vector<PlannedBucket> planned;
  const auto groups = group_by_dtype(buffers);
  for (size_t g = 0; g < groups.size(); ++g) {
    const DType dtype = buffers[groups[g][0]].dtype, wire = wire_of(dtype);
    size_t base = 0;
    for (Bucket& pieces : cut_into_buckets(buffers, groups[g],
                                           std::max<size_t>(1, bucket_bytes / dtype_size(wire)))) {
      PlannedBucket b{{{}, pack_list(dtype, pieces, buffers), {}, g, base}, std::move(pieces)};
      b.fused.sig.dtype = wire;
      b.fused.sig.count = b.fused.buffers.count();
      base += b.fused.sig.count;
      planned.push_back(std::move(b));
    }
  }
  for (size_t i = 0; i < planned.size(); ++i) {
    LayoutHash h;
    h.add(i);
    h.add(planned.size());
    h.add(uint64_t(planned[i].fused.buffers.dtype()));
    for (const Piece& p : planned[i].pieces) {
      h.add(buffers[p.index].count);
      h.add(p.first);
      h.add(p.count);
      extra(h, p.index);
    }
    planned[i].fused.sig.aux = h.value;
  }
  return planned;
}

void no_extra(LayoutHash&, size_t) {}
DType same_dtype(DType t) { return t; }

// Sets the parts of `sig` the planner leaves to the collective.
void complete(Signature& sig, Collective coll, ReduceOp op, Algorithm algo, int root) {
  sig.coll = coll;
  sig.op = op;
  sig.algo = algo;
  sig.root = root;
}

}  // namespace

std::shared_ptr<const ReductionOrders> Communicator::reduction_orders(uint32_t algorithms) {
  std::lock_guard<std::mutex> lk(orders_mu_);
  std::shared_ptr<ReductionOrders> grown;
  for (Algorithm a : kAllReduceAlgorithms) {
    if (!(algorithms & (1u << unsigned(a))) || (orders_ && orders_->has(a))) continue;
    if (!grown)
      grown = orders_ ? std::make_shared<ReductionOrders>(*orders_)
                      : std::make_shared<ReductionOrders>(world_size_, layout_);
    grown->require(a);
  }
  if (grown) orders_ = std::move(grown);
  return orders_;
}

bool Communicator::CoalescedCall::same(const std::vector<BufferRef>& b, ReduceOp o, size_t bytes,
                                       const FusedReduceOptions& opt) const {
  if (o != op || bytes != bucket_bytes || opt.float32_wire != options.float32_wire ||
      opt.prescale != options.prescale || b.size() != buffers.size())
    return false;
  for (size_t i = 0; i < b.size(); ++i)
    if (b[i].data != buffers[i].data || b[i].count != buffers[i].count ||
        b[i].dtype != buffers[i].dtype)
      return false;
  return true;
}

WorkPtr Communicator::all_reduce_coalesced(const std::vector<BufferRef>& buffers, ReduceOp op,
                                           size_t bucket_bytes, const FusedReduceOptions& options,
                                           bool async) {
  // Its reduction orders are the built-ins'; a registered algorithm runs through all_reduce.
  RC_CHECK_ARG(forced_registered_.empty(),
               "all_reduce_coalesced runs the built-in algorithms: "
               "RINGCOMM_ALGO=",
               forced_registered_, " names a registered one");
  std::shared_ptr<const CoalescedAllReduce> plan;
  {
    std::lock_guard<std::mutex> lk(coalesced_mu_);
    for (auto it = coalesced_calls_.begin(); it != coalesced_calls_.end(); ++it) {
      if (!it->same(buffers, op, bucket_bytes, options)) continue;
      plan = it->plan;
      if (it != coalesced_calls_.begin()) {
        CoalescedCall hit = std::move(*it);
        coalesced_calls_.erase(it);
        coalesced_calls_.push_front(std::move(hit));
      }
      break;
    }
  }
  if (!plan) {
    plan = plan_all_reduce_coalesced(buffers, op, bucket_bytes, options);
    std::lock_guard<std::mutex> lk(coalesced_mu_);
    coalesced_calls_.push_front({buffers, op, bucket_bytes, options, plan});
    if (coalesced_calls_.size() > kCoalescedPlansKept) coalesced_calls_.pop_back();
  }
  if (plan->buckets.empty()) return finished_work();  // an empty list
  return submit(
      plan->buckets[0].sig,
      [this, plan](Context& ctx) {
        for (const iovec& run : plan->runs) mesh_->offer_huge_pages(run.iov_base, run.iov_len);
        // Here, in the order operations run: the retuned choice is the same on every rank.
        coalesced_all_reduce(ctx, *plan, coalesced_through_boards(*plan));
      },
      async, plan->buckets.size());
}

// The boards, unless RINGCOMM_ALGO forces another algorithm, or two ranks send by single copy.
// They beat the pipeline at 4 and 8 ranks, with single copy or without, on views of one buffer
// and on spread tensors; at 2 ranks through the slots they are level or ahead
// (docs/algorithms.md). At 2 ranks by single copy the pipeline, reading views of one buffer
// straight out of the peer's memory, beats the boards on such views but not on spread tensors:
// there the call goes the way of a flat all-reduce of its largest bucket, which runs the boards
// or reads by single copy.
bool Communicator::coalesced_through_boards(const CoalescedAllReduce& plan) const {
  if (forced_all_reduce_ != Algorithm::kAuto) return forced_all_reduce_ == Algorithm::kSharedBuffer;
  if (world_size_ == 2 && plan.one_host && selector_.model().single_copy)
    return algorithm_for(plan.largest_bucket_bytes, Algorithm::kAuto) == Algorithm::kSharedBuffer;
  return true;
}

std::shared_ptr<const CoalescedAllReduce> Communicator::plan_all_reduce_coalesced(
    const std::vector<BufferRef>& buffers, ReduceOp op, size_t bucket_bytes,
    const FusedReduceOptions& options) {
  const DType f32_wire = options.float32_wire;
  RC_CHECK_ARG(
      f32_wire == DType::kFloat32 || f32_wire == DType::kFloat16 || f32_wire == DType::kBFloat16,
      "float32 buffers travel as float32, float16 or bfloat16, not ", dtype_name(f32_wire));
  auto wire_of = [&](DType t) { return t == DType::kFloat32 ? f32_wire : t; };
  auto plan = std::make_shared<CoalescedAllReduce>();
  plan->op = op;
  plan->one_host = layout_.hosts.size() == 1;
  if (options.prescale != 1.0) plan->pack_scaling = {cpu::ScaleKind::kMultiply, options.prescale};
  if (op == ReduceOp::kAvg) plan->unpack_scaling = {cpu::ScaleKind::kDivide, double(world_size_)};
  for (const BufferRef& b : buffers) {
    RC_CHECK_ARG(op != ReduceOp::kAvg || is_floating(b.dtype), "op avg needs floating dtypes, got ",
                 dtype_name(b.dtype));
    checked_op(int(op), b.dtype);  // bitwise ops on integers and bool only
    cpu::check_conversion(b.dtype, wire_of(b.dtype), plan->pack_scaling);
    cpu::check_conversion(wire_of(b.dtype), b.dtype, plan->unpack_scaling);
  }
  check_disjoint(pointers(buffers), "buffers");
  plan->runs = runs_together(buffers);

  // Each buffer is reduced in the order all_reduce would use on its packed bytes.
  std::vector<Algorithm> algos;
  uint32_t used = 0;  // a bit per algorithm chosen
  for (const BufferRef& b : buffers) {
    algos.push_back(choose_all_reduce(b.count * dtype_size(wire_of(b.dtype)), Algorithm::kAuto));
    used |= 1u << unsigned(algos.back());
  }
  if (world_size_ > 1) {
    plan->orders = reduction_orders(used);
    for (const auto& members : group_by_dtype(buffers)) {
      plan->ranges.emplace_back();
      size_t offset = 0;
      for (size_t i : members) {
        plan->orders->ranges(algos[i], buffers[i].count, offset, plan->ranges.back());
        offset += buffers[i].count;
      }
    }
  }
  auto add_algorithm = [&](LayoutHash& h, size_t i) { h.add(uint64_t(algos[i])); };
  for (PlannedBucket& b : plan_buckets(buffers, bucket_bytes, wire_of, add_algorithm)) {
    complete(b.fused.sig, Collective::kAllReduceCoalesced, op, Algorithm::kDirect, -1);
    plan->buckets.push_back(std::move(b.fused));
  }
  finish_plan(*plan);
  return plan;
}

WorkPtr Communicator::broadcast_coalesced(const std::vector<BufferRef>& buffers, int root,
                                          size_t bucket_bytes, bool async) {
  check_rank(root, "broadcast src");
  check_disjoint(pointers(buffers), "buffers");
  auto buckets = std::make_shared<std::vector<FusedBucket>>();
  for (PlannedBucket& b : plan_buckets(buffers, bucket_bytes, same_dtype, no_extra)) {
    // The shape broadcast would pick for the fused bucket.
    const size_t bytes = b.fused.sig.count * dtype_size(b.fused.sig.dtype);
    const Algorithm shape = choose_rooted(bytes);
    complete(b.fused.sig, Collective::kBroadcastCoalesced, ReduceOp::kSum, shape, root);
    buckets->push_back(std::move(b.fused));
  }
  if (buckets->empty()) return finished_work();  // an empty list
  const Signature first = (*buckets)[0].sig;
  return submit(
      first, [buckets, root](Context& ctx) { coalesced_broadcast(ctx, *buckets, root); }, async,
      buckets->size());
}

WorkPtr Communicator::all_gather_coalesced(const std::vector<std::vector<BufferRef>>& outputs,
                                           const std::vector<BufferRef>& inputs,
                                           size_t bucket_bytes, bool async) {
  RC_CHECK_ARG(int(outputs.size()) == world_size_, "all_gather_coalesced needs ", world_size_,
               " output lists, got ", outputs.size());
  std::vector<const BufferRef*> all = pointers(inputs);
  for (int q = 0; q < world_size_; ++q) {
    const auto& out = outputs[size_t(q)];
    RC_CHECK_ARG(out.size() == inputs.size(), "output list ", q, " has ", out.size(),
                 " buffers, expected ", inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      RC_CHECK_ARG(out[i].dtype == inputs[i].dtype && out[i].count == inputs[i].count, "output ", q,
                   "[", i, "] (", out[i].count, " x ", dtype_name(out[i].dtype),
                   ") does not match input ", i, " (", inputs[i].count, " x ",
                   dtype_name(inputs[i].dtype), ")");
      all.push_back(&out[i]);
    }
  }
  check_disjoint(all, "inputs and outputs");
  auto buckets = std::make_shared<std::vector<FusedBucket>>();
  for (PlannedBucket& b : plan_buckets(inputs, bucket_bytes, same_dtype, no_extra)) {
    complete(b.fused.sig, Collective::kAllGatherCoalesced, ReduceOp::kSum, Algorithm::kDirect, -1);
    for (const auto& out : outputs)
      b.fused.outputs.push_back(pack_list(b.fused.sig.dtype, b.pieces, out));
    buckets->push_back(std::move(b.fused));
  }
  if (buckets->empty()) return finished_work();  // an empty list
  const Signature first = (*buckets)[0].sig;
  return submit(
      first, [buckets](Context& ctx) { coalesced_all_gather(ctx, *buckets); }, async,
      buckets->size());
}

}  // namespace ringcomm
