// See NOTE [Fallback caching allocator] in fallback_allocator.h and
// NOTE [Stream-safe reuse] in stream_order.h.
#include "core/fallback_allocator.h"

#include <algorithm>
#include <sstream>

namespace memo::core {

FallbackAllocator::FallbackAllocator(RawBackend* backend, StreamOrder* order, std::size_t min_segment,
                                     std::size_t limit)
    : backend_(backend), order_(order), min_segment_(0), limit_(limit) {
  set_min_segment(min_segment);
}

// Live blocks at destruction would dangle; the owner never destroys a
// FallbackAllocator with live blocks (process-lifetime objects). The segments
// give their memory back as they die (Segment::base, a RawRegion).
FallbackAllocator::~FallbackAllocator() = default;

void FallbackAllocator::set_min_segment(std::size_t bytes) {
  min_segment_ = round_up(std::max<std::size_t>(bytes, kBlockAlignment), kBlockAlignment);
}

std::size_t FallbackAllocator::block_size(const void* ptr) const {
  auto it = live_.find(const_cast<void*>(ptr));
  return it == live_.end() ? 0 : it->second->size;
}

std::string FallbackAllocator::oom_message(std::size_t bytes, const FallbackFailure& failure,
                                           const std::string& where, const std::string& also_tried) const {
  std::ostringstream os;
  os << "memo allocator: fallback pool (" << backend_->name() << ") cannot serve a request of " << format_bytes(bytes)
     << " in " << (where.empty() ? std::string("no phase") : "phase " + where) << ": " << failure.why
     << ". It needs a new segment of " << format_bytes(failure.segment_bytes) << "; reserved "
     << format_bytes(stats_.reserved_bytes) << ", allocated " << format_bytes(stats_.allocated_bytes) << ", limit "
     << (limit_ == 0 ? std::string("none") : format_bytes(limit_)) << ". " << also_tried
     << (also_tried.empty() ? "" : " ")
     << "Raise the fallback limit, or re-profile so that the plan covers these requests.";
  return os.str();
}

FallbackAllocator::Block* FallbackAllocator::new_segment(std::size_t bytes, FallbackFailure* failure) {
  std::size_t seg_bytes = bytes <= min_segment_ ? min_segment_ : round_up(bytes, kSegmentGranularity);
  if (limit_ != 0 && stats_.reserved_bytes + seg_bytes > limit_) {
    // A smaller segment that just fits the request may still be within the limit.
    const std::size_t exact = round_up(bytes, kBlockAlignment);
    // Give the cached free segments back only when that makes room: a refused
    // request may still be served from the arena (NOTE [One device pool]), and
    // the cache should survive it (on CUDA each release synchronises the device).
    if (stats_.reserved_bytes - free_segment_bytes() + exact > limit_) {
      *failure = FallbackFailure{seg_bytes, "the fallback limit is reached"};
      return nullptr;
    }
    empty_cache();
    if (stats_.reserved_bytes + seg_bytes > limit_) seg_bytes = exact;
  }
  void* base = backend_->raw_alloc(seg_bytes);
  if (base == nullptr) {
    empty_cache();
    base = backend_->raw_alloc(seg_bytes);
    if (base == nullptr) {
      const std::string why = backend_->last_failure();
      *failure = FallbackFailure{seg_bytes, why.empty() ? "the backend has no memory left"
                                                        : "the backend refused: " + why};
      return nullptr;
    }
  }
  auto seg = std::make_unique<Segment>();
  seg->base = own_region(backend_, base, seg_bytes);
  seg->size = seg_bytes;
  seg->first.reset(new Block{seg->base.get(), seg_bytes, false, nullptr, nullptr, seg.get(), kDefaultStream, {}});
  Block* block = seg->first.get();
  segments_.push_back(std::move(seg));
  stats_.reserved_bytes += seg_bytes;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  stats_.segment_allocs += 1;
  return block;
}

void* FallbackAllocator::allocate(std::size_t bytes, StreamId stream, const std::string& where) {
  FallbackFailure failure;
  void* p = try_allocate(bytes, stream, &failure);
  if (p == nullptr) throw OutOfMemory(oom_message(bytes, failure, where, ""));
  return p;
}

void* FallbackAllocator::try_allocate(std::size_t bytes, StreamId stream, FallbackFailure* failure) {
  const std::size_t size = round_up(std::max<std::size_t>(bytes, 1), kBlockAlignment);
  Block probe{nullptr, size, false, nullptr, nullptr, nullptr, kDefaultStream, {}};
  auto it = free_.lower_bound(&probe);  // best fit: smallest free block >= size, lowest address
  Block* block;
  if (it != free_.end()) {
    block = *it;
    free_.erase(it);
  } else {
    block = new_segment(size, failure);
    if (block == nullptr) return nullptr;
  }
  // The block's earlier users on other streams may still have work queued on
  // any of its bytes: the new owner's stream waits for them.
  for (const StreamUse& use : block->uses) order_->order_after(stream, use);
  if (block->size - size >= kBlockAlignment) {
    std::unique_ptr<Block> rest(new Block{block->ptr + size, block->size - size, false, block,
                                          std::move(block->next), block->segment, kDefaultStream, block->uses});
    // Only `stream` waited: the remainder keeps every use for its own next owner.
    order_->prune(&rest->uses);
    if (rest->next != nullptr) rest->next->prev = rest.get();
    block->size = size;
    free_.insert(rest.get());
    block->next = std::move(rest);
  }
  block->uses.clear();
  block->stream = stream;
  block->allocated = true;
  live_.emplace(block->ptr, block);
  stats_.allocated_bytes += block->size;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  stats_.num_allocs += 1;
  return block->ptr;
}

bool FallbackAllocator::free(void* ptr) {
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  Block* block = it->second;
  live_.erase(it);
  block->allocated = false;
  block->uses.push_back(StreamUse{block->stream, order_->tick()});
  stats_.allocated_bytes -= block->size;
  stats_.num_frees += 1;
  // Coalescing merges the neighbours' uses: the merged block's next owner
  // waits for every stream that used any of its bytes.
  if (Block* next = block->next.get(); next != nullptr && !next->allocated) {
    free_.erase(next);
    for (const StreamUse& use : next->uses) merge_use(&block->uses, use);
    block->size += next->size;
    if (next->next != nullptr) next->next->prev = block;
    block->next = std::move(next->next);  // `next` dies here
  }
  if (Block* prev = block->prev; prev != nullptr && !prev->allocated) {
    free_.erase(prev);
    for (const StreamUse& use : block->uses) merge_use(&prev->uses, use);
    prev->size += block->size;
    if (block->next != nullptr) block->next->prev = prev;
    prev->next = std::move(block->next);  // `block` dies here
    block = prev;
  }
  order_->prune(&block->uses);
  free_.insert(block);
  return true;
}

void FallbackAllocator::release_segment(std::unique_ptr<Segment> seg) {
  free_.erase(seg->first.get());  // a wholly free segment is exactly one free block
  stats_.reserved_bytes -= seg->size;
  stats_.segment_releases += 1;
}

std::size_t FallbackAllocator::free_segment_bytes() const {
  std::size_t n = 0;
  for (const auto& seg : segments_)
    if (!seg->first->allocated && seg->first->next == nullptr) n += seg->size;
  return n;
}

std::size_t FallbackAllocator::empty_cache() {
  std::size_t released = 0;
  std::vector<std::unique_ptr<Segment>> kept;
  for (auto& seg : segments_) {
    if (!seg->first->allocated && seg->first->next == nullptr) {
      released += seg->size;
      release_segment(std::move(seg));
    } else {
      kept.push_back(std::move(seg));
    }
  }
  segments_.swap(kept);
  return released;
}

FallbackStats FallbackAllocator::stats() const {
  FallbackStats s = stats_;
  s.live_blocks = live_.size();
  s.free_blocks = free_.size();
  s.largest_free_block = free_.empty() ? 0 : (*free_.rbegin())->size;
  s.segments = segments_.size();
  return s;
}

void FallbackAllocator::reset_stats() {
  stats_.num_allocs = 0;
  stats_.num_frees = 0;
  stats_.segment_allocs = 0;
  stats_.segment_releases = 0;
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

}  // namespace memo::core
