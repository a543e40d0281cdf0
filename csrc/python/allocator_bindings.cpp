// The Python binding of memo's planned allocator: one binding over the C API
// (NOTE [One allocator C API] in core/allocator_api.h). A Library is one
// implementation of that API: this binary's (the CPU backend) or the CUDA
// library's, whose functions are looked up by name (dlsym) into the same
// table, typed by the C header, so the two cannot drift apart. The glue only
// converts Python values (plan tables, stats, traces) and raises the C API's
// errors. Only pybind11 headers (not torch/extension.h), to keep this
// translation unit cheap to compile.
#include <dlfcn.h>
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

#include "core/alloc_backend.h"
#include "core/allocator_api.h"
#include "core/planned_allocator.h"
#include "cpu/cpu_allocator.h"
#include "cpu/host_backend.h"
#include "python/registry.h"

namespace py = pybind11;

namespace memo::python {

namespace {

// The C API's functions as one binary implements them.
struct Api {
#define MEMO_API_FIELD(fn) decltype(&::fn) fn = nullptr;
  MEMO_ALLOC_API_FUNCTIONS(MEMO_API_FIELD)
#undef MEMO_API_FIELD
};

struct Library {
  std::string path;  // empty for this binary
  Api api;

  // Raises the C API's error (AllocatorError or OutOfMemory, with its message) unless `status` is MEMO_OK.
  void check(int status) const {
    if (status == MEMO_OK) return;
    const std::string message = api.memo_alloc_last_error();
    if (status == MEMO_OUT_OF_MEMORY) throw core::OutOfMemory(message);
    throw core::AllocatorError(message);
  }
  memo_alloc* checked(memo_alloc* handle) const {
    if (handle == nullptr) throw core::AllocatorError(api.memo_alloc_last_error());
    return handle;
  }
};

// This binary's C API: the CPU backend.
std::shared_ptr<Library> this_library() {
  static const std::shared_ptr<Library> lib = [] {
    auto l = std::make_shared<Library>();
#define MEMO_API_LOCAL(fn) l->api.fn = &::fn;
    MEMO_ALLOC_API_FUNCTIONS(MEMO_API_LOCAL)
#undef MEMO_API_LOCAL
    return l;
  }();
  return lib;
}

// The C API of the library at `path` (the CUDA backend). RTLD_LOCAL keeps its symbols out of the global
// scope; CUDAPluggableAllocator opens the same file and so reaches the same allocators. Never closed:
// tensors over its memory may outlive every reference to it.
std::shared_ptr<Library> load_library(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    PyErr_SetString(PyExc_OSError, dlerror());
    throw py::error_already_set();
  }
  auto lib = std::make_shared<Library>();
  lib->path = path;
#define MEMO_API_LOOKUP(fn)                                                                          \
  lib->api.fn = reinterpret_cast<decltype(&::fn)>(dlsym(handle, #fn));                              \
  if (lib->api.fn == nullptr)                                                                        \
    throw core::AllocatorError("memo allocator: the library " + path + " lacks " #fn ": it is from " \
                               "another memo build");
  MEMO_ALLOC_API_FUNCTIONS(MEMO_API_LOOKUP)
#undef MEMO_API_LOOKUP
  return lib;
}

int backend_kind(const std::string& device_type) {
  if (device_type == "cpu") return MEMO_BACKEND_CPU;
  if (device_type == "cuda") return MEMO_BACKEND_CUDA;
  throw core::AllocatorError("memo allocator: no backend for device type '" + device_type +
                             "'; use 'cpu' or 'cuda'");
}

// One allocator of the C API; destroys it when it made it (a standalone allocator), never a device one.
class Allocator {
 public:
  Allocator(std::shared_ptr<const Library> lib, memo_alloc* handle, bool owned)
      : lib_(std::move(lib)), handle_(handle), owned_(owned) {}
  virtual ~Allocator() {
    if (owned_) lib_->api.memo_alloc_destroy(handle_);
  }
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  const Api& api() const { return lib_->api; }
  memo_alloc* handle() const { return handle_; }
  void check(int status) const { lib_->check(status); }

 private:
  std::shared_ptr<const Library> lib_;
  memo_alloc* handle_;
  bool owned_;
};

// The value of a Python int, or nullopt when it is not an int or does not fit 64 bits (pybind's
// cast would throw an opaque "Unable to cast" RuntimeError).
std::optional<long long> int64_of(const py::handle& value) {
  if (!py::isinstance<py::int_>(value)) return std::nullopt;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0) return std::nullopt;
  return v;
}

// Plan tables in the C API's flat shape. Converts only: Python ints (64-bit) and None; the core checks
// the values (NOTE [Plan tables are checked in the core]).
struct FlatPlan {
  std::vector<std::string> names;
  std::vector<const char*> name_ptrs;
  std::vector<std::int64_t> counts, sizes, offsets;
  std::vector<std::uint8_t> planned;
  std::int64_t peak = 0;
};

FlatPlan flat_plan(const py::dict& tables, const py::object& peak) {
  FlatPlan out;
  for (auto item : tables) {
    if (!py::isinstance<py::str>(item.first))
      throw core::AllocatorError("memo allocator: phase table keys must be phase names (str), got " +
                                 std::string(py::str(py::type::of(item.first))));
    const std::string name = item.first.cast<std::string>();
    std::int64_t count = 0;
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
      py::object size = seq[0], offset = seq[1];
      const auto size_value = int64_of(size);
      if (!size_value)
        throw core::AllocatorError("memo allocator: table " + name + " entry " + std::to_string(count) +
                                   ": size must be a positive int up to 2**62, got " + std::string(py::repr(size)));
      std::int64_t offset_value = 0;
      if (!offset.is_none()) {
        const auto value = int64_of(offset);
        if (!value)
          throw core::AllocatorError("memo allocator: table " + name + " entry " + std::to_string(count) +
                                     ": offset must be an int >= 0 or None, got " + std::string(py::repr(offset)));
        offset_value = *value;
      }
      out.sizes.push_back(*size_value);
      out.offsets.push_back(offset_value);
      out.planned.push_back(offset.is_none() ? 0 : 1);
      ++count;
    }
    out.names.push_back(name);
    out.counts.push_back(count);
  }
  for (const std::string& name : out.names) out.name_ptrs.push_back(name.c_str());
  const auto peak_value = int64_of(peak);
  if (!peak_value)
    throw core::AllocatorError("memo allocator: plan peak must be an int >= 0 and below 2**62 (bytes), got " +
                               std::string(py::repr(peak)));
  out.peak = *peak_value;
  return out;
}

py::object deviation_obj(const memo_deviation& dev) {
  py::dict d;
  d["phase"] = dev.phase;
  d["index"] = dev.index;
  d["expected"] = dev.expected;
  d["actual"] = dev.actual;
  d["reason"] = dev.reason;
  return std::move(d);
}

py::object deviation(const Allocator& a, bool take) {
  memo_deviation dev{};
  if (a.api().memo_alloc_deviation(a.handle(), take ? 1 : 0, &dev) == 0) return py::none();
  return deviation_obj(dev);
}

std::vector<std::string> stat_names(const Api& api) {
  std::vector<std::string> names;
  for (int i = 0; i < api.memo_alloc_stat_count(); ++i) names.emplace_back(api.memo_alloc_stat_name(i));
  return names;
}

// The counters under the core's own names (NOTE [Stat names]): "fallback.x" nests as d["fallback"]["x"].
py::dict stats_dict(const Allocator& a) {
  const std::vector<std::string> names = stat_names(a.api());
  std::vector<std::uint64_t> values(names.size());
  const int n = static_cast<int>(values.size());
  if (a.api().memo_alloc_stats(a.handle(), values.data(), n) != n)
    throw core::AllocatorError("memo allocator: the library wrote fewer counters than it names");
  py::dict d;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::string& name = names[i];
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
  d["first_deviation"] = deviation(a, false);
  return d;
}

// (events as (is_malloc, id, size, phase_index) tuples, phase names)
py::tuple stop_logging(const Allocator& a) {
  const Api& api = a.api();
  std::int64_t n = 0;
  {
    py::gil_scoped_release release;
    n = api.memo_alloc_stop_logging(a.handle());
  }
  if (n < 0) a.check(MEMO_ERROR);
  const auto count = static_cast<std::size_t>(n);
  std::vector<std::uint8_t> is_malloc(count);
  std::vector<std::uint64_t> ids(count), sizes(count);
  std::vector<std::int32_t> phases(count);
  api.memo_alloc_read_log(a.handle(), is_malloc.data(), ids.data(), sizes.data(), phases.data(), n);
  py::list events;
  for (std::size_t i = 0; i < count; ++i)
    events.append(py::make_tuple(is_malloc[i] != 0, ids[i], sizes[i], phases[i]));
  std::vector<std::string> names;
  for (int i = 0; i < api.memo_alloc_log_phase_count(a.handle()); ++i)
    names.emplace_back(api.memo_alloc_log_phase_name(a.handle(), i));
  return py::make_tuple(events, names);
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

  void* raw_alloc(std::size_t bytes) override { return host_.raw_alloc(bytes); }
  void raw_free(void* ptr, std::size_t bytes) override { host_.raw_free(ptr, bytes); }
  void fill(void* ptr, std::size_t bytes, unsigned char byte) override { host_.fill(ptr, bytes, byte); }
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

  cpu::HostBackend host_;
  core::EventId next_event_ = 1;  // 0 means "no event" to the core
  std::map<core::EventId, Event> events_;
  std::vector<Call> calls_;
};

// A standalone allocator over FakeStreamBackend, made through the C API (core::create_allocator).
class StreamTestHarness final : public Allocator {
 public:
  StreamTestHarness(std::size_t min_segment, std::size_t fallback_limit)
      : StreamTestHarness(new FakeStreamBackend, min_segment, fallback_limit) {}

  FakeStreamBackend& backend() const { return *backend_; }

 private:
  // The allocator owns `backend` from here on.
  StreamTestHarness(FakeStreamBackend* backend, std::size_t min_segment, std::size_t fallback_limit)
      : Allocator(this_library(),
                  core::create_allocator(std::unique_ptr<core::RawBackend>(backend), min_segment, fallback_limit),
                  true),
        backend_(backend) {}
  FakeStreamBackend* backend_;
};

void bind_library(py::module_& sub) {
  py::class_<Library, std::shared_ptr<Library>>(
      sub, "Library",
      "One implementation of the allocator's C API: library() (this module: the CPU backend) or "
      "load_library(path) (the CUDA backend library).")
      .def_readonly("path", &Library::path, "The library's file; '' for this module.")
      .def(
          "device_allocator",
          [](const std::shared_ptr<Library>& lib, const std::string& device_type, int index) {
            memo_alloc* handle = lib->checked(lib->api.memo_alloc_device(backend_kind(device_type), index));
            return std::make_unique<Allocator>(lib, handle, false);
          },
          py::arg("device_type"), py::arg("index"),
          "The process-lifetime allocator PyTorch allocates `device_type` tensors of device `index` through.")
      .def(
          "check_plan",
          [](const Library& lib, const py::dict& tables, const py::object& peak) {
            FlatPlan p = flat_plan(tables, peak);
            lib.check(lib.api.memo_alloc_check_plan(static_cast<int>(p.names.size()), p.name_ptrs.data(),
                                                    p.counts.data(), p.sizes.data(), p.offsets.data(),
                                                    p.planned.data(), p.peak));
          },
          py::arg("tables"), py::arg("peak"),
          "Check plan tables and their peak as load_plan does, loading nothing: AllocatorError naming the bad "
          "entry (NOTE [Plan tables are checked in the core]).")
      .def("stat_names", [](const Library& lib) { return stat_names(lib.api); },
           "The names of the counters stats() reports, in the core's order (NOTE [Stat names]); "
           "'fallback.x' is stats()['fallback']['x'].")
      .def(
          "runtime_version",
          [](const Library& lib, const std::string& device_type) {
            return lib.api.memo_alloc_runtime_version(backend_kind(device_type));
          },
          py::arg("device_type"),
          "The runtime version behind the backend (CUDA: 1000 * major + 10 * minor; CPU: 0); -1 when this "
          "library lacks it or the runtime cannot say.");
  sub.def("library", &this_library,
          "This module's implementation of the C API (the CPU backend).");
  sub.def(
      "load_library", &load_library,
      py::arg("path"), "The C API of the library at `path` (OSError when it cannot be loaded).");
}

void bind_allocator_class(py::module_& sub) {
  py::class_<Allocator>(sub, "PlannedAllocator",
                        "Arena + fallback caching allocator, reached through the C API. A standalone instance "
                        "over host memory (PlannedAllocator(min_segment, fallback_limit)) is for tests; "
                        "Library.device_allocator(...) gives the ones behind PyTorch's tensors.")
      .def(py::init([](std::size_t min_segment, std::size_t fallback_limit) {
             const auto& lib = this_library();
             memo_alloc* handle = lib->checked(lib->api.memo_alloc_create(MEMO_BACKEND_CPU, 0, min_segment,
                                                                         fallback_limit));
             return std::make_unique<Allocator>(lib, handle, true);
           }),
           py::arg("min_segment") = core::PlannedAllocator::kDefaultMinSegment, py::arg("fallback_limit") = 0)
      .def(
          "load_plan",
          [](const Allocator& a, const py::dict& tables, const py::object& peak) {
            FlatPlan p = flat_plan(tables, peak);
            a.check(a.api().memo_alloc_load_plan(a.handle(), static_cast<int>(p.names.size()), p.name_ptrs.data(),
                                                 p.counts.data(), p.sizes.data(), p.offsets.data(),
                                                 p.planned.data(), p.peak));
          },
          py::arg("tables"), py::arg("peak"))
      .def("unload_plan", [](const Allocator& a) { a.check(a.api().memo_alloc_unload_plan(a.handle())); })
      .def("has_plan", [](const Allocator& a) { return a.api().memo_alloc_has_plan(a.handle()) != 0; })
      .def(
          "set_phase",
          [](const Allocator& a, const std::optional<std::string>& name) {
            a.check(a.api().memo_alloc_set_phase(a.handle(), name ? name->c_str() : nullptr));
          },
          py::arg("name"))
      .def("suspend_phase", [](const Allocator& a) { a.check(a.api().memo_alloc_suspend_phase(a.handle())); })
      .def("resume_phase", [](const Allocator& a) { a.check(a.api().memo_alloc_resume_phase(a.handle())); })
      .def(
          "malloc",
          [](const Allocator& a, std::size_t n) {
            if (n == 0) throw core::AllocatorError("memo allocator: malloc of 0 bytes");
            void* p = nullptr;
            a.check(a.api().memo_alloc_malloc(a.handle(), n, core::kDefaultStream, &p));
            return reinterpret_cast<std::uintptr_t>(p);
          },
          py::arg("size"))
      .def(
          "free",
          [](const Allocator& a, std::uintptr_t p) { a.api().memo_alloc_free(a.handle(), reinterpret_cast<void*>(p)); },
          py::arg("ptr"))
      .def(
          "owns",
          [](const Allocator& a, std::uintptr_t p) {
            return a.api().memo_alloc_owns(a.handle(), reinterpret_cast<void*>(p)) != 0;
          },
          py::arg("ptr"))
      .def(
          "arena_extent",
          [](const Allocator& a) {
            std::uintptr_t base = 0;
            std::uint64_t bytes = 0;
            a.check(a.api().memo_alloc_arena_extent(a.handle(), &base, &bytes));
            return std::make_pair(base, bytes);
          },
          "(base address, bytes) of the current arena; (0, 0) without one (tests, diagnostics).")
      .def(
          "set_poison", [](const Allocator& a, bool on) { a.check(a.api().memo_alloc_set_poison(a.handle(), on)); },
          py::arg("on"))
      .def(
          "set_fallback_limit",
          [](const Allocator& a, std::uint64_t bytes) {
            a.check(a.api().memo_alloc_set_fallback_limit(a.handle(), bytes));
          },
          py::arg("bytes"))
      .def(
          "set_min_segment",
          [](const Allocator& a, std::uint64_t bytes) {
            a.check(a.api().memo_alloc_set_min_segment(a.handle(), bytes));
          },
          py::arg("bytes"))
      .def("empty_cache", [](const Allocator& a) { return a.api().memo_alloc_empty_cache(a.handle()); })
      .def("start_logging", [](const Allocator& a) { a.check(a.api().memo_alloc_start_logging(a.handle())); })
      .def("stop_logging", &stop_logging)
      .def("stats", &stats_dict)
      .def("reset_stats", [](const Allocator& a) { a.check(a.api().memo_alloc_reset_stats(a.handle())); })
      .def("take_deviation_report", [](const Allocator& a) { return deviation(a, true); });

  py::class_<StreamTestHarness, Allocator>(
      sub, "StreamTestHarness",
      "Test harness for NOTE [Stream-safe reuse]: a PlannedAllocator over host memory whose backend has "
      "fake streams (any int; 0 is the default stream) and logs every stream hook the core calls. "
      "take_calls() returns them as (call, a, b) tuples: ('record_event', stream, event), "
      "('stream_wait_event', stream, event), ('event_done', event, 0|1), ('destroy_event', event, stream).")
      .def(py::init<std::size_t, std::size_t>(), py::arg("min_segment") = core::PlannedAllocator::kDefaultMinSegment,
           py::arg("fallback_limit") = 0)
      .def(
          "allocate",
          [](const StreamTestHarness& h, std::size_t n, core::StreamId stream) {
            if (n == 0) throw core::AllocatorError("memo allocator: malloc of 0 bytes");
            void* p = nullptr;
            h.check(h.api().memo_alloc_malloc(h.handle(), n, stream, &p));
            return reinterpret_cast<std::uintptr_t>(p);
          },
          py::arg("size"), py::arg("stream"), "Allocate `size` bytes for use on fake stream `stream`.")
      .def(
          "complete", [](const StreamTestHarness& h, core::StreamId stream) { h.backend().complete(stream); },
          py::arg("stream"), "Mark the events recorded so far on `stream` complete.")
      .def("take_calls", [](const StreamTestHarness& h) { return h.backend().take_calls(); })
      .def("live_events", [](const StreamTestHarness& h) { return h.backend().live_events(); },
           "Events recorded and not yet destroyed.");
}

void bind_allocator(py::module_& m) {
  py::module_ sub = m.def_submodule("allocator", "memo's planned allocator: one binding over its C API");
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
  bind_library(sub);
  bind_allocator_class(sub);
  sub.def("install_cpu", &cpu::install_cpu_allocator, "Route PyTorch's CPU allocations through memo.");
  sub.def("uninstall_cpu", &cpu::uninstall_cpu_allocator, "Restore PyTorch's previous CPU allocator.");
  sub.def("cpu_installed", &cpu::cpu_allocator_installed);
  sub.attr("BLOCK_ALIGNMENT") = core::kBlockAlignment;
}

}  // namespace

}  // namespace memo::python

MEMO_REGISTER_BINDINGS(allocator, memo::python::bind_allocator)
