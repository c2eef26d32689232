// Bindings of registered algorithms (algorithms/registered.h) into ringcomm._C. Lists cross from
// ringcomm.algorithms as a tuple: (collective name, blocks, pipeline "step" or "slice", slice
// bytes (-1: the pipeline's own, 0: whole blocks), size class (-1: lists for every size), one
// list per rank of steps (primitive code, block, from, to, incoming first, lag)).
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "algorithms/registered.h"
#include "communicator.h"

namespace py = pybind11;

namespace ringcomm {
namespace {

constexpr std::pair<const char*, Prim> kPrimitives[] = {
    {"send", Prim::kSend},
    {"recv", Prim::kRecv},
    {"recv_send", Prim::kRecvSend},
    {"recv_reduce", Prim::kRecvReduce},
    {"recv_reduce_send", Prim::kRecvReduceSend},
    {"exchange_reduce", Prim::kExchangeReduce},
};

Collective collective_named(const std::string& name) {
  for (Collective c : kRegisteredCollectives)
    if (name == collective_name(c)) return c;
  RC_INVALID("no registered algorithm runs ", name,
             "; they run all_reduce, reduce_scatter, all_gather, broadcast or reduce");
}

using StepTuple = std::tuple<int, int, int, int, bool, int>;
using ListsTuple = std::tuple<std::string, int, std::string, int64_t, int64_t,
                              std::vector<std::vector<StepTuple>>>;

AlgorithmLists lists_of(const std::string& name, const ListsTuple& t) {
  const auto& [coll, blocks, pipeline, slice_bytes, size_class, ranks] = t;
  RC_CHECK_ARG(pipeline == "step" || pipeline == "slice", "pipeline '", pipeline,
               "': 'step' or 'slice'");
  AlgorithmLists lists;
  lists.name = name;
  lists.coll = collective_named(coll);
  lists.blocks = blocks;
  lists.pipeline = pipeline == "step" ? Pipeline::kByStep : Pipeline::kBySlice;
  lists.slice_bytes = slice_bytes;
  lists.sized = size_class >= 0;
  lists.size_class = lists.sized ? size_t(size_class) : 0;
  for (const std::vector<StepTuple>& steps : ranks) {
    Schedule s;
    s.pipeline = lists.pipeline;
    for (const auto& [prim, block, from, to, incoming_first, lag] : steps) {
      RC_CHECK_ARG(prim >= 0 && prim < int(std::size(kPrimitives)), "unknown primitive code ",
                   prim);
      Step step{Prim(prim), block, from, to};
      step.incoming_first = incoming_first;
      step.lag = lag;
      s.steps.push_back(step);
    }
    lists.schedules.push_back(std::move(s));
  }
  return lists;
}

py::dict checked(const AlgorithmLists& lists, const std::vector<std::string>& orders) {
  py::dict d;
  d["id"] = lists.id;
  d["orders"] = orders;
  py::list steps;
  for (const Schedule& s : lists.schedules) steps.append(s.describe());
  d["steps"] = steps;
  return d;
}

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

}  // namespace

void bind_algorithms(py::module_& m) {
  py::dict primitives;
  for (const auto& [name, prim] : kPrimitives) primitives[name] = int(prim);
  m.attr("PRIMITIVE_CODES") = primitives;
  // Checks lists (check_lists): {"id", "orders": each block's order of combination, "steps":
  // each rank's list as the executor runs it, its completing steps marked}; ValueError naming the
  // rank, step and block at fault.
  m.def(
      "check_algorithm",
      [](const std::string& name, const ListsTuple& t) {
        AlgorithmLists lists = lists_of(name, t);
        std::vector<std::string> orders;
        {
          py::gil_scoped_release nogil;
          orders = check_lists(lists);
        }
        return checked(lists, orders);
      },
      py::arg("name"), py::arg("lists"));
  // Where the core finds registered lists: `source(name, world_size, size_class)` returns their
  // tuple, or None where it knows no such name (world_size 0: any tuple where it knows it).
  // Called with the GIL taken, from any thread; what it raises is raised as ValueError by the call
  // that asked.
  m.def("set_algorithm_source", [](py::object source) {
    if (source.is_none()) {
      set_lists_source(nullptr);
      return;
    }
    auto held = std::shared_ptr<py::object>(new py::object(std::move(source)), [](py::object* o) {
      py::gil_scoped_acquire gil;
      delete o;
    });
    set_lists_source([held](const std::string& name, int world_size, size_t size_class) {
      py::gil_scoped_acquire gil;
      py::object got;
      try {
        got = (*held)(name, world_size, size_class);
      } catch (py::error_already_set& e) {
        throw std::invalid_argument(py::str(e.value()).cast<std::string>());
      }
      if (got.is_none()) return std::optional<AlgorithmLists>();
      if (world_size == 0) return std::optional<AlgorithmLists>(AlgorithmLists{});
      return std::optional<AlgorithmLists>(lists_of(name, got.cast<ListsTuple>()));
    });
  });
  m.def("forget_algorithm", &forget_lists, py::arg("name"));
  // The lists the core runs for `name` among `world_size` ranks for a message of `nbytes`,
  // checked (as check_algorithm returns them, without the orders).
  m.def(
      "registered_algorithm",
      [](const std::string& name, const std::string& coll, int world_size,
         size_t nbytes) -> py::object {
        std::shared_ptr<const AlgorithmLists> lists =
            registered_lists(name, collective_named(coll), world_size, nbytes);
        if (!lists) return py::none();
        return checked(*lists, {});
      },
      py::arg("name"), py::arg("collective"), py::arg("world_size"), py::arg("nbytes") = 0);

  // Collectives by a registered algorithm (Communicator::*_registered). all_reduce returns the
  // Work only when async, as the built-ins' binding does.
  m.def("all_reduce_registered",
        [](Communicator& c, uintptr_t buf, size_t n, int dt, int op, const std::string& algorithm,
           bool async) -> py::object {
          DType t = checked_dtype(dt);
          ReduceOp o = checked_op(op, t);
          WorkPtr work;
          {
            py::gil_scoped_release nogil;
            work = c.all_reduce_registered(ptr(buf), n, t, o, algorithm, async);
          }
          return async ? py::cast(work) : py::none();
        });
  using G = py::call_guard<py::gil_scoped_release>;
  m.def(
      "reduce_scatter_registered",
      [](Communicator& c, uintptr_t out, uintptr_t in, size_t n, int dt, int op,
         const std::string& algorithm, bool async) {
        DType t = checked_dtype(dt);
        return c.reduce_scatter_registered(ptr(out), ptr(in), n, t, checked_op(op, t), algorithm,
                                           async);
      },
      G());
  m.def(
      "all_gather_registered",
      [](Communicator& c, uintptr_t out, uintptr_t in, size_t n, int dt,
         const std::string& algorithm, bool async) {
        return c.all_gather_registered(ptr(out), ptr(in), n, checked_dtype(dt), algorithm, async);
      },
      G());
  m.def(
      "broadcast_registered",
      [](Communicator& c, uintptr_t buf, size_t n, int dt, int root, const std::string& algorithm,
         bool async) {
        return c.broadcast_registered(ptr(buf), n, checked_dtype(dt), root, algorithm, async);
      },
      G());
  m.def(
      "reduce_registered",
      [](Communicator& c, uintptr_t buf, size_t n, int dt, int op, int root,
         const std::string& algorithm, bool async) {
        DType t = checked_dtype(dt);
        return c.reduce_registered(ptr(buf), n, t, checked_op(op, t), root, algorithm, async);
      },
      G());
}

}  // namespace ringcomm
