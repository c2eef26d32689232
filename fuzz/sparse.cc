// Fuzz target: the sparse all-reduce's handling of what peers sent (algorithms/sparse_decode.h),
// every step of gather and ranges in the order sparse.cc runs them, with the fuzzer's bytes as
// every message received.
//
// Input: a locally valid call, then the messages.
//   byte 0: world size n (1-8); byte 1: this rank; bytes 2-3: numel (0-4096);
//   byte 4: value dtype and out dtype (float32, float16, bfloat16 each);
//   byte 5: bit 0: ranges (else gather); bit 1: sizes and counts as 2-byte words (else 8-byte,
//           any value a peer could send).
//   Step 0: the (pair count, packed size) word pair of every rank.
//   gather: every rank's packed block, back to back.
//   ranges: the pair count every rank sends this owner (this rank's own: at most its own pair
//           count, as sparse.cc computes it); their packed pairs; every rank's piece size; the
//           pieces.
// Every input ends in success or a ringcomm::Error; anything else thrown escapes and is a crash,
// as is a read or write outside a buffer (every message and `out` are allocations of exactly their
// size, null when empty). A message longer than what is left of the input ends it (its sender would
// have had to send those bytes first). On top of the sanitizers:
//   gather: the call succeeds exactly when every block is well-formed (an index encoding of
//           exactly its size, every index in [0, numel)), whatever the decode buffer held before.
//   ranges: the owner's additions write only its range; placing the pieces writes only the other
//           ranks' ranges.
#include <algorithm>
#include <vector>

#include "algorithms/sparse_decode.h"
#include "common/error.h"
#include "fuzz_input.h"
#include "kernels/cpu/index_codec.h"

using namespace ringcomm;

namespace {

constexpr DType kTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr uint8_t kUntouched = 0xa5;  // `out` bytes nothing may write

// Whether the gather blocks are well-formed, decoded independently of decode_block.
bool gather_blocks_valid(const SparseSizes& s, const char* blocks) {
  for (int q = 0; q < s.n; ++q) {
    const size_t k = s.k[q], index_bytes = s.packed[q] - k * s.value_size;
    std::vector<int32_t> idx(k);
    const size_t used =
        cpu::decode_indices(reinterpret_cast<const uint8_t*>(blocks), index_bytes, k, idx.data());
    if (used != index_bytes || (k > 0 && used == 0)) return false;
    for (int32_t i : idx)
      if (i < 0 || size_t(i) >= s.numel) return false;
    blocks += s.packed[q];
  }
  return true;
}

// Whether `out` bytes [begin, end) of [0, size) are the only ones changed from kUntouched.
bool untouched_outside(const char* out, size_t size, size_t begin, size_t end) {
  for (size_t i = 0; i < size; ++i)
    if ((i < begin || i >= end) && uint8_t(out[i]) != kUntouched) return false;
  return true;
}

void run(Input& in) {
  const int n = 1 + in.take<uint8_t>() % 8;
  const int rank = in.take<uint8_t>() % n;
  const size_t numel = in.take<uint16_t>() % 4097;
  const uint8_t types = in.take<uint8_t>();
  const uint8_t flags = in.take<uint8_t>();
  const bool ranges = flags & 1, small_words = flags & 2;
  auto word = [&]() -> size_t {
    return small_words ? in.take<uint16_t>() : size_t(in.take<uint64_t>());
  };
  SparseSizes s(n, rank, numel, kTypes[types % 3], kTypes[types / 3 % 3]);
  const size_t out_bytes = numel * s.out_size;
  std::unique_ptr<char[]> out = exact_buffer(out_bytes);
  if (out_bytes) std::memset(out.get(), kUntouched, out_bytes);

  for (int q = 0; q < n; ++q) {
    const size_t k = word(), packed = word();
    check_peer_size(s, q, k, packed);
    s.k.push_back(k);
    s.packed.push_back(packed);
  }

  if (!ranges) {
    size_t total = 0;
    for (size_t b : s.packed) total = std::min(total + b, in.left() + 1);  // no overflow
    if (total > in.left()) return;
    std::unique_ptr<char[]> blocks = in.bytes(total);
    const bool valid = gather_blocks_valid(s, blocks.get());
    // The decode buffer is scratch reused across calls: start it with indices that would pass.
    size_t total_k = 0;
    for (size_t k : s.k) total_k += k;  // each below its packed size (check_peer_size)
    std::vector<int32_t> decoded(std::max<size_t>(1, total_k), 0);
    bool ok = false;
    try {
      std::vector<uint64_t> seen((numel + 63) / 64 + 1);
      // every rank's block, back to back in the input, decoded as sparse.cc does
      std::vector<SparsePairs> pairs;
      bool ascending = true;
      for (size_t q = 0, offset = 0, at = 0; q < size_t(n);
           offset += s.packed[q], at += s.k[q], ++q)
        pairs.push_back(
            decode_block(s, int(q), blocks.get() + offset, decoded.data() + at, &ascending));
      reduce_decoded(s, pairs, ascending, seen.data(), out.get(), ReduceOp::kAvg);
      ok = true;
    } catch (const Error&) {
    }
    FUZZ_CHECK(ok == valid);
    return;
  }

  // ranges, step 1: the counts; this rank's own is local (the pairs it has for itself).
  std::vector<size_t> from(n);
  for (size_t& f : from) f = word();
  check_owner_counts(s, from);
  from[rank] %= s.k[rank] + 1;
  size_t total = 0;
  for (size_t f : from) total = std::min(total + packed_bytes(f, s.value_size), in.left() + 1);
  if (total > in.left()) return;
  std::unique_ptr<char[]> incoming = in.bytes(total);
  // Step 2.
  const size_t begin = s.range_begin(rank), len = s.range_count(rank);
  std::vector<uint8_t> touched(len, 0);
  const size_t n_touched = add_owned_pairs(s, incoming.get(), from, out.get(), touched.data());
  FUZZ_CHECK(n_touched == size_t(std::count(touched.begin(), touched.end(), 1)));
  FUZZ_CHECK(n_touched + size_t(std::count(touched.begin(), touched.end(), 0)) == len);
  FUZZ_CHECK(
      untouched_outside(out.get(), out_bytes, begin * s.out_size, (begin + len) * s.out_size));
  // Step 3: what add_owned_pairs left in my range must survive placing the others' pieces.
  std::vector<size_t> piece_sizes(n);
  for (size_t& p : piece_sizes) p = word();
  check_piece_sizes(s, piece_sizes);
  total = 0;
  for (size_t p : piece_sizes) total = std::min(total + p, in.left() + 1);
  if (total > in.left()) return;
  std::unique_ptr<char[]> pieces = in.bytes(total);
  std::vector<char> mine(out.get() + begin * s.out_size, out.get() + (begin + len) * s.out_size);
  place_pieces(s, pieces.get(), piece_sizes, out.get());
  FUZZ_CHECK(std::equal(mine.begin(), mine.end(), out.get() + begin * s.out_size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  try {
    run(in);
  } catch (const Error&) {
    // A peer's impossible size, index or encoding: the error sparse_all_reduce raises.
  }
  return 0;
}
