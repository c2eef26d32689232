// Pipelined trees: all-reduce over a double binary tree, and broadcast / reduce over a binomial
// tree (small messages: log2(n) hops) or a chain (large messages: every link busy at once).
//
// A tree gives each rank a parent (none at the root) and children. Data is cut into chunks of
// RINGCOMM_TREE_CHUNK_BYTES, and each chunk goes through
//   reduce phase:    receive each child's partial chunk, combine in child order
//                    (acc = mine (op) child_0 (op) child_1), send acc to the parent;
//   broadcast phase: receive the finished chunk from the parent, send it to every child.
// Chunk c+1 climbs while chunk c descends, so for large messages every link is busy.
//
// Double binary tree all-reduce (tree_all_reduce): two heap-shaped binary trees, the second the
// mirror image of the first (rank r sits where rank n-1-r sits in the first), so a rank that is a
// leaf in one tree is an inner node in the other. Each tree carries half of the buffer (S/2).
// Bytes on the wire per rank for a buffer of S bytes: as an inner node of one tree, S/2 up and
// S/2 to each of two children; as a leaf of the other, S/2 up: about 2S sent and 2S received,
// with 2*log2(n) hops of latency. Results are computed once at each root and copied down, so
// every rank gets the same bits. reduction_order.cc replays this order for coalesced all-reduce
// (checked by tests/test_fusion.py).
//
// Broadcast: S bytes received and forwarded once per rank (chain) or to each child (binomial).
// Reduce: each rank sends S bytes once; the input of non-root ranks is left untouched.
#include <cstring>

#include "algorithms/algorithms.h"
#include "kernels/cpu/reduce.h"

namespace ringcomm {
namespace {

// Heap order over ranks (children of position p are 2p+1, 2p+2); `mirrored` maps position p to
// rank n-1-p.
TreeLinks heap_tree(int n, int rank, bool mirrored) {
  auto rank_at = [&](int pos) { return mirrored ? n - 1 - pos : pos; };
  int pos = mirrored ? n - 1 - rank : rank;
  TreeLinks t;
  if (pos > 0) t.parent = rank_at((pos - 1) / 2);
  for (int child : {2 * pos + 1, 2 * pos + 2})
    if (child < n) t.children.push_back(rank_at(child));
  return t;
}

}  // namespace

// Binomial tree rooted at `root`: in root-relative numbering v, the parent of v is v minus its
// lowest set bit, and the children are v + 2^k for every 2^k below that bit (largest subtree
// first). Chain: v's parent is v-1, its child v+1.
TreeLinks rooted_tree(int n, int rank, int root, Algorithm shape) {
  int v = mod(rank - root, n);
  auto rank_of = [&](int rel) { return mod(rel + root, n); };
  TreeLinks t;
  if (shape == Algorithm::kChain) {
    if (v > 0) t.parent = rank_of(v - 1);
    if (v + 1 < n) t.children.push_back(rank_of(v + 1));
    return t;
  }
  int low = v == 0 ? n : (v & -v);
  if (v > 0) t.parent = rank_of(v - low);
  int top = 1;
  while (top * 2 < low && v + top * 2 < n) top *= 2;
  for (int step = top; step >= 1; step /= 2)
    if (step < low && v + step < n) t.children.push_back(rank_of(v + step));
  return t;
}

namespace {

class TreePipeline {
 public:
  // `chunk_elems`: the most elements of one reduce_chunk (0 for a broadcast-only pipeline); room
  // for a child's chunk is taken from scratch once, here.
  TreePipeline(Context& ctx, TreeLinks links, DType dtype, ReduceOp op, size_t chunk_elems)
      : ctx_(ctx), t_(std::move(links)), dtype_(dtype), op_(op), elem_(dtype_size(dtype)),
        incoming_(chunk_elems ? ctx.scratch(chunk_elems * elem_) : nullptr) {}

  bool is_root() const { return t_.parent < 0; }

  // Reduce phase of one chunk of n elements. Returns where the combined chunk is: `local` for a
  // leaf, `acc` otherwise (acc may alias local).
  const char* reduce_chunk(const char* local, char* acc, size_t n) {
    const size_t bytes = n * elem_;
    const char* partial = local;
    for (int child : t_.children) {
      ctx_.wait(ctx_.recv(child, incoming_, bytes));
      cpu::reduce(dtype_, op_, acc, partial, incoming_, n);
      partial = acc;
    }
    if (!is_root()) ctx_.send(t_.parent, partial, bytes);
    return partial;
  }

  // Broadcast phase of one chunk of `bytes` bytes.
  void broadcast_chunk(char* data, size_t bytes) {
    if (!is_root()) ctx_.wait(ctx_.recv(t_.parent, data, bytes));
    for (int child : t_.children) ctx_.send(child, data, bytes);
  }

 private:
  Context& ctx_;
  TreeLinks t_;
  DType dtype_;
  ReduceOp op_;
  size_t elem_;
  char* incoming_;
};

size_t chunk_elems(DType dtype) {
  return std::max<size_t>(1, AlgorithmTuning::get().tree_chunk_bytes / dtype_size(dtype));
}

}  // namespace

void tree_all_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op) {
  const int n = ctx.size();
  if (n == 1) return;
  ScratchFrame frame(ctx);
  const size_t e = dtype_size(dtype), chunk = chunk_elems(dtype);
  char* data = static_cast<char*>(buf);
  struct Half {
    TreePipeline tree;
    size_t offset, count, chunks;
  };
  const size_t low = count / 2, high = count - low;  // elements of each tree's half
  Half halves[2] = {
      {TreePipeline(ctx, heap_tree(n, ctx.rank(), false), dtype, op, std::min(chunk, low)), 0, low,
       0},
      {TreePipeline(ctx, heap_tree(n, ctx.rank(), true), dtype, op, std::min(chunk, high)), low,
       high, 0}};
  size_t rounds = 0;
  for (Half& h : halves) {
    h.chunks = piece_count(h.count, chunk);
    rounds = std::max(rounds, h.chunks);
  }
  auto chunk_range = [&](const Half& h, size_t c) {
    size_t begin = c * chunk;
    return std::make_pair(h.offset + begin, std::min(chunk, h.count - std::min(h.count, begin)));
  };
  // Round c: both trees reduce chunk c, then both broadcast chunk c-1. Every rank runs the same
  // sequence, so messages between any two ranks are posted in the same order on both sides.
  for (size_t c = 0; c <= rounds; ++c) {
    for (Half& h : halves) {
      if (c >= h.chunks) continue;
      auto [first, len] = chunk_range(h, c);
      char* p = data + first * e;
      h.tree.reduce_chunk(p, p, len);
      if (h.tree.is_root() && op == ReduceOp::kAvg) cpu::divide(dtype, p, len, n);
    }
    for (Half& h : halves) {
      if (c == 0 || c - 1 >= h.chunks) continue;
      auto [first, len] = chunk_range(h, c - 1);
      h.tree.broadcast_chunk(data + first * e, len * e);
    }
  }
  ctx.finish();
}

void tree_broadcast(Context& ctx, void* buf, size_t bytes, int root, Algorithm shape) {
  if (ctx.size() == 1) return;
  TreePipeline tree(ctx, rooted_tree(ctx.size(), ctx.rank(), root, shape), DType::kUInt8,
                    ReduceOp::kSum, 0);
  const size_t chunk = AlgorithmTuning::get().tree_chunk_bytes;
  char* data = static_cast<char*>(buf);
  for (size_t c = 0, pieces = piece_count(bytes, chunk); c < pieces; ++c) {
    size_t begin = c * chunk;
    tree.broadcast_chunk(data + begin, std::min(chunk, bytes - std::min(bytes, begin)));
  }
  ctx.finish();
}

void tree_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op, int root,
                 Algorithm shape) {
  const int n = ctx.size();
  if (n == 1) return;
  ScratchFrame frame(ctx);
  const size_t e = dtype_size(dtype), chunk = chunk_elems(dtype);
  TreePipeline tree(ctx, rooted_tree(n, ctx.rank(), root, shape), dtype, op,
                    std::min(chunk, count));
  char* data = static_cast<char*>(buf);
  // Non-root ranks combine into scratch so their input survives.
  char* acc = tree.is_root() ? data : ctx.scratch(count * e);
  for (size_t c = 0, pieces = piece_count(count, chunk); c < pieces; ++c) {
    size_t begin = c * chunk, len = std::min(chunk, count - std::min(count, begin));
    const char* result = tree.reduce_chunk(data + begin * e, acc + begin * e, len);
    if (tree.is_root() && op == ReduceOp::kAvg)
      cpu::divide(dtype, const_cast<char*>(result), len, n);
  }
  ctx.finish();
}

}  // namespace ringcomm
