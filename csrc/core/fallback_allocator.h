// The fallback caching allocator: serves every request the plan does not
// cover (outside planned phases, or deviating from the plan).
//
// NOTE [Fallback caching allocator]
// A real caching allocator, not one backend allocation per request:
// * memory comes from the backend in segments of at least `min_segment`
//   bytes (large requests get a segment of their own size, rounded up to
//   kSegmentGranularity);
// * requests are rounded up to kBlockAlignment and served best-fit from a
//   free list ordered by (size, address): the smallest free block that fits;
// * a block larger than the request by at least kBlockAlignment is split,
//   the remainder stays free;
// * a freed block is coalesced with free neighbours in the same segment;
// * segments go back to the backend only on empty_cache() (or when a new
//   segment would pass the limit and releasing the free segments makes room
//   for it: then they are released first), never on a plain free, so
//   steady-state training makes no backend calls.
// Streams: a live block remembers the stream it was allocated on; a free
// block carries the streams that used its bytes (merged on coalescing), and
// a request on another stream waits for them (NOTE [Stream-safe reuse] in
// stream_order.h). Best fit ignores streams: a cross-stream hit makes the
// requester wait for the earlier users' queued work rather than grow the
// pool (rare in memo: its copy streams copy into buffers allocated up front).
// reserved = bytes held from the backend; allocated = bytes in live blocks
// (rounded sizes); reserved - allocated is the cached/fragmented part.
// Not thread-safe by itself: the owner (PlannedAllocator) holds the lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/alloc_backend.h"
#include "core/stream_order.h"

namespace memo::core {

struct FallbackStats {
  // Bytes in live blocks and held from the backend, now and at their highest.
  std::size_t allocated_bytes = 0, reserved_bytes = 0;
  std::size_t peak_allocated_bytes = 0, peak_reserved_bytes = 0;
  // The pool's shape now.
  std::size_t live_blocks = 0, free_blocks = 0, largest_free_block = 0, segments = 0;
  // Counters since the last reset.
  std::uint64_t num_allocs = 0, num_frees = 0, segment_allocs = 0, segment_releases = 0;
};

// Why a request could not be served (try_allocate), for the out-of-memory message.
struct FallbackFailure {
  std::size_t segment_bytes = 0;  // the new segment it needed
  std::string why;                // "the fallback limit is reached", or the backend's refusal
};

class FallbackAllocator {
 public:
  static constexpr std::size_t kSegmentGranularity = 2u << 20;  // 2 MiB

  // limit: most bytes this allocator may reserve from the backend (0 = no limit).
  // `order` (owned by the caller, shared with the arena) orders reuse across streams.
  FallbackAllocator(RawBackend* backend, StreamOrder* order, std::size_t min_segment, std::size_t limit);
  ~FallbackAllocator();
  FallbackAllocator(const FallbackAllocator&) = delete;
  FallbackAllocator& operator=(const FallbackAllocator&) = delete;

  // Throws OutOfMemory (with the numbers) when the request cannot be served.
  // `where` names the phase for the message. The block is usable on `stream`:
  // earlier users on other streams are waited for.
  void* allocate(std::size_t bytes, StreamId stream, const std::string& where);
  // Like allocate, but returns nullptr and fills `failure` instead of throwing
  // (the owner may still serve the request elsewhere: NOTE [One device pool]).
  void* try_allocate(std::size_t bytes, StreamId stream, FallbackFailure* failure);
  // The out-of-memory message for a failed request: the pool's numbers, then
  // `also_tried` (a sentence, or empty), then what to do.
  std::string oom_message(std::size_t bytes, const FallbackFailure& failure, const std::string& where,
                          const std::string& also_tried) const;
  // Returns false when `ptr` is not a live block of this allocator.
  bool free(void* ptr);
  bool owns(const void* ptr) const { return live_.count(const_cast<void*>(ptr)) != 0; }
  // Size the block was rounded to, 0 when not live here.
  std::size_t block_size(const void* ptr) const;
  // Releases every segment that is entirely free; returns bytes released.
  std::size_t empty_cache();

  void set_limit(std::size_t limit) { limit_ = limit; }
  std::size_t limit() const { return limit_; }
  void set_min_segment(std::size_t bytes);
  FallbackStats stats() const;
  // Zeroes the counters (allocs, frees, segment allocs/releases) and sets peaks to the current values.
  void reset_stats();

 private:
  // Ownership (RAII): segments_ owns the segments; a segment owns its memory
  // (a RawRegion, given back to the backend when the segment dies) and its
  // first block; each block owns the next one in address order. free_ and
  // live_ only point at blocks.
  struct Segment;
  struct Block {
    char* ptr;
    std::size_t size;
    bool allocated;
    Block* prev;                 // address neighbours inside the segment (prev: not owned)
    std::unique_ptr<Block> next;
    Segment* segment;
    StreamId stream = kDefaultStream;  // live: the stream it was allocated on
    std::vector<StreamUse> uses;       // free: streams whose frees it holds, one entry each
  };
  struct Segment {
    RawRegion base;
    std::size_t size;
    std::unique_ptr<Block> first;
    // Unlinks the blocks one by one: a long chain must not recurse once per block.
    ~Segment() {
      while (first != nullptr) first = std::move(first->next);
    }
  };
  struct BySizeThenAddr {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };

  // nullptr (and `failure` filled) when the limit or the backend refuses.
  Block* new_segment(std::size_t bytes, FallbackFailure* failure);
  // Counts the release; the segment (and with it its memory) dies with `seg`.
  void release_segment(std::unique_ptr<Segment> seg);
  // Bytes of the segments that are entirely free (what empty_cache() would release).
  std::size_t free_segment_bytes() const;

  RawBackend* backend_;
  StreamOrder* order_;
  std::size_t min_segment_;
  std::size_t limit_;
  std::set<Block*, BySizeThenAddr> free_;
  std::unordered_map<void*, Block*> live_;
  std::vector<std::unique_ptr<Segment>> segments_;
  FallbackStats stats_;
};

}  // namespace memo::core
