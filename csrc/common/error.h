// Errors raised by the core. Python sees ringcomm::Error as ringcomm.RingcommError, or the
// subclass for its kind (csrc/python/bindings.cc), and std::invalid_argument as ValueError.
#pragma once

#include <cstdint>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

namespace ringcomm {

// What went wrong, for callers that handle some failures differently: retry or report a
// timeout, restart the job when a peer is lost, fix the program on a mismatch. A rank that fails
// tells its peers the kind with its reason, so every rank raises the same kind.
enum class ErrorKind : uint8_t {
  kOther = 0,
  kTimeout,   // a peer did not do its part within the communicator's timeout
  kPeerLost,  // a peer's connection closed or failed: the process died or left
  kMismatch,  // ranks issued different operations (collective, count, dtype, op, root)
  kProtocol,  // bytes from a peer that do not add up: garbage, a forged header, a stranger
  kAborted,   // the communicator was aborted (abort(), a signal handler, a closed communicator)
};
constexpr int kErrorKinds = int(ErrorKind::kAborted) + 1;  // the last kind above, plus one

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, ErrorKind kind = ErrorKind::kOther)
      : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// The kind of a caught error: kOther for anything but a ringcomm::Error.
ErrorKind error_kind_of(const std::exception_ptr& error);

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

#define RC_THROW(...) throw ::ringcomm::Error(::ringcomm::str_cat(__VA_ARGS__))
// RC_THROW_AS(kTimeout, "waited ", s, " s"): an Error of that ErrorKind.
#define RC_THROW_AS(kind, ...) \
  throw ::ringcomm::Error(::ringcomm::str_cat(__VA_ARGS__), ::ringcomm::ErrorKind::kind)
#define RC_INVALID(...) throw std::invalid_argument(::ringcomm::str_cat(__VA_ARGS__))
#define RC_CHECK_ARG(cond, ...)           \
  do {                                    \
    if (!(cond)) RC_INVALID(__VA_ARGS__); \
  } while (0)

}  // namespace ringcomm
