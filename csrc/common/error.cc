#include "common/error.h"

namespace ringcomm {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kOther: return "other";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kPeerLost: return "peer lost";
    case ErrorKind::kMismatch: return "mismatch";
    case ErrorKind::kProtocol: return "protocol";
    case ErrorKind::kAborted: return "aborted";
  }
  return "unknown";
}

ErrorKind error_kind_of(const std::exception_ptr& error) {
  if (!error) return ErrorKind::kOther;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return e.kind();
  } catch (...) {
    return ErrorKind::kOther;
  }
}

}  // namespace ringcomm
