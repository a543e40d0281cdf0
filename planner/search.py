"""Exact DSA search over canonical placements: is there a placement with peak <= C?

NOTE [Canonical placements]
Any placement can be pushed down until every item rests on an item below it
that it overlaps in time, or on 0, without raising the peak. So it is enough
to search placements built bottom-up on a *skyline*: cut time into sections
(NOTE [Sections are maximal cliques]); the skyline of a section is the top of what has been
placed there. Take the lowest section (leftmost among equals) that still has
items to hold. Either one of the items alive there rests right on it (the
items whose whole lifetime sees a skyline no higher: they sit exactly on this
level), or nothing does and the section is *closed*: the item that ends up
above it rests on something higher elsewhere in its lifetime. Trying each
candidate, then closing, visits every canonical placement, so the search
finds a placement within C whenever one exists. (MiniMalloc, Moffitt, ASPLOS
2023, solves DSA with a search over canonical solutions too.)

NOTE [Section bound]
The level of the section being filled never goes down, and every item placed
from now on sits at that level or higher. The items still to place in one
section are stacked on each other above max(skyline, level) (above the
skyline plus one unit when the section is closed). So that height plus the
unplaced units alive in the section must stay <= C, or the branch is dead.

NOTE [Tight sections]
The items still to come in a section are also stacked above the lowest
offset any of them can still take (the highest skyline over its lifetime).
Where a section has no slack left, that leaves no room for a gap: some item
alive there must be able to rest right on its skyline, or the branch is
dead. On packings with no slack at all (the optimum equals the lower
bound), the two bounds leave little to guess, which is what makes the hard
instances, where greedy ends 30-50% above the lower bound, solvable in well
under a second.

NOTE [Restarts]
A depth-first search that takes a wrong turn near the root can spend
minutes below it. :func:`search` runs it in short runs whose node limits
follow the Luby sequence (1, 1, 2, 1, 1, 2, 4, ... times a base), each after
the first with a randomly perturbed "biggest first" order: the usual cure
for such heavy tails. Only a run that finishes within its limit proves that
no placement fits.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memo import _C

from .dsa import DSAResult, Item, lower_bound, overlapping_pairs

__all__ = ["count_overlapping_pairs", "fits", "search"]

#: Nodes per unit of the Luby sequence that limits each run (NOTE [Restarts]).
LUBY_UNIT_NODES = 1000


@dataclass
class Outcome:
    """What one run of :func:`fits` found."""

    offsets: list[int] | None  # a placement within the capacity, or None
    exhausted: bool  # True when the run proved there is none
    nodes: int


class _Sections:
    """The static part of an instance: items cut into time sections, and who overlaps whom."""

    def __init__(self, items: Sequence[Item]) -> None:
        n = len(items)
        self.n = n
        self.size = np.fromiter((it.size for it in items), dtype=np.int64, count=n)
        # NOTE [Sections are maximal cliques]: only which lifetimes overlap matters, not when. The
        # items alive at one start form a clique; it is maximal when something ends before the
        # next start, otherwise the next start's clique holds it all. Sections are those maximal
        # cliques, in time order; every item spans a run of them, and two items overlap exactly
        # when they share one. So the same instance gets the same sections however its events
        # are timed (a free and a malloc at one instant, or a trace's one event per step), and
        # no section holds less than a neighbour it could hide slack in.
        start = np.fromiter((it.start for it in items), dtype=np.int64, count=n)
        end = np.fromiter((it.end for it in items), dtype=np.int64, count=n)
        starts = np.unique(start)
        ends = np.sort(end)
        ended_by = np.searchsorted(ends, starts, side="right")  # items ended at or before each start
        maximal = np.append(ended_by[1:] > ended_by[:-1], True)
        sections = starts[maximal]
        self.first = np.searchsorted(sections, start, side="left").astype(np.int64)
        self.last = np.searchsorted(sections, end, side="left").astype(np.int64)
        self.n_sections = len(sections)
        lengths = self.last - self.first
        # (item, section) incidence: one entry per section each item is alive in.
        self.pair_item = np.repeat(np.arange(n), lengths)
        offsets_in_item = np.arange(len(self.pair_item)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        self.pair_section = self.first[self.pair_item] + offsets_in_item
        # The same incidence grouped by section: the native run scans a section's items from it.
        order = np.argsort(self.pair_section, kind="stable")
        self.by_section = self.pair_item[order]
        self.section_starts = np.searchsorted(self.pair_section[order], np.arange(self.n_sections))
        self.demand = np.bincount(self.pair_section, weights=self.size[self.pair_item],
                                  minlength=self.n_sections).astype(np.int64)
        neighbours: list[list[int]] = [[] for _ in range(n)]
        for i, j in overlapping_pairs(items):
            neighbours[i].append(j)
            neighbours[j].append(i)
        neighbour_starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(nb) for nb in neighbours], out=neighbour_starts[1:])
        neighbour_items = np.fromiter((j for nb in neighbours for j in nb), dtype=np.int64,
                                      count=int(neighbour_starts[-1]))
        # The run's state is all in the native object; these arrays are copied into it once.
        self.native = _C.planner.DsaSearch(self.size, self.first, self.last, self.by_section,
                                           self.section_starts, self.demand, neighbour_starts,
                                           neighbour_items)


def _run(sec: _Sections, capacity: int, rank: np.ndarray, deadline: float, node_limit: int | None
         ) -> Outcome:
    """One depth-first run (NOTE [Canonical placements]) with candidates tried in ``rank`` order."""
    # The per-node loop is memo._C's (csrc/core/dsa_search.cpp): in numpy every node paid for
    # whole-array passes and Python dispatch, about 30k nodes/s, and the restarts need many nodes.
    offsets, exhausted, nodes = sec.native.run(capacity, rank, deadline - time.perf_counter(), node_limit)
    return Outcome(offsets, exhausted, nodes)


def count_overlapping_pairs(items: Sequence[Item]) -> int:
    """How many pairs of items overlap in time, without listing them (O(n log n))."""
    if not items:
        return 0
    start = np.fromiter((it.start for it in items), dtype=np.int64, count=len(items))
    end = np.fromiter((it.end for it in items), dtype=np.int64, count=len(items))
    # j overlaps i when start_j < end_i and end_j > start_i; the second count removes the j
    # that ended by start_i (all of which also started before end_i), and i itself is counted once.
    alive = (np.searchsorted(np.sort(start), end, side="left")
             - np.searchsorted(np.sort(end), start, side="right") - 1)
    return int(alive.sum()) // 2


def _luby(i: int) -> int:
    """The i-th term (from 1) of the Luby sequence 1, 1, 2, 1, 1, 2, 4, 1, 1, 2, 1, 1, 2, 4, 8, ..."""
    k = 1
    while (1 << k) - 1 < i:
        k += 1
    while (1 << k) - 1 != i:
        i -= (1 << (k - 1)) - 1
        k = 1
        while (1 << k) - 1 < i:
            k += 1
    return 1 << (k - 1)


def _biggest_first(sec: _Sections, rng: random.Random | None) -> np.ndarray:
    """Rank of each item in "biggest first" order; with ``rng``, each size is first multiplied by a
    random factor (log-normal, sigma 0.6: restarts need orders that differ well before the leaves)."""
    key = sec.size.astype(np.float64)
    if rng is not None:
        key = key * np.exp(np.array([rng.gauss(0.0, 0.6) for _ in range(sec.n)]))
    rank = np.empty(sec.n, dtype=np.int64)
    rank[np.lexsort((sec.first, -key))] = np.arange(sec.n)
    return rank


def _require_lifetimes(items: Sequence[Item]) -> None:
    # Sections are built from starts (NOTE [Sections are maximal cliques]): an item that lives
    # for no time would span none of them. Traces never make one (a malloc and its free are
    # two events), so this is a caller's mistake, not a case to plan around.
    bad = next((i for i, it in enumerate(items) if it.end <= it.start), None)
    if bad is not None:
        raise ValueError(f"memo.planner.search: item {bad} {items[bad]} ends before it starts; "
                         "every lifetime [start, end) must have start < end")


def fits(items: Sequence[Item], capacity: int, *, deadline: float, node_limit: int | None = None,
         seed: int | None = None) -> Outcome:
    """Search for a placement of ``items`` with peak <= ``capacity`` (one depth-first run).

    Args:
        deadline: a ``time.perf_counter()`` value; the run stops there.
        node_limit: stop after this many nodes (None: no limit).
        seed: None tries candidates biggest first; an integer perturbs that order at random.

    Returns the placement; or None with ``exhausted`` True when none exists, False when the
    deadline or the node limit stopped the run first.
    """
    _require_lifetimes(items)
    sec = _Sections(items)
    rng = None if seed is None else random.Random(seed)
    return _run(sec, capacity, _biggest_first(sec, rng), deadline, node_limit)


def search(items: Sequence[Item], warm: DSAResult, *, time_limit: float, seed: int = 0) -> DSAResult:
    """Smallest peak the canonical search finds between the lower bound and ``warm``'s peak.

    Tries the lower bound first (on the instances where it matters the optimum is there),
    then bisects between the largest capacity proven infeasible and the best placement.
    Each capacity gets half the time left (all of it for the last candidate), in restarts
    (NOTE [Restarts]). Never returns worse than ``warm``; ``optimal`` is True when the
    result is proven minimal.
    """
    _require_lifetimes(items)
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    rng = random.Random(seed)
    best_offsets, best_peak = list(warm.offsets), warm.peak
    proven = lower_bound(items)  # no capacity below this fits
    untried = proven  # the smallest capacity worth a try (above any that ran out of time)
    capacity = proven
    # The instance is only set up when there is a gap to search (warm starts often sit at the bound).
    sec = _Sections(items) if proven < best_peak else None
    nodes = runs = 0
    while untried < best_peak and time.perf_counter() < deadline:
        left = deadline - time.perf_counter()
        until = deadline if capacity == best_peak - 1 else time.perf_counter() + left / 2
        restart = 0
        while True:
            rank = _biggest_first(sec, rng if restart else None)
            out = _run(sec, capacity, rank, until, LUBY_UNIT_NODES * _luby(restart + 1))
            nodes += out.nodes
            runs += 1
            restart += 1
            if out.offsets is not None or out.exhausted or time.perf_counter() >= until:
                break
        if out.offsets is not None:
            best_offsets = out.offsets
            best_peak = max(o + it.size for o, it in zip(out.offsets, items, strict=True))
        elif out.exhausted:
            proven = capacity + 1
            untried = max(untried, proven)
        else:
            untried = capacity + 1  # out of time: aim higher, where placements are easier to find
        capacity = (untried + best_peak) // 2
    optimal = best_peak <= proven
    return DSAResult(best_offsets, best_peak, "search", time.perf_counter() - t0,
                     status="optimal" if optimal else "time limit", optimal=optimal,
                     extra={"fallback": False, "nodes": nodes, "runs": runs})
