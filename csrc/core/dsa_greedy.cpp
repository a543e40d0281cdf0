// NOTE [Greedy over an interval structure] in dsa_greedy.h.
#include "core/dsa_greedy.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <queue>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

namespace memo::core {

namespace {

// An item spanning more buckets than this is a "long" one: listed once, read by every query.
constexpr std::int64_t kLongSpan = 32;

void check_sizes(const std::vector<std::int64_t>& size, const std::vector<std::int64_t>& start,
                 const std::vector<std::int64_t>& end) {
  if (start.size() != size.size() || end.size() != size.size())
    throw std::invalid_argument("memo.planner: size, start and end must have one entry per item");
  for (std::size_t i = 0; i < size.size(); ++i)
    if (size[i] < 0 || end[i] <= start[i] || start[i] < 0)
      throw std::invalid_argument("memo.planner: item " + std::to_string(i) +
                                  " needs size >= 0 and 0 <= start < end");
}

}  // namespace

GreedyPlacement greedy_place(const std::vector<std::int64_t>& size, const std::vector<std::int64_t>& start,
                             const std::vector<std::int64_t>& end, const std::vector<std::int64_t>& order,
                             double seconds, bool may_stop) {
  check_sizes(size, start, end);
  const std::int64_t n = static_cast<std::int64_t>(size.size());
  if (static_cast<std::int64_t>(order.size()) != n)
    throw std::invalid_argument("memo.planner: the order must list every item once");
  GreedyPlacement out;
  out.offsets.assign(n, -1);
  if (n == 0) return out;
  const std::int64_t horizon = *std::max_element(end.begin(), end.end());
  const std::int64_t n_buckets = std::max<std::int64_t>(1, std::min<std::int64_t>(horizon, n / 4 + 1));
  const std::int64_t width = (horizon + n_buckets - 1) / n_buckets;
  std::vector<std::vector<std::int32_t>> buckets(n_buckets);
  std::vector<std::int32_t> long_items;
  std::vector<std::int64_t> stamp(n, -1);
  std::vector<char> seen(n, 0);
  std::vector<std::pair<std::int64_t, std::int64_t>> busy;  // occupied [lo, hi) of the overlapping items
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t i = order[k];
    if (i < 0 || i >= n || seen[i]) throw std::invalid_argument("memo.planner: the order must list every item once");
    seen[i] = 1;
    if (may_stop && (k & 1023) == 0 && k > 0) {
      const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (spent > seconds) {
        out.complete = false;
        return out;
      }
    }
    busy.clear();
    auto consider = [&](std::int32_t j) {
      if (stamp[j] == i) return;
      stamp[j] = i;
      if (start[j] < end[i] && start[i] < end[j]) busy.emplace_back(out.offsets[j], out.offsets[j] + size[j]);
    };
    const std::int64_t b0 = start[i] / width, b1 = (end[i] - 1) / width;
    for (std::int64_t b = b0; b <= b1; ++b)
      for (std::int32_t j : buckets[b]) consider(j);
    for (std::int32_t j : long_items) consider(j);
    // Best fit, as planner/dsa.py's _tightest_gap: gaps between the intervals sorted by their
    // bottom, each from the top of everything below it; the narrowest that holds the item, the
    // lowest of equals; the open top (width "infinite") when none does.
    std::sort(busy.begin(), busy.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::int64_t best = -1, best_width = std::numeric_limits<std::int64_t>::max();
    std::int64_t top = 0;
    for (const auto& [lo, hi] : busy) {
      const std::int64_t w = lo - top;
      if (w >= size[i] && w < best_width) {
        best = top;
        best_width = w;
      }
      top = std::max(top, hi);
    }
    if (best < 0) best = top;
    out.offsets[i] = best;
    out.peak = std::max(out.peak, best + size[i]);
    if (b1 - b0 >= kLongSpan) {
      long_items.push_back(static_cast<std::int32_t>(i));
    } else {
      for (std::int64_t b = b0; b <= b1; ++b) buckets[b].push_back(static_cast<std::int32_t>(i));
    }
  }
  return out;
}

std::pair<std::int64_t, std::int64_t> first_clash(const std::vector<std::int64_t>& size,
                                                  const std::vector<std::int64_t>& start,
                                                  const std::vector<std::int64_t>& end,
                                                  const std::vector<std::int64_t>& offset) {
  check_sizes(size, start, end);
  const std::int64_t n = static_cast<std::int64_t>(size.size());
  if (static_cast<std::int64_t>(offset.size()) != n)
    throw std::invalid_argument("memo.planner: one offset per item");
  std::vector<std::int64_t> by_start(n);
  for (std::int64_t i = 0; i < n; ++i) by_start[i] = i;
  std::stable_sort(by_start.begin(), by_start.end(), [&](std::int64_t a, std::int64_t b) { return start[a] < start[b]; });
  // Live items by (offset, item); empty ones take no bytes and never clash.
  std::set<std::pair<std::int64_t, std::int64_t>> live;
  using Expiry = std::pair<std::int64_t, std::int64_t>;  // (end, item)
  std::priority_queue<Expiry, std::vector<Expiry>, std::greater<Expiry>> expiring;
  for (std::int64_t i : by_start) {
    while (!expiring.empty() && expiring.top().first <= start[i]) {
      live.erase({offset[expiring.top().second], expiring.top().second});
      expiring.pop();
    }
    if (size[i] == 0) continue;
    auto next = live.lower_bound({offset[i], -1});
    if (next != live.end() && next->first < offset[i] + size[i]) return {next->second, i};
    if (next != live.begin()) {
      auto prev = std::prev(next);
      if (prev->first + size[prev->second] > offset[i]) return {prev->second, i};
    }
    live.insert({offset[i], i});
    expiring.push({end[i], i});
  }
  return {-1, -1};
}

}  // namespace memo::core
