// One depth-first run of the exact DSA search in planner/search.py (see the
// NOTEs there: canonical skyline placements, maximal-clique sections, section
// bound, tight sections, closing a section). The Python side builds the
// sections and runs the restarts; this is only the per-node loop, which is
// where the time goes. Plain C++17, no torch.
#pragma once

#include <cstdint>
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

  std::int64_t num_items() const { return static_cast<std::int64_t>(inst_.size.size()); }
  std::int64_t num_sections() const { return static_cast<std::int64_t>(inst_.demand.size()); }

 private:
  DsaInstance inst_;
};

}  // namespace memo::core
