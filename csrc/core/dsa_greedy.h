// The planner's greedy placement and placement check, native (memo._planner_native).
//
// NOTE [Greedy over an interval structure]
// The greedy places items one by one, each at the bottom of the tightest free gap among the
// placed items its lifetime overlaps (best fit; the open top when no gap holds it). Finding
// those items by comparing with every placed one is quadratic: 120,000 allocations took 6 s
// per ordering in numpy, far past a `memo plan --time-limit` of a few seconds. Here time is cut
// into buckets, each placed item is listed in the buckets its lifetime covers, and a query
// reads only the buckets of its own lifetime (an item seen twice is skipped by a stamp). Items
// that span many buckets (the few long-lived skeletal tensors) are kept in one list instead,
// read by every query: a query costs the short items near it plus the long ones. The rule,
// ties included, is planner/dsa.py's `_tightest_gap`, so both give the same offsets.
// The check sweeps items by start with the live ones ordered by offset: live items never
// overlap in memory (else the check has stopped), so a new item can only clash with its
// neighbours in that order.
#pragma once

#include <cstdint>
#include <vector>

namespace memo::core {

struct GreedyPlacement {
  std::vector<std::int64_t> offsets;  // per item; -1 for those not placed (complete == false)
  std::int64_t peak = 0;
  bool complete = true;  // false: the deadline came first (only when may_stop)
};

// Places the items in `order` (a permutation of 0..n-1). With may_stop, returns unfinished
// once `seconds` have passed.
GreedyPlacement greedy_place(const std::vector<std::int64_t>& size, const std::vector<std::int64_t>& start,
                             const std::vector<std::int64_t>& end, const std::vector<std::int64_t>& order,
                             double seconds, bool may_stop);

// The first pair of items that overlap in time and in memory, (-1, -1) when none do.
std::pair<std::int64_t, std::int64_t> first_clash(const std::vector<std::int64_t>& size,
                                                  const std::vector<std::int64_t>& start,
                                                  const std::vector<std::int64_t>& end,
                                                  const std::vector<std::int64_t>& offset);

}  // namespace memo::core
