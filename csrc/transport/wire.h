// The header every message carries, on a socket or in a shared-memory slot: the message's
// signature and payload size, so a receiver checks both before it accepts a byte.
// Little-endian hosts only (checked in the TCP handshake; shared memory is one host).
#pragma once

#include <cstdint>

#include "transport/transport.h"

namespace ringcomm {

constexpr uint32_t kMessageMagic = 0x524d4331;  // "RMC1"
constexpr uint8_t kDataMessage = 1;
constexpr uint8_t kAbortMessage = 2;  // payload: the reason, as text; `aux`: its ErrorKind
// No payload; `root`: a rank the sender has been waiting on for a while. Sent to every peer while
// blocked (transport/mesh.cc), so that a rank that times out can follow who waits on whom to the
// rank that is stuck.
constexpr uint8_t kWaitingMessage = 3;
constexpr size_t kMaxAbortText = 4096;

struct WireHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t coll;
  uint8_t dtype;
  uint8_t op;
  uint8_t algo;
  uint8_t p2p;
  uint16_t reserved;
  int32_t root;
  uint64_t seq;
  uint64_t count;
  uint64_t aux;
  uint64_t payload_bytes;
};
static_assert(sizeof(WireHeader) == 48, "WireHeader must be 48 bytes");

inline WireHeader make_header(const Signature& sig, uint64_t bytes) {
  WireHeader h{};
  h.magic = kMessageMagic;
  h.kind = kDataMessage;
  h.coll = uint8_t(sig.coll);
  h.dtype = uint8_t(sig.dtype);
  h.op = uint8_t(sig.op);
  h.algo = uint8_t(sig.algo);
  h.p2p = sig.p2p;
  h.root = sig.root;
  h.seq = sig.seq;
  h.count = sig.count;
  h.aux = sig.aux;
  h.payload_bytes = bytes;
  return h;
}

inline WireHeader make_abort_header(uint64_t text_bytes, ErrorKind why) {
  WireHeader h{};
  h.magic = kMessageMagic;
  h.kind = kAbortMessage;
  h.aux = uint64_t(why);
  h.payload_bytes = text_bytes;
  return h;
}

inline WireHeader make_waiting_header(int on) {
  WireHeader h{};
  h.magic = kMessageMagic;
  h.kind = kWaitingMessage;
  h.root = on;
  return h;
}

// Throws what rank `peer` aborted with: its reason, as the kind it named. A kind no ErrorKind
// has is reported as what it is, bytes that do not add up.
[[noreturn]] inline void throw_remote_abort(int peer, const std::string& reason, uint64_t kind) {
  if (kind >= uint64_t(kErrorKinds))
    RC_THROW_AS(kProtocol, "protocol error: rank ", peer, " aborted with error kind ", kind,
                " (there are ", kErrorKinds, "): ", reason);
  throw Error(str_cat("rank ", peer, " aborted: ", reason), ErrorKind(kind));
}

inline Signature header_signature(const WireHeader& h) {
  Signature s;
  s.coll = Collective(h.coll);
  s.dtype = DType(h.dtype);
  s.op = ReduceOp(h.op);
  s.algo = Algorithm(h.algo);
  s.p2p = h.p2p != 0;
  s.root = h.root;
  s.seq = h.seq;
  s.count = h.count;
  s.aux = h.aux;
  return s;
}

// A message that arrives with nothing posted for it is a mismatch if it belongs to the running
// collective (same sequence number, other signature) or to one already finished.
inline bool stray_mismatch(const Signature& theirs, const Signature& current) {
  return !theirs.p2p && !current.p2p &&
         (theirs.seq < current.seq || (theirs.seq == current.seq && theirs != current));
}

}  // namespace ringcomm
