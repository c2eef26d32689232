// Fuzz target: the unpack of fused and coalesced collectives (kernels/cpu/pack.h,
// kernels/pack_math.h): a slice of payload a peer sent, in the wire dtype, converted and scaled
// into the caller's buffers as the local plan lays them out (algorithms/coalesced.cc).
//
// Input: byte 0: wire dtype; byte 1: the buffers' dtype; byte 2: scaling kind; byte 3 (mod 8):
// the factor (0: 1, 1: 0, 2: the world size, 3: its inverse, else bytes 4-11 as a double, NaN
// and Inf included); byte 12: world size - 1; byte 13: number of buffers (1-8), then 2 bytes of
// element count each (0-512); 2 bytes each of the slice's begin and length; the payload,
// (end - begin) elements (the slice is cut to the bytes there are). A plan is only built when
// check_conversion accepts its dtypes and scaling, as coalesced plans are.
// The payload and every buffer are allocations of exactly their size (null when empty, as an
// empty tensor's data may be): the unpack must stay inside them, write only the slice's
// elements, and copy the bytes unchanged when there is no cast and no scaling. NaN and Inf are
// fine.
#include <stdexcept>
#include <vector>

#include "fuzz_input.h"
#include "kernels/cpu/pack.h"

using namespace ringcomm;

namespace {

constexpr uint8_t kUntouched = 0x5a;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const DType wire = DType(in.take<uint8_t>() % kNumDTypes);
  const DType dtype = DType(in.take<uint8_t>() % kNumDTypes);
  cpu::Scaling scaling;
  scaling.kind = cpu::ScaleKind(in.take<uint8_t>() % 3);
  const uint8_t factor = in.take<uint8_t>();
  const double raw = in.take<double>();
  const int world = 1 + in.take<uint8_t>();
  scaling.factor = factor % 8 == 0   ? 1.0
                   : factor % 8 == 1 ? 0.0
                   : factor % 8 == 2 ? double(world)
                   : factor % 8 == 3 ? 1.0 / world
                                     : raw;
  try {
    cpu::check_conversion(wire, dtype, scaling);
  } catch (const std::invalid_argument&) {
    return 0;  // no plan would ask for it
  }

  const size_t e_wire = dtype_size(wire), e = dtype_size(dtype);
  const int nbuf = 1 + in.take<uint8_t>() % 8;
  std::vector<std::unique_ptr<char[]>> buffers;
  cpu::PackList list(dtype);
  for (int i = 0; i < nbuf; ++i) {
    const size_t count = in.take<uint16_t>() % 513;
    buffers.push_back(exact_buffer(count * e));
    if (count) std::memset(buffers.back().get(), kUntouched, count * e);
    list.add(buffers.back().get(), count);
  }
  const size_t begin = in.take<uint16_t>() % (list.count() + 1);
  size_t end = begin + in.take<uint16_t>() % (list.count() - begin + 1);
  end = std::min(end, begin + in.left() / e_wire);
  std::unique_ptr<char[]> payload = in.bytes((end - begin) * e_wire);

  cpu::unpack(payload.get(), wire, list, begin, end, scaling);

  for (size_t i = 0; i < list.size(); ++i)
    for (size_t j = 0; j < list.count(i); ++j) {
      const size_t pos = list.offset(i) + j;
      const char* got = list.data(i) + j * e;
      if (pos < begin || pos >= end) {
        for (size_t b = 0; b < e; ++b) FUZZ_CHECK(uint8_t(got[b]) == kUntouched);
      } else if (wire == dtype && scaling.kind == cpu::ScaleKind::kNone) {
        FUZZ_CHECK(std::memcmp(got, payload.get() + (pos - begin) * e_wire, e) == 0);
      }
    }
  return 0;
}
