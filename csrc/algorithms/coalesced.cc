// Coalesced collectives: the caller's buffers, grouped by dtype and cut into buckets (one
// operation on the wire each, with its own sequence number and signature). An all_reduce whose
// buckets can go through shared memory's boards runs each through the shared buffer's rounds
// (shared_buffer.cc) over the buffers where they lie (BucketElements). Otherwise they flow
// through a pipeline of slices. A slice is packed from the buffers into a slice buffer (cast and
// scaled on the way, kernels/cpu/pack.h), exchanged, and unpacked back into the buffers.
//
// Iteration t of the pipeline runs stage 0 of slice t, then stage 1 of slice t-1, then stage 2
// of slice t-2. Every wait progresses all posted messages, so packing slice t and unpacking
// slice t-2 run while slice t-1 (and t) are in flight, on the one thread that runs the
// operation. Slices run on across bucket edges: bucket i+1 is packed while bucket i's last slices
// are still on the wire. S below is RINGCOMM_FUSION_SLICE_BYTES, the size of one message.
//
// all_reduce, 3 stages; a slice is n parts of S, part k owned by rank k:
//   0. pack part `me`; send part k to rank k (every k != me), packed as it goes out
//      (Context::send_produce); receive every rank's part `me` (with two ranks, the one other
//      contribution is reduced into part `me` as it arrives, Context::recv_apply: from a
//      shared-memory peer's slots without a copy).
//   1. reduce part `me` from the n contributions, element by element in the order that one
//      all_reduce per buffer would have used (reduction_order.h), so the results are bitwise
//      those of per-buffer all_reduce (two ranks: done in stage 0); send it to every rank;
//      unpack it. With no cast or scaling, no part is packed: the reduction reads my
//      contribution from the buffers and writes the result back into them, and every part
//      travels as ranges of the buffers (Context::send_ranges, recv_ranges): copied into and
//      out of a shared-memory peer's slots, or read by the peer straight out of the buffers by
//      single copy (with two ranks, then, the copies of a flat all-reduce).
//   2. receive every other part from its owner, unpacked as it arrives (Context::recv_apply),
//      or straight into the buffers.
//   Bytes on the wire per rank: 2(n-1)/n of the data (sent and received), as a ring all-reduce,
//   in two message latencies per slice. Every rank gets the owner's bits.
// broadcast, 2 stages; the binomial tree or chain of broadcast (by bucket size):
//   0. the root packs the slice and sends it to its children; the others receive it from their
//      parent.  1. forward it to the children; unpack it.   S received per rank per slice.
// all_gather, 2 stages; a slice is S of every rank's inputs:
//   0. pack my slice; send it to every rank; receive every rank's slice.  1. unpack all of them.
//   (n-1) S sent and received per rank per slice.
#include "algorithms/coalesced.h"

#include <algorithm>
#include <cstdint>

#include "algorithms/algorithms.h"

namespace ringcomm {
namespace {

struct Slice {
  size_t bucket, begin, end;  // fused elements [begin, end) of the bucket
  size_t count() const { return end - begin; }
};

// Elements of bucket `b` in one message: at most RINGCOMM_FUSION_SLICE_BYTES, and no more than
// `pieces` messages need to carry the whole bucket (so small buckets reserve small buffers).
size_t message_elems(const FusedBucket& b, size_t pieces) {
  const size_t per_slice =
      std::max<size_t>(1, AlgorithmTuning::get().fusion_slice_bytes / dtype_size(b.sig.dtype));
  return std::max<size_t>(1, std::min(per_slice, (b.buffers.count() + pieces - 1) / pieces));
}

// Bucket `b` needs no cast or scaling on the way out: the reduction reads this rank's
// contribution straight from the buffers, and the parts it sends travel as ranges of them.
bool coalesced_from_buffers(const CoalescedAllReduce& plan, const FusedBucket& b) {
  return plan.pack_scaling.kind == cpu::ScaleKind::kNone && b.buffers.dtype() == b.sig.dtype;
}

// The caller's memory holding fused elements [begin, begin + count) of `list`, listed in
// scratch.
Ranges ranges_of(Context& ctx, const cpu::PackList& list, size_t begin, size_t count) {
  if (count == 0) return {};
  const size_t e = dtype_size(list.dtype());
  const size_t most = list.find(begin + count - 1) - list.find(begin) + 1;
  auto* ranges = reinterpret_cast<iovec*>(ctx.scratch(most * sizeof(iovec)));
  size_t used = 0;
  kernels::for_parts(list, begin, begin + count, [&](size_t i, size_t pos, size_t len) {
    ranges[used++] = {list.data(i) + (pos - list.offset(i)) * e, len * e};
  });
  return {ranges, used};
}

// Slices of at most `per_bucket(bucket)` elements, at least one per bucket so that an empty
// bucket still travels and is checked against the peers' signatures.
template <typename PerBucket>
std::vector<Slice> slices_of(const std::vector<FusedBucket>& buckets, PerBucket per_bucket) {
  std::vector<Slice> slices;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const size_t count = buckets[b].buffers.count(), slice = per_bucket(buckets[b]);
    for (size_t j = 0, pieces = piece_count(count, slice); j < pieces; ++j)
      slices.push_back({b, std::min(count, j * slice), std::min(count, (j + 1) * slice)});
  }
  return slices;
}

// The largest per-message buffer any bucket needs, in bytes, rounded up to a cache line: buffers
// are laid back to back, one per rank, and each must be aligned for every dtype.
template <typename PerBucket>
size_t max_message_bytes(const std::vector<FusedBucket>& buckets, PerBucket per_bucket) {
  size_t bytes = 1;
  for (const FusedBucket& b : buckets)
    bytes = std::max(bytes, per_bucket(b) * dtype_size(b.sig.dtype));
  return (bytes + 63) / 64 * 64;
}

// Bucket i's signature carries the call's first sequence number + i.
std::vector<Signature> signatures(const Context& ctx, const std::vector<FusedBucket>& buckets) {
  std::vector<Signature> sigs;
  for (size_t i = 0; i < buckets.size(); ++i) {
    sigs.push_back(buckets[i].sig);
    sigs.back().seq = ctx.signature().seq + i;
  }
  return sigs;
}

// Runs stage(s, c) for stage s < depth of slice c at iteration c + s, stages in order. Slice c
// uses buffers c % depth, which slice c + depth takes over once slice c's sends are out: only
// those are waited for, so that the sends of the slices in between stay in flight.
template <typename Stage>
void run_pipeline(Context& ctx, const std::vector<Slice>& slices,
                  const std::vector<Signature>& sigs, size_t depth, Stage stage) {
  const size_t count = slices.size();
  std::vector<std::vector<Request>> sends(depth);  // by buffers: the sends of their slice
  for (size_t t = 0; t + 1 < count + depth; ++t) {
    // The oldest slice in flight: messages of later buckets may arrive before they are expected.
    size_t oldest = t + 1 < depth ? 0 : std::min(count - 1, t + 1 - depth);
    ctx.set_current(sigs[slices[oldest].bucket]);
    if (t >= depth) {
      for (Request r : sends[t % depth]) ctx.wait(r);
      sends[t % depth].clear();
    }
    for (size_t s = 0; s < depth; ++s) {
      if (t < s || t - s >= count) continue;
      const size_t mark = ctx.sends_posted();
      stage(s, t - s);
      ctx.take_sends(mark, sends[(t - s) % depth]);
    }
  }
  for (const std::vector<Request>& left : sends)
    for (Request r : left) ctx.wait(r);
  ctx.finish();
}

// n pointers, on the stack for up to 16 ranks: the reductions below take one list per buffer
// piece, a thousand per call for a thousand small tensors, where a heap allocation each showed.
class Pointers {
 public:
  explicit Pointers(int n) : heap_(n > kOnStack ? size_t(n) : 0) {}
  const char** data() { return heap_.empty() ? stack_ : heap_.data(); }
  const char*& operator[](int q) { return data()[q]; }

 private:
  static constexpr int kOnStack = 16;
  const char* stack_[kOnStack];
  std::vector<const char*> heap_;
};

// out = my part's reduction, for fused elements [begin, begin + count) of bucket `b`, each
// element by its own range's program. inputs[q]: rank q's contribution to those elements.
// `cursor` (may be null): where the caller's last call left off in the group's ranges, kept by
// callers that walk the elements in order (SIZE_MAX at first): the next range is then the same
// or a step or two on, where a binary search over every buffer's ranges cost more than reducing
// a small buffer.
void reduce_in_order(const CoalescedAllReduce& plan, const FusedBucket& b, size_t begin,
                     size_t count, const char* const* inputs, char* out, char* temps, int n,
                     size_t* cursor = nullptr) {
  const std::vector<OrderedRange>& ranges = plan.ranges[b.order_group];
  const DType dtype = b.sig.dtype;
  const size_t e = dtype_size(dtype), first = b.order_base + begin, last = first + count;
  auto it = ranges.begin();
  if (cursor && *cursor < ranges.size() && ranges[*cursor].begin <= first) {
    it += std::ptrdiff_t(*cursor);  // the loop below passes over the ranges that end before
  } else {
    it = std::upper_bound(ranges.begin(), ranges.end(), first,
                          [](size_t pos, const OrderedRange& r) { return pos < r.begin; });
    if (it != ranges.begin()) --it;
  }
  Pointers shifted(n);
  for (; it != ranges.end() && it->begin < last; ++it) {
    size_t lo = std::max(first, it->begin), hi = std::min(last, it->begin + it->count);
    if (cursor) *cursor = size_t(it - ranges.begin());
    if (lo >= hi) continue;
    for (int q = 0; q < n; ++q) shifted[q] = inputs[q] + (lo - first) * e;
    plan.orders->program(it->program)
        .run(dtype, plan.op, shifted.data(), out + (lo - first) * e, hi - lo, temps);
  }
}

// reduce_in_order with my contribution (rank `me`) read from the bucket's buffers and the
// others' from inputs[q] (contiguous over the range; inputs[me] is not read); the result goes
// back into the buffers (`out` null) or to `out`.
void reduce_from_buffers(const CoalescedAllReduce& plan, const FusedBucket& b, size_t begin,
                         size_t count, int me, const char* const* inputs, char* out, char* temps,
                         int n) {
  const size_t e = dtype_size(b.sig.dtype);
  const cpu::PackList& list = b.buffers;
  Pointers shifted(n);
  size_t cursor = SIZE_MAX;
  kernels::for_parts(list, begin, begin + count, [&](size_t i, size_t pos, size_t len) {
    cpu::fetch_ahead(list, i);
    const size_t at = (pos - begin) * e;
    char* own = list.data(i) + (pos - list.offset(i)) * e;
    for (int q = 0; q < n; ++q) shifted[q] = q == me ? own : inputs[q] + at;
    reduce_in_order(plan, b, pos, len, shifted.data(), out ? out + at : own, temps, n, &cursor);
  });
}

// A bucket's elements where they lie in the caller's buffers, for the shared-buffer rounds
// (shared_buffer.cc): gathered onto the board range by range, each reduced by its own buffer's
// program (every rank's contribution is at hand), the results scattered back.
class BucketElements : public BoardElements {
 public:
  BucketElements(const CoalescedAllReduce& plan, const FusedBucket& b, char* temps)
      : plan_(plan), b_(b), temps_(temps) {}
  void copy_in(Context& ctx, size_t first, size_t count, size_t offset) override {
    publish(ctx, first, count, offset, 1);
  }
  void reduce(Context& ctx, size_t first, size_t count, const char* const* inputs,
              size_t offset) override {
    reduce_from_buffers(plan_, b_, first, count, ctx.rank(), inputs, nullptr, temps_, ctx.size());
    publish(ctx, first, count, offset, ctx.size() - 1);
  }
  void copy_out(size_t first, size_t count, const char* src) override {
    cpu::unpack(src, b_.sig.dtype, b_.buffers, first, first + count, {});
  }

 private:
  void publish(Context& ctx, size_t first, size_t count, size_t offset, int readers) {
    ScratchFrame frame(ctx);
    ctx.write_board(offset, ranges_of(ctx, b_.buffers, first, count), readers);
  }

  const CoalescedAllReduce& plan_;
  const FusedBucket& b_;
  char* temps_;
};

}  // namespace

void finish_plan(CoalescedAllReduce& plan) {
  plan.largest_bucket_bytes = 0;
  plan.fits_boards = plan.unpack_scaling.kind == cpu::ScaleKind::kNone;
  for (const FusedBucket& b : plan.buckets) {
    plan.largest_bucket_bytes =
        std::max(plan.largest_bucket_bytes, b.sig.count * dtype_size(b.sig.dtype));
    plan.fits_boards &= b.buffers.count() > 0 && coalesced_from_buffers(plan, b);
  }
}

void coalesced_all_reduce(Context& ctx, const CoalescedAllReduce& plan, bool boards) {
  const int n = ctx.size(), me = ctx.rank();
  if (n == 1 || plan.buckets.empty()) return;
  size_t temp_bytes = 1;
  for (const FusedBucket& b : plan.buckets)
    temp_bytes = std::max(temp_bytes, plan.orders->scratch_bytes(b.sig.dtype));
  char* temps = ctx.scratch(temp_bytes);
  if (boards && plan.fits_boards && ctx.has_boards()) {
    ctx.settle_algorithm(Algorithm::kSharedBuffer);
    for (size_t i = 0; i < plan.buckets.size(); ++i) {
      const FusedBucket& b = plan.buckets[i];
      Signature sig = b.sig;
      sig.seq = ctx.signature().seq + i;
      sig.algo = Algorithm::kSharedBuffer;
      ctx.set_current(sig);
      BucketElements elements(plan, b, temps);
      shared_buffer_rounds(ctx, elements, b.buffers.count(), sig.dtype, sig);
    }
    return;
  }
  // A slice is n parts, one per rank. Parts that travel as ranges of the buffers between ranks
  // of one host that send by single copy need no slices to pipeline packing with: they are cut
  // evenly into parts of at least the ring's slice, as large as the flat all-reduce's. Each
  // sender's transport then moves a part by single copy where its ranges, joined across small
  // gaps, are long enough (kSingleCopyRangeBytes, transport.h: views of one buffer, tensors
  // allocated one after another), and through its slots where they are not (spread tensors),
  // judging its own memory: ranks may differ in that, not in the cut, which depends only on
  // what is the same on every rank (the layout and the link model).
  const bool by_address = plan.one_host && ctx.selector().model().single_copy;
  const auto part_elems = [&](const FusedBucket& b) {
    if (!by_address || !coalesced_from_buffers(plan, b)) return message_elems(b, size_t(n));
    const size_t count = b.buffers.count(), slice = ring_slice(dtype_size(b.sig.dtype), n);
    const size_t slices = std::max<size_t>(1, count / (slice * size_t(n)));
    return std::max<size_t>(1, piece_count(count, slices * size_t(n)));
  };
  const auto slices =
      slices_of(plan.buckets, [&](const FusedBucket& b) { return part_elems(b) * size_t(n); });
  const auto sigs = signatures(ctx, plan.buckets);
  const size_t part_bytes = max_message_bytes(plan.buckets, part_elems);
  constexpr size_t depth = 3;
  struct SlotState {
    char* buffer;    // the packed slice, then the reduced parts
    char* incoming;  // the other ranks' contributions to my part, (n-1) x part_bytes
    std::vector<Request> contributions, results;  // by peer
    std::vector<Ranges> ranges;  // by part, with from_buffers: where each lies in the buffers
  } slots[depth];
  for (size_t s = 0; s < std::min(depth, slices.size()); ++s) {
    slots[s].buffer = ctx.scratch(part_bytes * size_t(n));
    slots[s].incoming = ctx.scratch(part_bytes * size_t(n - 1));
    slots[s].contributions.resize(size_t(n));
    slots[s].results.resize(size_t(n));
    slots[s].ranges.resize(size_t(n));
  }
  auto incoming_of = [&](SlotState& slot, int q) {
    return slot.incoming + size_t(q < me ? q : q - 1) * part_bytes;
  };

  run_pipeline(ctx, slices, sigs, depth, [&](size_t stage, size_t c) {
    const Slice& slice = slices[c];
    const FusedBucket& b = plan.buckets[slice.bucket];
    const Signature& sig = sigs[slice.bucket];
    const size_t e = dtype_size(sig.dtype);
    const Segments parts(slice.count(), n);
    SlotState& slot = slots[c % depth];
    char* mine = slot.buffer + parts.offset(me) * e;
    auto unpack_part = [&](int k) {
      size_t begin = slice.begin + parts.offset(k);
      trace::Span span("unpack", parts.count(k) * e);
      cpu::unpack(slot.buffer + parts.offset(k) * e, sig.dtype, b.buffers, begin,
                  begin + parts.count(k), plan.unpack_scaling);
    };
    // from_buffers: my part is not packed, and the others' parts go out as ranges of the buffers.
    // in_place: the reduction writes my result into the buffers, it is sent from there, and the
    // others' results are received into them.
    const bool from_buffers = coalesced_from_buffers(plan, b);
    const bool in_place = from_buffers && plan.unpack_scaling.kind == cpu::ScaleKind::kNone;
    if (stage == 0) {
      if (from_buffers) {
        for (int k = 0; k < n; ++k)
          slot.ranges[size_t(k)] =
              ranges_of(ctx, b.buffers, slice.begin + parts.offset(k), parts.count(k));
      } else {
        trace::Span span("pack", parts.count(me) * e);
        const size_t begin = slice.begin + parts.offset(me);
        cpu::pack(b.buffers, begin, begin + parts.count(me), mine, sig.dtype, plan.pack_scaling);
      }
      for (int q = 0; q < n; ++q) {
        if (q == me) continue;
        if (n == 2) {
          // One other contribution: reduced into my part where it arrives (a shared-memory
          // peer's slots), without a copy into `incoming` first.
          const CoalescedAllReduce* p = &plan;
          const FusedBucket* bucket = &b;
          const size_t first = slice.begin + parts.offset(me);
          slot.contributions[size_t(q)] = ctx.recv_apply(
              q, incoming_of(slot, q), parts.count(me) * e, sig,
              [p, bucket, first, mine, me, from_buffers, in_place](size_t offset, const char* data,
                                                                   size_t bytes) {
                trace::Span span("reduce", bytes, 1 - me);
                const size_t esize = dtype_size(bucket->sig.dtype), begin = first + offset / esize;
                const char* inputs[2];
                inputs[me] = mine + offset;
                inputs[1 - me] = data;
                // Two ranks: one combination per element, no temporaries.
                if (from_buffers)
                  reduce_from_buffers(*p, *bucket, begin, bytes / esize, me, inputs,
                                      in_place ? nullptr : mine + offset, nullptr, 2);
                else
                  reduce_in_order(*p, *bucket, begin, bytes / esize, inputs, mine + offset, nullptr,
                                  2);
              });
        } else {
          slot.contributions[size_t(q)] =
              ctx.recv(q, incoming_of(slot, q), parts.count(me) * e, sig);
        }
        // Part q goes from the buffers as it lies; or packed straight into q's shared memory,
        // or staged in the slice buffer.
        char* staging = slot.buffer + parts.offset(q) * e;
        if (from_buffers) {
          ctx.send_ranges(q, slot.ranges[size_t(q)], staging, sig);
          continue;
        }
        const FusedBucket* bucket = &b;
        const CoalescedAllReduce* p = &plan;
        const size_t begin = slice.begin + parts.offset(q);
        ctx.send_produce(q, staging, parts.count(q) * e, sig,
                         [bucket, p, begin, e](size_t offset, char* dst, size_t bytes) {
                           trace::Span span("pack", bytes);
                           cpu::pack(bucket->buffers, begin + offset / e,
                                     begin + (offset + bytes) / e, dst, bucket->sig.dtype,
                                     p->pack_scaling);
                         });
      }
    } else if (stage == 1) {
      if (n == 2) {
        ctx.wait(slot.contributions[size_t(1 - me)]);  // reduced as it arrived (stage 0)
      } else {
        std::vector<const char*> inputs(static_cast<size_t>(n));
        for (int q = 0; q < n; ++q) {
          if (q == me) {
            inputs[size_t(q)] = mine;
            continue;
          }
          ctx.wait(slot.contributions[size_t(q)]);
          inputs[size_t(q)] = incoming_of(slot, q);
        }
        const size_t begin = slice.begin + parts.offset(me);
        if (from_buffers)
          reduce_from_buffers(plan, b, begin, parts.count(me), me, inputs.data(),
                              in_place ? nullptr : mine, temps, n);
        else
          reduce_in_order(plan, b, begin, parts.count(me), inputs.data(), mine, temps, n);
      }
      for (int q = 0; q < n; ++q) {
        if (q == me) continue;
        // The results travel as ranges of the buffers both ways where they need no scaling;
        // staged where my contribution to q was: q sends its result only after it has all of it.
        char* staging = slot.buffer + parts.offset(q) * e;
        if (in_place) {
          ctx.send_ranges(q, slot.ranges[size_t(me)], mine, sig);
          slot.results[size_t(q)] = ctx.recv_ranges(q, slot.ranges[size_t(q)], staging, sig);
          continue;
        }
        ctx.send(q, mine, parts.count(me) * e, sig);
        // Unpacked where it arrives (a shared-memory peer's slots), or staged.
        const FusedBucket* bucket = &b;
        const CoalescedAllReduce* p = &plan;
        const size_t begin = slice.begin + parts.offset(q);
        slot.results[size_t(q)] = ctx.recv_apply(
            q, staging, parts.count(q) * e, sig,
            [bucket, p, begin, e](size_t offset, const char* data, size_t bytes) {
              trace::Span span("unpack", bytes);
              cpu::unpack(data, bucket->sig.dtype, bucket->buffers, begin + offset / e,
                          begin + (offset + bytes) / e, p->unpack_scaling);
            });
      }
      if (!in_place) unpack_part(me);
    } else {
      for (int q = 0; q < n; ++q)
        if (q != me) ctx.wait(slot.results[size_t(q)]);
    }
  });
}

void coalesced_broadcast(Context& ctx, const std::vector<FusedBucket>& buckets, int root) {
  const int n = ctx.size(), me = ctx.rank();
  if (n == 1 || buckets.empty()) return;
  const auto elems = [](const FusedBucket& b) { return message_elems(b, 1); };
  const auto slices = slices_of(buckets, elems);
  const auto sigs = signatures(ctx, buckets);
  std::vector<TreeLinks> links;
  for (const FusedBucket& b : buckets) links.push_back(rooted_tree(n, me, root, b.sig.algo));
  const size_t bytes = max_message_bytes(buckets, elems);
  constexpr size_t depth = 2;
  char* buffers[depth];
  Request from_parent[depth];
  for (size_t s = 0; s < std::min(depth, slices.size()); ++s) buffers[s] = ctx.scratch(bytes);

  run_pipeline(ctx, slices, sigs, depth, [&](size_t stage, size_t c) {
    const Slice& slice = slices[c];
    const FusedBucket& b = buckets[slice.bucket];
    const Signature& sig = sigs[slice.bucket];
    const TreeLinks& tree = links[slice.bucket];
    const size_t len = slice.count() * dtype_size(sig.dtype);
    char* buf = buffers[c % depth];
    if (stage == 0) {
      if (me == root) {
        {
          trace::Span span("pack", len);
          cpu::pack(b.buffers, slice.begin, slice.end, buf, sig.dtype, {});
        }
        for (int child : tree.children) ctx.send(child, buf, len, sig);
      } else {
        from_parent[c % depth] = ctx.recv(tree.parent, buf, len, sig);
      }
    } else if (me != root) {
      ctx.wait(from_parent[c % depth]);
      for (int child : tree.children) ctx.send(child, buf, len, sig);
      trace::Span span("unpack", len);
      cpu::unpack(buf, sig.dtype, b.buffers, slice.begin, slice.end, {});
    }
  });
}

void coalesced_all_gather(Context& ctx, const std::vector<FusedBucket>& buckets) {
  const int n = ctx.size(), me = ctx.rank();
  if (buckets.empty()) return;
  const auto elems = [](const FusedBucket& b) { return message_elems(b, 1); };
  const auto slices = slices_of(buckets, elems);
  const auto sigs = signatures(ctx, buckets);
  const size_t part_bytes = max_message_bytes(buckets, elems);
  constexpr size_t depth = 2;
  char* buffers[depth];
  std::vector<Request> from_peer[depth];
  for (size_t s = 0; s < std::min(depth, slices.size()); ++s) {
    buffers[s] = ctx.scratch(part_bytes * size_t(n));
    from_peer[s].resize(size_t(n));
  }

  run_pipeline(ctx, slices, sigs, depth, [&](size_t stage, size_t c) {
    const Slice& slice = slices[c];
    const FusedBucket& b = buckets[slice.bucket];
    const Signature& sig = sigs[slice.bucket];
    const size_t len = slice.count() * dtype_size(sig.dtype);
    char* buf = buffers[c % depth];
    auto part = [&](int q) { return buf + size_t(q) * part_bytes; };
    if (stage == 0) {
      {
        trace::Span span("pack", len);
        cpu::pack(b.buffers, slice.begin, slice.end, part(me), sig.dtype, {});
      }
      for (int q = 0; q < n; ++q) {
        if (q == me) continue;
        from_peer[c % depth][size_t(q)] = ctx.recv(q, part(q), len, sig);
        ctx.send(q, part(me), len, sig);
      }
    } else {
      for (int q = 0; q < n; ++q) {
        if (q != me) ctx.wait(from_peer[c % depth][size_t(q)]);
        trace::Span span("unpack", len);
        cpu::unpack(part(q), sig.dtype, b.outputs[size_t(q)], slice.begin, slice.end, {});
      }
    }
  });
}

}  // namespace ringcomm
