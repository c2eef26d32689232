#include "algorithms/stream_plan.h"

namespace ringcomm {

std::vector<StreamGroup> stream_groups(const Schedule& schedule, const Segments& blocks,
                                       size_t slice) {
  std::vector<StreamGroup> groups;
  std::vector<StreamMessage> pending;  // sends waiting for the next group
  auto close = [&](StreamGroup g) {
    g.messages.insert(g.messages.begin(), pending.begin(), pending.end());
    pending.clear();
    groups.push_back(std::move(g));
  };
  walk_schedule(schedule, blocks, std::max<size_t>(1, slice),
                [&](size_t step, size_t first, size_t last) {
                  const Step& s = schedule.steps[step];
                  const int i = int(step);
                  if (s.prim == Prim::kSend) {
                    for (size_t j = first; j < last; ++j)
                      pending.push_back({true, i, j, s.to, false});
                    return;
                  }
                  StreamGroup g;
                  g.step = i;
                  g.first = first;
                  g.last = last;
                  g.reduce = s.prim == Prim::kRecvReduce || s.prim == Prim::kRecvReduceSend ||
                             s.prim == Prim::kExchangeReduce;
                  for (size_t j = first; j < last; ++j) {
                    if (s.prim == Prim::kExchangeReduce)
                      g.messages.push_back({true, i, j, s.to, false});
                    g.messages.push_back(
                        {false, i, j, s.prim == Prim::kExchangeReduce ? s.to : s.from, g.reduce});
                  }
                  close(std::move(g));
                  if (s.prim == Prim::kRecvSend || s.prim == Prim::kRecvReduceSend)
                    for (size_t j = first; j < last; ++j)
                      pending.push_back({true, i, j, s.to, false});
                });
  if (!pending.empty()) close(StreamGroup{});
  return groups;
}

}  // namespace ringcomm
