// One depth-first run of the exact DSA search in planner/search.py (see the
// NOTEs there: canonical skyline placements, maximal-clique sections, section
// bound, tight sections, closing a section). The Python side builds the
// sections and runs the restarts; this is only the per-node loop, which is
// where the time goes. Plain C++17, no torch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memo::core {

// The static part of an instance, as planner/search.py's _Sections builds it.
struct DsaInstance {
  std::vector<std::int64_t> size;            // per item
  std::vector<std::int64_t> first, last;     // per item: sections [first, last) it is alive in
  std::vector<std::int64_t> by_section;      // items alive in each section, grouped by section
  std::vector<std::int64_t> section_starts;  // per section, where its group starts in by_section
  std::vector<std::int64_t> demand;          // per section: total size alive there
  std::vector<std::int64_t> neighbour_starts;  // per item + 1: CSR over neighbour_items
  std::vector<std::int64_t> neighbour_items;   // items that overlap each item in time
  std::vector<std::int64_t> length;            // per item: its lifetime's length (end - start)
};

struct DsaOutcome {
  bool found = false;      // offsets holds a placement within the capacity
  bool exhausted = false;  // the run proved there is none
  std::int64_t nodes = 0;
  std::vector<std::int64_t> offsets;
};

class DsaSearch {
 public:
  // Throws std::invalid_argument when the arrays do not describe one instance.
  explicit DsaSearch(DsaInstance instance);

  // rank: per item, the order candidates are tried in (lower first).
  // seconds: time left for the run (infinite allowed); node_limit < 0: none.
  DsaOutcome run(std::int64_t capacity, const std::vector<std::int64_t>& rank, double seconds,
                 std::int64_t node_limit) const;

  // The same question answered by the offset-order search (NOTE [Offset-order search] in
  // planner/search.py): items placed one at a time at their lowest free offset, in increasing
  // (offset, rank) order, split into independent parts whenever no unplaced item joins them.
  // keys: how each part orders its items (biggest first, `rank` breaking ties), one letter a
  // key: 'T' the most unplaced demand in its sections, 'W' lifetime length, 'A' size x length,
  // 'C' sections spanned, 'Z' size; empty: `rank` alone.
  DsaOutcome run_by_offset(std::int64_t capacity, const std::vector<std::int64_t>& rank, double seconds,
                           std::int64_t node_limit, const std::string& keys = "") const;

  std::int64_t num_items() const { return static_cast<std::int64_t>(inst_.size.size()); }
  std::int64_t num_sections() const { return static_cast<std::int64_t>(inst_.demand.size()); }

 private:
  DsaInstance inst_;
};

}  // namespace memo::core
