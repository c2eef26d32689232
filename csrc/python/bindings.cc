// pybind11 bindings: ringcomm._C. Buffers cross as (address, element count, dtype code); the
// Python layer turns tensors and arrays into those and keeps them alive while in use.
#include <chrono>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/crypto.h"
#include "common/knobs.h"
#include "common/logging.h"
#include "common/trace.h"
#include "algorithms/select.h"
#include "communicator.h"
#include "transport/shm/shm_transport.h"
#include "kernels/cpu/reduce.h"

namespace py = pybind11;
using namespace ringcomm;

namespace ringcomm {
void bind_compress(py::module_& m);    // compress_bindings.cc
void bind_fusion(py::module_& m);      // fusion_bindings.cc
void bind_algorithms(py::module_& m);  // algorithm_bindings.cc
}  // namespace ringcomm

namespace {

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

py::dict stats_dict(const OpStats& s) {
  py::dict d;
  d["calls"] = s.calls;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["queued_s"] = double(s.queued_ns) * 1e-9;
  d["run_s"] = double(s.run_ns) * 1e-9;
  d["idle_s"] = double(s.idle_ns) * 1e-9;
  if (s.algorithm) d["algorithm"] = s.algorithm;
  return d;
}

// A Python callable that may be called and destroyed on a thread without the GIL.
template <typename... Args>
std::function<void(Args...)> gil_safe_callback_of(py::function fn) {
  auto holder = std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
  return [holder](Args... args) {
    py::gil_scoped_acquire gil;
    try {
      (*holder)(args...);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("ringcomm callback");
    }
  };
}

std::function<void()> gil_safe_callback(py::function fn) {
  return gil_safe_callback_of<>(std::move(fn));
}

// ringcomm.RingcommError (a RuntimeError) and a subclass per ErrorKind, as `error_types` indexed
// by kind (kOther: RingcommError itself). They live as long as the interpreter.
void bind_errors(py::module_& m) {
  struct Named {
    ErrorKind kind;
    const char* name;
    const char* doc;
  };
  static const Named subclasses[] = {
      {ErrorKind::kTimeout, "CollectiveTimeoutError",
       "A peer did not do its part within the communicator's timeout (the message names the "
       "ranks waited on and, where they said, on whom they wait), or Work.wait(timeout) expired."},
      {ErrorKind::kPeerLost, "PeerLostError",
       "A peer's connection closed or failed: its process died or left."},
      {ErrorKind::kMismatch, "MismatchError",
       "Ranks issued different operations: collective, count, dtype, op or root (both named)."},
      {ErrorKind::kProtocol, "ProtocolError",
       "Bytes from a peer that do not add up: garbage, a forged header, a stranger on the port."},
      {ErrorKind::kAborted, "AbortedError",
       "The communicator was aborted (Communicator.abort, a signal handler) or closed."},
  };
  auto make = [&](const char* name, PyObject* base, const char* doc) {
    const std::string qualified = std::string("ringcomm._C.") + name;
    PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base, nullptr);
    if (type == nullptr) throw py::error_already_set();
    m.add_object(name, py::handle(type));  // the module takes a reference; this one is kept
    return type;
  };
  static PyObject* types[kErrorKinds] = {};
  types[int(ErrorKind::kOther)] =
      make("RingcommError", PyExc_RuntimeError,
           "Any ringcomm failure; the subclasses name its kind. After one raised by an "
           "operation the communicator is broken: later calls raise the same class.");
  for (const Named& n : subclasses) types[int(n.kind)] = make(n.name, types[0], n.doc);
  py::tuple by_kind(kErrorKinds);
  for (int k = 0; k < kErrorKinds; ++k)
    by_kind[size_t(k)] = py::reinterpret_borrow<py::object>(types[k]);
  m.attr("error_types") = by_kind;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(types[int(e.kind())], e.what());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ringcomm core: communicators, transports, algorithms and CPU kernels";
  bind_errors(m);
  // The codes the calls below take, by name: ringcomm's Python tables are made from these.
  py::dict dtypes, floating, ops, algorithms, sparse_algorithms;
  for (int t = 0; t < kNumDTypes; ++t) {
    dtypes[dtype_name(DType(t))] = t;
    if (is_floating(DType(t))) floating[dtype_name(DType(t))] = t;
  }
  for (int op = 0; op < kNumReduceOps; ++op) ops[op_name(ReduceOp(op))] = op;
  algorithms[algorithm_name(Algorithm::kAuto)] = int(Algorithm::kAuto);
  for (Algorithm a : kAllReduceAlgorithms) algorithms[algorithm_name(a)] = int(a);
  sparse_algorithms[algorithm_name(Algorithm::kAuto)] = int(Algorithm::kAuto);
  for (Algorithm a : kSparseAllReduceAlgorithms) sparse_algorithms[algorithm_name(a)] = int(a);
  m.attr("DTYPE_CODES") = dtypes;
  m.attr("FLOATING_DTYPE_CODES") = floating;
  m.attr("OP_CODES") = ops;
  m.attr("ALGORITHM_CODES") = algorithms;
  m.attr("SPARSE_ALGORITHM_CODES") = sparse_algorithms;

  py::class_<Work, WorkPtr>(m, "Work")
      // Waits in slices of 100 ms with Python's signal handlers run between them: a SIGINT or a
      // preemption SIGTERM handler runs (and may raise) while an operation is pending.
      .def(
          "wait",
          [](Work& w, double timeout_s) {
            const auto start = std::chrono::steady_clock::now();
            while (true) {
              double slice = 0.1;
              if (timeout_s >= 0) {
                double left =
                    timeout_s -
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                slice = std::max(0.0, std::min(slice, left));
              }
              bool done;
              {
                py::gil_scoped_release nogil;
                done = w.wait(slice);
              }
              if (done) return true;
              if (PyErr_CheckSignals() != 0) throw py::error_already_set();
              if (timeout_s >= 0 && slice < 0.1) return false;
            }
          },
          py::arg("timeout_s") = -1.0)
      .def("is_completed", &Work::is_completed)
      .def("error", &Work::error)
      .def("error_kind", [](Work& w) { return int(w.error_kind()); })
      .def("source", &Work::source)
      .def("stats", [](const Work& w) { return stats_dict(w.stats()); })
      .def("add_done_callback",
           [](Work& w, py::function fn) { w.on_finished(gil_safe_callback(std::move(fn))); });

  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init<int, int, double, const std::string&>(), py::arg("rank"), py::arg("world_size"),
           py::arg("timeout_s"), py::arg("master_addr") = "")
      // The communicator of a torch process group's ringcomm backend (csrc/torch/), handed over
      // as a capsule: the two extensions are built against different pybind11s.
      .def_static("from_capsule",
                  [](py::capsule c) {
                    RC_CHECK_ARG(std::string(c.name() ? c.name() : "") == kCommunicatorCapsule,
                                 "not a ringcomm communicator capsule");
                    return *static_cast<std::shared_ptr<Communicator>*>(c.get_pointer());
                  })
      // The other way: this communicator for ringcomm._C_torch's all_reduce_tensor.
      .def("capsule",
           [](const std::shared_ptr<Communicator>& self) {
             auto* held = new std::shared_ptr<Communicator>(self);
             return py::capsule(held, kCommunicatorCapsule, [](void* p) {
               delete static_cast<std::shared_ptr<Communicator>*>(p);
             });
           })
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def("address", &Communicator::address)
      .def("transport_of", &Communicator::transport_of, py::arg("peer"))
      .def("connect", &Communicator::connect, G())
      .def(
          "rendezvous",
          [](Communicator& c, std::function<void(const std::string&, const std::string&)> set,
             std::function<std::string(const std::string&)> get) { c.rendezvous({set, get}); },
          py::arg("set"), py::arg("get"), G())
      .def("algorithm_for",
           [](const Communicator& c, size_t bytes, int algo) {
             if (Algorithm(algo) == Algorithm::kAuto && !c.forced_registered().empty())
               return c.forced_registered();
             return std::string(algorithm_name(c.algorithm_for(bytes, Algorithm(algo))));
           })
      .def("auto_trials",
           [](const Communicator& c) {
             py::list out;
             for (const Retuner::Report& r : c.auto_trials()) {
               py::list candidates;
               for (Algorithm a : r.candidates) candidates.append(algorithm_name(a));
               py::dict d;
               d["bytes"] = r.bytes;
               d["candidates"] = candidates;
               d["seconds"] = r.seconds;
               d["paid"] = r.paid;
               d["winner"] = algorithm_name(r.winner);
               d["rounds"] = r.rounds;
               d["reference"] = r.reference;
               d["spans"] = r.spans;
               out.append(d);
             }
             return out;
           })
      // Returns the Work only when async: wrapping it for a call that has finished costs more
      // than a small all-reduce's exchange.
      .def("all_reduce",
           [](Communicator& c, uintptr_t buf, size_t n, int dt, int op, int algo,
              bool async) -> py::object {
             DType t = checked_dtype(dt);
             ReduceOp o = checked_op(op, t);
             WorkPtr work;
             {
               py::gil_scoped_release nogil;
               work = c.all_reduce(ptr(buf), n, t, o, Algorithm(algo), async);
             }
             return async ? py::cast(work) : py::none();
           })
      .def(
          "reduce_scatter",
          [](Communicator& c, uintptr_t out, uintptr_t in, size_t n, int dt, int op, bool async) {
            DType t = checked_dtype(dt);
            return c.reduce_scatter(ptr(out), ptr(in), n, t, checked_op(op, t), async);
          },
          G())
      .def(
          "all_gatherv",
          [](Communicator& c, uintptr_t out, uintptr_t in, const std::vector<size_t>& counts,
             int dt, bool async) {
            return c.all_gatherv(ptr(out), ptr(in), counts, checked_dtype(dt), async);
          },
          G())
      .def(
          "broadcast",
          [](Communicator& c, uintptr_t buf, size_t n, int dt, int root, bool async) {
            return c.broadcast(ptr(buf), n, checked_dtype(dt), root, async);
          },
          G())
      .def(
          "reduce",
          [](Communicator& c, uintptr_t buf, size_t n, int dt, int op, int root, bool async) {
            DType t = checked_dtype(dt);
            return c.reduce(ptr(buf), n, t, checked_op(op, t), root, async);
          },
          G())
      .def("barrier", &Communicator::barrier, G())
      .def(
          "gather",
          [](Communicator& c, uintptr_t in, const std::vector<uintptr_t>& outs, size_t n, int dt,
             int root, bool async) {
            std::vector<void*> outputs;
            for (uintptr_t o : outs) outputs.push_back(ptr(o));
            return c.gather(ptr(in), outputs, n, checked_dtype(dt), root, async);
          },
          G())
      .def(
          "scatter",
          [](Communicator& c, const std::vector<uintptr_t>& ins, uintptr_t out, size_t n, int dt,
             int root, bool async) {
            std::vector<const void*> inputs;
            for (uintptr_t i : ins) inputs.push_back(ptr(i));
            return c.scatter(inputs, ptr(out), n, checked_dtype(dt), root, async);
          },
          G())
      .def(
          "all_to_all",
          [](Communicator& c, const std::vector<uintptr_t>& ins, const std::vector<size_t>& in_n,
             const std::vector<uintptr_t>& outs, const std::vector<size_t>& out_n, int dt,
             bool async) {
            std::vector<const void*> inputs;
            std::vector<void*> outputs;
            for (uintptr_t i : ins) inputs.push_back(ptr(i));
            for (uintptr_t o : outs) outputs.push_back(ptr(o));
            return c.all_to_all(inputs, in_n, outputs, out_n, checked_dtype(dt), async);
          },
          G())
      .def(
          "send",
          [](Communicator& c, uintptr_t buf, size_t n, int dt, int peer, bool async) {
            return c.send(ptr(buf), n, checked_dtype(dt), peer, async);
          },
          G())
      .def(
          "recv",
          [](Communicator& c, uintptr_t buf, size_t n, int dt, int peer, bool async) {
            return c.recv(ptr(buf), n, checked_dtype(dt), peer, async);
          },
          G())
      .def(
          "recv_any",
          [](Communicator& c, uintptr_t buf, size_t n, int dt, bool async) {
            return c.recv_any(ptr(buf), n, checked_dtype(dt), async);
          },
          G())
      .def(
          "sparse_all_reduce",
          [](Communicator& c, uintptr_t indices, uintptr_t values, size_t k, int value_dt,
             uintptr_t out, size_t numel, int out_dt, int op, int algo, bool async) {
            DType vt = checked_dtype(value_dt), ot = checked_dtype(out_dt);
            return c.sparse_all_reduce(static_cast<const int32_t*>(ptr(indices)), ptr(values), k,
                                       vt, ptr(out), numel, ot, checked_op(op, ot), Algorithm(algo),
                                       async);
          },
          G())
      .def("compression_costs",
           [](const Communicator& c, size_t numel, size_t k, int value_dt, int out_dt) {
             DType vt = checked_dtype(value_dt), ot = checked_dtype(out_dt);
             Algorithm dense = c.choose_all_reduce(numel * dtype_size(ot), Algorithm::kAuto);
             CompressionCosts costs =
                 compression_costs(c.selector(), numel, k, dtype_size(vt), dtype_size(ot), dense);
             return std::make_pair(costs.sparse, costs.dense);
           })
      .def_property_readonly("bytes_sent", [](const Communicator& c) { return c.bytes_sent(); })
      .def_property_readonly("scratch_bytes", &Communicator::scratch_bytes)
      .def(
          "bytes_sent_over",
          [](const Communicator& c, const std::string& transport) {
            return c.bytes_sent(transport);
          },
          py::arg("transport"))
      .def_property_readonly("hosts", [](const Communicator& c) { return c.layout().hosts; })
      .def("link_model",
           [](const Communicator& c) {
             const LinkModel& m = c.selector().model();
             py::dict d;
             d["alpha_s"] = m.alpha_s;
             d["bytes_per_s"] = m.bytes_per_s;
             d["reduce_bytes_per_s"] = m.reduce_bytes_per_s;
             d["local_alpha_s"] = m.local_alpha_s;
             d["local_bytes_per_s"] = m.local_bytes_per_s;
             d["single_copy"] = m.single_copy;
             py::dict factors;  // {bytes: {algorithm: factor}}, empty where not measured
             for (size_t point = 0; point < m.factors.size(); ++point) {
               py::dict row;
               for (size_t a = 0; a < kMeasuredAlgorithms.size(); ++a)
                 row[algorithm_name(kMeasuredAlgorithms[a])] = m.factors[point][a];
               factors[py::int_(kMeasuredBytes[point])] = row;
             }
             d["factors"] = factors;
             return d;
           })
      .def("stats",
           [](const Communicator& c) {
             py::dict d;
             for (const auto& [name, s] : c.stats()) d[py::str(name)] = stats_dict(s);
             return d;
           })
      .def_property_readonly("idle_s", [](const Communicator& c) { return c.idle_ns() * 1e-9; })
      .def_property_readonly("cpu_moves", &Communicator::cpu_moves)
      .def("broken_reason", &Communicator::broken_reason)
      .def("on_progress_thread", &Communicator::on_progress_thread)
      .def("abort", &Communicator::abort, py::arg("reason") = "", G())
      .def("close", &Communicator::close, G());

  m.def("shm_bytes_sent", &shm::ShmTransport::bytes_sent_by_process);
  m.def("shm_bytes_read", &shm::ShmTransport::bytes_pulled_by_process);
  // Where RC_LOG lines go: a Python callable taking the line (ringcomm/__init__.py hands them to
  // the "ringcomm" logger and takes the sink back at exit), or None for stderr.
  m.def("set_log_sink", [](py::object fn) {
    if (fn.is_none()) {
      set_log_sink(nullptr);
      return;
    }
    auto callback =
        gil_safe_callback_of<const std::string&>(py::reinterpret_borrow<py::function>(fn));
    set_log_sink(callback);
  });
  // The environment's table (common/knobs.h), and its readers: ringcomm/_env.py reads through
  // them and ringcomm/_knobs.py writes docs/configuration.md's section from the rows.
  m.def("knobs", [] {
    py::list rows;
    for (const Knob& k : knobs()) {
      py::dict row;
      row["name"] = k.name;
      row["type"] = knob_type_name(k.type);
      row["values"] = k.values;
      row["default"] = k.default_text;
      row["section"] = k.section;
      row["doc"] = k.doc;
      rows.append(row);
    }
    return rows;
  });
  m.def("knob_int", [](const std::string& name) { return knob_int(name.c_str()); });
  m.def("knob_on", [](const std::string& name) { return knob_on(name.c_str()); });
  m.def("knob_string", [](const std::string& name) { return knob_string(name.c_str()); });
  // The timeline's C++ half (ringcomm/trace.py writes it out).
  m.def("trace_enable", &trace::enable, py::arg("on"), py::arg("max_events"));
  m.def("trace_take", [] {
    trace::Taken t;
    {
      py::gil_scoped_release nogil;
      t = trace::take();
    }
    py::list events;
    for (const trace::Event& e : t.events)
      events.append(py::make_tuple(e.name, e.detail ? py::object(py::str(e.detail)) : py::none(),
                                   e.begin_ns, e.end_ns, e.thread, e.peer, e.seq, e.bytes, e.comm));
    return py::make_tuple(events, t.dropped, t.threads);
  });
  // The handshake's HMAC, for tests that check it against Python's hmac module.
  m.def("_hmac_sha256", [](const std::string& key, const py::bytes& message) {
    std::string text = message;
    Digest d = hmac_sha256(key, {{text.data(), text.size()}});
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });

  // Kernels, exposed for tests and benchmarks.
  m.def(
      "reduce_kernel",
      [](int dt, int op, uintptr_t out, uintptr_t a, uintptr_t b, size_t n) {
        DType t = checked_dtype(dt);
        cpu::reduce(t, checked_op(op, t), ptr(out), ptr(a), ptr(b), n);
      },
      G());
  bind_compress(m);
  bind_fusion(m);
  bind_algorithms(m);
  m.def(
      "divide_kernel",
      [](int dt, uintptr_t x, size_t n, int divisor) {
        cpu::divide(checked_dtype(dt), ptr(x), n, divisor);
      },
      G());
}
