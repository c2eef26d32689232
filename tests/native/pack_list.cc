// kernels::PackList (csrc/kernels/pack_list.h): buffers added where the last one ends join it,
// empty ones add nothing, others stay apart; a walk over the joined list (for_parts, and the
// CPU pack and unpack) covers the same fused elements as one over the buffers. Prints "ok", or
// the first difference and exits 1.
//
// usage: pack_list
#include <cstdio>
#include <vector>

#include "kernels/cpu/pack.h"

namespace {

using ringcomm::DType;
using ringcomm::kernels::PackList;

struct Part {
  size_t index, first, count;
  bool operator==(const Part& o) const {
    return index == o.index && first == o.first && count == o.count;
  }
};

std::vector<Part> parts(const PackList& list, size_t begin, size_t end) {
  std::vector<Part> out;
  ringcomm::kernels::for_parts(
      list, begin, end, [&](size_t i, size_t first, size_t n) { out.push_back({i, first, n}); });
  return out;
}

bool check(bool ok, const char* what) {
  if (!ok) std::printf("%s\n", what);
  return ok;
}

}  // namespace

int main() {
  bool ok = true;
  std::vector<float> a(100), b(100);
  for (int i = 0; i < 100; ++i) a[size_t(i)] = float(i), b[size_t(i)] = float(1000 + i);

  // Views of `a` in order, an empty one between them: one buffer.
  PackList views(DType::kFloat32);
  views.add(&a[0], 10);
  views.add(&a[10], 0);
  views.add(&a[10], 30);
  views.add(&a[40], 60);
  ok &= check(views.size() == 1 && views.count() == 100 && views.data(0) == (char*)&a[0],
              "views in order: not one buffer of 100");

  // A gap, a step back and another allocation each start a buffer.
  PackList apart(DType::kFloat32);
  apart.add(&a[0], 10);
  apart.add(&a[11], 9);  // a gap of one element
  apart.add(&a[0], 0);   // empty: nothing
  apart.add(&b[0], 20);
  apart.add(&a[20], 10);  // after b: not where the last one ends
  ok &= check(apart.size() == 4 && apart.count() == 49, "buffers apart: not 4 buffers of 49");
  ok &= check(parts(apart, 5, 25) == std::vector<Part>{{0, 5, 5}, {1, 10, 9}, {2, 19, 6}},
              "for_parts over [5, 25) of the buffers apart");
  ok &= check(apart.find(19) == 2 && apart.find(48) == 3, "find in the buffers apart");

  // pack then unpack through the joined views: the same elements in the same order.
  std::vector<float> packed(100, -1.0f), back(100, -1.0f);
  ringcomm::cpu::pack(views, 7, 93, packed.data(), DType::kFloat32, {});
  bool packed_ok = true;
  for (size_t i = 0; i < 86; ++i) packed_ok &= packed[i] == float(7 + i);
  ok &= check(packed_ok, "pack of views [7, 93)");
  PackList into(DType::kFloat32);
  into.add(&back[0], 50);
  into.add(&back[50], 50);
  ringcomm::cpu::unpack(packed.data(), DType::kFloat32, into, 7, 93, {});
  bool unpacked_ok = back[6] == -1.0f && back[93] == -1.0f;
  for (size_t i = 7; i < 93; ++i) unpacked_ok &= back[i] == float(i);
  ok &= check(unpacked_ok, "unpack into views [7, 93)");

  if (ok) std::printf("ok\n");
  return ok ? 0 : 1;
}
