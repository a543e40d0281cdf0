// Stream ordering for reused memory, shared by the fallback allocator and the
// planned arena. Backend-neutral: streams and events are opaque handles and
// the backend's hooks (RawBackend::record_event etc.) do the device work.
//
// NOTE [Stream-safe reuse]
// A device allocator hands out memory whose previous owner's kernels may
// still be queued. Within one stream that is harmless: the new owner's work
// is queued behind them. Across streams it is a race. The rule:
// * every live block (fallback block or planned slot) remembers the stream
//   it was allocated on; PyTorch's pluggable allocator passes that stream to
//   malloc and frees on it, and memo treats it as the block's only user;
// * a free turns that into a StreamUse {stream T, tick} on the freed memory:
//   the fallback keeps the set of such uses per free block (coalescing
//   merges the sets, one entry per stream), the arena keeps freed byte
//   ranges (offset, end, use) that later slots may overlap in any way;
// * when memory carrying a use by T goes to a request on a stream S != T,
//   S is made to wait for the work T had queued: record an event on T, make
//   S wait on it. Same-stream reuse needs nothing (stream order).
// The event is recorded lazily, at reuse time, not at every free: recorded
// now it covers everything queued on T so far, which includes all the work
// before the free, and most frees are reused on their own stream and never
// need one. One event per stream is kept and shared: a use freed before that
// event was recorded is covered by it, so later reuses of T's memory wait on
// it without recording again, and once a query finds it complete every use
// of T freed before it is dropped without any wait. A stream that already
// waited on a covering event of T (e.g. for another piece of a coalesced
// block) does not wait again. This is what PyTorch's caching allocator
// achieves with record_stream events, for the one stream a pluggable
// allocator can see. Uses on a third stream that only record_stream would
// reveal stay invisible here: their user must fence them (memo's runtime
// does, with its own events).
#pragma once

#include <cstdint>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/alloc_backend.h"

namespace memo::core {

// Memory freed by its owner on `stream` at logical time `tick`.
struct StreamUse {
  StreamId stream = kDefaultStream;
  std::uint64_t tick = 0;
};

// Adds `use` to `uses`, keeping one entry per stream: the later free of a
// stream is covered by any event that covers it, so it stands for both.
void merge_use(std::vector<StreamUse>* uses, const StreamUse& use);

struct StreamOrderStats {
  std::uint64_t events_recorded = 0;  // record_event calls (lazy, at cross-stream reuse)
  std::uint64_t stream_waits = 0;     // stream_wait_event calls
};

// The per-stream event state behind NOTE [Stream-safe reuse]. Not
// thread-safe by itself: the owner (PlannedAllocator) holds the lock.
class StreamOrder {
 public:
  explicit StreamOrder(RawBackend* backend) : backend_(backend) {}
  ~StreamOrder();
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // A new tick for a free: later than every tick and event so far.
  std::uint64_t tick() { return ++clock_; }
  // Makes work queued on `requester` from now on run after the work that was
  // queued on use.stream when `use` was freed. Nothing for the same stream.
  void order_after(StreamId requester, const StreamUse& use);
  // Whether `use` is known complete without asking the backend (a cheap
  // filter to drop entries when lists are merged or split).
  bool known_complete(const StreamUse& use) const;
  // Drops the entries of `uses` that are known complete.
  void prune(std::vector<StreamUse>* uses) const;

  StreamOrderStats stats() const { return stats_; }
  void reset_stats() { stats_ = StreamOrderStats{}; }

 private:
  struct Fence {
    EventId event = 0;            // latest event recorded on the stream, 0: none held
    std::uint64_t event_tick = 0;  // uses with tick < event_tick are covered by `event`
    std::uint64_t done_tick = 0;   // uses with tick < done_tick are known complete
  };

  RawBackend* backend_;
  std::uint64_t clock_ = 0;
  std::unordered_map<StreamId, Fence> fences_;
  // (waiting stream, waited-on stream) -> event_tick of the latest event of
  // the second that the first was made to wait on.
  std::map<std::pair<StreamId, StreamId>, std::uint64_t> waited_;
  StreamOrderStats stats_;
};

}  // namespace memo::core
