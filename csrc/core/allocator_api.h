// The allocator's C API: the one interface to the planned allocator core
// (planned_allocator.h), for every backend and every caller.
//
// NOTE [One allocator C API]
// Implemented once, in allocator_api.cpp, over the core. A caller holds an
// opaque memo_alloc handle made for a backend kind: MEMO_BACKEND_CPU (host
// memory) or MEMO_BACKEND_CUDA (cudaMalloc and CUDA streams). Each binary that
// links the core defines memo::core::make_backend for the kinds it holds:
// memo._C the CPU backend (csrc/cpu), memo/_lib/libmemo_cuda.so the CUDA
// backend (csrc/cuda), which needs the CUDA runtime and so lives in a library
// of its own (NOTE [The core is built once] in setup.py). Asking a binary for
// a kind it lacks is an error naming the kind.
// Every caller goes through these functions: PyTorch's CPU hook (csrc/cpu),
// the functions CUDAPluggableAllocator loads (csrc/cuda), and memo's Python
// binding (csrc/python/allocator_bindings.cpp), which calls this binary's
// functions for the CPU backend and the same functions looked up in the CUDA
// library for the CUDA backend: one binding, one set of names and checks.
//
// Conventions: functions returning int give MEMO_OK, MEMO_ERROR or
// MEMO_OUT_OF_MEMORY, with the message in memo_alloc_last_error() (per
// thread); functions returning a handle give NULL on error. Plan tables come
// flat: phase i has counts[i] entries, stored one after another in sizes,
// offsets and planned (nonzero: planned at offsets[j]); the core checks them
// (NOTE [Plan tables are checked in the core] in planned_allocator.h).
#pragma once

#include <stddef.h>
#include <stdint.h>

#define MEMO_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

typedef struct memo_alloc memo_alloc;

enum { MEMO_BACKEND_CPU = 0, MEMO_BACKEND_CUDA = 1 };
enum { MEMO_OK = 0, MEMO_ERROR = -1, MEMO_OUT_OF_MEMORY = -2 };

// The first deviation from the plan (NOTE [Deviation policy]); the strings stay valid until the next
// memo_alloc_deviation on the same allocator.
typedef struct memo_deviation {
  const char* phase;
  const char* reason;
  int64_t index;
  uint64_t expected;  // 0 when the table has no entry at that index
  uint64_t actual;
} memo_deviation;

// Why the last call on this thread failed.
MEMO_API const char* memo_alloc_last_error(void);
// The version of the runtime behind backend `kind` (CUDA: cudaRuntimeGetVersion, 1000 * major + 10 * minor;
// CPU: 0); -1 when this binary lacks the kind or the runtime cannot say.
MEMO_API int memo_alloc_runtime_version(int kind);

// The process-lifetime allocator of device `device` of `kind`: the one PyTorch allocates through. Made on
// first use, never destroyed. Phase calls on it reach every device allocator of its kind (the phase is one
// per process, like PyTorch's allocator).
MEMO_API memo_alloc* memo_alloc_device(int kind, int device);
// A standalone allocator (tests, diagnostics); fallback_limit 0 means none. memo_alloc_destroy frees it.
MEMO_API memo_alloc* memo_alloc_create(int kind, int device, uint64_t min_segment, uint64_t fallback_limit);
// Only for memo_alloc_create's allocators; its arena and segments go back to the backend.
MEMO_API void memo_alloc_destroy(memo_alloc* a);

// Checks tables as loading them would, touching no device.
MEMO_API int memo_alloc_check_plan(int n_phases, const char* const* names, const int64_t* counts,
                                   const int64_t* sizes, const int64_t* offsets, const uint8_t* planned,
                                   int64_t peak);
// Checks the tables and reserves the arena (NOTE [Arena lifetime]); replaces any loaded plan.
MEMO_API int memo_alloc_load_plan(memo_alloc* a, int n_phases, const char* const* names, const int64_t* counts,
                                  const int64_t* sizes, const int64_t* offsets, const uint8_t* planned,
                                  int64_t peak);
MEMO_API int memo_alloc_unload_plan(memo_alloc* a);
// 1 with a plan loaded, else 0.
MEMO_API int memo_alloc_has_plan(memo_alloc* a);

// Opens phase `name` (request index 0); NULL or "" means no phase.
MEMO_API int memo_alloc_set_phase(memo_alloc* a, const char* name);
// NOTE [One-time allocations inside a phase] (memo/allocator/_api.py): calls nest.
MEMO_API int memo_alloc_suspend_phase(memo_alloc* a);
MEMO_API int memo_alloc_resume_phase(memo_alloc* a);

// `stream` is the stream the memory is used on (a cudaStream_t; 0 for the CPU backend). *out is NULL for
// size 0.
MEMO_API int memo_alloc_malloc(memo_alloc* a, uint64_t size, uintptr_t stream, void** out);
// Never fails: pointers the allocator does not know are counted (invalid_frees).
MEMO_API void memo_alloc_free(memo_alloc* a, void* ptr);
// 1 when `ptr` is a live block of the allocator, else 0.
MEMO_API int memo_alloc_owns(memo_alloc* a, const void* ptr);
// The current arena's base (0 without one) and bytes.
MEMO_API int memo_alloc_arena_extent(memo_alloc* a, uintptr_t* base, uint64_t* bytes);

MEMO_API int memo_alloc_set_poison(memo_alloc* a, int on);
MEMO_API int memo_alloc_set_fallback_limit(memo_alloc* a, uint64_t bytes);
MEMO_API int memo_alloc_set_min_segment(memo_alloc* a, uint64_t bytes);
// Returns the bytes of wholly free fallback segments given back to the backend.
MEMO_API uint64_t memo_alloc_empty_cache(memo_alloc* a);

// NOTE [Stat names] (planned_allocator.h): the counters' names, in the order memo_alloc_stats writes them.
MEMO_API int memo_alloc_stat_count(void);
// The name of counter `i`; "" when i is out of range.
MEMO_API const char* memo_alloc_stat_name(int i);
// Writes up to `n` counters in memo_alloc_stat_name order; returns how many were written.
MEMO_API int memo_alloc_stats(memo_alloc* a, uint64_t* out, int n);
MEMO_API int memo_alloc_reset_stats(memo_alloc* a);
// take != 0: the report-once deviation (for the warning); take == 0: the first deviation of the stats.
// Returns 1 and fills *out when there is one, else 0.
MEMO_API int memo_alloc_deviation(memo_alloc* a, int take, memo_deviation* out);

MEMO_API int memo_alloc_start_logging(memo_alloc* a);
// Stops logging and keeps the trace in the allocator for the three readers below; returns the number of
// events, or -1 on error.
MEMO_API int64_t memo_alloc_stop_logging(memo_alloc* a);
// Copies up to `n` events of the kept trace; phases index memo_alloc_log_phase_name (-1: no phase).
MEMO_API int64_t memo_alloc_read_log(memo_alloc* a, uint8_t* is_malloc, uint64_t* ids, uint64_t* sizes,
                                     int32_t* phases, int64_t n);
MEMO_API int memo_alloc_log_phase_count(memo_alloc* a);
// "" when i is out of range.
MEMO_API const char* memo_alloc_log_phase_name(memo_alloc* a, int i);

#ifdef __cplusplus
}  // extern "C"

// Every function above, for callers that look them up by name in a library (the Python binding's CUDA
// backend): X(name) once per function.
#define MEMO_ALLOC_API_FUNCTIONS(X)                                                                       \
  X(memo_alloc_last_error) X(memo_alloc_runtime_version) X(memo_alloc_device) X(memo_alloc_create)       \
  X(memo_alloc_destroy) X(memo_alloc_check_plan) X(memo_alloc_load_plan) X(memo_alloc_unload_plan)       \
  X(memo_alloc_has_plan) X(memo_alloc_set_phase) X(memo_alloc_suspend_phase) X(memo_alloc_resume_phase)  \
  X(memo_alloc_malloc) X(memo_alloc_free) X(memo_alloc_owns) X(memo_alloc_arena_extent)                  \
  X(memo_alloc_set_poison) X(memo_alloc_set_fallback_limit) X(memo_alloc_set_min_segment)                \
  X(memo_alloc_empty_cache) X(memo_alloc_stat_count) X(memo_alloc_stat_name) X(memo_alloc_stats)         \
  X(memo_alloc_reset_stats) X(memo_alloc_deviation) X(memo_alloc_start_logging)                          \
  X(memo_alloc_stop_logging) X(memo_alloc_read_log) X(memo_alloc_log_phase_count)                        \
  X(memo_alloc_log_phase_name)

#include <cstddef>
#include <memory>

#include "core/alloc_backend.h"

namespace memo::core {

// Defined once by each binary that links the core (NOTE [One allocator C API]): a raw backend of `kind`
// for `device`, or nullptr when this binary does not hold that kind.
std::unique_ptr<RawBackend> make_backend(int kind, int device);

// A standalone allocator over a backend the caller made (the stream-ordering test harness's fake
// streams); memo_alloc_destroy frees both.
memo_alloc* create_allocator(std::unique_ptr<RawBackend> backend, std::size_t min_segment,
                             std::size_t fallback_limit);

}  // namespace memo::core
#endif
