// See NOTE [Plan replay by request order], [Deviation policy], [Arena lifetime]
// and [One device pool] in planned_allocator.h, NOTE [Stream-safe reuse] in stream_order.h.
#include "core/planned_allocator.h"

#include <algorithm>
#include <iterator>
#include <sstream>
#include <utility>

namespace memo::core {

namespace {
constexpr unsigned char kPoisonByte = 0xFF;  // all-ones bytes: NaN in fp32/fp16/bf16

std::size_t total_bytes(const std::map<std::size_t, std::size_t>& ranges) {
  std::size_t n = 0;
  for (const auto& [begin, end] : ranges) n += end - begin;
  return n;
}
// NOTE [Stat names] in planned_allocator.h: the one list of counter names, each with its value.
struct StatField {
  const char* name;
  std::uint64_t (*value)(const AllocatorStats&);
};
const StatField kStatFields[] = {
    {"requests", [](const AllocatorStats& s) -> std::uint64_t { return s.requests; }},
    {"planned_hits", [](const AllocatorStats& s) -> std::uint64_t { return s.planned_hits; }},
    {"fallback_requests", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback_requests; }},
    {"unplanned_requests", [](const AllocatorStats& s) -> std::uint64_t { return s.unplanned_requests; }},
    {"deviations", [](const AllocatorStats& s) -> std::uint64_t { return s.deviations; }},
    {"slot_busy", [](const AllocatorStats& s) -> std::uint64_t { return s.slot_busy; }},
    {"slot_lent", [](const AllocatorStats& s) -> std::uint64_t { return s.slot_lent; }},
    {"other_thread_requests", [](const AllocatorStats& s) -> std::uint64_t { return s.other_thread_requests; }},
    {"frees", [](const AllocatorStats& s) -> std::uint64_t { return s.frees; }},
    {"invalid_frees", [](const AllocatorStats& s) -> std::uint64_t { return s.invalid_frees; }},
    {"bytes_in_use", [](const AllocatorStats& s) -> std::uint64_t { return s.bytes_in_use; }},
    {"peak_bytes_in_use", [](const AllocatorStats& s) -> std::uint64_t { return s.peak_bytes_in_use; }},
    {"borrowed_allocs", [](const AllocatorStats& s) -> std::uint64_t { return s.borrowed_allocs; }},
    {"borrowed_blocks", [](const AllocatorStats& s) -> std::uint64_t { return s.borrowed_blocks; }},
    {"borrowed_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.borrowed_bytes; }},
    {"peak_borrowed_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.peak_borrowed_bytes; }},
    {"device_reserved_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.device_reserved_bytes; }},
    {"peak_device_reserved_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.peak_device_reserved_bytes; }},
    {"arena_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.arena_bytes; }},
    {"arena_in_use", [](const AllocatorStats& s) -> std::uint64_t { return s.arena_in_use; }},
    {"arena_high_water", [](const AllocatorStats& s) -> std::uint64_t { return s.arena_high_water; }},
    {"arena_reservations", [](const AllocatorStats& s) -> std::uint64_t { return s.arena_reservations; }},
    {"arena_releases", [](const AllocatorStats& s) -> std::uint64_t { return s.arena_releases; }},
    {"retired_arenas", [](const AllocatorStats& s) -> std::uint64_t { return s.retired_arenas; }},
    {"events_recorded", [](const AllocatorStats& s) -> std::uint64_t { return s.streams.events_recorded; }},
    {"stream_waits", [](const AllocatorStats& s) -> std::uint64_t { return s.streams.stream_waits; }},
    {"fallback.allocated_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.allocated_bytes; }},
    {"fallback.reserved_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.reserved_bytes; }},
    {"fallback.peak_allocated_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.peak_allocated_bytes; }},
    {"fallback.peak_reserved_bytes", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.peak_reserved_bytes; }},
    {"fallback.live_blocks", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.live_blocks; }},
    {"fallback.free_blocks", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.free_blocks; }},
    {"fallback.largest_free_block", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.largest_free_block; }},
    {"fallback.num_allocs", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.num_allocs; }},
    {"fallback.num_frees", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.num_frees; }},
    {"fallback.segment_allocs", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.segment_allocs; }},
    {"fallback.segment_releases", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.segment_releases; }},
    {"fallback.segments", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.segments; }},
    {"segment_allocs", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.segment_allocs; }},
    {"segment_releases", [](const AllocatorStats& s) -> std::uint64_t { return s.fallback.segment_releases; }},
};
constexpr std::size_t kStatFieldCount = sizeof(kStatFields) / sizeof(kStatFields[0]);
}  // namespace

std::size_t stat_count() { return kStatFieldCount; }

const char* stat_name(std::size_t i) { return i < kStatFieldCount ? kStatFields[i].name : nullptr; }

std::size_t stat_values(const AllocatorStats& s, std::uint64_t* out, std::size_t n) {
  const std::size_t count = std::min(n, kStatFieldCount);
  for (std::size_t i = 0; i < count; ++i) out[i] = kStatFields[i].value(s);
  return count;
}

PlannedAllocator::PlannedAllocator(RawBackend* backend, std::size_t min_segment, std::size_t fallback_limit)
    : backend_(backend), order_(backend), fallback_(backend, &order_, min_segment, fallback_limit) {}

// The arenas give their reservations back as they die (Arena::base, a RawRegion).
PlannedAllocator::~PlannedAllocator() = default;

void PlannedAllocator::release_arena(std::unique_ptr<Arena> arena) {
  arena_reserved_bytes_ -= arena->bytes;
  stats_.arena_releases += 1;
}

void PlannedAllocator::retire_current_arena() {
  if (arena_ == nullptr) return;
  if (arena_->live == 0) {
    release_arena(std::move(arena_));
  } else {
    arena_->retired = true;
    retired_.push_back(std::move(arena_));
  }
  arena_ = nullptr;
}

PhaseTables check_plan(const PlanInput& tables, std::int64_t peak) {
  // NOTE [Plan tables are checked in the core]; NOTE [Byte counts are bounded] (memo/units.py): with
  // sizes, offsets and the peak below 2**62 bytes, no sum the allocator makes can wrap around.
  constexpr std::int64_t kMaxBytes = std::int64_t{1} << 62;
  if (peak < 0 || peak >= kMaxBytes)
    throw AllocatorError("memo allocator: plan peak must be an int >= 0 and below 2**62 (bytes), got " +
                         std::to_string(peak) + "; pass the plan's peak (Plan.peak), the arena's size in bytes");
  PhaseTables out;
  for (const PlanTableInput& table : tables) {
    const std::string& name = table.phase;
    if (name.empty())
      throw AllocatorError("memo allocator: phase table keys must be non-empty phase names, got an empty "
                           "name; name each table by its phase instance, e.g. 'layer.fwd[3]'");
    std::vector<PlanSlot> slots;
    slots.reserve(table.entries.size());
    for (std::size_t k = 0; k < table.entries.size(); ++k) {
      const PlanEntry& e = table.entries[k];
      auto bad = [&](const std::string& what) {
        std::ostringstream os;
        os << "memo allocator: bad plan table entry " << name << "[" << k << "] (size " << e.size << ", offset ";
        if (e.planned) {
          os << e.offset;
        } else {
          os << "None";
        }
        os << "): " << what;
        return AllocatorError(os.str());
      };
      if (e.size <= 0) throw bad("size must be a positive int (bytes); re-plan (memo plan) or fix the table");
      if (e.size >= kMaxBytes) throw bad("size is not below 2**62 bytes (4 EiB)");
      if (e.planned) {
        if (e.offset < 0) throw bad("offset must be an int >= 0, or None for an unplanned request");
        if (e.offset >= kMaxBytes) throw bad("offset is not below 2**62 bytes (4 EiB)");
        if (e.offset % static_cast<std::int64_t>(kBlockAlignment) != 0) {
          std::ostringstream os;
          os << "offset must be a multiple of " << kBlockAlignment << " bytes; re-plan with alignment "
             << kBlockAlignment;
          throw bad(os.str());
        }
        if (e.offset + e.size > peak) {  // both below 2**62: no overflow
          std::ostringstream os;
          os << "offset + size = " << e.offset + e.size << " exceeds the plan's peak (arena) of " << peak
             << " bytes; pass the peak of the plan these tables come from";
          throw bad(os.str());
        }
      }
      slots.push_back(PlanSlot{static_cast<std::size_t>(e.size), e.planned ? e.offset : -1});
    }
    if (!out.emplace(name, std::move(slots)).second)
      throw AllocatorError("memo allocator: phase " + name + " has two tables; give each phase instance one");
  }
  return out;
}

PlanInput plan_from_arrays(int n_phases, const char* const* names, const std::int64_t* counts,
                           const std::int64_t* sizes, const std::int64_t* offsets, const std::uint8_t* planned) {
  if (n_phases < 0)
    throw AllocatorError("memo allocator: a plan has " + std::to_string(n_phases) + " phase tables; expected >= 0");
  PlanInput out(static_cast<std::size_t>(n_phases));
  std::size_t at = 0;
  for (int i = 0; i < n_phases; ++i) {
    out[i].phase = names[i] == nullptr ? std::string() : std::string(names[i]);
    if (counts[i] < 0)
      throw AllocatorError("memo allocator: phase table " + out[i].phase + " has " + std::to_string(counts[i]) +
                           " entries; expected >= 0");
    out[i].entries.resize(static_cast<std::size_t>(counts[i]));
    for (PlanEntry& e : out[i].entries) {
      e = PlanEntry{sizes[at], offsets[at], planned[at] != 0};
      ++at;
    }
  }
  return out;
}

void PlannedAllocator::load_plan(const PlanInput& tables, std::int64_t peak) {
  install_plan(check_plan(tables, peak), static_cast<std::size_t>(peak));
}

void PlannedAllocator::install_plan(PhaseTables tables, std::size_t peak) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Reserve before dropping the old plan, so a failure leaves the old one usable.
  std::unique_ptr<Arena> fresh;
  const std::size_t arena_bytes = round_up(peak, kSegmentAlignment);
  const bool reuse = arena_ != nullptr && arena_->live == 0 && arena_->bytes == arena_bytes;
  if (!reuse && arena_bytes > 0) {
    void* base = backend_->raw_alloc(arena_bytes);
    if (base == nullptr) {
      fallback_.empty_cache();
      base = backend_->raw_alloc(arena_bytes);
    }
    if (base == nullptr) {
      std::ostringstream os;
      os << "memo allocator: cannot reserve the arena of " << arena_bytes << " bytes ("
         << static_cast<double>(arena_bytes) / (1 << 20) << " MiB) that the plan needs on " << backend_->name()
         << (backend_->last_failure().empty() ? "" : " (" + backend_->last_failure() + ")")
         << "; the fallback pool holds " << fallback_.stats().reserved_bytes
         << " bytes. Free memory, or plan for a shorter sequence.";
      throw OutOfMemory(os.str());
    }
    fresh = std::make_unique<Arena>();
    fresh->base = own_region(backend_, base, arena_bytes);
    fresh->bytes = arena_bytes;
    arena_reserved_bytes_ += arena_bytes;
    stats_.arena_reservations += 1;
  }
  if (!reuse) {
    retire_current_arena();
    arena_ = std::move(fresh);
  }
  note_peaks();
  tables_ = std::move(tables);
  has_plan_ = true;
  peak_ = peak;
  stats_.arena_high_water = 0;
  auto it = tables_.find(phase_);
  phase_table_ = it == tables_.end() ? nullptr : &it->second;
  phase_index_ = 0;
  phase_deviated_ = false;
}

void PlannedAllocator::unload_plan() {
  std::lock_guard<std::mutex> lock(mutex_);
  retire_current_arena();
  tables_.clear();
  has_plan_ = false;
  peak_ = 0;
  phase_table_ = nullptr;
  phase_index_ = 0;
  phase_deviated_ = false;
}

bool PlannedAllocator::has_plan() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return has_plan_;
}

std::int32_t PlannedAllocator::phase_id(const std::string& name) {
  if (name.empty()) return -1;
  auto it = log_phase_ids_.find(name);
  if (it != log_phase_ids_.end()) return it->second;
  auto id = static_cast<std::int32_t>(log_phase_names_.size());
  log_phase_names_.push_back(name);
  log_phase_ids_.emplace(name, id);
  return id;
}

void PlannedAllocator::set_phase(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ = name;
  phase_thread_ = std::this_thread::get_id();
  auto it = name.empty() ? tables_.end() : tables_.find(name);
  phase_table_ = it == tables_.end() ? nullptr : &it->second;
  phase_index_ = 0;
  phase_deviated_ = false;
  if (logging_) current_phase_id_ = phase_id(name);
}

void PlannedAllocator::suspend_phase() {
  std::lock_guard<std::mutex> lock(mutex_);
  suspended_ += 1;
}

void PlannedAllocator::resume_phase() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (suspended_ == 0) throw AllocatorError("memo allocator: resume_phase() without a matching suspend_phase()");
  suspended_ -= 1;
}

bool PlannedAllocator::overlaps(const Ranges& ranges, std::size_t begin, std::size_t end) {
  // Ranges are disjoint, so only the last range starting before `end` can overlap.
  auto it = ranges.lower_bound(end);
  if (it == ranges.begin()) return false;
  --it;
  return it->second > begin;
}

template <typename F>
void PlannedAllocator::for_each_idle(const Arena& arena, F&& f) {
  // Merge the two disjoint sets of busy ranges in address order; every gap
  // starts at the next multiple of kBlockAlignment after the busy bytes
  // (planned sizes are not rounded) and ends at the next busy offset (a
  // multiple of it) or the arena's end.
  auto a = arena.live_ranges.begin();
  auto b = arena.lent.begin();
  std::size_t cursor = 0;
  while (a != arena.live_ranges.end() || b != arena.lent.end()) {
    auto& next = (b == arena.lent.end() || (a != arena.live_ranges.end() && a->first < b->first)) ? a : b;
    const std::size_t begin = next->first, end = next->second;
    ++next;
    const std::size_t gap = round_up(cursor, kBlockAlignment);
    if (begin > gap) f(gap, begin);
    cursor = std::max(cursor, end);
  }
  const std::size_t gap = round_up(cursor, kBlockAlignment);
  if (arena.bytes > gap) f(gap, arena.bytes);
}

void* PlannedAllocator::borrow_locked(std::size_t bytes, StreamId stream) {
  if (arena_ == nullptr) return nullptr;  // only the current arena lends: a retired one is never handed out
  const std::size_t size = round_up(std::max<std::size_t>(bytes, 1), kBlockAlignment);
  bool found = false;
  std::size_t best = 0, best_len = 0;
  for_each_idle(*arena_, [&](std::size_t begin, std::size_t end) {
    const std::size_t len = end - begin;
    if (len >= size && (!found || len < best_len)) {  // best fit, lowest offset among equals
      found = true;
      best = begin;
      best_len = len;
    }
  });
  if (!found) return nullptr;
  const std::size_t end = best + size;
  claim_freed(arena_.get(), best, end, stream);
  arena_->lent.emplace(best, end);
  arena_->live += 1;
  void* p = arena_->base.get() + best;
  arena_live_.emplace(p, ArenaBlock{arena_.get(), best, size, stream, true});
  borrowed_bytes_ += size;
  borrowed_blocks_ += 1;
  stats_.borrowed_allocs += 1;
  stats_.peak_borrowed_bytes = std::max(stats_.peak_borrowed_bytes, borrowed_bytes_);
  return p;
}

void PlannedAllocator::throw_oom(std::size_t bytes, const FallbackFailure& failure) const {
  std::string tried;
  if (arena_ != nullptr) {
    std::size_t largest = 0;
    for_each_idle(*arena_, [&](std::size_t begin, std::size_t end) { largest = std::max(largest, end - begin); });
    std::ostringstream os;
    os << "The idle ranges of the plan's arena were tried too (NOTE [One device pool]): none holds "
       << format_bytes(round_up(std::max<std::size_t>(bytes, 1), kBlockAlignment)) << " (arena "
       << format_bytes(arena_->bytes) << ": " << format_bytes(total_bytes(arena_->live_ranges))
       << " in live planned blocks, " << format_bytes(total_bytes(arena_->lent))
       << " lent to earlier requests, largest idle range " << format_bytes(largest) << "; in use in all "
       << format_bytes(planned_bytes_ + borrowed_bytes_ + fallback_.stats().allocated_bytes) << ").";
    tried = os.str();
  }
  throw OutOfMemory(fallback_.oom_message(bytes, failure, phase_, tried));
}

void PlannedAllocator::deviate(std::size_t expected, std::size_t actual, const char* reason) {
  stats_.deviations += 1;
  if (!stats_.has_deviation) {
    stats_.has_deviation = true;
    stats_.first_deviation = Deviation{phase_, static_cast<std::int64_t>(phase_index_), expected, actual, reason};
  }
}

void PlannedAllocator::claim_freed(Arena* arena, std::size_t begin, std::size_t end, StreamId stream) {
  auto& freed = arena->freed;
  auto it = freed.lower_bound(begin);
  if (it != freed.begin() && std::prev(it)->second.end > begin) --it;  // a range starting before `begin`
  while (it != freed.end() && it->first < end) {
    const std::size_t r_begin = it->first;
    const FreedRange r = it->second;
    order_.order_after(stream, r.use);
    it = freed.erase(it);
    // The parts outside [begin, end) still carry the old use for their own next owner.
    if (r_begin < begin) freed.emplace_hint(it, r_begin, FreedRange{begin, r.use});
    if (r.end > end) it = freed.emplace_hint(it, end, FreedRange{r.end, r.use});  // ends the loop
  }
}

void* PlannedAllocator::fallback_locked(std::size_t bytes, StreamId stream) {
  FallbackFailure failure;
  void* p = fallback_.try_allocate(bytes, stream, &failure);
  if (p == nullptr) p = borrow_locked(bytes, stream);  // NOTE [One device pool]
  if (p == nullptr) throw_oom(bytes, failure);
  stats_.fallback_requests += 1;
  return p;
}

void* PlannedAllocator::allocate_locked(std::size_t bytes, StreamId stream) {
  stats_.requests += 1;
  if (phase_table_ == nullptr || arena_ == nullptr || suspended_ > 0) {
    stats_.unplanned_requests += 1;
    return fallback_locked(bytes, stream);
  }
  if (std::this_thread::get_id() != phase_thread_) {  // NOTE [Requests from other threads]
    stats_.unplanned_requests += 1;
    stats_.other_thread_requests += 1;
    return fallback_locked(bytes, stream);
  }
  const std::vector<PlanSlot>& table = *phase_table_;
  void* p = nullptr;
  if (phase_deviated_) {
    deviate(phase_index_ < table.size() ? table[phase_index_].size : 0, bytes, "after an earlier deviation");
  } else if (phase_index_ >= table.size()) {
    phase_deviated_ = true;
    deviate(0, bytes, "count");
  } else if (table[phase_index_].offset < 0) {
    stats_.unplanned_requests += 1;
  } else if (table[phase_index_].size != bytes) {
    phase_deviated_ = true;
    deviate(table[phase_index_].size, bytes, "size");
  } else {
    const auto begin = static_cast<std::size_t>(table[phase_index_].offset);
    const std::size_t end = begin + bytes;
    if (overlaps(arena_->lent, begin, end)) {  // NOTE [One device pool]
      stats_.slot_lent += 1;
      deviate(bytes, bytes, kReasonSlotLent);
    } else if (overlaps(arena_->live_ranges, begin, end)) {
      stats_.slot_busy += 1;
      deviate(bytes, bytes, "slot busy");
    } else {
      claim_freed(arena_.get(), begin, end, stream);
      p = arena_->base.get() + begin;
      arena_->live_ranges.emplace(begin, end);
      arena_->live += 1;
      arena_live_.emplace(p, ArenaBlock{arena_.get(), begin, bytes, stream, false});
      planned_bytes_ += bytes;
      stats_.planned_hits += 1;
      stats_.arena_high_water = std::max(stats_.arena_high_water, end);
    }
  }
  phase_index_ += 1;
  return p != nullptr ? p : fallback_locked(bytes, stream);
}

void PlannedAllocator::note_peaks() {
  const FallbackStats f = fallback_.stats();
  // NOTE [One device pool], "What in use counts": a borrowed block is in neither planned_bytes_ nor f.
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, planned_bytes_ + borrowed_bytes_ + f.allocated_bytes);
  stats_.peak_device_reserved_bytes =
      std::max(stats_.peak_device_reserved_bytes, arena_reserved_bytes_ + f.reserved_bytes);
}

void* PlannedAllocator::allocate(std::size_t bytes, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  void* p = allocate_locked(bytes, stream);
  note_peaks();
  if (logging_) {
    const std::uint64_t id = next_id_++;
    log_ids_[p] = id;
    const bool own = std::this_thread::get_id() == phase_thread_ && suspended_ == 0;
    log_.push_back(TraceEvent{true, id, bytes, own ? current_phase_id_ : -1});
  }
  return p;
}

void PlannedAllocator::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    if (logging_) {
      auto it = log_ids_.find(ptr);
      if (it != log_ids_.end()) {
        log_.push_back(TraceEvent{false, it->second, 0, current_phase_id_});
        log_ids_.erase(it);
      }
    }
    auto it = arena_live_.find(ptr);
    if (it != arena_live_.end()) {
      const ArenaBlock block = it->second;
      arena_live_.erase(it);
      Arena* arena = block.arena;
      if (block.borrowed) {
        borrowed_bytes_ -= block.size;
        borrowed_blocks_ -= 1;
        arena->lent.erase(block.offset);
      } else {
        planned_bytes_ -= block.size;
        arena->live_ranges.erase(block.offset);
      }
      arena->live -= 1;
      stats_.frees += 1;
      if (arena->retired) {
        if (arena->live == 0) {
          auto owner = std::find_if(retired_.begin(), retired_.end(),
                                    [arena](const std::unique_ptr<Arena>& a) { return a.get() == arena; });
          std::unique_ptr<Arena> done = std::move(*owner);
          retired_.erase(owner);
          release_arena(std::move(done));
        }
      } else {
        if (poison_) backend_->fill(ptr, block.size, kPoisonByte);  // queued on the freeing stream
        // A retired arena is never handed out again, so only a current one keeps freed ranges.
        arena->freed.emplace(block.offset, FreedRange{block.offset + block.size, {block.stream, order_.tick()}});
      }
      return;
    }
    if (fallback_.free(ptr)) {
      stats_.frees += 1;
    } else {
      stats_.invalid_frees += 1;
    }
  } catch (...) {
    stats_.invalid_frees += 1;  // bookkeeping allocation failed; never throw from a deleter
  }
}

bool PlannedAllocator::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return arena_live_.count(const_cast<void*>(ptr)) != 0 || fallback_.owns(ptr);
}

std::pair<std::uintptr_t, std::size_t> PlannedAllocator::arena_extent() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (arena_ == nullptr) return {0, 0};
  return {reinterpret_cast<std::uintptr_t>(arena_->base.get()), arena_->bytes};
}

void PlannedAllocator::set_poison(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  poison_ = on;
  // Poison the idle arena too, so reads of never-written planned memory show up.
  if (on && arena_ != nullptr && arena_->live == 0) backend_->fill(arena_->base.get(), arena_->bytes, kPoisonByte);
}

void PlannedAllocator::set_fallback_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  fallback_.set_limit(bytes);
}

void PlannedAllocator::set_min_segment(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  fallback_.set_min_segment(bytes);
}

std::size_t PlannedAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  return fallback_.empty_cache();
}

void PlannedAllocator::start_logging() {
  std::lock_guard<std::mutex> lock(mutex_);
  logging_ = true;
  next_id_ = 0;
  log_.clear();
  log_ids_.clear();
  log_phase_names_.clear();
  log_phase_ids_.clear();
  current_phase_id_ = phase_id(phase_);
}

std::vector<TraceEvent> PlannedAllocator::stop_logging(std::vector<std::string>* phase_names) {
  std::lock_guard<std::mutex> lock(mutex_);
  logging_ = false;
  std::vector<TraceEvent> out;
  out.swap(log_);
  if (phase_names != nullptr) *phase_names = log_phase_names_;
  log_ids_.clear();
  log_phase_names_.clear();
  log_phase_ids_.clear();
  current_phase_id_ = -1;
  return out;
}

AllocatorStats PlannedAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  AllocatorStats s = stats_;
  s.fallback = fallback_.stats();
  s.bytes_in_use = planned_bytes_ + borrowed_bytes_ + s.fallback.allocated_bytes;
  s.borrowed_blocks = borrowed_blocks_;
  s.borrowed_bytes = borrowed_bytes_;
  s.device_reserved_bytes = arena_reserved_bytes_ + s.fallback.reserved_bytes;
  s.arena_bytes = arena_ == nullptr ? 0 : arena_->bytes;
  s.arena_in_use = arena_ == nullptr ? 0 : total_bytes(arena_->live_ranges) + total_bytes(arena_->lent);
  s.retired_arenas = retired_.size();
  s.streams = order_.stats();
  return s;
}

void PlannedAllocator::reset_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t reservations = stats_.arena_reservations;
  const std::uint64_t releases = stats_.arena_releases;
  stats_ = AllocatorStats{};
  stats_.arena_reservations = reservations;
  stats_.arena_releases = releases;
  const FallbackStats f = fallback_.stats();
  stats_.peak_bytes_in_use = planned_bytes_ + borrowed_bytes_ + f.allocated_bytes;
  stats_.peak_borrowed_bytes = borrowed_bytes_;
  stats_.peak_device_reserved_bytes = arena_reserved_bytes_ + f.reserved_bytes;
  deviation_reported_ = false;
  fallback_.reset_stats();
  order_.reset_stats();
}

bool PlannedAllocator::take_deviation_report(Deviation* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!stats_.has_deviation || deviation_reported_) return false;
  deviation_reported_ = true;
  if (out != nullptr) *out = stats_.first_deviation;
  return true;
}

}  // namespace memo::core
