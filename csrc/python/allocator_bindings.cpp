// pybind11 glue for the planned allocator: validates Python inputs and
// converts stats and traces. Only pybind11 headers (not torch/extension.h),
// to keep this translation unit cheap to compile.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/planned_allocator.h"
#include "cpu/cpu_allocator.h"
#include "cpu/host_backend.h"
#include "python/registry.h"

namespace py = pybind11;

namespace memo::python {

namespace {

using core::PlannedAllocator;

// The value of a Python int, or nullopt when it is not an int or does not fit 64 bits (pybind's
// cast would throw an opaque "Unable to cast" RuntimeError).
std::optional<long long> int64_of(const py::handle& value) {
  if (!py::isinstance<py::int_>(value)) return std::nullopt;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0) return std::nullopt;
  return v;
}

// Converts only: Python ints (64-bit) and None into the core's input; the core checks the values
// (NOTE [Plan tables are checked in the core]).
core::PlanInput tables_from_python(const py::dict& tables) {
  core::PlanInput out;
  for (auto item : tables) {
    if (!py::isinstance<py::str>(item.first))
      throw core::AllocatorError("memo allocator: phase table keys must be phase names (str), got " +
                                 std::string(py::str(py::type::of(item.first))));
    core::PlanTableInput table;
    table.phase = item.first.cast<std::string>();
    const std::string& name = table.phase;
    for (auto entry : py::iter(item.second)) {
      auto pair = py::reinterpret_borrow<py::object>(entry);
      py::sequence seq;
      try {
        seq = pair.cast<py::sequence>();
      } catch (const py::cast_error&) {
        throw core::AllocatorError("memo allocator: table " + name +
                                   " must list (size, offset-or-None) pairs, got " + std::string(py::repr(pair)));
      }
      if (py::len(seq) != 2)
        throw core::AllocatorError("memo allocator: table " + name +
                                   " must list (size, offset-or-None) pairs, got " + std::string(py::repr(pair)));
      core::PlanEntry e;
      py::object size = seq[0], offset = seq[1];
      const auto size_value = int64_of(size);
      if (!size_value)
        throw core::AllocatorError("memo allocator: table " + name + " entry " + std::to_string(table.entries.size()) +
                                   ": size must be a positive int up to 2**62, got " + std::string(py::repr(size)));
      e.size = *size_value;
      if (!offset.is_none()) {
        const auto offset_value = int64_of(offset);
        if (!offset_value)
          throw core::AllocatorError("memo allocator: table " + name + " entry " +
                                     std::to_string(table.entries.size()) +
                                     ": offset must be an int >= 0 or None, got " + std::string(py::repr(offset)));
        e.offset = *offset_value;
        e.planned = true;
      }
      table.entries.push_back(e);
    }
    out.push_back(std::move(table));
  }
  return out;
}

std::int64_t peak_from_python(const py::object& peak) {
  const auto value = int64_of(peak);
  if (!value)
    throw core::AllocatorError("memo allocator: plan peak must be an int >= 0 and below 2**62 (bytes), got " +
                               std::string(py::repr(peak)));
  return *value;
}

py::object deviation_obj(const core::Deviation& dev) {
  py::dict d;
  d["phase"] = dev.phase;
  d["index"] = dev.index;
  d["expected"] = dev.expected;
  d["actual"] = dev.actual;
  d["reason"] = dev.reason;
  return std::move(d);
}

std::vector<std::string> stat_names() {
  std::vector<std::string> names;
  for (std::size_t i = 0; i < core::stat_count(); ++i) names.emplace_back(core::stat_name(i));
  return names;
}

// The counters under the core's own names (NOTE [Stat names]): "fallback.x" nests as d["fallback"]["x"].
py::dict stats_dict(const core::AllocatorStats& s) {
  std::vector<std::uint64_t> values(core::stat_count());
  core::stat_values(s, values.data(), values.size());
  py::dict d;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::string name = core::stat_name(i);
    const std::size_t dot = name.find('.');
    if (dot == std::string::npos) {
      d[py::str(name)] = values[i];
      continue;
    }
    const py::str group(name.substr(0, dot));
    if (!d.contains(group)) d[group] = py::dict();
    py::dict sub = d[group];
    sub[py::str(name.substr(dot + 1))] = values[i];
  }
  d["first_deviation"] = s.has_deviation ? deviation_obj(s.first_deviation) : py::none();
  return d;
}

// (events as (is_malloc, id, size, phase_index) tuples, phase names)
py::tuple stop_logging(PlannedAllocator& a) {
  std::vector<std::string> names;
  std::vector<core::TraceEvent> events;
  {
    py::gil_scoped_release release;
    events = a.stop_logging(&names);
  }
  py::list out;
  for (const auto& e : events) out.append(py::make_tuple(e.is_malloc, e.id, e.size, e.phase));
  return py::make_tuple(out, names);
}

// A RawBackend with fake streams for testing NOTE [Stream-safe reuse]
// through the core's C++ API: memory is host memory, streams are plain
// numbers, and every stream hook is logged as (call, a, b):
//   ("record_event", stream, event)      ("stream_wait_event", stream, event)
//   ("event_done", event, 0 or 1)        ("destroy_event", event, stream it was recorded on)
// An event is "done" once complete(stream) was called after it was recorded.
// Using an event after destroy_event raises (the core must never do that).
class FakeStreamBackend final : public core::RawBackend {
 public:
  using Call = std::tuple<std::string, std::uint64_t, std::uint64_t>;

  void* raw_alloc(std::size_t bytes) override { return cpu::host_backend().raw_alloc(bytes); }
  void raw_free(void* ptr, std::size_t bytes) override { cpu::host_backend().raw_free(ptr, bytes); }
  void fill(void* ptr, std::size_t bytes, unsigned char byte) override {
    cpu::host_backend().fill(ptr, bytes, byte);
  }
  const char* name() const override { return "fake-streams"; }

  core::EventId record_event(core::StreamId stream) override {
    const core::EventId ev = next_event_++;
    events_.emplace(ev, Event{stream, false});
    calls_.emplace_back("record_event", stream, ev);
    return ev;
  }
  void stream_wait_event(core::StreamId stream, core::EventId event) override {
    live(event);
    calls_.emplace_back("stream_wait_event", stream, event);
  }
  bool event_done(core::EventId event) override {
    const bool done = live(event).done;
    calls_.emplace_back("event_done", event, done ? 1 : 0);
    return done;
  }
  void destroy_event(core::EventId event) override {
    calls_.emplace_back("destroy_event", event, live(event).stream);
    events_.erase(event);
  }

  // All work queued on `stream` so far has run: its recorded events complete.
  void complete(core::StreamId stream) {
    for (auto& [id, ev] : events_)
      if (ev.stream == stream) ev.done = true;
  }
  std::vector<Call> take_calls() {
    std::vector<Call> out;
    out.swap(calls_);
    return out;
  }
  std::size_t live_events() const { return events_.size(); }

 private:
  struct Event {
    core::StreamId stream;
    bool done;
  };
  Event& live(core::EventId event) {
    auto it = events_.find(event);
    if (it == events_.end())
      throw std::logic_error("memo StreamTestHarness: the core used event " + std::to_string(event) +
                             ", which it never recorded or already destroyed");
    return it->second;
  }

  core::EventId next_event_ = 1;  // 0 means "no event" to the core
  std::map<core::EventId, Event> events_;
  std::vector<Call> calls_;
};

// A PlannedAllocator over FakeStreamBackend (declared first: it outlives the allocator).
struct StreamTestHarness {
  StreamTestHarness(std::size_t min_segment, std::size_t fallback_limit)
      : alloc(&backend, min_segment, fallback_limit) {}
  FakeStreamBackend backend;
  PlannedAllocator alloc;
};

void bind_stream_test_harness(py::module_& sub) {
  py::class_<StreamTestHarness>(
      sub, "StreamTestHarness",
      "Test harness for NOTE [Stream-safe reuse]: a PlannedAllocator over host memory whose backend has "
      "fake streams (any int; 0 is the default stream) and logs every stream hook the core calls. "
      "take_calls() returns them as (call, a, b) tuples: ('record_event', stream, event), "
      "('stream_wait_event', stream, event), ('event_done', event, 0|1), ('destroy_event', event, stream).")
      .def(py::init<std::size_t, std::size_t>(), py::arg("min_segment") = PlannedAllocator::kDefaultMinSegment,
           py::arg("fallback_limit") = 0)
      .def(
          "load_plan",
          [](StreamTestHarness& h, const py::dict& tables, const py::object& peak) {
            h.alloc.load_plan(tables_from_python(tables), peak_from_python(peak));
          },
          py::arg("tables"), py::arg("peak"))
      .def(
          "set_phase",
          [](StreamTestHarness& h, const std::optional<std::string>& name) {
            h.alloc.set_phase(name.value_or(""));
          },
          py::arg("name"))
      .def(
          "allocate",
          [](StreamTestHarness& h, std::size_t n, core::StreamId stream) {
            if (n == 0) throw core::AllocatorError("memo allocator: malloc of 0 bytes");
            return reinterpret_cast<std::uintptr_t>(h.alloc.allocate(n, stream));
          },
          py::arg("size"), py::arg("stream"), "Allocate `size` bytes for use on fake stream `stream`.")
      .def(
          "free", [](StreamTestHarness& h, std::uintptr_t p) { h.alloc.free(reinterpret_cast<void*>(p)); },
          py::arg("ptr"))
      .def(
          "complete", [](StreamTestHarness& h, core::StreamId stream) { h.backend.complete(stream); },
          py::arg("stream"), "Mark the events recorded so far on `stream` complete.")
      .def("take_calls", [](StreamTestHarness& h) { return h.backend.take_calls(); })
      .def("live_events", [](const StreamTestHarness& h) { return h.backend.live_events(); },
           "Events recorded and not yet destroyed.")
      .def("arena_extent", [](const StreamTestHarness& h) { return h.alloc.arena_extent(); },
           "(base address, bytes) of the current arena; (0, 0) without one.")
      .def("stats", [](const StreamTestHarness& h) { return stats_dict(h.alloc.stats()); });
}

void bind_allocator(py::module_& m) {
  py::module_ sub = m.def_submodule("allocator", "memo's planned allocator (core + CPU backend)");
  static py::exception<core::AllocatorError> error(sub, "AllocatorError", PyExc_RuntimeError);
  static py::exception<core::OutOfMemory> oom(sub, "OutOfMemory", error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const core::OutOfMemory& e) {
      PyErr_SetString(oom.ptr(), e.what());
    } catch (const core::AllocatorError& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  py::class_<PlannedAllocator>(sub, "PlannedAllocator",
                               "Arena + fallback caching allocator. A standalone instance over host memory "
                               "(PlannedAllocator(min_segment, fallback_limit)) is for tests; cpu_allocator() "
                               "is the one behind PyTorch's CPU tensors while installed.")
      .def(py::init([](std::size_t min_segment, std::size_t fallback_limit) {
             return std::make_unique<PlannedAllocator>(&cpu::host_backend(), min_segment, fallback_limit);
           }),
           py::arg("min_segment") = PlannedAllocator::kDefaultMinSegment, py::arg("fallback_limit") = 0)
      .def(
          "load_plan",
          [](PlannedAllocator& a, const py::dict& tables, const py::object& peak) {
            a.load_plan(tables_from_python(tables), peak_from_python(peak));
          },
          py::arg("tables"), py::arg("peak"))
      .def("unload_plan", &PlannedAllocator::unload_plan)
      .def("has_plan", &PlannedAllocator::has_plan)
      .def(
          "set_phase",
          [](PlannedAllocator& a, const std::optional<std::string>& name) { a.set_phase(name.value_or("")); },
          py::arg("name"))
      .def("suspend_phase", &PlannedAllocator::suspend_phase)
      .def("resume_phase", &PlannedAllocator::resume_phase)
      .def("phase", [](const PlannedAllocator& a) -> py::object {
        std::string p = a.phase();
        if (p.empty()) return py::none();
        return py::str(p);
      })
      .def(
          "malloc",
          [](PlannedAllocator& a, std::size_t n) {
            if (n == 0) throw core::AllocatorError("memo allocator: malloc of 0 bytes");
            return reinterpret_cast<std::uintptr_t>(a.allocate(n));
          },
          py::arg("size"))
      .def(
          "free", [](PlannedAllocator& a, std::uintptr_t p) { a.free(reinterpret_cast<void*>(p)); },
          py::arg("ptr"))
      .def(
          "owns", [](const PlannedAllocator& a, std::uintptr_t p) { return a.owns(reinterpret_cast<void*>(p)); },
          py::arg("ptr"))
      .def("arena_extent", &PlannedAllocator::arena_extent,
           "(base address, bytes) of the current arena; (0, 0) without one (tests, diagnostics).")
      .def("set_poison", &PlannedAllocator::set_poison, py::arg("on"))
      .def("set_fallback_limit", &PlannedAllocator::set_fallback_limit, py::arg("bytes"))
      .def("set_min_segment", &PlannedAllocator::set_min_segment, py::arg("bytes"))
      .def("empty_cache", &PlannedAllocator::empty_cache)
      .def("start_logging", &PlannedAllocator::start_logging)
      .def("logging", &PlannedAllocator::logging)
      .def("stop_logging", &stop_logging)
      .def("stats", [](const PlannedAllocator& a) { return stats_dict(a.stats()); })
      .def("reset_stats", &PlannedAllocator::reset_stats)
      .def("take_deviation_report", [](PlannedAllocator& a) -> py::object {
        core::Deviation dev;
        if (!a.take_deviation_report(&dev)) return py::none();
        return deviation_obj(dev);
      });

  sub.def(
      "cpu_allocator", []() -> PlannedAllocator& { return cpu::cpu_planned_allocator(); },
      py::return_value_policy::reference, "The planned allocator behind PyTorch's CPU tensors.");
  sub.def("install_cpu", &cpu::install_cpu_allocator, "Route PyTorch's CPU allocations through memo.");
  sub.def("uninstall_cpu", &cpu::uninstall_cpu_allocator, "Restore PyTorch's previous CPU allocator.");
  sub.def("cpu_installed", &cpu::cpu_allocator_installed);
  sub.attr("BLOCK_ALIGNMENT") = core::kBlockAlignment;
  sub.def(
      "check_plan",
      [](const py::dict& tables, const py::object& peak) {
        core::check_plan(tables_from_python(tables), peak_from_python(peak));
      },
      py::arg("tables"), py::arg("peak"),
      "Check plan tables and their peak as load_plan does, loading nothing: AllocatorError naming the bad "
      "entry (NOTE [Plan tables are checked in the core]).");
  sub.def("stat_names", &stat_names,
          "The names of the counters stats() reports, in the core's order (NOTE [Stat names]); "
          "'fallback.x' is stats()['fallback']['x'].");
  bind_stream_test_harness(sub);
}

}  // namespace

}  // namespace memo::python

MEMO_REGISTER_BINDINGS(allocator, memo::python::bind_allocator)
