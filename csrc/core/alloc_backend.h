// Raw memory source under memo's allocators, and the allocator's error type.
//
// The core (fallback caching allocator, planned arena, statistics, trace log)
// is backend-neutral C++17: it never includes torch or CUDA headers. A backend
// (host memory in csrc/cpu, cudaMalloc in csrc/cuda) only hands out and takes
// back large raw regions, fills memory for poisoning, and orders streams
// with events (NOTE [Stream-safe reuse] in core/stream_order.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>

namespace memo::core {

// Opaque handles the core stores but never interprets: a cudaStream_t /
// cudaEvent_t for the CUDA backend. Stream 0 is the only stream the CPU
// backend has (and CUDA's legacy default stream, an ordinary stream here).
using StreamId = std::uintptr_t;
using EventId = std::uintptr_t;
constexpr StreamId kDefaultStream = 0;

// Thrown for every user-facing allocator failure: bad tables, memory that
// cannot be had. The message carries the numbers; the C API returns it as
// its status and message (allocator_api.h), which the Python binding raises
// and PyTorch's allocator hooks throw with the same text.
class AllocatorError : public std::runtime_error {
 public:
  explicit AllocatorError(const std::string& what) : std::runtime_error(what) {}
};

// Like AllocatorError, but specifically "no memory": arena or fallback limit
// reached, or the backend refused a segment.
class OutOfMemory : public AllocatorError {
 public:
  explicit OutOfMemory(const std::string& what) : AllocatorError(what) {}
};

class RawBackend {
 public:
  virtual ~RawBackend() = default;
  // Returns nullptr when the memory cannot be had. The result is aligned to
  // at least kSegmentAlignment.
  virtual void* raw_alloc(std::size_t bytes) = 0;
  virtual void raw_free(void* ptr, std::size_t bytes) = 0;
  // Fills [ptr, ptr + bytes) with `byte` (poisoning of freed planned memory).
  virtual void fill(void* ptr, std::size_t bytes, unsigned char byte) = 0;
  virtual const char* name() const = 0;
  // Why the last raw_alloc returned nullptr, when the backend knows (e.g. the CUDA error).
  virtual std::string last_failure() const { return {}; }
  // The version of the runtime the backend allocates through (CUDA: cudaRuntimeGetVersion); 0 for none.
  virtual int runtime_version() const { return 0; }

  // Stream ordering (NOTE [Stream-safe reuse]). The core calls these only
  // when memory last used on one stream goes to a request on another, so a
  // backend with a single stream (CPU) never sees a call; the defaults are
  // what "no streams" means. All four are called under the allocator's lock.
  //
  // An event that completes once all work queued on `stream` so far has run.
  // 0 means that work is already known complete (a backend that cannot
  // record may synchronise instead and return 0).
  virtual EventId record_event(StreamId /*stream*/) { return 0; }
  // Work queued on `stream` from now on runs after `event` completes.
  virtual void stream_wait_event(StreamId /*stream*/, EventId /*event*/) {}
  // Whether `event` has completed (a non-blocking query).
  virtual bool event_done(EventId /*event*/) { return true; }
  // The core holds `event` no longer; waits already queued on it still hold.
  virtual void destroy_event(EventId /*event*/) {}
};

// Owns a region from RawBackend::raw_alloc: gives it back to its backend when
// it dies (unique_ptr's deleter), so arenas and segments cannot leak or be
// freed twice. The backend must outlive the region (the allocators that hold
// regions keep a pointer to a backend that outlives them).
struct RawFree {
  RawBackend* backend = nullptr;
  std::size_t bytes = 0;
  void operator()(char* ptr) const {
    if (ptr != nullptr) backend->raw_free(ptr, bytes);
  }
};
using RawRegion = std::unique_ptr<char, RawFree>;

// Takes ownership of `bytes` at `ptr` from `backend` (nullptr: an empty region).
inline RawRegion own_region(RawBackend* backend, void* ptr, std::size_t bytes) {
  return RawRegion(static_cast<char*>(ptr), RawFree{backend, bytes});
}

// Every block the allocators hand out is aligned to this (c10's default CPU
// alignment is 64, CUDA's caching allocator uses 512): planned offsets are
// multiples of it and segment/arena bases are aligned to at least it.
constexpr std::size_t kBlockAlignment = 512;
constexpr std::size_t kSegmentAlignment = 4096;

inline std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// "1048576 B (1 MiB)": bytes as the allocators' error messages give them.
inline std::string format_bytes(std::size_t bytes) {
  std::ostringstream os;
  os << bytes << " B (" << static_cast<double>(bytes) / (1 << 20) << " MiB)";
  return os.str();
}

}  // namespace memo::core
