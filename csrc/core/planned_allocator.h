// The planned allocator: one arena reserved at the plan's peak, planned
// offsets selected by (phase, request index), a fallback caching allocator
// for everything else, statistics and trace logging. Backend-neutral C++17.
//
// NOTE [Plan replay by request order]
// The device allocator sees only sizes (CUDAPluggableAllocator passes size,
// device and stream; c10::Allocator passes size), never tensor identity. So a
// plan is a table per phase instance ("layer.fwd[3]") listing, for the k-th
// request of that phase, its size and its arena offset (or none: fallback).
// Python sets the phase on every phase change; each set starts the request
// index at 0. A request is served from the arena when its size equals the
// table's and its byte range does not overlap a live arena allocation.
//
// NOTE [Deviation policy]
// * Size mismatch, or more requests than the table has: the phase instance
//   is out of sync; this request and the rest of the instance go to the
//   fallback. The next phase starts in sync again.
// * The slot's byte range still overlaps a live arena allocation (a tensor
//   kept alive longer than in the profiled run): this one request goes to the
//   fallback (the order is still in sync, so later requests keep the plan).
//   The check is a range check against every live arena allocation, not just
//   the slot's own id: two phases' slots that share bytes are both protected.
// * The slot's byte range overlaps a live borrowed block (NOTE [One device
//   pool]): like a busy slot, this one request goes to the fallback, with
//   reason "arena range lent to an unplanned request" (counted in slot_lent).
// Each such request counts as a deviation; the first one is kept (phase,
// index, expected and actual size, reason) and reported once.
//
// NOTE [Requests from other threads]
// Only requests made on the thread that opened the current phase follow the
// plan (and carry the phase in a trace). Intra-op worker threads (OpenMP
// reductions allocate per-thread scratch) race each other, so their order
// and lifetimes differ from run to run; they are served by the fallback as
// unplanned requests and logged without a phase, so the planner never plans
// them. The phase is opened by hooks that run on the thread doing the work:
// the Python thread in forward, the autograd engine's thread in backward
// (the calling thread for CPU graphs, the device thread for CUDA graphs).
//
// NOTE [Arena lifetime]
// Loading another plan or leaving the planned context must not pull memory
// from under live tensors (gradients made in backward outlive the context).
// An arena with live allocations is retired: it stays reserved, its frees
// are still recognised by address, and it goes back to the backend when its
// last allocation is freed.
//
// Streams: a planned slot remembers the stream it was allocated on; a freed
// slot leaves a freed range (offset, end, stream) in its arena, and a later
// slot on another stream that overlaps it waits for that stream's work
// (NOTE [Stream-safe reuse] in stream_order.h). Overlapped parts are cut out
// of the freed ranges (the new owner's own free will stand for them), so the
// freed ranges stay disjoint and their number bounded by the arena's layout.
//
// NOTE [One device pool]
// The arena and the fallback share one device budget: the fallback's limit
// is what the budget leaves beside the arena (memo train: budget - arena -
// parameters). The arena is reserved at the plan's peak, but the peak is one
// instant of the iteration: most of the time much of the arena is idle. A
// hard split would fail an unplanned request (a gradient, an optimizer
// state) at the fallback's limit while the budget still has room in the
// arena. So a request the fallback cannot serve (the limit is reached, or
// the backend refuses a segment) is served from an idle range of the current
// arena before it fails: a "borrowed" block.
// * Idle: overlapping no live planned block and no live borrowed block.
//   Best fit over the gaps between those (the smallest gap that holds the
//   request, the lowest offset among equals); offsets are multiples of
//   kBlockAlignment like the plan's slots, the size is rounded up to it like
//   a fallback block's. Freed ranges whose last user may still have work
//   queued count as idle: taking one orders the borrower's stream after
//   them and cuts them out (claim_freed), as for a planned slot, and the
//   free of a borrowed block leaves a freed range with its stream in turn
//   (NOTE [Stream-safe reuse]).
// * A borrowed block is an arena block: its free is recognised by address,
//   it keeps a retired arena alive (NOTE [Arena lifetime]; only the current
//   arena lends), and its bytes are never handed out while it lives: a
//   planned request whose slot overlaps it goes to the fallback as a
//   deviation (NOTE [Deviation policy]). Planned slots are checked against
//   live planned and borrowed ranges, borrowed ranges come from the gaps
//   between both, fallback blocks live in their own segments: nothing hands
//   out overlapping live memory.
// * Only when no idle range holds the request does it fail, with the
//   fallback's out-of-memory error extended by the arena's numbers.
// * Why lend instead of raising the limit: the arena is already held, so
//   lending its idle bytes adds nothing to what the device holds, and a
//   budget of arena + limit stays a budget. The price: a borrowed block that
//   lives long (an optimizer state made under pressure) turns the planned
//   requests over its bytes into deviations while it lives; they are counted
//   and reported once, and results stay correct.
// * Without a limit (0) the fallback fails only when the backend refuses a
//   segment; the same rule applies then (the device is full while arena
//   bytes are idle). A run that never reaches the limit never borrows.
//
// What "in use" counts. bytes_in_use is the bytes of live blocks, each once:
// planned slots (requested sizes) + borrowed blocks + fallback blocks
// (rounded sizes). A borrowed block is not a fallback block (it is not in
// fallback.allocated_bytes) and it lies inside the arena: it adds to
// bytes_in_use, but not to what the device holds. device_reserved_bytes =
// arenas (current and retired) + fallback segments; borrowing never raises
// it, and bytes_in_use <= device_reserved_bytes always.
// peak_bytes_in_use (reports call it memo_allocator_peak_in_use) is the
// largest bytes_in_use at one instant: what tensors needed at once, the
// quantity a trace's lower bound speaks of. peak_device_reserved_bytes is
// what the device held at most: what a budget caps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/alloc_backend.h"
#include "core/fallback_allocator.h"
#include "core/stream_order.h"

namespace memo::core {

struct PlanSlot {
  std::size_t size = 0;
  std::int64_t offset = -1;  // -1: not planned, use the fallback
};

using PhaseTables = std::unordered_map<std::string, std::vector<PlanSlot>>;

// NOTE [Plan tables are checked in the core]
// The tables a caller hands in are checked in one place, check_plan below:
// phase names non-empty and unique; sizes > 0; offsets >= 0 (or unplanned)
// and multiples of kBlockAlignment; offset + size within the peak; sizes,
// offsets and the peak below 2**62 (NOTE [Byte counts are bounded] in
// memo/units.py). The C API (allocator_api.h) takes them as flat arrays
// (plan_from_arrays), the Python binding only converts Python ints and None
// into those, and both hand on the core's AllocatorError, whose text names
// the entry and what to do; memo.allocator raises it as a MemoError. The
// input is signed, so a negative size or offset reaches the check instead of
// wrapping around to a huge one.
struct PlanEntry {
  std::int64_t size = 0;
  std::int64_t offset = 0;
  bool planned = false;  // false: the request is not planned (the fallback serves it); offset is ignored
};
struct PlanTableInput {
  std::string phase;
  std::vector<PlanEntry> entries;
};
using PlanInput = std::vector<PlanTableInput>;

// Checks the tables and the peak (AllocatorError naming the bad entry) and returns them as PhaseTables.
PhaseTables check_plan(const PlanInput& tables, std::int64_t peak);
// The C API's flat shape: phase i has counts[i] entries, stored one after another in sizes,
// offsets and planned (nonzero: planned at offsets[j]). Throws AllocatorError for a negative count.
PlanInput plan_from_arrays(int n_phases, const char* const* names, const std::int64_t* counts,
                           const std::int64_t* sizes, const std::int64_t* offsets, const std::uint8_t* planned);

struct Deviation {
  std::string phase;
  std::int64_t index = -1;
  std::size_t expected = 0;  // 0 when the table has no entry at that index
  std::size_t actual = 0;
  // "size", "count", "slot busy", "after an earlier deviation",
  // kReasonSlotLent (NOTE [One device pool])
  std::string reason;
};

inline constexpr char kReasonSlotLent[] = "arena range lent to an unplanned request";

struct AllocatorStats {
  std::uint64_t requests = 0;            // every malloc
  std::uint64_t planned_hits = 0;        // served from the arena
  std::uint64_t fallback_requests = 0;   // served from the fallback (all reasons)
  std::uint64_t unplanned_requests = 0;  // outside planned phases, or slot without offset
  std::uint64_t deviations = 0;          // fallback because the run left the plan
  std::uint64_t slot_busy = 0;           // of which: planned bytes still owned by a live tensor
  std::uint64_t slot_lent = 0;           // of which: planned bytes lent to a borrowed block
  std::uint64_t other_thread_requests = 0;  // of unplanned: not the phase's thread
  std::uint64_t frees = 0;
  std::uint64_t invalid_frees = 0;  // pointers neither the arena nor the fallback knows
  bool has_deviation = false;
  Deviation first_deviation;
  // NOTE [One device pool], "What in use counts": live planned + borrowed + fallback bytes, each once.
  std::size_t bytes_in_use = 0;
  std::size_t peak_bytes_in_use = 0;
  // Borrowed blocks: fallback requests served from an idle arena range (NOTE [One device pool]).
  std::uint64_t borrowed_allocs = 0;  // of fallback_requests, since the last reset
  std::size_t borrowed_blocks = 0;    // live now (every arena)
  std::size_t borrowed_bytes = 0;     // their bytes now (rounded to kBlockAlignment)
  std::size_t peak_borrowed_bytes = 0;
  // What memo holds from the backend: arenas (current and retired) + fallback segments.
  std::size_t device_reserved_bytes = 0;
  std::size_t peak_device_reserved_bytes = 0;
  std::size_t arena_bytes = 0;  // reserved arena of the loaded plan
  std::size_t arena_in_use = 0;  // bytes of the current arena in live blocks, planned and borrowed
  std::size_t arena_high_water = 0;  // max(offset + size) of planned slots handed out since the plan was loaded
  std::uint64_t arena_reservations = 0;
  std::uint64_t arena_releases = 0;
  std::size_t retired_arenas = 0;
  StreamOrderStats streams;  // cross-stream reuse: events recorded, waits issued
  FallbackStats fallback;
};

// NOTE [Stat names]
// The counters of AllocatorStats by name, in one table (kStatFields in
// planned_allocator.cpp) that the C API gives with the values
// (memo_alloc_stat_count / memo_alloc_stat_name / memo_alloc_stats), and the
// Python dicts are built from those names (python/allocator_bindings.cpp),
// never from a list kept in step by hand. "fallback.x" is field x of
// AllocatorStats::fallback (the Python dict nests it under "fallback");
// "segment_allocs" and "segment_releases" repeat the fallback's counters at
// the top level. first_deviation is not a counter: the C API reports it
// beside the table (memo_alloc_deviation).
std::size_t stat_count();
// The name of counter `i`; nullptr when i >= stat_count().
const char* stat_name(std::size_t i);
// Writes the first min(n, stat_count()) counters of `s` in stat_name order; returns how many.
std::size_t stat_values(const AllocatorStats& s, std::uint64_t* out, std::size_t n);

struct TraceEvent {
  bool is_malloc = true;
  std::uint64_t id = 0;
  std::size_t size = 0;
  std::int32_t phase = -1;  // index into the phase name list, -1 outside phases
};

class PlannedAllocator {
 public:
  static constexpr std::size_t kDefaultMinSegment = 2u << 20;

  explicit PlannedAllocator(RawBackend* backend, std::size_t min_segment = kDefaultMinSegment,
                            std::size_t fallback_limit = 0);
  ~PlannedAllocator();
  PlannedAllocator(const PlannedAllocator&) = delete;
  PlannedAllocator& operator=(const PlannedAllocator&) = delete;

  // Checks the tables (check_plan: AllocatorError naming the bad entry) and reserves
  // the arena (OutOfMemory with the numbers). Replaces any loaded plan.
  void load_plan(const PlanInput& tables, std::int64_t peak);
  void unload_plan();
  bool has_plan() const;

  // Opens phase `name` (request index 0); an empty name means "no phase".
  void set_phase(const std::string& name);
  // NOTE [One-time allocations inside a phase] (memo/allocator/_api.py): while
  // suspended (calls nest), requests are outside every phase and the open
  // phase keeps its request index for when it resumes.
  void suspend_phase();
  void resume_phase();

  // `stream`: the stream the caller will use the memory on (NOTE [Stream-safe reuse]).
  void* allocate(std::size_t bytes, StreamId stream = kDefaultStream);
  // Never throws: it runs from deleters. Unknown pointers are counted.
  void free(void* ptr) noexcept;
  // Whether `ptr` is a live block of this allocator.
  bool owns(const void* ptr) const;
  // Where the current arena lies: its base (0 without one) and bytes. For tests and diagnostics.
  std::pair<std::uintptr_t, std::size_t> arena_extent() const;

  void set_poison(bool on);
  void set_fallback_limit(std::size_t bytes);
  void set_min_segment(std::size_t bytes);
  std::size_t empty_cache();

  void start_logging();
  // Stops logging and returns the events and the phase names they index.
  std::vector<TraceEvent> stop_logging(std::vector<std::string>* phase_names);

  AllocatorStats stats() const;
  // Zeroes the counters (the fallback's too) and sets peaks to the current values.
  void reset_stats();
  // The first deviation, once: true (and fills `out`) only on the first call
  // after it happened. Used to warn exactly once.
  bool take_deviation_report(Deviation* out);

 private:
  struct FreedRange {
    std::size_t end;
    StreamUse use;
  };
  using Ranges = std::map<std::size_t, std::size_t>;  // offset -> end, disjoint
  struct Arena {
    RawRegion base;  // owns the reservation: given back to the backend when the arena dies
    std::size_t bytes = 0;
    std::size_t live = 0;  // live blocks, planned and borrowed
    bool retired = false;
    Ranges live_ranges;  // live planned slots
    Ranges lent;         // live borrowed blocks (NOTE [One device pool]); disjoint from live_ranges
    // Freed bytes whose last user may still have work queued: offset -> range.
    // Disjoint from each other, from live_ranges and from lent.
    std::map<std::size_t, FreedRange> freed;
  };
  struct ArenaBlock {
    Arena* arena;  // not owned: arena_ or one of retired_
    std::size_t offset;
    std::size_t size;  // planned: the requested size; borrowed: rounded to kBlockAlignment
    StreamId stream;
    bool borrowed;
  };

  void install_plan(PhaseTables tables, std::size_t peak);
  void* allocate_locked(std::size_t bytes, StreamId stream);
  void* fallback_locked(std::size_t bytes, StreamId stream);
  // An idle range of the current arena for a request the fallback refused; nullptr when none holds it.
  void* borrow_locked(std::size_t bytes, StreamId stream);
  // The idle gaps of `arena` (between live planned and borrowed blocks), aligned, in address order.
  template <typename F>
  static void for_each_idle(const Arena& arena, F&& f);
  [[noreturn]] void throw_oom(std::size_t bytes, const FallbackFailure& failure) const;
  static bool overlaps(const Ranges& ranges, std::size_t begin, std::size_t end);
  void note_peaks();
  // Orders `stream` after the freed ranges overlapping [begin, end) and cuts that span out of them.
  void claim_freed(Arena* arena, std::size_t begin, std::size_t end, StreamId stream);
  void deviate(std::size_t expected, std::size_t actual, const char* reason);
  void retire_current_arena();
  // Counts the release; the arena (and with it its reservation) dies with `arena`.
  void release_arena(std::unique_ptr<Arena> arena);
  std::int32_t phase_id(const std::string& name);

  mutable std::mutex mutex_;
  RawBackend* backend_;
  StreamOrder order_;  // before fallback_, which keeps a pointer to it
  FallbackAllocator fallback_;

  PhaseTables tables_;
  bool has_plan_ = false;
  std::size_t peak_ = 0;
  std::unique_ptr<Arena> arena_;
  std::vector<std::unique_ptr<Arena>> retired_;
  std::size_t arena_reserved_bytes_ = 0;  // current and retired arenas
  std::unordered_map<void*, ArenaBlock> arena_live_;  // planned and borrowed blocks
  std::size_t planned_bytes_ = 0;
  std::size_t borrowed_bytes_ = 0;
  std::size_t borrowed_blocks_ = 0;

  std::string phase_;
  std::thread::id phase_thread_;
  const std::vector<PlanSlot>* phase_table_ = nullptr;
  std::size_t phase_index_ = 0;
  bool phase_deviated_ = false;
  int suspended_ = 0;

  bool poison_ = false;
  bool deviation_reported_ = false;
  AllocatorStats stats_;

  bool logging_ = false;
  std::uint64_t next_id_ = 0;
  std::unordered_map<void*, std::uint64_t> log_ids_;
  std::vector<TraceEvent> log_;
  std::vector<std::string> log_phase_names_;
  std::unordered_map<std::string, std::int32_t> log_phase_ids_;
  std::int32_t current_phase_id_ = -1;
};

}  // namespace memo::core
