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
  require(static_cast<i64>(rank.size()) == n,
          "rank must have one entry per item, got " + std::to_string(rank.size()) + " for " + std::to_string(n));
  require(!std::isnan(seconds), "the time left must be a number, got NaN");
  DsaOutcome out;
  if (n == 0) {
    out.found = true;
    return out;
  }
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

}  // namespace memo::core
