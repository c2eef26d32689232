#include "transport/tcp/socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "common/error.h"
#include "common/knobs.h"
#include "common/logging.h"

namespace ringcomm {
namespace tcp {

std::string errno_string(int err) { return str_cat(strerror(err), " (errno ", err, ")"); }

std::string Endpoint::str() const {
  return host.find(':') != std::string::npos ? str_cat("[", host, "]:", port)
                                             : str_cat(host, ":", port);
}

Endpoint Endpoint::parse(const std::string& text) {
  size_t colon = text.rfind(':');
  RC_CHECK_ARG(colon != std::string::npos && colon + 1 < text.size(), "bad address '", text,
               "', expected host:port");
  Endpoint e;
  e.host = text.substr(0, colon);
  if (e.host.size() >= 2 && e.host.front() == '[' && e.host.back() == ']')
    e.host = e.host.substr(1, e.host.size() - 2);
  e.port = std::stoi(text.substr(colon + 1));
  return e;
}

namespace {

std::string numeric_host(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET)
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof buf);
  else
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof buf);
  return buf;
}

struct AddrInfo {
  addrinfo* list = nullptr;
  AddrInfo(const std::string& host, int port, int flags) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = flags;
    int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
    if (rc != 0) RC_THROW("cannot resolve '", host, "': ", gai_strerror(rc));
  }
  ~AddrInfo() { freeaddrinfo(list); }
};

std::string interface_host(const std::string& ifname) {
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) RC_THROW("getifaddrs failed: ", errno_string(errno));
  std::string v4, v6;
  for (ifaddrs* it = ifs; it; it = it->ifa_next) {
    if (!it->ifa_addr || ifname != it->ifa_name) continue;
    if (it->ifa_addr->sa_family == AF_INET && v4.empty()) v4 = numeric_host(it->ifa_addr);
    if (it->ifa_addr->sa_family == AF_INET6 && v6.empty()) v6 = numeric_host(it->ifa_addr);
  }
  freeifaddrs(ifs);
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  RC_INVALID("RINGCOMM_SOCKET_IFNAME=", ifname, ": no such interface with an IP address");
}

// The source address the kernel would use to reach `host` (a UDP connect sends nothing).
std::string route_source_host(const std::string& host) {
  AddrInfo info(host, 9, 0);
  for (addrinfo* ai = info.list; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    bool ok = ::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
              getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    close(fd);
    if (ok) return numeric_host(reinterpret_cast<sockaddr*>(&local));
  }
  RC_THROW("no route to MASTER_ADDR=", host);
}

}  // namespace

std::string choose_bind_host(const std::string& master_addr) {
  std::string addr = knob_string("RINGCOMM_SOCKET_ADDR");
  if (!addr.empty()) return addr;
  std::string ifname = knob_string("RINGCOMM_SOCKET_IFNAME");
  if (!ifname.empty()) return interface_host(ifname);
  if (!master_addr.empty()) return route_source_host(master_addr);
  return "127.0.0.1";
}

int listen_on(const std::string& host, Endpoint* bound) {
  AddrInfo info(host, 0, AI_PASSIVE | AI_NUMERICSERV);
  for (addrinfo* ai = info.list; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 512) == 0) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
      bound->host = numeric_host(reinterpret_cast<sockaddr*>(&addr));
      bound->port =
          ntohs(addr.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&addr)->sin_port
                                          : reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
      set_nonblocking(fd);
      return fd;
    }
    close(fd);
  }
  RC_THROW("cannot listen on ", host, ": ", errno_string(errno));
}

// Non-blocking connects, each bounded by the deadline: a blocking connect to a host that drops
// SYNs would wait for the kernel's own timeout (minutes).
int connect_with_retry(const Endpoint& to, Clock::time_point deadline) {
  auto backoff = std::chrono::milliseconds(5);
  int last_error = 0;
  while (true) {
    AddrInfo info(to.host, to.port, AI_NUMERICSERV);
    for (addrinfo* ai = info.list; ai; ai = ai->ai_next) {
      int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) {
        last_error = errno;
        if (errno == EMFILE || errno == ENFILE)
          RC_THROW("cannot connect to ", to.str(), ": out of file descriptors (",
                   errno_string(errno), "); raise the limit (ulimit -n)");
        continue;
      }
      int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        pollfd p{fd, POLLOUT, 0};
        int ready = poll(&p, 1, int(std::max<int64_t>(0, std::min<int64_t>(left.count(), 1000))));
        int error = 0;
        socklen_t len = sizeof error;
        if (ready > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0)
          rc = 0;
        else
          errno = ready > 0 ? error : ETIMEDOUT;
      }
      if (rc == 0) {
        int flags = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);  // callers set the mode they want
        return fd;
      }
      last_error = errno;
      close(fd);
    }
    if (Clock::now() + backoff > deadline)
      RC_THROW("cannot connect to ", to.str(), ": ", errno_string(last_error));
    RC_LOG("connect to ", to.str(), " failed (", errno_string(last_error), "), retrying");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

void configure_data_socket(int fd, int buffer_bytes) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (buffer_bytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof buffer_bytes);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof buffer_bytes);
  }
  set_nonblocking(fd);
}

namespace {
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return false;
  pollfd p{fd, events, 0};
  return poll(&p, 1, int(std::min<int64_t>(left.count(), 1000000))) > 0;
}
}  // namespace

bool write_fully(int fd, const void* data, size_t bytes, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = send(fd, p, bytes, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      bytes -= size_t(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!wait_fd(fd, POLLOUT, deadline)) return false;
    } else {
      return false;
    }
  }
  return true;
}

bool read_fully(int fd, void* data, size_t bytes, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    ssize_t n = recv(fd, p, bytes, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= size_t(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!wait_fd(fd, POLLIN, deadline)) return false;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace tcp
}  // namespace ringcomm
