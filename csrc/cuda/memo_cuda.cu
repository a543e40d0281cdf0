// The CUDA backend: memo's planned allocator as a standalone shared library
// (memo/_lib/libmemo_cuda.so) that PyTorch loads through
// torch.cuda.memory.CUDAPluggableAllocator(path, "memo_malloc", "memo_free").
// The library exports the allocator's C API (core/allocator_api.h) with this
// file's backend behind its CUDA kind, and memo.allocator reaches it through
// the same binding as the CPU backend (NOTE [One allocator C API]).
//
// The backend-neutral core is plain C++17, compiled once into an archive
// that this library and the extension (memo._C) both link (NOTE [The core is
// built once] in setup.py); it shares no torch headers with the extension.
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
// memo_malloc throws the C API's message as a C++ exception (an
// AllocatorError, a std::runtime_error): the function has C linkage but
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
// the C API (MEMO_API) and the two functions below (MEMO_CUDA_API) are
// exported.
#include <cuda_runtime.h>

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/alloc_backend.h"
#include "core/allocator_api.h"

#define MEMO_CUDA_API __attribute__((visibility("default")))

namespace memo::cuda {

namespace {

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
  int runtime_version() const override {
    int version = 0;
    if (cudaRuntimeGetVersion(&version) != cudaSuccess) {
      cudaGetLastError();
      return -1;
    }
    return version;
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

}  // namespace

}  // namespace memo::cuda

namespace memo::core {

// libmemo_cuda.so holds the CUDA backend (NOTE [One allocator C API]).
std::unique_ptr<RawBackend> make_backend(int kind, int device) {
  if (kind != MEMO_BACKEND_CUDA) return nullptr;
  return std::make_unique<cuda::CudaBackend>(device);
}

}  // namespace memo::core

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
  memo::cuda::refuse_capture(stream, size, device);  // NOTE [CUDA allocation failures]: throws
  memo_alloc* alloc = memo_alloc_device(MEMO_BACKEND_CUDA, device);
  if (alloc == nullptr) throw memo::core::AllocatorError(memo_alloc_last_error());
  memo::cuda::current_stream = stream;
  void* p = nullptr;
  if (memo_alloc_malloc(alloc, static_cast<uint64_t>(size), reinterpret_cast<uintptr_t>(stream), &p) != MEMO_OK)
    throw memo::core::AllocatorError(memo_alloc_last_error());
  return p;
}

// `stream` is the one the block was allocated on; the core kept it too.
MEMO_CUDA_API void memo_free(void* ptr, ssize_t /*size*/, int device, cudaStream_t stream) {
  memo_alloc* alloc = memo_alloc_device(MEMO_BACKEND_CUDA, device);
  if (alloc == nullptr) return;
  memo::cuda::current_stream = stream;  // NOTE [CUDA streams and frees]: poisoning is queued on it
  memo_alloc_free(alloc, ptr);
}

}  // extern "C"
