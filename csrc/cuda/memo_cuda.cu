// The CUDA backend: memo's planned allocator as a standalone shared library
// (memo/_lib/libmemo_cuda.so) that PyTorch loads through
// torch.cuda.memory.CUDAPluggableAllocator(path, "memo_malloc", "memo_free"),
// plus a small C API that memo.allocator calls through ctypes.
//
// The backend-neutral core is plain C++17, compiled once into an archive
// that this library and the extension (memo._C) both link (NOTE [The core is
// built once] in setup.py); this file reaches it through its headers, as the
// pybind glue does, and shares no torch headers with the extension.
//
// NOTE [CUDA streams and frees]
// PyTorch's pluggable allocator hands memo_malloc the stream of the
// allocating context, and memo_free the stream the block was allocated on
// (it records it); no tensor identity, and record_stream() is a no-op for
// it. The core keeps the allocation stream of every live block and, when
// memory freed by stream T goes to a request on stream S != T, makes S wait
// on an event recorded on T at that moment (NOTE [Stream-safe reuse] in
// core/stream_order.h); reuse on the same stream needs nothing, the next
// kernel on it runs after the previous owner's. The events come from a small
// per-device pool (cudaEventDisableTiming) and are recorded lazily, only on
// cross-stream reuse. What stays invisible: a tensor also used on a third
// stream, which only record_stream() would reveal. Its user must fence that
// use before the tensor dies; memo's runtime does: its copy streams wait on
// and record events, and its two device rounding buffers, which come from
// this allocator too (made once on the compute stream and served by the
// fallback: NOTE [One-time allocations inside a phase] in
// memo/allocator/_api.py) and are read and written on the copy streams, are
// freed only after the runtime has synchronized its copy streams
// (MemoRuntime._release in memo/runtime/runtime.py).
// Poisoning is enqueued on the freeing (= allocating) stream, so it runs
// after the previous owner's kernels and before any later owner, which is
// ordered after that stream. Phases are set from the host thread that
// launches the work (NOTE [Requests from other threads]).
//
// NOTE [CUDA graph capture]
// Replaying a captured graph reuses the addresses malloc returned during
// capture with no allocator involved; PyTorch keeps them alive in a private
// pool of its caching allocator, which a pluggable allocator does not have,
// and the arena's plan replay and the event waits above cannot be captured
// either. So memo_malloc refuses a request on a capturing stream with an
// AllocatorError (which libtorch turns into a Python RuntimeError) instead
// of returning memory that the graph would later use unowned.
//
// NOTE [CUDA allocation failures]
// PyTorch's CUDAPluggableAllocator::malloc does not check the returned
// pointer: a nullptr would become a tensor over address 0. So on failure
// memo_malloc records the message (memo_cuda_last_error()) and lets the C++
// exception (a std::runtime_error) propagate: the function has C linkage but
// is C++, called from libtorch's C++, which turns it into a Python
// RuntimeError carrying our message (RMM's pluggable allocator does the
// same). Zero-byte requests return nullptr, as the caching allocator does.
// Also: PyTorch's torch.cuda.memory_stats()/memory_allocated() and
// record_stream() are not supported for pluggable allocators, and
// torch.cuda.empty_cache() does not reach us: use memo.allocator.stats()
// and memo.allocator.empty_cache("cuda").
//
// Symbols: the library and the core archive are built with
// -fvisibility=hidden (setup.py), so the core linked in stays private and only
// the C API below, marked MEMO_CUDA_API, is exported.
#include <cuda_runtime.h>

#include <sys/types.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/alloc_backend.h"
#include "core/planned_allocator.h"

#define MEMO_CUDA_API __attribute__((visibility("default")))

namespace memo::cuda {

namespace {

constexpr int kMaxDevices = 64;

thread_local cudaStream_t current_stream = nullptr;  // stream of the malloc/free in progress

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
    device_ = device;
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  int device_ = 0;
};

cudaStream_t as_stream(core::StreamId s) { return reinterpret_cast<cudaStream_t>(s); }
cudaEvent_t as_event(core::EventId e) { return reinterpret_cast<cudaEvent_t>(e); }

class CudaBackend final : public core::RawBackend {
 public:
  // Events kept for reuse; more than this many idle ones are destroyed.
  static constexpr std::size_t kEventPoolSize = 16;

  explicit CudaBackend(int device) : device_(device) {}
  void* raw_alloc(std::size_t bytes) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();  // a failed cudaMalloc leaves a non-sticky error behind: clear it
      std::lock_guard<std::mutex> lock(failure_mutex_);
      failure_ = std::string("cudaMalloc: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
      return nullptr;
    }
    return p;
  }
  void raw_free(void* ptr, std::size_t /*bytes*/) override {
    DeviceGuard guard(device_);
    cudaFree(ptr);  // synchronises the device: pending work on the memory completes first
  }
  void fill(void* ptr, std::size_t bytes, unsigned char byte) override {
    DeviceGuard guard(device_);
    cudaMemsetAsync(ptr, byte, bytes, current_stream);
  }
  const char* name() const override { return "cuda"; }
  std::string last_failure() const override {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    return failure_;
  }

  // NOTE [CUDA streams and frees]. The core calls these under its lock, so
  // the pool needs no lock of its own. If the runtime refuses an event
  // operation (e.g. the stream was destroyed), ordering falls back to a
  // device-wide synchronisation: slow but never unsafe.
  core::EventId record_event(core::StreamId stream) override {
    DeviceGuard guard(device_);
    cudaEvent_t ev = nullptr;
    if (!pool_.empty()) {
      ev = pool_.back();
      pool_.pop_back();
    } else if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      cudaDeviceSynchronize();
      return 0;  // 0: the stream's work is complete already
    }
    if (cudaEventRecord(ev, as_stream(stream)) != cudaSuccess) {
      cudaGetLastError();
      cudaEventDestroy(ev);
      cudaDeviceSynchronize();
      return 0;
    }
    return reinterpret_cast<core::EventId>(ev);
  }
  void stream_wait_event(core::StreamId stream, core::EventId event) override {
    DeviceGuard guard(device_);
    if (cudaStreamWaitEvent(as_stream(stream), as_event(event), 0) != cudaSuccess) {
      cudaGetLastError();
      cudaDeviceSynchronize();  // the wait did not happen: finish the earlier work now instead
    }
  }
  bool event_done(core::EventId event) override {
    const cudaError_t err = cudaEventQuery(as_event(event));
    if (err == cudaSuccess) return true;
    cudaGetLastError();  // cudaErrorNotReady is reported, not sticky: clear it like PyTorch does
    return false;
  }
  void destroy_event(core::EventId event) override {
    // Reusing or destroying a recorded event is safe: cudaStreamWaitEvent
    // captured the record it waits for when it was called.
    if (pool_.size() < kEventPoolSize) {
      pool_.push_back(as_event(event));
    } else {
      cudaEventDestroy(as_event(event));
    }
  }

 private:
  int device_;
  std::vector<cudaEvent_t> pool_;
  mutable std::mutex failure_mutex_;
  std::string failure_;
};

struct DeviceState {
  explicit DeviceState(int device) : backend(device), alloc(&backend) {}
  CudaBackend backend;
  core::PlannedAllocator alloc;
};

std::mutex states_mutex;
std::array<DeviceState*, kMaxDevices> states{};  // process lifetime, never destroyed

thread_local std::string last_error;

DeviceState* state(int device) {
  if (device < 0 || device >= kMaxDevices) {
    last_error = "memo allocator (cuda): device index " + std::to_string(device) + " is out of range";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(states_mutex);
  if (states[device] == nullptr) states[device] = new DeviceState(device);
  return states[device];
}

// Trace read out by memo_cuda_stop_logging / memo_cuda_read_log.
std::mutex log_mutex;
std::vector<core::TraceEvent> log_events;
std::vector<std::string> log_names;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

}  // namespace

}  // namespace memo::cuda

using memo::cuda::state;

namespace memo::cuda {
namespace {

// NOTE [CUDA graph capture]. A stream that joined a capture reports
// "active"; the legacy default stream used while another stream captures
// in global mode reports cudaErrorStreamCaptureImplicit: refuse both.
void refuse_capture(cudaStream_t stream, ssize_t size, int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err != cudaSuccess) cudaGetLastError();  // not sticky; clear it for the caller
  const bool capturing = err == cudaErrorStreamCaptureImplicit ||
                         (err == cudaSuccess && status != cudaStreamCaptureStatusNone);
  if (!capturing) return;
  throw core::AllocatorError(
      "memo allocator (cuda): CUDA graph capture is not supported by memo's allocator (a request of " +
      std::to_string(size) + " bytes on device " + std::to_string(device) +
      " came from a capturing stream; a replayed graph would reuse that memory without an owner). "
      "Capture without memo's allocator (a process that does not call memo.allocator.install_cuda()) "
      "or run this part without CUDA graphs (e.g. torch.compile without mode='reduce-overhead').");
}

}  // namespace
}  // namespace memo::cuda

extern "C" {

// ---- the functions CUDAPluggableAllocator loads ----

MEMO_CUDA_API void* memo_malloc(ssize_t size, int device, cudaStream_t stream) {
  if (size <= 0) return nullptr;
  try {  // NOTE [CUDA allocation failures]
    memo::cuda::refuse_capture(stream, size, device);
    auto* s = state(device);
    if (s == nullptr) throw memo::core::AllocatorError(memo::cuda::last_error);
    memo::cuda::current_stream = stream;
    return s->alloc.allocate(static_cast<std::size_t>(size), reinterpret_cast<memo::core::StreamId>(stream));
  } catch (const std::exception& e) {
    memo::cuda::last_error = e.what();
    throw;
  }
}

// `stream` is the one the block was allocated on; the core kept it too.
MEMO_CUDA_API void memo_free(void* ptr, ssize_t /*size*/, int device, cudaStream_t stream) {
  auto* s = state(device);
  if (s == nullptr) return;
  memo::cuda::current_stream = stream;  // NOTE [CUDA streams and frees]: poisoning is queued on it
  s->alloc.free(ptr);
}

// ---- the C API memo.allocator uses through ctypes (0 = ok, -1 = error, see last_error) ----

MEMO_CUDA_API const char* memo_cuda_last_error() { return memo::cuda::last_error.c_str(); }

// The CUDA runtime this library runs with (cudaRuntimeGetVersion: 1000 * major + 10 * minor),
// for memo.allocator to check it against torch.version.cuda. -1 when the runtime cannot say.
MEMO_CUDA_API int memo_cuda_runtime_version() {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return version;
}

// Phase i has counts[i] entries, one after another in sizes, offsets and planned (nonzero: planned at
// that offset). The core checks them (NOTE [Plan tables are checked in the core]); -1 and its message
// in memo_cuda_last_error() when they are wrong.
MEMO_CUDA_API int memo_cuda_load_plan(int device, int n_phases, const char* const* names, const int64_t* counts,
                                      const int64_t* sizes, const int64_t* offsets, const uint8_t* planned,
                                      int64_t peak) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] {
    s->alloc.load_plan(memo::core::plan_from_arrays(n_phases, names, counts, sizes, offsets, planned), peak);
  });
}

// Checks tables (memo_cuda_load_plan's arguments) as loading them would, touching no device.
MEMO_CUDA_API int memo_cuda_check_plan(int n_phases, const char* const* names, const int64_t* counts,
                                       const int64_t* sizes, const int64_t* offsets, const uint8_t* planned,
                                       int64_t peak) {
  return memo::cuda::guarded([&] {
    memo::core::check_plan(memo::core::plan_from_arrays(n_phases, names, counts, sizes, offsets, planned), peak);
  });
}

MEMO_CUDA_API int memo_cuda_unload_plan(int device) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.unload_plan(); });
}

// The phase is one for the whole process: every device that has state hears it.
MEMO_CUDA_API void memo_cuda_set_phase(const char* name) {
  const std::string phase = name == nullptr ? std::string() : std::string(name);
  for (int d = 0; d < memo::cuda::kMaxDevices; ++d) {
    memo::cuda::DeviceState* s;
    {
      std::lock_guard<std::mutex> lock(memo::cuda::states_mutex);
      s = memo::cuda::states[d];
    }
    if (s != nullptr) s->alloc.set_phase(phase);
  }
}

// NOTE [One-time allocations inside a phase]: suspend/resume nest, on every device.
MEMO_CUDA_API void memo_cuda_suspend_phase(int suspend) {
  for (int d = 0; d < memo::cuda::kMaxDevices; ++d) {
    memo::cuda::DeviceState* s;
    {
      std::lock_guard<std::mutex> lock(memo::cuda::states_mutex);
      s = memo::cuda::states[d];
    }
    if (s == nullptr) continue;
    if (suspend != 0) {
      s->alloc.suspend_phase();
    } else {
      memo::cuda::guarded([&] { s->alloc.resume_phase(); });
    }
  }
}

MEMO_CUDA_API int memo_cuda_set_poison(int device, int on) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.set_poison(on != 0); });
}

MEMO_CUDA_API int memo_cuda_set_fallback_limit(int device, uint64_t bytes) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.set_fallback_limit(bytes); });
}

MEMO_CUDA_API uint64_t memo_cuda_empty_cache(int device) {
  auto* s = state(device);
  return s == nullptr ? 0 : s->alloc.empty_cache();
}

MEMO_CUDA_API int memo_cuda_reset_stats(int device) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.reset_stats(); });
}

// NOTE [Stat names] (core/planned_allocator.h): the counters' names, in the order memo_cuda_stats
// writes their values; memo.allocator builds its stats dict from them.
MEMO_CUDA_API int memo_cuda_stat_count() { return static_cast<int>(memo::core::stat_count()); }

// The name of counter `i`; "" when i is out of range.
MEMO_CUDA_API const char* memo_cuda_stat_name(int i) {
  const char* name = i < 0 ? nullptr : memo::core::stat_name(static_cast<std::size_t>(i));
  return name == nullptr ? "" : name;
}

// Writes up to `n` counters in memo_cuda_stat_name order; returns how many were written.
MEMO_CUDA_API int memo_cuda_stats(int device, uint64_t* out, int n) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  if (n < 0) n = 0;
  return static_cast<int>(memo::core::stat_values(s->alloc.stats(), out, static_cast<std::size_t>(n)));
}

// take != 0: the report-once deviation (for the warning); take == 0: the first deviation
// from the stats. Returns 1 and fills the outputs when there is one, else 0.
MEMO_CUDA_API int memo_cuda_deviation(int device, int take, char* phase, int phase_len, int64_t* index,
                                      uint64_t* expected, uint64_t* actual, char* reason, int reason_len) {
  auto* s = state(device);
  if (s == nullptr) return 0;
  memo::core::Deviation dev;
  if (take != 0) {
    if (!s->alloc.take_deviation_report(&dev)) return 0;
  } else {
    const memo::core::AllocatorStats st = s->alloc.stats();
    if (!st.has_deviation) return 0;
    dev = st.first_deviation;
  }
  std::snprintf(phase, static_cast<std::size_t>(phase_len), "%s", dev.phase.c_str());
  std::snprintf(reason, static_cast<std::size_t>(reason_len), "%s", dev.reason.c_str());
  *index = dev.index;
  *expected = dev.expected;
  *actual = dev.actual;
  return 1;
}

MEMO_CUDA_API int memo_cuda_start_logging(int device) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.start_logging(); });
}

// Stops logging and keeps the trace for memo_cuda_read_log; returns the number of events.
MEMO_CUDA_API int64_t memo_cuda_stop_logging(int device) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  std::lock_guard<std::mutex> lock(memo::cuda::log_mutex);
  memo::cuda::log_events = s->alloc.stop_logging(&memo::cuda::log_names);
  return static_cast<int64_t>(memo::cuda::log_events.size());
}

MEMO_CUDA_API int64_t memo_cuda_read_log(uint8_t* is_malloc, uint64_t* ids, uint64_t* sizes, int32_t* phases,
                                         int64_t n) {
  std::lock_guard<std::mutex> lock(memo::cuda::log_mutex);
  const int64_t count = std::min<int64_t>(n, static_cast<int64_t>(memo::cuda::log_events.size()));
  for (int64_t i = 0; i < count; ++i) {
    const auto& e = memo::cuda::log_events[static_cast<std::size_t>(i)];
    is_malloc[i] = e.is_malloc ? 1 : 0;
    ids[i] = e.id;
    sizes[i] = e.size;
    phases[i] = e.phase;
  }
  return count;
}

MEMO_CUDA_API int memo_cuda_log_phase_count() {
  std::lock_guard<std::mutex> lock(memo::cuda::log_mutex);
  return static_cast<int>(memo::cuda::log_names.size());
}

MEMO_CUDA_API const char* memo_cuda_log_phase_name(int i) {
  std::lock_guard<std::mutex> lock(memo::cuda::log_mutex);
  if (i < 0 || i >= static_cast<int>(memo::cuda::log_names.size())) return "";
  return memo::cuda::log_names[static_cast<std::size_t>(i)].c_str();
}

}  // extern "C"
