// Errors raised by the core. Python sees ringcomm::Error as ringcomm.RingcommError and
// std::invalid_argument as ValueError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace ringcomm {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

#define RC_THROW(...) throw ::ringcomm::Error(::ringcomm::str_cat(__VA_ARGS__))
#define RC_INVALID(...) throw std::invalid_argument(::ringcomm::str_cat(__VA_ARGS__))
#define RC_CHECK_ARG(cond, ...) \
  do {                          \
    if (!(cond)) RC_INVALID(__VA_ARGS__); \
  } while (0)

}  // namespace ringcomm
