// A single-copy message of several ranges whose sender changes its list after publishing it: the
// receiver reads the list out of the sender's memory, so what it finds there is the peer's word
// and must be checked. Two forked processes, each with a shared-memory transport mapped to the
// other's; rank 1 sends two ranges, then (once the slot is published) forges its list as
// `case`; rank 0 receives and prints what it got: "ok", or "error: <message>". Case `count`
// rewrites the count the slot publishes instead, through rank 1's own mapping of its segment, as
// a hostile peer could.
//
// usage: forged_ranges <case>   case: honest | short | long | address | count
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "transport/shm/shm_transport.h"

namespace {

using ringcomm::Clock;
using ringcomm::Ranges;
using ringcomm::Signature;
using ringcomm::shm::ShmOptions;
using ringcomm::shm::ShmTransport;

constexpr size_t kRangeBytes = 100000;  // two of them: well above single copy's 64 KiB a range

struct Done : ringcomm::PartSink {
  int parts = 0;
  void part_done(int64_t) override { ++parts; }
};

void write_line(int fd, const std::string& line) {
  std::string text = line + "\n";
  if (write(fd, text.data(), text.size()) != ssize_t(text.size())) throw std::runtime_error("pipe");
}

std::string read_line(int fd) {
  std::string line;
  char c;
  for (;;) {
    if (read(fd, &c, 1) != 1) throw std::runtime_error("the other rank is gone");
    if (c == '\n') return line;
    line += c;
  }
}

// In the segment behind `address` ("pid:fd:...", the receiver's), finds the published slot's {list,
// bytes, count} and makes its count `count`.
void forge_count(const std::string& address, const iovec* list, uint64_t bytes, uint64_t count) {
  const size_t colon = address.find(':');
  const std::string path = "/proc/" + address.substr(0, colon) + "/fd/" +
                           address.substr(colon + 1, address.find(':', colon + 1) - colon - 1);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) throw std::runtime_error("cannot open " + path);
  void* base = mmap(nullptr, size_t(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) throw std::runtime_error("mmap");
  const uint64_t published[3] = {uint64_t(reinterpret_cast<uintptr_t>(list)), bytes, 2};
  char* at = static_cast<char*>(base);
  char* end = at + st.st_size - sizeof published;
  for (; at <= end; ++at)  // a slot's payload need not be 8-aligned
    if (memcmp(at, published, sizeof published) == 0) break;
  if (at > end) throw std::runtime_error("published slot not found");
  memcpy(at + 2 * sizeof(uint64_t), &count, sizeof count);
  munmap(base, size_t(st.st_size));
}

// Progresses `t` until `done` has `parts` parts or 10 s pass.
void progress_until(ShmTransport& t, const Done& done, int parts) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (done.parts < parts) {
    t.progress();
    if (Clock::now() > until) throw std::runtime_error("timed out");
  }
}

int run(int rank, const std::string& forge, int to_peer, int from_peer) {
  Done done;
  ShmOptions options;
  options.single_copy_bytes = 4096;
  ShmTransport t(rank, 2, options, done);
  std::string why;
  if (!t.prepare({0, 1}, &why)) throw std::runtime_error(why);
  write_line(to_peer, t.address());
  const std::string peer_address = read_line(from_peer);
  if (!t.link(1 - rank, peer_address, &why)) throw std::runtime_error(why);
  t.enable(1 - rank);
  write_line(to_peer, "mapped");
  read_line(from_peer);
  Signature sig;
  sig.count = 2 * kRangeBytes;
  std::vector<char> first(kRangeBytes, 'a'), second(kRangeBytes, 'b');
  if (rank == 1) {
    iovec list[2] = {{first.data(), kRangeBytes}, {second.data(), kRangeBytes}};
    t.post_ranges(true, 0, Ranges{list, 2}, 2 * kRangeBytes, sig, 1);
    t.progress();  // publishes the slot: the list's address, its count and the message's size
    if (forge == "short") list[1].iov_len = kRangeBytes / 2;
    if (forge == "long") list[1].iov_len = 3 * kRangeBytes;
    if (forge == "address") list[1].iov_base = reinterpret_cast<void*>(uintptr_t(4096));
    // one range more than the message has bytes: a receiver that believed it would allocate
    // and read a list of that many
    if (forge == "count") forge_count(peer_address, list, 2 * kRangeBytes, 2 * kRangeBytes + 1);
    write_line(to_peer, "forged");
    read_line(from_peer);  // rank 0 is done reading
    return 0;
  }
  read_line(from_peer);  // the list is forged
  std::vector<char> into(2 * kRangeBytes);
  t.post(false, 1, into.data(), into.size(), sig, 1);
  std::string result = "ok";
  try {
    progress_until(t, done, 1);
    if (std::string(into.data(), kRangeBytes) != std::string(kRangeBytes, 'a') ||
        std::string(into.data() + kRangeBytes, kRangeBytes) != std::string(kRangeBytes, 'b'))
      result = "wrong bytes";
  } catch (const std::exception& e) {
    result = std::string("error: ") + e.what();
  }
  std::printf("%s\n", result.c_str());
  std::fflush(stdout);
  write_line(to_peer, "read");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: forged_ranges honest|short|long|address|count\n");
    return 2;
  }
  int down[2], up[2];  // rank 0 -> rank 1, rank 1 -> rank 0
  if (pipe(down) != 0 || pipe(up) != 0) return 1;
  pid_t child = fork();
  if (child == 0) {
    close(down[1]);  // each rank holds only its own ends, so one that fails ends the other's reads
    close(up[0]);
    try {
      _exit(run(1, argv[1], up[1], down[0]));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank 1: %s\n", e.what());
      _exit(1);
    }
  }
  close(down[0]);
  close(up[1]);
  int rc = 0;
  try {
    rc = run(0, argv[1], down[1], up[0]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank 0: %s\n", e.what());
    rc = 1;
  }
  int status = 0;
  waitpid(child, &status, 0);
  return rc != 0 ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
