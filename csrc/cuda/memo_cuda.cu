// The CUDA backend: memo's planned allocator as a standalone shared library
// (memo/_lib/libmemo_cuda.so) that PyTorch loads through
// torch.cuda.memory.CUDAPluggableAllocator(path, "memo_malloc", "memo_free"),
// plus a small C API that memo.allocator calls through ctypes.
//
// The backend-neutral core is plain C++17; it is compiled into this library
// from its own sources (included below) so the extension (memo._C) and this
// library share code without sharing an object file or torch headers.
//
// NOTE [CUDA streams and frees]
// PyTorch's pluggable allocator hands us the stream of the allocating
// context and no tensor identity, and it does not forward record_stream().
// Policy: memory is stream-ordered on the stream it was used on. A freed
// block (planned slot or fallback block) may be handed out again at once,
// which is safe for work on the same stream (the next kernel on that stream
// runs after the previous user's kernels). Tensors used on another stream
// (offload/prefetch copies) must be fenced by their user before they are
// freed (the runtime waits on its events; its rounding buffers do not come
// from this allocator). Poisoning is enqueued on the freeing stream, so it
// also runs after the previous user's kernels. Phases are set from the host
// thread that launches the work (NOTE [Requests from other threads]).
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

#include "core/fallback_allocator.cpp"
#include "core/planned_allocator.cpp"

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

class CudaBackend final : public core::RawBackend {
 public:
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

 private:
  int device_;
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

extern "C" {

// ---- the functions CUDAPluggableAllocator loads ----

void* memo_malloc(ssize_t size, int device, cudaStream_t stream) {
  if (size <= 0) return nullptr;
  auto* s = state(device);
  if (s == nullptr) throw memo::core::AllocatorError(memo::cuda::last_error);
  memo::cuda::current_stream = stream;
  try {
    return s->alloc.allocate(static_cast<std::size_t>(size));
  } catch (const std::exception& e) {  // NOTE [CUDA allocation failures]
    memo::cuda::last_error = e.what();
    throw;
  }
}

void memo_free(void* ptr, ssize_t /*size*/, int device, cudaStream_t stream) {
  auto* s = state(device);
  if (s == nullptr) return;
  memo::cuda::current_stream = stream;  // NOTE [CUDA streams and frees]
  s->alloc.free(ptr);
}

// ---- the C API memo.allocator uses through ctypes (0 = ok, -1 = error, see last_error) ----

const char* memo_cuda_last_error() { return memo::cuda::last_error.c_str(); }

int memo_cuda_load_plan(int device, int n_phases, const char* const* names, const int64_t* counts,
                        const uint64_t* sizes, const int64_t* offsets, uint64_t peak) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] {
    memo::core::PhaseTables tables;
    std::size_t at = 0;
    for (int i = 0; i < n_phases; ++i) {
      std::vector<memo::core::PlanSlot> slots(static_cast<std::size_t>(counts[i]));
      for (auto& slot : slots) {
        slot.size = sizes[at];
        slot.offset = offsets[at];
        ++at;
      }
      tables.emplace(names[i], std::move(slots));
    }
    s->alloc.load_plan(std::move(tables), peak);
  });
}

int memo_cuda_unload_plan(int device) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.unload_plan(); });
}

// The phase is one for the whole process: every device that has state hears it.
void memo_cuda_set_phase(const char* name) {
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
void memo_cuda_suspend_phase(int suspend) {
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

int memo_cuda_set_poison(int device, int on) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.set_poison(on != 0); });
}

int memo_cuda_set_fallback_limit(int device, uint64_t bytes) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.set_fallback_limit(bytes); });
}

uint64_t memo_cuda_empty_cache(int device) {
  auto* s = state(device);
  return s == nullptr ? 0 : s->alloc.empty_cache();
}

int memo_cuda_reset_stats(int device) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.reset_stats(); });
}

// Writes the counters in the order of CUDA_STAT_FIELDS (memo/allocator/_backends.py);
// returns how many were written.
int memo_cuda_stats(int device, uint64_t* out, int n) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  const memo::core::AllocatorStats st = s->alloc.stats();
  const memo::core::FallbackStats& f = st.fallback;
  const uint64_t values[] = {
      st.requests, st.planned_hits, st.fallback_requests, st.unplanned_requests, st.deviations, st.slot_busy,
      st.other_thread_requests, st.frees, st.invalid_frees, st.bytes_in_use, st.peak_bytes_in_use,
      st.arena_bytes, st.arena_in_use, st.arena_high_water, st.arena_reservations, st.arena_releases,
      st.retired_arenas, f.allocated_bytes, f.reserved_bytes, f.peak_allocated_bytes, f.peak_reserved_bytes,
      f.live_blocks, f.free_blocks, f.largest_free_block, f.num_allocs, f.num_frees, f.segment_allocs,
      f.segment_releases, f.segments,
  };
  const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
  int written = 0;
  for (; written < n && written < count; ++written) out[written] = values[written];
  return written;
}

// take != 0: the report-once deviation (for the warning); take == 0: the first deviation
// from the stats. Returns 1 and fills the outputs when there is one, else 0.
int memo_cuda_deviation(int device, int take, char* phase, int phase_len, int64_t* index, uint64_t* expected,
                        uint64_t* actual, char* reason, int reason_len) {
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

int memo_cuda_start_logging(int device) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  return memo::cuda::guarded([&] { s->alloc.start_logging(); });
}

// Stops logging and keeps the trace for memo_cuda_read_log; returns the number of events.
int64_t memo_cuda_stop_logging(int device) {
  auto* s = state(device);
  if (s == nullptr) return -1;
  std::lock_guard<std::mutex> lock(memo::cuda::log_mutex);
  memo::cuda::log_events = s->alloc.stop_logging(&memo::cuda::log_names);
  return static_cast<int64_t>(memo::cuda::log_events.size());
}

int64_t memo_cuda_read_log(uint8_t* is_malloc, uint64_t* ids, uint64_t* sizes, int32_t* phases, int64_t n) {
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

int memo_cuda_log_phase_count() {
  std::lock_guard<std::mutex> lock(memo::cuda::log_mutex);
  return static_cast<int>(memo::cuda::log_names.size());
}

const char* memo_cuda_log_phase_name(int i) {
  std::lock_guard<std::mutex> lock(memo::cuda::log_mutex);
  if (i < 0 || i >= static_cast<int>(memo::cuda::log_names.size())) return "";
  return memo::cuda::log_names[static_cast<std::size_t>(i)].c_str();
}

}  // extern "C"
