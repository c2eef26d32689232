// Heap allocations per collective call, small vs large, on real ranks (forked processes over
// loopback TCP or shared memory). A large call sends many more messages than a small one (ring
// steps x slices); if posting a message allocated, its count would grow with the size. Operator
// new and delete are replaced here, so every C++ allocation of the core is counted.
//
// usage: count_allocations <world> <store dir>   prints "<case> <small> <large>" per case, from
// rank 0, as allocations per call.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "communicator.h"

static std::atomic<long> allocations{0};

void* operator new(size_t bytes) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(bytes ? bytes : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace {

using ringcomm::Algorithm;
using ringcomm::Communicator;
using ringcomm::DType;
using ringcomm::ReduceOp;

// A key-value store in a directory: a key is a file, written whole with a rename.
Communicator::KeyValueStore file_store(const std::string& dir) {
  Communicator::KeyValueStore store;
  store.set = [dir](const std::string& key, const std::string& value) {
    std::string name = key;
    for (char& c : name) c = c == '/' ? '_' : c;
    std::string path = dir + "/" + name, temporary = path + ".tmp" + std::to_string(getpid());
    std::ofstream(temporary) << value;
    std::rename(temporary.c_str(), path.c_str());
  };
  store.get = [dir](const std::string& key) {
    std::string name = key;
    for (char& c : name) c = c == '/' ? '_' : c;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      std::ifstream file(dir + "/" + name);
      if (file.good()) {
        std::stringstream text;
        text << file.rdbuf();
        return text.str();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    throw std::runtime_error("store: no key " + key);
  };
  return store;
}

struct Case {
  const char* name;
  void (*call)(Communicator&, std::vector<float>&, std::vector<float>&);
};

const Case kCases[] = {
    {"all_reduce ring",
     [](Communicator& c, std::vector<float>& a, std::vector<float>&) {
       c.all_reduce(a.data(), a.size(), DType::kFloat32, ReduceOp::kSum, Algorithm::kRing, false)
           ->wait(-1);
     }},
    {"all_reduce tree",
     [](Communicator& c, std::vector<float>& a, std::vector<float>&) {
       c.all_reduce(a.data(), a.size(), DType::kFloat32, ReduceOp::kSum, Algorithm::kTree, false)
           ->wait(-1);
     }},
    {"broadcast",
     [](Communicator& c, std::vector<float>& a, std::vector<float>&) {
       c.broadcast(a.data(), a.size(), DType::kFloat32, 0, false)->wait(-1);
     }},
    {"all_gather",
     [](Communicator& c, std::vector<float>& a, std::vector<float>& out) {
       c.all_gather(out.data(), a.data(), a.size(), DType::kFloat32, false)->wait(-1);
     }},
};

double per_call(Communicator& comm, const Case& test, size_t count, int calls) {
  std::vector<float> data(count, 1.0f), out(count * size_t(comm.world_size()));
  for (int i = 0; i < 20; ++i) test.call(comm, data, out);  // grow what is reused
  long before = allocations.load();
  for (int i = 0; i < calls; ++i) test.call(comm, data, out);
  return double(allocations.load() - before) / calls;
}

int run_rank(int rank, int world, const std::string& dir) {
  Communicator comm(rank, world, 60.0, "127.0.0.1");
  comm.rendezvous(file_store(dir));
  for (const Case& test : kCases) {
    double small = per_call(comm, test, 2, 200);
    double large = per_call(comm, test, 1 << 20, 20);  // 4 MiB: tens of messages per call
    if (rank == 0) std::printf("%s %.2f %.2f\n", test.name, small, large);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <world> <store dir>\n", argv[0]);
    return 2;
  }
  const int world = std::atoi(argv[1]);
  std::vector<pid_t> children;
  for (int rank = 1; rank < world; ++rank) {
    pid_t pid = fork();
    if (pid == 0) _exit(run_rank(rank, world, argv[2]));
    children.push_back(pid);
  }
  int status = run_rank(0, world, argv[2]);
  for (pid_t pid : children) {
    int child = 0;
    waitpid(pid, &child, 0);
    if (!WIFEXITED(child) || WEXITSTATUS(child) != 0) status = 1;
  }
  return status;
}
