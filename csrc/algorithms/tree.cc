// Pipelined trees: all-reduce over a double binary tree, and broadcast / reduce over a binomial
// tree (small messages: log2(n) hops) or a chain (large messages: every link busy at once).
//
// A tree gives each rank a parent (none at the root) and children. Data is cut into slices of
// RINGCOMM_TREE_CHUNK_BYTES, and each slice goes through (rank's steps, schedule.h)
//   reduce phase:    recv-reduce each child's partial slice in child order
//                    (acc = mine (op) child_0 (op) child_1), the last one recv-reduce-send to
//                    the parent (complete at the root); a leaf just sends its own;
//   broadcast phase: recv the finished slice from the parent, send it to every child.
// The schedule is pipelined by slice: in round j a rank reduces slice j and broadcasts slice
// j-1, so slice j+1 climbs while slice j descends, and for large messages every link is busy.
//
// Double binary tree all-reduce: two heap-shaped binary trees, the second the
// mirror image of the first (rank r sits where rank n-1-r sits in the first), so a rank that is a
// leaf in one tree is an inner node in the other. Each tree carries half of the buffer (S/2).
// Bytes on the wire per rank for a buffer of S bytes: as an inner node of one tree, S/2 up and
// S/2 to each of two children; as a leaf of the other, S/2 up: about 2S sent and 2S received,
// with 2*log2(n) hops of latency. Results are computed once at each root and copied down, so
// every rank gets the same bits. reduction_order.cc replays this order for coalesced all-reduce,
// from the same step lists (checked by tests/test_fusion.py).
//
// Broadcast: S bytes received and forwarded once per rank (chain) or to each child (binomial).
// Reduce: each rank sends S bytes once; the input of non-root ranks is left untouched.
#include <cstring>

#include "algorithms/algorithms.h"

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

// The reduce phase of a tree over `block` (children's partial results combined in child order,
// acc = mine (op) child_0 (op) child_1, the result sent to the parent; complete at the root)
// and, `lag` slices behind, its broadcast phase (the result received from the parent and sent to
// every child). Either phase may be left out.
void append_tree(std::vector<Step>& reduce, std::vector<Step>& broadcast, const TreeLinks& t,
                 int block, bool with_reduce, bool with_broadcast) {
  if (with_reduce) {
    if (t.children.empty()) {
      reduce.push_back({Prim::kSend, block, -1, t.parent});
    } else {
      for (size_t i = 0; i < t.children.size(); ++i) {
        const bool last = i + 1 == t.children.size();
        Step s{last && t.parent >= 0 ? Prim::kRecvReduceSend : Prim::kRecvReduce, block,
               t.children[i], last ? t.parent : -1};
        s.completes = last && t.parent < 0;
        reduce.push_back(s);
      }
    }
  }
  if (with_broadcast) {
    const int lag = with_reduce ? 1 : 0;
    if (t.parent >= 0) {
      Step s{Prim::kRecv, block, t.parent, -1};
      s.lag = lag;
      broadcast.push_back(s);
    }
    for (int child : t.children) {
      Step s{Prim::kSend, block, -1, child};
      s.lag = lag;
      broadcast.push_back(s);
    }
  }
}

}  // namespace

size_t tree_slice(size_t elem) {
  return std::max<size_t>(1, AlgorithmTuning::get().tree_chunk_bytes / elem);
}

Segments tree_halves(size_t count) {
  return Segments(std::vector<size_t>{count / 2, count - count / 2});
}

Schedule double_tree_all_reduce_schedule(int n, int rank) {
  Schedule s;
  s.pipeline = Pipeline::kBySlice;
  std::vector<Step> broadcast;
  for (int half : {0, 1})
    append_tree(s.steps, broadcast, heap_tree(n, rank, half == 1), half, true, true);
  s.steps.insert(s.steps.end(), broadcast.begin(), broadcast.end());
  return s;
}

void tree_broadcast(Context& ctx, void* buf, size_t bytes, int root, Algorithm shape) {
  if (ctx.size() == 1) return;
  Schedule s;
  s.pipeline = Pipeline::kBySlice;
  std::vector<Step> unused;
  append_tree(unused, s.steps, rooted_tree(ctx.size(), ctx.rank(), root, shape), 0, false, true);
  char* data = static_cast<char*>(buf);
  run_schedule(ctx, s, Segments(bytes, 1), {data, data}, DType::kUInt8, ReduceOp::kSum,
               tree_slice(1));
  ctx.finish();
}

void tree_reduce(Context& ctx, void* buf, size_t count, DType dtype, ReduceOp op, int root,
                 Algorithm shape) {
  if (ctx.size() == 1) return;
  ScratchFrame frame(ctx);  // closes after finish(): no send reads `work` any more
  Schedule s;
  s.pipeline = Pipeline::kBySlice;
  std::vector<Step> unused;
  const TreeLinks links = rooted_tree(ctx.size(), ctx.rank(), root, shape);
  append_tree(s.steps, unused, links, 0, true, false);
  char* data = static_cast<char*>(buf);
  // Other ranks combine into scratch so that their input survives.
  char* work = links.parent < 0 ? data : ctx.scratch(count * dtype_size(dtype));
  run_schedule(ctx, s, Segments(count, 1), {data, work}, dtype, op, tree_slice(dtype_size(dtype)));
  ctx.finish();
}

}  // namespace ringcomm
