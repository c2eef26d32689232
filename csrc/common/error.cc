#include "common/error.h"

namespace ringcomm {

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
