// NOTE [One allocator C API] in allocator_api.h: the C API over the core, for every backend.
#include "core/allocator_api.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/planned_allocator.h"

using memo::core::AllocatorError;
using memo::core::PlannedAllocator;

struct memo_alloc {
  memo_alloc(std::unique_ptr<memo::core::RawBackend> raw, int kind_, bool device_wide_, std::size_t min_segment,
             std::size_t fallback_limit)
      : backend(std::move(raw)), alloc(backend.get(), min_segment, fallback_limit), kind(kind_),
        device_wide(device_wide_) {}

  std::unique_ptr<memo::core::RawBackend> backend;  // declared first: it outlives the allocator
  PlannedAllocator alloc;
  const int kind;  // MEMO_BACKEND_*; -1 for a caller's own backend (create_allocator)
  const bool device_wide;  // a device allocator: phase calls reach every device allocator of its kind

  // Kept for the C API's readers: the trace of the last stop_logging, the strings of the last deviation.
  std::mutex kept_mutex;
  std::vector<memo::core::TraceEvent> log_events;
  std::vector<std::string> log_names;
  memo::core::Deviation deviation;
};

namespace memo::core {

namespace {

constexpr int kMaxDevices = 64;

thread_local std::string last_error;

const char* kind_name(int kind) {
  switch (kind) {
    case MEMO_BACKEND_CPU:
      return "cpu";
    case MEMO_BACKEND_CUDA:
      return "cuda";
    default:
      return "unknown";
  }
}

std::unique_ptr<RawBackend> backend_of(int kind, int device) {
  std::unique_ptr<RawBackend> backend = make_backend(kind, device);
  if (backend == nullptr)
    throw AllocatorError(std::string("memo allocator: this library has no ") + kind_name(kind) + " backend (kind " +
                         std::to_string(kind) + "); the CPU backend is in memo._C, the CUDA backend in "
                         "memo/_lib/libmemo_cuda.so");
  return backend;
}

// Runs `f`; turns an exception into its status and keeps its message for memo_alloc_last_error.
template <typename F>
int guarded(F&& f) {
  try {
    f();
    return MEMO_OK;
  } catch (const OutOfMemory& e) {
    last_error = e.what();
    return MEMO_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    last_error = e.what();
    return MEMO_ERROR;
  }
}

// The device allocators by (kind, device): process lifetime, never destroyed, as the tensors whose
// deleters reach them may outlive every static destructor (NOTE [CPU allocator interception]).
struct Registry {
  std::mutex mutex;
  std::map<std::pair<int, int>, memo_alloc*> devices;
};
Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

// `a` itself, or for a device allocator every device allocator of its kind.
std::vector<memo_alloc*> phase_targets(memo_alloc* a) {
  if (!a->device_wide) return {a};
  std::vector<memo_alloc*> out;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [key, alloc] : r.devices)
    if (key.first == a->kind) out.push_back(alloc);
  return out;
}

}  // namespace

memo_alloc* create_allocator(std::unique_ptr<RawBackend> backend, std::size_t min_segment,
                             std::size_t fallback_limit) {
  return new memo_alloc(std::move(backend), -1, false, min_segment, fallback_limit);
}

}  // namespace memo::core

namespace core = memo::core;

extern "C" {

MEMO_API const char* memo_alloc_last_error(void) { return core::last_error.c_str(); }

MEMO_API int memo_alloc_runtime_version(int kind) {
  const std::unique_ptr<core::RawBackend> backend = core::make_backend(kind, 0);
  return backend == nullptr ? -1 : backend->runtime_version();
}

MEMO_API memo_alloc* memo_alloc_device(int kind, int device) {
  memo_alloc* out = nullptr;
  core::guarded([&] {
    if (device < 0 || device >= core::kMaxDevices)
      throw AllocatorError(std::string("memo allocator (") + core::kind_name(kind) + "): device index " +
                           std::to_string(device) + " is out of range");
    core::Registry& r = core::registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.devices.find({kind, device});
    if (it == r.devices.end()) {
      auto* made = new memo_alloc(core::backend_of(kind, device), kind, true, PlannedAllocator::kDefaultMinSegment, 0);
      it = r.devices.emplace(std::make_pair(kind, device), made).first;
    }
    out = it->second;
  });
  return out;
}

MEMO_API memo_alloc* memo_alloc_create(int kind, int device, uint64_t min_segment, uint64_t fallback_limit) {
  memo_alloc* out = nullptr;
  core::guarded([&] { out = new memo_alloc(core::backend_of(kind, device), kind, false, min_segment, fallback_limit); });
  return out;
}

MEMO_API void memo_alloc_destroy(memo_alloc* a) {
  if (a != nullptr && !a->device_wide) delete a;
}

MEMO_API int memo_alloc_check_plan(int n_phases, const char* const* names, const int64_t* counts,
                                   const int64_t* sizes, const int64_t* offsets, const uint8_t* planned,
                                   int64_t peak) {
  return core::guarded(
      [&] { core::check_plan(core::plan_from_arrays(n_phases, names, counts, sizes, offsets, planned), peak); });
}

MEMO_API int memo_alloc_load_plan(memo_alloc* a, int n_phases, const char* const* names, const int64_t* counts,
                                  const int64_t* sizes, const int64_t* offsets, const uint8_t* planned,
                                  int64_t peak) {
  return core::guarded(
      [&] { a->alloc.load_plan(core::plan_from_arrays(n_phases, names, counts, sizes, offsets, planned), peak); });
}

MEMO_API int memo_alloc_unload_plan(memo_alloc* a) {
  return core::guarded([&] { a->alloc.unload_plan(); });
}

MEMO_API int memo_alloc_has_plan(memo_alloc* a) { return a->alloc.has_plan() ? 1 : 0; }

MEMO_API int memo_alloc_set_phase(memo_alloc* a, const char* name) {
  const std::string phase = name == nullptr ? std::string() : std::string(name);
  return core::guarded([&] {
    for (memo_alloc* target : core::phase_targets(a)) target->alloc.set_phase(phase);
  });
}

MEMO_API int memo_alloc_suspend_phase(memo_alloc* a) {
  return core::guarded([&] {
    for (memo_alloc* target : core::phase_targets(a)) target->alloc.suspend_phase();
  });
}

MEMO_API int memo_alloc_resume_phase(memo_alloc* a) {
  return core::guarded([&] {
    for (memo_alloc* target : core::phase_targets(a)) target->alloc.resume_phase();
  });
}

MEMO_API int memo_alloc_malloc(memo_alloc* a, uint64_t size, uintptr_t stream, void** out) {
  *out = nullptr;
  if (size == 0) return MEMO_OK;
  return core::guarded([&] { *out = a->alloc.allocate(size, stream); });
}

MEMO_API void memo_alloc_free(memo_alloc* a, void* ptr) { a->alloc.free(ptr); }

MEMO_API int memo_alloc_owns(memo_alloc* a, const void* ptr) { return a->alloc.owns(ptr) ? 1 : 0; }

MEMO_API int memo_alloc_arena_extent(memo_alloc* a, uintptr_t* base, uint64_t* bytes) {
  const auto [b, n] = a->alloc.arena_extent();
  *base = b;
  *bytes = n;
  return MEMO_OK;
}

MEMO_API int memo_alloc_set_poison(memo_alloc* a, int on) {
  return core::guarded([&] { a->alloc.set_poison(on != 0); });
}

MEMO_API int memo_alloc_set_fallback_limit(memo_alloc* a, uint64_t bytes) {
  return core::guarded([&] { a->alloc.set_fallback_limit(bytes); });
}

MEMO_API int memo_alloc_set_min_segment(memo_alloc* a, uint64_t bytes) {
  return core::guarded([&] { a->alloc.set_min_segment(bytes); });
}

MEMO_API uint64_t memo_alloc_empty_cache(memo_alloc* a) { return a->alloc.empty_cache(); }

MEMO_API int memo_alloc_stat_count(void) { return static_cast<int>(core::stat_count()); }

MEMO_API const char* memo_alloc_stat_name(int i) {
  const char* name = i < 0 ? nullptr : core::stat_name(static_cast<std::size_t>(i));
  return name == nullptr ? "" : name;
}

MEMO_API int memo_alloc_stats(memo_alloc* a, uint64_t* out, int n) {
  return static_cast<int>(core::stat_values(a->alloc.stats(), out, static_cast<std::size_t>(std::max(n, 0))));
}

MEMO_API int memo_alloc_reset_stats(memo_alloc* a) {
  return core::guarded([&] { a->alloc.reset_stats(); });
}

MEMO_API int memo_alloc_deviation(memo_alloc* a, int take, memo_deviation* out) {
  std::lock_guard<std::mutex> lock(a->kept_mutex);
  core::Deviation& dev = a->deviation;
  if (take != 0) {
    if (!a->alloc.take_deviation_report(&dev)) return 0;
  } else {
    const core::AllocatorStats st = a->alloc.stats();
    if (!st.has_deviation) return 0;
    dev = st.first_deviation;
  }
  *out = memo_deviation{dev.phase.c_str(), dev.reason.c_str(), dev.index, dev.expected, dev.actual};
  return 1;
}

MEMO_API int memo_alloc_start_logging(memo_alloc* a) {
  return core::guarded([&] { a->alloc.start_logging(); });
}

MEMO_API int64_t memo_alloc_stop_logging(memo_alloc* a) {
  std::lock_guard<std::mutex> lock(a->kept_mutex);
  int64_t n = -1;
  core::guarded([&] {
    a->log_events = a->alloc.stop_logging(&a->log_names);
    n = static_cast<int64_t>(a->log_events.size());
  });
  return n;
}

MEMO_API int64_t memo_alloc_read_log(memo_alloc* a, uint8_t* is_malloc, uint64_t* ids, uint64_t* sizes,
                                     int32_t* phases, int64_t n) {
  std::lock_guard<std::mutex> lock(a->kept_mutex);
  const int64_t count = std::min<int64_t>(n, static_cast<int64_t>(a->log_events.size()));
  for (int64_t i = 0; i < count; ++i) {
    const core::TraceEvent& e = a->log_events[static_cast<std::size_t>(i)];
    is_malloc[i] = e.is_malloc ? 1 : 0;
    ids[i] = e.id;
    sizes[i] = e.size;
    phases[i] = e.phase;
  }
  return count;
}

MEMO_API int memo_alloc_log_phase_count(memo_alloc* a) {
  std::lock_guard<std::mutex> lock(a->kept_mutex);
  return static_cast<int>(a->log_names.size());
}

MEMO_API const char* memo_alloc_log_phase_name(memo_alloc* a, int i) {
  std::lock_guard<std::mutex> lock(a->kept_mutex);
  if (i < 0 || i >= static_cast<int>(a->log_names.size())) return "";
  return a->log_names[static_cast<std::size_t>(i)].c_str();
}

}  // extern "C"
