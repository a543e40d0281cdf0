#include "core/dsa_search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace memo::core {

namespace {

using i64 = std::int64_t;
constexpr i64 kNever = std::numeric_limits<i64>::max();

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("memo.planner.search: " + what);
}

// The arguments both searches take: one rank per item, and a time that is a number.
// A run's arguments checked; true when there is nothing to place (``out`` is then the answer).
bool nothing_to_place(i64 n, const std::vector<i64>& rank, double seconds, DsaOutcome& out) {
  require(static_cast<i64>(rank.size()) == n,
          "rank must have one entry per item, got " + std::to_string(rank.size()) + " for " + std::to_string(n));
  require(!std::isnan(seconds), "the time left must be a number, got NaN");
  out.found = n == 0;
  return n == 0;
}

// What a node did below itself, so that undo can take it back.
enum class Change : std::uint8_t { kNone, kClose, kPlace };

struct Node {
  i64 section;
  i64 level;
  std::size_t cand_begin, cand_end;  // its candidates, in the shared candidate pool
  std::size_t pos = 0;               // the next candidate; one past the end means "close"
  Change change = Change::kNone;
  i64 item = -1;                 // the item placed, for kPlace
  std::size_t saved_begin = 0;   // its saved state, in the shared save pool, for kPlace
};

}  // namespace

DsaSearch::DsaSearch(DsaInstance instance) : inst_(std::move(instance)) {
  const std::size_t n = inst_.size.size();
  const std::size_t sections = inst_.demand.size();
  const std::size_t pairs = inst_.by_section.size();
  require(inst_.first.size() == n && inst_.last.size() == n,
          "size, first and last must have one entry per item, got " + std::to_string(n) + ", " +
              std::to_string(inst_.first.size()) + " and " + std::to_string(inst_.last.size()));
  require(inst_.section_starts.size() == sections,
          "section_starts and demand must have one entry per section, got " +
              std::to_string(inst_.section_starts.size()) + " and " + std::to_string(sections));
  require(inst_.neighbour_starts.size() == n + 1,
          "neighbour_starts must have items + 1 entries, got " + std::to_string(inst_.neighbour_starts.size()) +
              " for " + std::to_string(n) + " items");
  require(n == 0 || sections > 0, "an instance with items needs at least one section");
  require(inst_.length.size() == n, "length must have one entry per item, got " + std::to_string(inst_.length.size()) +
                                        " for " + std::to_string(n) + " items");
  for (std::size_t i = 0; i < n; ++i) {
    require(inst_.size[i] >= 0, "item " + std::to_string(i) + " has negative size");
    require(0 <= inst_.first[i] && inst_.first[i] < inst_.last[i] &&
                inst_.last[i] <= static_cast<i64>(sections),
            "item " + std::to_string(i) + " spans sections [" + std::to_string(inst_.first[i]) + ", " +
                std::to_string(inst_.last[i]) + "), not a non-empty range within " + std::to_string(sections));
  }
  // The loops below index with these without checks, so every one is checked here once.
  for (std::size_t s = 0; s < sections; ++s) {
    const i64 begin = inst_.section_starts[s];
    const i64 end = s + 1 < sections ? inst_.section_starts[s + 1] : static_cast<i64>(pairs);
    require(0 <= begin && begin < end && end <= static_cast<i64>(pairs),
            "section_starts must rise strictly from 0 within by_section (every section holds an item); "
            "section " + std::to_string(s) + " is [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
  }
  require(sections == 0 || inst_.section_starts[0] == 0, "section_starts must start at 0");
  for (std::size_t p = 0; p < pairs; ++p)
    require(0 <= inst_.by_section[p] && inst_.by_section[p] < static_cast<i64>(n),
            "by_section entry " + std::to_string(p) + " is not an item index");
  require(inst_.neighbour_starts.empty() || inst_.neighbour_starts[0] == 0, "neighbour_starts must start at 0");
  for (std::size_t i = 0; i < n; ++i)
    require(inst_.neighbour_starts[i] <= inst_.neighbour_starts[i + 1],
            "neighbour_starts must not decrease (item " + std::to_string(i) + ")");
  require(inst_.neighbour_starts[n] == static_cast<i64>(inst_.neighbour_items.size()),
          "neighbour_starts must end at the length of neighbour_items");
  for (std::size_t p = 0; p < inst_.neighbour_items.size(); ++p)
    require(0 <= inst_.neighbour_items[p] && inst_.neighbour_items[p] < static_cast<i64>(n),
            "neighbour_items entry " + std::to_string(p) + " is not an item index");
  inst_.section_starts.push_back(static_cast<i64>(pairs));  // one past the last section's group
}

DsaOutcome DsaSearch::run(i64 capacity, const std::vector<i64>& rank, double seconds, i64 node_limit) const {
  const i64 n = num_items();
  const i64 sections = num_sections();
  DsaOutcome out;
  if (nothing_to_place(n, rank, seconds, out)) return out;
  const auto& size = inst_.size;
  const auto& first = inst_.first;
  const auto& last = inst_.last;
  const auto& by_section = inst_.by_section;
  const auto& section_starts = inst_.section_starts;
  const auto& nb_starts = inst_.neighbour_starts;
  const auto& nb_items = inst_.neighbour_items;
  if (*std::max_element(size.begin(), size.end()) > capacity ||
      *std::max_element(inst_.demand.begin(), inst_.demand.end()) > capacity) {
    out.exhausted = true;
    return out;
  }

  // The items alive in each section in rank order: the order candidates are tried in.
  // Stable, so equal ranks keep item order, as numpy's lexsort does.
  std::vector<i64> covering(by_section);
  for (i64 s = 0; s < sections; ++s)
    std::stable_sort(covering.begin() + section_starts[s], covering.begin() + section_starts[s + 1],
                     [&rank](i64 a, i64 b) { return rank[a] < rank[b]; });

  // A deadline past what steady_clock can hold (or infinite) is no deadline at all.
  using Clock = std::chrono::steady_clock;
  const bool timed = seconds < 1e9;
  const Clock::time_point deadline =
      timed ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds))
            : Clock::time_point::max();

  std::vector<i64> demand(inst_.demand);
  std::vector<i64> skyline(sections, 0);
  std::vector<i64> closed(sections, 0);  // 1: no item rests right on this skyline
  std::vector<i64> lowest(n, 0);         // each item's lowest offset: the highest skyline it spans
  std::vector<char> unplaced(n, 1);
  std::vector<i64> offsets(n, 0);
  // Per section, the lowest offset its unplaced items can take (NOTE [Tight sections]), kept
  // exact without rescanning every section at every node, which cost ~90% of the run:
  // * a placement only raises values or drops items, so a section's minimum can move only
  //   when an item that held it changed: those sections are marked and rescanned before the
  //   next bound check;
  // * an undo only lowers values or brings items back, so min() with them is exact.
  // Everything starts at 0 with every item unplaced, and every section holds an item.
  std::vector<i64> rest_on(sections, 0);
  std::vector<char> is_dirty(sections, 0);
  std::vector<i64> dirty;
  auto mark_held = [&](i64 item, i64 old_low) {
    for (i64 s = first[item]; s < last[item]; ++s)
      if (rest_on[s] == old_low && !is_dirty[s]) {
        is_dirty[s] = 1;
        dirty.push_back(s);
      }
  };
  auto lower_to = [&](i64 item, i64 low) {
    for (i64 s = first[item]; s < last[item]; ++s) rest_on[s] = std::min(rest_on[s], low);
  };

  std::vector<Node> stack;
  std::vector<i64> cand_pool;
  std::vector<i64> save_pool;
  i64 nodes = 0;
  bool stopped = false;

  // Opens a node at the current state: false when the branch is dead.
  auto open_node = [&]() -> bool {
    ++nodes;
    if ((nodes & 127) == 0 && ((timed && Clock::now() > deadline) || (node_limit >= 0 && nodes > node_limit))) {
      stopped = true;
      return false;
    }
    i64 k = -1, level = kNever;
    for (i64 s = 0; s < sections; ++s)
      if (closed[s] == 0 && demand[s] > 0 && skyline[s] < level) {
        level = skyline[s];
        k = s;
      }
    // Before any return: undo relies on rest_on being exact for the state it takes back.
    for (const i64 s : dirty) {
      i64 low = kNever;
      for (i64 p = section_starts[s]; p < section_starts[s + 1]; ++p) {
        const i64 i = by_section[p];
        if (unplaced[i] && lowest[i] < low) low = lowest[i];
      }
      rest_on[s] = low;
      is_dirty[s] = 0;
    }
    dirty.clear();
    if (k < 0) return false;  // every section left is closed: nothing can rest on a skyline any more
    // NOTE [Section bound]: what is still to come in a section is stacked above its floor and
    // above the lowest offset any of those items can still take (NOTE [Tight sections]).
    for (i64 s = 0; s < sections; ++s) {
      i64 floor = std::max(skyline[s] + closed[s], level);
      if (demand[s] > 0) floor = std::max(floor, rest_on[s]);
      if (floor + demand[s] > capacity) return false;
    }
    Node node;
    node.section = k;
    node.level = level;
    node.cand_begin = cand_pool.size();
    for (i64 p = section_starts[k]; p < section_starts[k + 1]; ++p) {
      const i64 i = covering[p];
      if (unplaced[i] && lowest[i] == level && size[i] <= capacity - level) cand_pool.push_back(i);
    }
    node.cand_end = cand_pool.size();
    stack.push_back(node);
    return true;
  };

  // Takes back the change `node` made below itself; true if that was a placement.
  auto undo = [&](Node& node) -> bool {
    const Change change = node.change;
    node.change = Change::kNone;
    if (change == Change::kNone) return false;
    if (change == Change::kClose) {
      closed[node.section] = 0;
      return false;
    }
    const i64 b = node.item;
    const i64 lo = first[b], hi = last[b];
    std::size_t at = node.saved_begin;
    for (i64 s = lo; s < hi; ++s) skyline[s] = save_pool[at++];
    for (i64 s = lo; s < hi; ++s) closed[s] = save_pool[at++];
    for (i64 p = nb_starts[b]; p < nb_starts[b + 1]; ++p) {
      const i64 j = nb_items[p];
      const i64 low = save_pool[at++];
      if (unplaced[j] && low < lowest[j]) lower_to(j, low);
      lowest[j] = low;
    }
    save_pool.resize(node.saved_begin);
    for (i64 s = lo; s < hi; ++s) demand[s] += size[b];
    unplaced[b] = 1;
    lower_to(b, lowest[b]);
    return true;
  };

  // An explicit stack: a path is up to (items + sections) nodes deep.
  i64 placed = 0;
  open_node();
  while (!stack.empty() && !stopped) {
    Node& node = stack.back();
    placed -= undo(node);
    const std::size_t pos = node.pos++;
    const std::size_t count = node.cand_end - node.cand_begin;
    if (pos < count) {
      const i64 b = cand_pool[node.cand_begin + pos];
      const i64 top = node.level + size[b];
      const i64 lo = first[b], hi = last[b];
      node.change = Change::kPlace;
      node.item = b;
      node.saved_begin = save_pool.size();
      for (i64 s = lo; s < hi; ++s) save_pool.push_back(skyline[s]);
      for (i64 s = lo; s < hi; ++s) save_pool.push_back(closed[s]);
      for (i64 p = nb_starts[b]; p < nb_starts[b + 1]; ++p) save_pool.push_back(lowest[nb_items[p]]);
      for (i64 s = lo; s < hi; ++s) {
        skyline[s] = top;
        closed[s] = 0;
        demand[s] -= size[b];
      }
      unplaced[b] = 0;
      mark_held(b, lowest[b]);
      for (i64 p = nb_starts[b]; p < nb_starts[b + 1]; ++p) {
        const i64 j = nb_items[p];
        if (lowest[j] < top) {
          if (unplaced[j]) mark_held(j, lowest[j]);
          lowest[j] = top;
        }
      }
      offsets[b] = node.level;
      if (++placed == n) {
        out.found = true;
        out.nodes = nodes;
        out.offsets = std::move(offsets);
        return out;
      }
    } else if (pos == count) {
      node.change = Change::kClose;
      closed[node.section] = 1;
    } else {
      cand_pool.resize(node.cand_begin);
      stack.pop_back();
      continue;
    }
    open_node();  // may grow the stack: `node` is not used past here
  }
  out.exhausted = !stopped;
  out.nodes = nodes;
  return out;
}

namespace {

// One offset-order run (NOTE [Offset-order search] in planner/search.py). Recursive: a path is
// at most one frame per item, and every frame keeps its own candidate list.
class OffsetOrderRun {
 public:
  enum class Status : std::uint8_t { kFound, kNone, kStopped };

  OffsetOrderRun(const DsaInstance& inst, i64 capacity, const std::vector<i64>& rank, double seconds,
                 i64 node_limit, std::string keys)
      : inst_(inst), capacity_(capacity), tiebreak_(rank), rank_(rank), keys_(std::move(keys)),
        node_limit_(node_limit) {
    const i64 n = static_cast<i64>(inst.size.size());
    const i64 sections = static_cast<i64>(inst.demand.size());
    timed_ = seconds < 1e9;
    if (timed_)
      deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    off_.assign(n, -1);
    solution_.assign(n, 0);
    lowest_.assign(n, 0);
    floor_.assign(sections, 0);
    total_.assign(inst.demand.begin(), inst.demand.end());
    stamp_.assign(sections, 0);
    part_of_.assign(sections, 0);
    least_.assign(sections, 0);
    // cuts_[s]: unplaced items alive in both section s and section s + 1.
    cuts_.assign(sections > 0 ? sections - 1 : 0, 0);
    for (i64 i = 0; i < n; ++i)
      for (i64 s = inst.first[i]; s + 1 < inst.last[i]; ++s) ++cuts_[s];
  }

  // Solves every independent part of the whole instance.
  Status solve() {
    const i64 sections = static_cast<i64>(floor_.size());
    std::vector<i64> all(off_.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<i64>(i);
    return solve_parts(all, 0, sections, [&](i64 s) { return cuts_[s] == 0; });
  }

  std::int64_t nodes() const { return nodes_; }
  std::vector<i64>& solution() { return solution_; }

 private:
  using Clock = std::chrono::steady_clock;

  // Splits sections [lo, hi) where `cut(s)` says no unplaced item joins s and s + 1, and solves
  // each part on its own: the parts share no unplaced item, so each either fits or the node fails.
  template <typename Cut>
  Status solve_parts(const std::vector<i64>& items, i64 lo, i64 hi, Cut cut) {
    // part_of_[s]: the index of the part section s falls in; every unplaced item lies in one.
    std::vector<i64> begins;
    for (i64 s = lo; s < hi; ++s) {
      if (s == lo || cut(s - 1)) begins.push_back(s);
      part_of_[s] = static_cast<i64>(begins.size()) - 1;
    }
    std::vector<std::vector<i64>> parts(begins.size());
    for (const i64 i : items)
      if (off_[i] < 0) parts[part_of_[std::max(lo, inst_.first[i])]].push_back(i);
    for (std::size_t k = 0; k < parts.size(); ++k) {
      if (parts[k].empty()) continue;
      const i64 end = k + 1 < begins.size() ? begins[k + 1] : hi;
      std::vector<i64> saved;
      saved.reserve(parts[k].size());
      for (const i64 i : parts[k]) saved.push_back(rank_[i]);
      rank_part(parts[k]);
      const Status st = search(parts[k], begins[k], end, -1, -1);
      for (std::size_t q = 0; q < parts[k].size(); ++q) rank_[parts[k][q]] = saved[q];
      if (st != Status::kFound) return st;
    }
    return Status::kFound;
  }

  // Orders a new part by keys_ on what is left now (a part's demand is what its items still need).
  void rank_part(const std::vector<i64>& part) {
    if (keys_.empty()) return;
    const i64 m = static_cast<i64>(part.size());
    std::vector<i64> key(m * static_cast<i64>(keys_.size()));
    for (i64 q = 0; q < m; ++q) {
      const i64 i = part[q];
      for (std::size_t c = 0; c < keys_.size(); ++c) {
        i64 v = 0;
        switch (keys_[c]) {
          case 'T':
            for (i64 s = inst_.first[i]; s < inst_.last[i]; ++s) v = std::max(v, total_[s]);
            break;
          case 'W': v = inst_.length[i]; break;
          case 'C': v = inst_.last[i] - inst_.first[i]; break;
          case 'A': v = inst_.size[i] * inst_.length[i]; break;
          default: v = inst_.size[i]; break;  // 'Z'
        }
        key[q * keys_.size() + c] = v;
      }
    }
    std::vector<i64> at(m);
    for (i64 q = 0; q < m; ++q) at[q] = q;
    const std::size_t width = keys_.size();
    std::sort(at.begin(), at.end(), [&](i64 a, i64 b) {
      for (std::size_t c = 0; c < width; ++c)
        if (key[a * width + c] != key[b * width + c]) return key[a * width + c] > key[b * width + c];
      return tiebreak_[part[a]] < tiebreak_[part[b]];
    });
    for (i64 q = 0; q < m; ++q) rank_[part[at[q]]] = q;
  }

  Status search(const std::vector<i64>& items, i64 lo, i64 hi, i64 min_off, i64 min_rank) {
    ++nodes_;
    if ((nodes_ & 63) == 0 &&
        ((timed_ && Clock::now() > deadline_) || (node_limit_ >= 0 && nodes_ > node_limit_)))
      stopped_ = true;
    if (stopped_) return Status::kStopped;
    // The unplaced items of this part, lowest offset first, rank breaking ties.
    std::vector<i64> order;
    order.reserve(items.size());
    for (const i64 i : items)
      if (off_[i] < 0) order.push_back(i);
    if (order.empty()) return Status::kFound;
    std::sort(order.begin(), order.end(), [this](i64 a, i64 b) {
      return lowest_[a] != lowest_[b] ? lowest_[a] < lowest_[b] : rank_[a] < rank_[b];
    });
    // NOTE [Offset-order search], dominance: no item may start at or above the top of an
    // unplaced item sitting at its own lowest offset (that one could drop into the gap).
    i64 min_top = kNever;
    for (const i64 i : order) min_top = std::min(min_top, lowest_[i] + inst_.size[i]);
    for (const i64 b : order) {
      const i64 o = lowest_[b];
      if (o < min_off || (o == min_off && rank_[b] < min_rank)) continue;  // not in canonical order
      if (o >= min_top) break;  // sorted by offset: every later candidate is dominated too
      if (o + inst_.size[b] > capacity_) continue;
      bool hatless = true;
      const Status st = place_and_search(b, order, lo, hi, hatless);
      if (st == Status::kFound) {
        solution_[b] = o;
        return st;
      }
      if (st == Status::kStopped) return st;
      // Nothing unplaced meets b: placing another item first cannot help (b fits there anyway).
      if (hatless) break;
    }
    return Status::kNone;
  }

  Status place_and_search(i64 b, const std::vector<i64>& order, i64 lo, i64 hi, bool& hatless) {
    const auto& size = inst_.size;
    const auto& first = inst_.first;
    const auto& last = inst_.last;
    const i64 o = lowest_[b];
    const i64 top = o + size[b];
    off_[b] = o;
    const std::size_t lowest_mark = lowest_log_.size();
    const std::size_t floor_mark = floor_log_.size();
    const std::size_t min_mark = min_log_.size();
    // least_[s], the lowest offset an unplaced item of s can take, only rises on a placement,
    // and only where an item that held it left or rose: those sections are rescanned.
    ++epoch_;
    dirty_.clear();
    auto held = [&](i64 item) {
      for (i64 s = first[item]; s < last[item]; ++s)
        if (least_[s] == lowest_[item] && stamp_[s] != epoch_) {
          stamp_[s] = epoch_;
          dirty_.push_back(s);
        }
    };
    held(b);
    for (i64 p = inst_.neighbour_starts[b]; p < inst_.neighbour_starts[b + 1]; ++p) {
      const i64 j = inst_.neighbour_items[p];
      if (off_[j] >= 0) continue;
      hatless = false;
      if (lowest_[j] >= top) continue;
      held(j);
      lowest_log_.emplace_back(j, lowest_[j]);
      lowest_[j] = top;
    }
    for (i64 s = first[b]; s < last[b]; ++s) {
      floor_log_.emplace_back(s, floor_[s]);
      floor_[s] = top;  // items go in increasing offset: b is the highest one placed in s
      total_[s] -= size[b];
    }
    for (const i64 s : dirty_) {
      i64 low = kNever;
      for (i64 q = inst_.section_starts[s]; q < inst_.section_starts[s + 1]; ++q) {
        const i64 i = inst_.by_section[q];
        if (off_[i] < 0) low = std::min(low, lowest_[i]);
      }
      min_log_.emplace_back(s, least_[s]);
      least_[s] = low;
    }
    // NOTE [Section bound]: what a section still holds is stacked above its floor and above o.
    bool ok = true;
    for (i64 s = lo; s < hi && ok; ++s)
      if (total_[s] > 0 && std::max({o, floor_[s], least_[s]}) + total_[s] > capacity_) ok = false;
    Status st = Status::kNone;
    if (ok) {
      bool split = false;
      for (i64 s = first[b]; s + 1 < last[b]; ++s)
        if (--cuts_[s] == 0 && lo <= s && s + 1 < hi) split = true;
      if (split) {
        st = solve_parts(order, lo, hi, [&](i64 s) { return cuts_[s] == 0; });
      } else {
        st = search(order, lo, hi, o, rank_[b]);
      }
      for (i64 s = first[b]; s + 1 < last[b]; ++s) ++cuts_[s];
    }
    for (std::size_t k = floor_log_.size(); k > floor_mark; --k) floor_[floor_log_[k - 1].first] = floor_log_[k - 1].second;
    floor_log_.resize(floor_mark);
    for (i64 s = first[b]; s < last[b]; ++s) total_[s] += size[b];
    for (std::size_t k = min_log_.size(); k > min_mark; --k) least_[min_log_[k - 1].first] = min_log_[k - 1].second;
    min_log_.resize(min_mark);
    for (std::size_t k = lowest_log_.size(); k > lowest_mark; --k)
      lowest_[lowest_log_[k - 1].first] = lowest_log_[k - 1].second;
    lowest_log_.resize(lowest_mark);
    off_[b] = -1;
    return st;
  }

  const DsaInstance& inst_;
  const i64 capacity_;
  const std::vector<i64>& tiebreak_;
  std::vector<i64> rank_;  // per item: its place in its part's order (NOTE [Offset-order search])
  const std::string keys_;
  const i64 node_limit_;
  bool timed_ = false;
  Clock::time_point deadline_;
  bool stopped_ = false;
  i64 nodes_ = 0;
  std::vector<i64> off_, solution_, lowest_, floor_, total_, cuts_, part_of_;
  std::vector<std::uint64_t> stamp_;
  std::uint64_t epoch_ = 0;
  std::vector<std::pair<i64, i64>> lowest_log_, floor_log_, min_log_;
  std::vector<i64> least_, dirty_;  // per section: lowest offset its unplaced items can take
};

}  // namespace

DsaOutcome DsaSearch::run_by_offset(i64 capacity, const std::vector<i64>& rank, double seconds,
                                    i64 node_limit, const std::string& keys) const {
  const i64 n = num_items();
  DsaOutcome out;
  if (nothing_to_place(n, rank, seconds, out)) return out;
  if (*std::max_element(inst_.size.begin(), inst_.size.end()) > capacity ||
      *std::max_element(inst_.demand.begin(), inst_.demand.end()) > capacity) {
    out.exhausted = true;
    return out;
  }
  require(keys.find_first_not_of("TWACZ") == std::string::npos,
          "keys must be letters of TWACZ (demand, width, area, sections, size), got '" + keys + "'");
  OffsetOrderRun run(inst_, capacity, rank, seconds, node_limit, keys);
  const OffsetOrderRun::Status st = run.solve();
  out.nodes = run.nodes();
  out.found = st == OffsetOrderRun::Status::kFound;
  out.exhausted = st == OffsetOrderRun::Status::kNone;
  if (out.found) out.offsets = std::move(run.solution());
  return out;
}

}  // namespace memo::core
