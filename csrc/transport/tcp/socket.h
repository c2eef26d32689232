// Socket plumbing for the TCP transport: addresses, listening, connecting with retry, options.
#pragma once

#include <sys/socket.h>

#include <string>

#include "transport/transport.h"

namespace ringcomm {
namespace tcp {

// A numeric host and port, printable as "host:port" ("[v6]:port").
struct Endpoint {
  std::string host;
  int port = 0;
  std::string str() const;
  static Endpoint parse(const std::string& text);
};

// The address this rank listens on: RINGCOMM_SOCKET_ADDR, else the first address of
// RINGCOMM_SOCKET_IFNAME, else the local address of the route to `master_addr`, else loopback.
std::string choose_bind_host(const std::string& master_addr);

// Bound, listening socket on host with an ephemeral port; returns fd and fills `bound`.
int listen_on(const std::string& host, Endpoint* bound);

// Connects to `to`, retrying refused/unreachable attempts with exponential backoff until
// `deadline`. Returns a blocking fd.
int connect_with_retry(const Endpoint& to, Clock::time_point deadline);

// TCP_NODELAY, optional explicit buffer sizes (0 keeps the kernel's autotuning), non-blocking.
void configure_data_socket(int fd, int buffer_bytes);

// Blocking-style exact read/write on a non-blocking fd, bounded by `deadline`. Return false on
// timeout or a closed/broken connection.
bool write_fully(int fd, const void* data, size_t bytes, Clock::time_point deadline);
bool read_fully(int fd, void* data, size_t bytes, Clock::time_point deadline);

void set_nonblocking(int fd);
std::string errno_string(int err);

}  // namespace tcp
}  // namespace ringcomm
