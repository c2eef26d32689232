#include "device/executor.h"

#include <algorithm>

#include "algorithms/algorithms.h"
#include "algorithms/stream_plan.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/reduce.h"
#include "kernels/cuda/window.h"
#include "kernels/dispatch.h"

namespace ringcomm {
namespace device {
namespace {

// The slice length on a stream: a step pipelined by step (the ring) is one group whichever way
// it is cut, and the transport pipelines each message itself, so it goes whole, one message per
// step; the trees keep their slices, which pipeline across levels.
size_t stream_slice(const Schedule& schedule, const Segments& blocks, size_t slice) {
  return schedule.pipeline == Pipeline::kByStep ? std::max<size_t>(1, blocks.max_count()) : slice;
}

}  // namespace

Executor::Executor(DeviceTransport& transport, size_t round_bytes)
    : transport_(transport),
      layout_(window_layout(transport.size(), round_bytes)),
      state_(transport.size()) {
  RC_CHECK_ARG(transport.messages() != nullptr || transport.windows() != nullptr, "the ",
               transport.name(), " transport moves no bytes");
  if (Windows* windows = transport.windows())
    RC_CHECK_ARG(windows->window_bytes() >= layout_.bytes(), "windows of ", windows->window_bytes(),
                 " bytes cannot hold rounds of ", round_bytes, " bytes among ", transport.size(),
                 " ranks (", layout_.bytes(), " bytes)");
}

size_t Executor::window_bytes(int world, size_t round_bytes) {
  return window_layout(world, round_bytes).bytes();
}

Algorithm Executor::choose_all_reduce(size_t bytes) const {
  if (transport_.windows() != nullptr)
    return bytes <= kSmallBytes ? Algorithm::kOneShot : Algorithm::kSharedBuffer;
  return bytes <= kSmallBytes ? Algorithm::kRecursiveDoubling : Algorithm::kRing;
}

void Executor::all_reduce(void* data, size_t count, DType dtype, ReduceOp op, Algorithm algo,
                          cudaStream_t stream) {
  transport_.check_usable();
  cuda::DeviceScope scope(transport_.device());
  kernels::visit_reduce(dtype, op, [](auto, auto) {});  // raises on pairs no kernel reduces
  const int n = transport_.size();
  if (algo == Algorithm::kAuto) algo = choose_all_reduce(count * dtype_size(dtype));
  if (Windows* windows = transport_.windows()) {
    windows->agree(Signature{Collective::kAllReduce, dtype, op, algo, false, -1, 0, count, 0});
    const WindowPlan plan = window_all_reduce_plan(algo, layout_, state_, transport_.rank(), count,
                                                   dtype_size(dtype), op == ReduceOp::kAvg);
    run_plan(plan, static_cast<char*>(data), dtype, op, stream);
    return;
  }
  // Halving-doubling receives from one peer over several steps after sending to it over
  // several: stream groups of one receiving step each would wait on each other.
  RC_CHECK_ARG(
      algo == Algorithm::kRing || algo == Algorithm::kTree || algo == Algorithm::kRecursiveDoubling,
      "all_reduce by ", algorithm_name(algo), " does not run over ", transport_.name());
  if (n == 1) return;  // every op of one contribution is that contribution
  const AllReduceSchedule s =
      all_reduce_schedule(algo, n, transport_.rank(), count, dtype_size(dtype));
  run_groups(s.schedule, s.blocks, stream_slice(s.schedule, s.blocks, s.slice),
             static_cast<char*>(data), dtype, op, stream);
}

void Executor::all_gather(void* data, const std::vector<size_t>& counts, DType dtype,
                          cudaStream_t stream) {
  transport_.check_usable();
  cuda::DeviceScope scope(transport_.device());
  const int n = transport_.size();
  RC_CHECK_ARG(int(counts.size()) == n, counts.size(), " block sizes for ", n, " ranks");
  if (Windows* windows = transport_.windows()) {
    size_t total = 0;
    for (size_t c : counts) total += c;
    windows->agree(Signature{Collective::kAllGatherV, dtype, ReduceOp::kSum, Algorithm::kAuto,
                             false, -1, 0, total, hash_counts(counts.data(), counts.size())});
    const WindowPlan plan =
        window_all_gather_plan(layout_, state_, transport_.rank(), counts, dtype_size(dtype));
    run_plan(plan, static_cast<char*>(data), dtype, ReduceOp::kSum, stream);
    return;
  }
  if (n == 1) return;
  const Schedule schedule = ring_all_gather_schedule(n, transport_.rank());
  const Segments blocks(counts);
  run_groups(schedule, blocks, stream_slice(schedule, blocks, ring_slice(dtype_size(dtype), n)),
             static_cast<char*>(data), dtype, ReduceOp::kSum, stream);
}

void Executor::reduce_scatter(void* data, size_t block, DType dtype, ReduceOp op,
                              cudaStream_t stream) {
  transport_.check_usable();
  cuda::DeviceScope scope(transport_.device());
  kernels::visit_reduce(dtype, op, [](auto, auto) {});  // raises on pairs no kernel reduces
  const int n = transport_.size();
  if (Windows* windows = transport_.windows()) {
    windows->agree(Signature{Collective::kReduceScatter, dtype, op, Algorithm::kAuto, false, -1, 0,
                             block * size_t(n), 0});
    const WindowPlan plan = window_reduce_scatter_plan(layout_, state_, transport_.rank(), block,
                                                       dtype_size(dtype), op == ReduceOp::kAvg);
    run_plan(plan, static_cast<char*>(data), dtype, op, stream);
    return;
  }
  if (n == 1) return;
  const Schedule schedule = ring_reduce_scatter_schedule(n, transport_.rank());
  const Segments blocks(block * size_t(n), n);
  run_groups(schedule, blocks, stream_slice(schedule, blocks, ring_slice(dtype_size(dtype), n)),
             static_cast<char*>(data), dtype, op, stream);
}

void Executor::all_to_all(void* data, size_t block, DType dtype, cudaStream_t stream) {
  transport_.check_usable();
  cuda::DeviceScope scope(transport_.device());
  const int n = transport_.size(), rank = transport_.rank();
  const size_t bytes = block * dtype_size(dtype);
  if (Windows* windows = transport_.windows()) {
    windows->agree(Signature{Collective::kAllToAll, dtype, ReduceOp::kSum, Algorithm::kAuto, false,
                             -1, 0, block * size_t(n), 0});
    run_plan(window_all_to_all_plan(layout_, state_, rank, block, dtype_size(dtype)),
             static_cast<char*>(data), dtype, ReduceOp::kSum, stream);
    return;
  }
  if (n == 1 || bytes == 0) return;
  char* blocks = static_cast<char*>(data);
  char* sent = nullptr;  // the blocks as they were: the receives overwrite them in place
  RC_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&sent), bytes * size_t(n), stream));
  Messages& messages = *transport_.messages();
  try {
    RC_CUDA_CHECK(
        cudaMemcpyAsync(sent, blocks, bytes * size_t(n), cudaMemcpyDeviceToDevice, stream));
    messages.group_start();
    for (int q = 0; q < n; ++q) {
      if (q == rank) continue;
      messages.send(sent + size_t(q) * bytes, bytes, q, stream);
      messages.recv(blocks + size_t(q) * bytes, bytes, q, stream);
    }
    messages.group_end();
  } catch (...) {
    cudaFreeAsync(sent, stream);
    transport_.abort();
    throw;
  }
  RC_CUDA_CHECK(cudaFreeAsync(sent, stream));
}

void Executor::send(const void* data, size_t count, DType dtype, int peer, uint32_t tag,
                    cudaStream_t stream) {
  // A send's plan only reads its source.
  message(static_cast<char*>(const_cast<void*>(data)), count, dtype, peer, tag, true, stream);
}

void Executor::recv(void* data, size_t count, DType dtype, int peer, uint32_t tag,
                    cudaStream_t stream) {
  message(static_cast<char*>(data), count, dtype, peer, tag, false, stream);
}

void Executor::message(char* data, size_t count, DType dtype, int peer, uint32_t tag, bool send,
                       cudaStream_t stream) {
  transport_.check_usable();
  cuda::DeviceScope scope(transport_.device());
  const int rank = transport_.rank();
  RC_CHECK_ARG(peer >= 0 && peer < transport_.size() && peer != rank, "rank ", rank,
               send ? " cannot send to rank " : " cannot receive from rank ", peer, " of ",
               transport_.size());
  if (Windows* windows = transport_.windows()) {
    const size_t e = dtype_size(dtype);
    const WindowPlan plan = send ? window_send_plan(layout_, state_, rank, peer, count, e)
                                 : window_recv_plan(layout_, state_, rank, peer, count, e);
    windows->agree_message(peer, send, Windows::kPointToPoint,
                           Signature{Collective::kSendRecv, dtype, ReduceOp::kSum, Algorithm::kAuto,
                                     true, send ? rank : peer, 0, count, tag});
    run_plan(plan, data, dtype, ReduceOp::kSum, stream, data);
    return;
  }
  const size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return;
  Messages& messages = *transport_.messages();
  try {
    messages.group_start();
    if (send)
      messages.send(data, bytes, peer, stream);
    else
      messages.recv(data, bytes, peer, stream);
    messages.group_end();
  } catch (...) {
    transport_.abort();
    throw;
  }
}

void Executor::exchange(const void* source, void* data, const std::vector<Transfer>& sends,
                        const std::vector<Transfer>& recvs, DType dtype, Signature sig,
                        cudaStream_t stream) {
  transport_.check_usable();
  cuda::DeviceScope scope(transport_.device());
  const int rank = transport_.rank();
  const size_t e = dtype_size(dtype);
  const char* from = static_cast<const char*>(source);
  char* into = static_cast<char*>(data);
  if (Windows* windows = transport_.windows()) {
    const WindowPlan plan = window_exchange_plan(layout_, state_, rank, sends, recvs, e);
    windows->agree(sig);
    // Each part as the pair sees it: the collective's, its sender and its size.
    auto part = [&](int sender, size_t count) {
      Signature p = sig;
      p.p2p = true;
      p.root = sender;
      p.count = count;
      p.aux = 0;
      return p;
    };
    for (const Transfer& t : sends)
      if (t.peer != rank)
        windows->agree_message(t.peer, true, Windows::kCollective, part(rank, t.count));
    for (const Transfer& t : recvs)
      if (t.peer != rank)
        windows->agree_message(t.peer, false, Windows::kCollective, part(t.peer, t.count));
    run_plan(plan, into, dtype, ReduceOp::kSum, stream, from);
    return;
  }
  const ExchangeParts parts = exchange_parts(transport_.size(), rank, sends, recvs);
  Messages& messages = *transport_.messages();
  try {
    if (parts.to_self != nullptr && parts.to_self->count > 0)
      RC_CUDA_CHECK(cudaMemcpyAsync(into + parts.from_self->offset * e,
                                    from + parts.to_self->offset * e, parts.to_self->count * e,
                                    cudaMemcpyDeviceToDevice, stream));
    messages.group_start();
    for (const Transfer& t : sends) {
      if (t.count == 0 || t.peer == rank) continue;
      messages.send(from + t.offset * e, t.count * e, t.peer, stream);
    }
    for (const Transfer& t : recvs)
      if (t.count > 0 && t.peer != rank)
        messages.recv(into + t.offset * e, t.count * e, t.peer, stream);
    messages.group_end();
  } catch (...) {
    transport_.abort();
    throw;
  }
}

// The schedule's groups one after another on `stream`: the group's messages, then the
// reduction of what it received into staging.
void Executor::run_groups(const Schedule& schedule, const Segments& blocks, size_t slice,
                          char* data, DType dtype, ReduceOp op, cudaStream_t stream) {
  Messages& messages = *transport_.messages();
  const size_t e = dtype_size(dtype);
  const std::vector<StreamGroup> groups = stream_groups(schedule, blocks, slice);
  // Room for the receives of one group: the stream runs a group's reductions before the next
  // group receives.
  size_t staging_elems = 1;
  for (const StreamGroup& g : groups)
    if (g.reduce) staging_elems = std::max(staging_elems, (g.last - g.first) * slice);
  staging_elems = std::min(staging_elems, std::max<size_t>(1, blocks.max_count()));
  char* staging = nullptr;
  RC_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&staging), staging_elems * e, stream));
  // Slice j of a step: where it lives in `data`, and its length.
  auto slice_of = [&](int step, size_t j) {
    const Step& st = schedule.steps[size_t(step)];
    const size_t block = blocks.count(st.block), first = std::min(block, j * slice);
    return std::make_pair(data + (blocks.offset(st.block) + first) * e,
                          std::min(slice, block - first));
  };
  try {
    for (const StreamGroup& g : groups) {
      messages.group_start();
      for (const StreamMessage& m : g.messages) {
        auto [at, n] = slice_of(m.step, m.slice);
        if (m.send)
          messages.send(at, n * e, m.peer, stream);
        else
          messages.recv(m.to_staging ? staging + (m.slice - g.first) * slice * e : at, n * e,
                        m.peer, stream);
      }
      messages.group_end();
      if (!g.reduce) continue;
      const Step& step = schedule.steps[size_t(g.step)];
      for (size_t j = g.first; j < g.last; ++j) {
        auto [mine, n] = slice_of(g.step, j);
        const char* incoming = staging + (j - g.first) * slice * e;
        cuda::reduce(dtype, op, mine, step.incoming_first ? incoming : mine,
                     step.incoming_first ? mine : incoming, n, stream);
        if (step.completes && op == ReduceOp::kAvg)
          cuda::divide(dtype, mine, n, transport_.size(), stream);
      }
    }
  } catch (...) {
    // Messages already posted may never be matched: the transport is done.
    cudaFreeAsync(staging, stream);
    transport_.abort();
    throw;
  }
  RC_CUDA_CHECK(cudaFreeAsync(staging, stream));
}

// Consecutive signals and waits go to the transport as one batch, consecutive copies to one
// kernel; the plan's order is kept.
void Executor::run_plan(const WindowPlan& plan, char* data, DType dtype, ReduceOp op,
                        cudaStream_t stream, const char* source) {
  Windows& windows = *transport_.windows();
  const size_t e = dtype_size(dtype);
  auto address = [&](const WindowRef& r) -> char* {
    if (r.rank == WindowRef::kCaller) return data + r.offset;
    // Only copies read kSource: the kernels take it as a source, never write it.
    if (r.rank == WindowRef::kSource) return const_cast<char*>(source) + r.offset;
    return windows.window(r.rank) + r.offset;
  };
  std::vector<WindowSync> syncs;
  std::vector<cuda::CopyPiece> pieces;
  auto flush_syncs = [&] {
    if (!syncs.empty()) windows.sync(syncs.data(), syncs.size(), stream);
    syncs.clear();
  };
  auto flush_pieces = [&] {
    if (!pieces.empty()) cuda::copy_pieces(pieces.data(), int(pieces.size()), stream);
    pieces.clear();
  };
  try {
    for (const WindowAction& a : plan.actions) {
      const WindowRef* refs = plan.refs.data() + a.first;
      switch (a.kind) {
        case WindowAction::kSync:
          flush_pieces();
          syncs.push_back(a.sync);
          break;
        case WindowAction::kCopy:
          flush_syncs();
          if (pieces.size() == size_t(cuda::kMostPieces)) flush_pieces();
          pieces.push_back({address(refs[0]), address(refs[1]), a.count * e});
          break;
        case WindowAction::kFold: {
          flush_syncs();
          flush_pieces();
          cuda::FoldArgs args;
          RC_CHECK_ARG(a.sources <= cuda::kMostSources && a.dests <= cuda::kMostDests, "a fold of ",
                       a.sources, " sources into ", a.dests);
          for (int s = 0; s < a.sources; ++s) args.sources[s] = address(refs[s]);
          for (int d = 0; d < a.dests; ++d) args.dests[d] = address(refs[a.sources + d]);
          args.source_count = a.sources;
          args.dest_count = a.dests;
          args.n = a.count;
          args.divisor = a.divide ? transport_.size() : 0;
          cuda::fold(dtype, op, args, stream);
          break;
        }
      }
    }
    flush_syncs();
    flush_pieces();
  } catch (...) {
    // The counts of state_ ran ahead of what the stream holds: the peers would wait for
    // signals that never come.
    transport_.abort();
    throw;
  }
}

}  // namespace device
}  // namespace ringcomm
