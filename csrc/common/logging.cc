#include "common/logging.h"

#include <cstdio>
#include <memory>
#include <mutex>

namespace ringcomm {
namespace {
std::mutex sink_mu;
// Shared, so that a line being written keeps its sink alive while another thread replaces it.
std::shared_ptr<std::function<void(const std::string&)>> sink;
}  // namespace

void log_line(const std::string& line) {
  std::shared_ptr<std::function<void(const std::string&)>> to;
  {
    std::lock_guard<std::mutex> lk(sink_mu);
    to = sink;
  }
  if (to)
    (*to)(line);
  else
    std::fprintf(stderr, "[ringcomm] %s\n", line.c_str());
}

void set_log_sink(std::function<void(const std::string&)> fn) {
  std::lock_guard<std::mutex> lk(sink_mu);
  sink = fn ? std::make_shared<std::function<void(const std::string&)>>(std::move(fn)) : nullptr;
}

}  // namespace ringcomm
