// Sparse all-reduce: every rank holds k_r (index, value) pairs of a vector of `numel` elements;
// every rank gets the dense sum (or average) of all of them.
//
// Step 0 (always): every rank sends every other its pair count k_r and packed size, so every rank
// makes the same choice below. Then, by the cheapest estimate (select.h: bytes on the wire per
// rank, plus 64 KiB per message round):
//   gather:  every rank sends its packed pairs to every other; scatter-add them all, in rank order.
//            Packed: indices as zigzag-varint deltas (about 1.3 bytes each for ascending top-k
//            indices at 1% density, kernels/cpu/index_codec.h), then the values.
//            Bytes received per rank: the others' packed sizes.
//   ranges:  (Ok-Topk's shape) rank q owns index range q of n balanced ranges.
//            1. each rank sends each owner the pairs in its range (counts first): about
//               k (n-1)/n (4 + value size) bytes;
//            2. each owner adds what it received, in rank order, into its range: the "piece" is
//               the touched positions as (index, sum), or the whole range when that is smaller;
//            3. all-gather the pieces (sizes first): about U (n-1)/n (4 + out size) bytes for a
//               union of U touched indices.
//   dense:   scatter the local pairs into `out` and ring all-reduce it: 2 (n-1)/n numel x out size.
// Every index is summed in rank order (and pair order within a rank) from zero, so gather and
// ranges give the same bits on every rank; dense gives ring order, equally deterministic.
//
// What consumes peer bytes (the size checks, decoding, scatter-adds and placing of what arrived)
// is in sparse_decode.cc, functions of the bytes and the local call without a Context, so that
// it can be fuzzed on its own (fuzz/sparse.cc); this file does the exchanges around them.
#include <algorithm>
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/select.h"
#include "algorithms/sparse_decode.h"
#include "kernels/cpu/index_codec.h"
#include "kernels/cpu/reduce.h"

namespace ringcomm {
namespace {

// Every rank's `words` 8-byte values, via a ring all-gather: result[q * words + i].
std::vector<size_t> gather_words(Context& ctx, const uint64_t* mine, int words) {
  const int n = ctx.size();
  auto* all = reinterpret_cast<uint64_t*>(ctx.scratch(8 * words * n));
  std::memcpy(all + ctx.rank() * words, mine, 8 * words);
  if (n > 1) ring_all_gather(ctx, all, std::vector<size_t>(n, 8 * words), DType::kUInt8);
  return std::vector<size_t>(all, all + words * n);
}

// All-gather of variable byte blocks; block q lands at offset sum(bytes[0..q)) of the result.
char* gather_blocks(Context& ctx, const void* mine, const std::vector<size_t>& bytes) {
  size_t total = 0, offset = 0;
  for (int q = 0; q < int(bytes.size()); ++q) {
    if (q == ctx.rank()) offset = total;
    total += bytes[q];
  }
  char* all = ctx.scratch(total);
  if (bytes[ctx.rank()]) std::memcpy(all + offset, mine, bytes[ctx.rank()]);
  ring_all_gather(ctx, all, bytes, DType::kUInt8);
  return all;
}

Algorithm choose(const Selector& select, const SparseSizes& s) {
  return cheapest_way(sparse_costs(select, s));
}

// Packs my pairs for gather: encoded indices, then values. Returns the packed size.
size_t pack_for_gather(Context& ctx, const SparsePairs& mine, size_t value_size, char** packed) {
  trace::Span span("encode", mine.count * (sizeof(int32_t) + value_size));
  *packed = ctx.scratch(cpu::max_encoded_bytes(mine.count) + mine.count * value_size);
  // mine.index is the caller's int32 array, aligned.
  size_t index_bytes = cpu::encode_indices(reinterpret_cast<const int32_t*>(mine.index), mine.count,
                                           reinterpret_cast<uint8_t*>(*packed));
  if (mine.count) std::memcpy(*packed + index_bytes, mine.value, mine.count * value_size);
  return index_bytes + mine.count * value_size;
}

// Waits for the receives by_rank[q] of every rank q but `me` in the order they complete, calling
// arrived(q) for each.
template <typename Arrived>
void in_arrival_order(Context& ctx, const std::vector<Request>& by_rank, int me, Arrived arrived) {
  std::vector<Request> pending;
  std::vector<int> from;
  for (int q = 0; q < int(by_rank.size()); ++q) {
    if (q == me) continue;
    pending.push_back(by_rank[q]);
    from.push_back(q);
  }
  while (!pending.empty()) {
    const size_t i = ctx.wait_any(pending);
    const int q = from[i];
    pending.erase(pending.begin() + long(i));
    from.erase(from.begin() + long(i));
    arrived(q);
  }
}

// Step 0 and gather's packed pairs go straight from every rank to every other, not around a
// ring. Each rank sends every other its header (pair count, packed size, whether its packed pairs
// follow) and, where its own estimate already picks gather, its packed pairs right behind it. So
// the rank that comes last finds the others' headers and pairs waiting, and its own go out in one
// hop; around a ring its sizes, then each block, passed through every rank in turn after it came,
// and over slow links the last rank then waited several hops before it could decode.
struct Step0 {
  std::vector<const char*> blocks;  // gather: rank q's packed pairs, once received
  std::vector<Request> receives;    // of those blocks, where posted
  std::vector<bool> sent_pairs;     // whether rank q's packed pairs followed its header
};

constexpr size_t kHeaderWords = 3;  // pair count, packed size, pairs follow (0 or 1)

// Sends this rank's header (and with `pairs_follow` its packed pairs) to every other rank, and
// receives theirs in whatever order they come: checks each before trusting it, then fills s.k
// and s.packed, and posts the receive of the pairs that follow it.
Step0 exchange_sizes(Context& ctx, SparseSizes& s, size_t k, char* packed, size_t packed_bytes,
                     bool pairs_follow) {
  const int n = s.n, me = s.rank;
  Step0 step{std::vector<const char*>(n, nullptr), std::vector<Request>(n),
             std::vector<bool>(n, false)};
  step.blocks[me] = packed;
  step.sent_pairs[me] = pairs_follow;
  s.k.assign(n, 0);
  s.packed.assign(n, 0);
  s.k[me] = k;
  s.packed[me] = packed_bytes;
  auto* headers = reinterpret_cast<uint64_t*>(ctx.scratch(kHeaderWords * 8 * size_t(n)));
  uint64_t* mine = headers + kHeaderWords * me;
  mine[0] = k;
  mine[1] = packed_bytes;
  mine[2] = pairs_follow;
  std::vector<Request> header_receives(n);
  for (int q = 0; q < n; ++q)
    if (q != me) header_receives[q] = ctx.recv(q, headers + kHeaderWords * q, kHeaderWords * 8);
  // Every header before any pairs: the pairs to one rank would hold the headers to the others
  // back by their link time (about 1 ms each for top-k's 130 KB at 1 Gbit/s). The pairs go to
  // the next ranks first, so that not every rank's go to rank 0 first.
  for (int j = 1; j < n; ++j) ctx.send((me + j) % n, mine, kHeaderWords * 8);
  for (int j = 1; j < n && pairs_follow; ++j) ctx.send((me + j) % n, packed, packed_bytes);
  in_arrival_order(ctx, header_receives, me, [&](int q) {
    const uint64_t* header = headers + kHeaderWords * q;
    check_peer_size(s, q, header[0], header[1]);
    if (header[2] > 1)
      RC_THROW_AS(kProtocol, "sparse_all_reduce: rank ", q, " sent a header whose last word is ",
                  header[2], ", not 0 or 1");
    s.k[q] = header[0];
    s.packed[q] = header[1];
    step.sent_pairs[q] = header[2] == 1;
    if (step.sent_pairs[q]) {
      char* block = ctx.scratch(s.packed[q]);
      step.blocks[q] = block;
      step.receives[q] = ctx.recv(q, block, s.packed[q]);
    }
  });
  return step;
}

void gather_all_reduce(Context& ctx, const SparseSizes& s, Step0& step, void* out, ReduceOp op) {
  const int n = s.n, me = s.rank;
  for (int q = 0; q < n; ++q) {
    if (q == me || step.sent_pairs[q]) continue;
    char* block = ctx.scratch(s.packed[q]);
    step.blocks[q] = block;
    step.receives[q] = ctx.recv(q, block, s.packed[q]);
  }
  for (int j = 1; j < n && !step.sent_pairs[me]; ++j)
    ctx.send((me + j) % n, step.blocks[me], s.packed[me]);
  // Each block's indices are decoded as it comes, most of them while the last is on its way;
  // adding the pairs waits for all of them, as every position adds in rank order.
  size_t total = 0;
  for (size_t k : s.k) total += k;
  std::vector<int32_t*> decoded(static_cast<size_t>(n));  // rank q's indices, back to back
  decoded[0] = reinterpret_cast<int32_t*>(ctx.scratch(total * 4));
  for (int q = 1; q < n; ++q) decoded[q] = decoded[q - 1] + s.k[q - 1];
  std::vector<SparsePairs> pairs(static_cast<size_t>(n));
  bool ascending = true;
  auto decode = [&](int q) {
    trace::Span span("decode", s.packed[q], q);
    pairs[q] = decode_block(s, q, step.blocks[q], decoded[q], &ascending);
  };
  decode(me);
  in_arrival_order(ctx, step.receives, me, decode);
  trace::Span span("reduce", s.numel * s.out_size);
  auto* seen = reinterpret_cast<uint64_t*>(ctx.scratch((s.numel + 63) / 64 * 8));
  reduce_decoded(s, pairs, ascending, seen, out, op);
}

void ranges_all_reduce(Context& ctx, const SparseSizes& s, const SparsePairs& mine, void* out,
                       ReduceOp op) {
  const int n = s.n, me = s.rank;

  // 1. Partition my pairs by owner (stable: pair order within a rank is kept) and exchange.
  check_indices(mine, 0, s.numel, me);
  std::vector<size_t> to(n, 0), from(n, 0);
  for (size_t i = 0; i < mine.count; ++i) ++to[s.owner(mine.index_at(i))];
  std::vector<size_t> start(n + 1, 0);
  for (int q = 0; q < n; ++q) start[q + 1] = start[q] + packed_bytes(to[q], s.value_size);
  char* outgoing = ctx.scratch(start[n]);
  std::vector<size_t> filled(n, 0);
  for (size_t i = 0; i < mine.count; ++i) {
    int q = s.owner(mine.index_at(i));
    char* block = outgoing + start[q];
    std::memcpy(block + filled[q] * sizeof(int32_t), mine.index + i * sizeof(int32_t),
                sizeof(int32_t));
    std::memcpy(block + to[q] * sizeof(int32_t) + filled[q] * s.value_size,
                mine.value + i * s.value_size, s.value_size);
    ++filled[q];
  }
  std::vector<Request> count_recvs;
  for (int q = 0; q < n; ++q)
    if (q != me) count_recvs.push_back(ctx.recv(q, &from[q], sizeof(size_t)));
  for (int q = 0; q < n; ++q)
    if (q != me) ctx.send(q, &to[q], sizeof(size_t));
  for (Request r : count_recvs) ctx.wait(r);
  check_owner_counts(s, from);
  from[me] = to[me];
  std::vector<size_t> in_start(n + 1, 0);
  for (int q = 0; q < n; ++q) in_start[q + 1] = in_start[q] + packed_bytes(from[q], s.value_size);
  char* incoming = ctx.scratch(in_start[n]);
  std::vector<Request> pair_recvs;
  for (int q = 0; q < n; ++q)
    if (q != me)
      pair_recvs.push_back(ctx.recv(q, incoming + in_start[q], in_start[q + 1] - in_start[q]));
  for (int q = 0; q < n; ++q)
    if (q != me) ctx.send(q, outgoing + start[q], start[q + 1] - start[q]);
  std::memcpy(incoming + in_start[me], outgoing + start[me], start[me + 1] - start[me]);
  for (Request r : pair_recvs) ctx.wait(r);

  // 2. Reduce my range, in rank order, and note which positions were touched.
  const size_t begin = s.range_begin(me), len = s.range_count(me);
  char* out_bytes = static_cast<char*>(out);
  std::vector<uint8_t> touched(len, 0);
  size_t n_touched;
  {
    trace::Span span("decode", len * s.out_size);
    n_touched = add_owned_pairs(s, incoming, from, out, touched.data());
    // AVG: each owner divides its own range, so the pieces carry averages.
    if (op == ReduceOp::kAvg) cpu::divide(s.out_dtype, out_bytes + begin * s.out_size, len, n);
  }
  bool sparse_piece = packed_bytes(n_touched, s.out_size) < len * s.out_size;
  uint64_t piece_bytes = sparse_piece ? packed_bytes(n_touched, s.out_size) : len * s.out_size;
  char* piece = ctx.scratch(piece_bytes);
  if (sparse_piece) {
    auto* idx = reinterpret_cast<int32_t*>(piece);
    char* val = piece + n_touched * sizeof(int32_t);
    size_t j = 0;
    for (size_t i = 0; i < len; ++i)
      if (touched[i]) {
        idx[j] = int32_t(begin + i);
        std::memcpy(val + j * s.out_size, out_bytes + (begin + i) * s.out_size, s.out_size);
        ++j;
      }
  } else {
    if (len) std::memcpy(piece, out_bytes + begin * s.out_size, len * s.out_size);
  }

  // 3. All-gather the pieces; a piece is dense iff its size is the whole range's.
  std::vector<size_t> piece_sizes = gather_words(ctx, &piece_bytes, 1);
  check_piece_sizes(s, piece_sizes);
  const char* pieces = gather_blocks(ctx, piece, piece_sizes);
  trace::Span span("decode", s.numel * s.out_size);
  place_pieces(s, pieces, piece_sizes, out);
}

}  // namespace

Algorithm sparse_all_reduce_steps(Context& ctx, const int32_t* indices, const void* values,
                                  size_t k, DType value_dtype, void* out, size_t numel,
                                  DType out_dtype, ReduceOp op, Algorithm algo) {
  SparseSizes s(ctx.size(), ctx.rank(), numel, value_dtype, out_dtype);
  SparsePairs mine{reinterpret_cast<const char*>(indices), static_cast<const char*>(values), k};
  char* packed = nullptr;
  const size_t packed_bytes = pack_for_gather(ctx, mine, s.value_size, &packed);
  // Whether my pairs go out with my header: where gather is forced, or where my estimate picks
  // it taking every rank's sizes to be mine (the choice below, made with every rank's, nearly
  // always agrees; where it does not, those pairs are received and dropped).
  SparseSizes alike = s;
  alike.k.assign(size_t(s.n), k);
  alike.packed.assign(size_t(s.n), packed_bytes);
  const bool pairs_follow =
      algo == Algorithm::kSparseGather ||
      (algo == Algorithm::kAuto && choose(ctx.selector(), alike) == Algorithm::kSparseGather);
  Step0 step = exchange_sizes(ctx, s, k, packed, packed_bytes, pairs_follow);
  if (algo == Algorithm::kAuto) algo = choose(ctx.selector(), s);
  if (algo != Algorithm::kSparseGather) {
    for (int q = 0; q < s.n; ++q)
      if (q != s.rank && step.sent_pairs[q]) ctx.wait(step.receives[q]);
  }
  // AVG divides where each way has least to divide: the ring and ranges only their own share.
  switch (algo) {
    case Algorithm::kSparseRanges:
      ranges_all_reduce(ctx, s, mine, out, op);
      break;
    case Algorithm::kRing:
      check_indices(mine, 0, numel, s.rank);
      {
        trace::Span span("decode", numel * s.out_size);
        if (numel) std::memset(out, 0, numel * s.out_size);  // an empty `out` may be null
        scatter_add(value_dtype, out_dtype, out, mine);
      }
      ring_all_reduce(ctx, out, numel, out_dtype, op);
      break;
    default:
      gather_all_reduce(ctx, s, step, out, op);
  }
  ctx.finish();
  return algo;
}

}  // namespace ringcomm
