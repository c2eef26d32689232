// A schedule (schedule.h) laid out for a stream-ordered wire, NCCL's ncclSend/ncclRecv: the
// work of one rank runs on one CUDA stream, one item after another. A message whose peer has not
// posted its side yet blocks the stream, so a rank's sends and receives are posted in groups
// (ncclGroupStart/End), each group completing only when all of its messages have. A group holds
// the sends issued since the previous group and the receives of one step (an exchange: its sends
// too), and is followed on the stream by the reductions of what those receives brought (and the
// avg division of a completed block). Pipelined by step (the ring), a group takes every slice of
// the step; by slice (the trees), one slice.
// Sends wait for the next group rather than going out alone because a lone send blocks the
// stream until its peer receives, and the peer may first be waiting for this rank (the ring:
// every rank sends, then receives). A ring step's slices share one group because their sends
// went out together: were each receive a group of its own, a rank's first group would hold all
// of the previous step's sends while the peer receives them over as many groups.
// The order of (step, slice) is run_schedule's, so messages between two ranks pair up in the
// same order as on the other transports. tests/test_schedule.py runs every rank's groups under
// the rule above and checks that they all complete, with matching messages.
#pragma once

#include <vector>

#include "algorithms/schedule.h"

namespace ringcomm {

struct StreamMessage {
  bool send;
  int step;      // the schedule step it belongs to
  size_t slice;  // slice index within the step's block
  int peer;
  // A receive that is reduced after the group lands in staging, slice (slice - first) of it;
  // any other lands in place. A send reads the step's source (kSend, an exchange) or its target
  // (forwarding what it received).
  bool to_staging;
};

struct StreamGroup {
  std::vector<StreamMessage> messages;
  // After the group: slices [first, last) of step `step`, received into staging, are combined
  // into the step's target (and divided when the step completes an avg).
  bool reduce = false;
  int step = -1;
  size_t first = 0, last = 0;
};

// The groups of one rank's schedule over `blocks`, in slices of at most `slice` elements.
std::vector<StreamGroup> stream_groups(const Schedule& schedule, const Segments& blocks,
                                       size_t slice);

}  // namespace ringcomm
