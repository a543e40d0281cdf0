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

NOTE [Offset-order search]
A second exact search over the same canonical placements, after MiniMalloc's
(Moffitt, ASPLOS 2023; memo's own code): every item goes to its lowest free
offset (the top of the highest placed item it overlaps), one at a time, in
increasing (offset, rank) order, so each canonical placement is reached along
one path. Three things prune it:
* dominance: no item may go at or above the top an unplaced item would have
  at its own lowest offset (that one would fit below, in a gap left empty);
* an item that overlaps no unplaced item, once its branch fails, ends the
  node: placing others first cannot help it;
* the section bound (NOTE [Section bound]) with each section's floor raised to
  the lowest offset its unplaced items can take.
When a placement leaves no unplaced item alive in two neighbouring sections,
the two sides share nothing more: each is searched on its own (a failure on
one side fails the node, with no backtracking across). Each new part orders
its items afresh by what is left ("TWA": most unplaced demand in its sections,
then longest lifetime, then largest area), so a part deep in the search is
ordered by the demand it still has. On MiniMalloc's challenging suite this
finds placements at the capacity that the skyline search (NOTE [Canonical
placements]) misses in minutes; the skyline search is faster per node and
stronger on memo's strip tilings, so the two share the time
(NOTE [Two searches, one clock]).

NOTE [Two searches, one clock]
A round at one capacity (:func:`_round`) runs the three offset-order runs
("WAT", "TAW", "TWA") with a node limit of the item count times 2**k in round
k (as MiniMalloc's round robin), then skyline restarts (NOTE [Restarts]) for
as long as that took: each search gets about half the time, whichever is the
one that suits the instance; either proves infeasibility when a run ends
within its limit. Offset-order runs keep a candidate list per level of the
path, so above MAX_OFFSET_ORDER_ITEMS items only the skyline search runs.

NOTE [Capacity ladder]
How hard "does it fit in C?" is does not fall smoothly with C: on
MiniMalloc's instance J a placement within 1024 units is found in 0.2 s while
1039 runs out of 2.5 s. Bisection, which gives one capacity half the time
left, can spend it all on such an unlucky one. So each round (doubling node
limits) probes LADDER_PROBES capacities spread evenly from the largest not
yet proven out of reach up to just below the best placement: easy
capacities are found in the cheap early rounds, and the lower bound keeps
being probed with growing limits until it is reached or proven out of reach.
A target capacity is the only probe while it may still be reached.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

try:
    # NOTE [A torch-free planner module] (csrc/planner/module.cpp): links no libtorch.
    from memo import _planner_native
except ImportError as err:
    raise ImportError(f"memo.planner: its native search module memo._planner_native cannot be loaded "
                      f"({err}); build it with `make install` (or `pip install --no-build-isolation "
                      "--no-deps -e .`; torch is not needed for it)") from err

from .dsa import DSAResult, Item, lower_bound, overlapping_pairs

__all__ = ["count_overlapping_pairs", "fits", "search"]

#: Nodes per unit of the Luby sequence that limits each run (NOTE [Restarts]).
LUBY_UNIT_NODES = 1000
#: Above this many items only the skyline search runs (NOTE [Two searches, one clock]).
MAX_OFFSET_ORDER_ITEMS = 2000
#: The orders the offset-order runs give each part, round robin (NOTE [Offset-order search]):
#: letters of T (unplaced demand in its sections), W (lifetime length), A (area), most first.
OFFSET_ORDER_KEYS = ("WAT", "TAW", "TWA")
#: The shortest slice of skyline restarts per round (seconds).
MIN_SKYLINE_SLICE = 0.02
#: Capacities probed per round of the ladder (NOTE [Capacity ladder]).
LADDER_PROBES = 5


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
        self.length = end - start
        self.native = _planner_native.DsaSearch(self.size, self.first, self.last, self.by_section,
                                                self.section_starts, self.demand, neighbour_starts,
                                                neighbour_items, self.length)


def _run(sec: _Sections, capacity: int, rank: np.ndarray, deadline: float, node_limit: int | None
         ) -> Outcome:
    """One depth-first run (NOTE [Canonical placements]) with candidates tried in ``rank`` order."""
    # The per-node loop is memo._planner_native's (csrc/core/dsa_search.cpp): in numpy every node paid for
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


def _skyline(sec: _Sections, capacity: int, until: float, rng: random.Random, stats: dict[str, int],
             restarts: list[int]) -> Outcome:
    """Skyline restarts (NOTE [Restarts]) at ``capacity`` until one settles it or ``until``."""
    nodes = 0
    while time.perf_counter() < until:
        rank = _biggest_first(sec, rng if restarts[0] else None)
        out = _run(sec, capacity, rank, until, LUBY_UNIT_NODES * _luby(restarts[0] + 1))
        nodes += out.nodes
        restarts[0] += 1
        stats["runs"] += 1
        if out.offsets is not None or out.exhausted:
            stats["nodes"] += nodes
            return Outcome(out.offsets, out.exhausted, nodes)
    stats["nodes"] += nodes
    return Outcome(None, False, nodes)


def _round(sec: _Sections, capacity: int, k: int, until: float, rng: random.Random, stats: dict[str, int],
           restarts: list[int]) -> Outcome:
    """Round ``k`` at ``capacity`` (NOTE [Two searches, one clock]): the offset-order runs with
    ``items << k`` nodes each, then skyline restarts for as long as they took."""
    started = time.perf_counter()
    ties = np.arange(sec.n, dtype=np.int64)
    nodes = 0
    for keys in OFFSET_ORDER_KEYS:
        offsets, exhausted, n = sec.native.run_by_offset(capacity, ties, until - time.perf_counter(),
                                                         sec.n << k, keys)
        nodes += n
        stats["nodes"] += n
        stats["runs"] += 1
        if offsets is not None or exhausted:
            return Outcome(offsets, exhausted, nodes)
        if time.perf_counter() >= until:
            return Outcome(None, False, nodes)
    slice_end = min(until, time.perf_counter() + max(MIN_SKYLINE_SLICE, time.perf_counter() - started))
    out = _skyline(sec, capacity, slice_end, rng, stats, restarts)
    return Outcome(out.offsets, out.exhausted, nodes + out.nodes)


class _Bounds:
    """What the search knows: the best placement, the largest capacity proven out of reach + 1."""

    def __init__(self, items: Sequence[Item], warm: DSAResult) -> None:
        self.items = items
        self.offsets, self.peak = list(warm.offsets), warm.peak
        self.proven = lower_bound(items)  # no capacity below this fits
        self.untried = self.proven  # the smallest capacity worth a try

    def found(self, offsets: list[int]) -> None:
        peak = max(o + it.size for o, it in zip(offsets, self.items, strict=True))
        if peak < self.peak:
            self.offsets, self.peak = offsets, peak

    def infeasible(self, capacity: int) -> None:
        self.proven = max(self.proven, capacity + 1)
        self.untried = max(self.untried, self.proven)


def _bisect(sec: _Sections, b: _Bounds, capacity: int, deadline: float, rng: random.Random,
            stats: dict[str, int], done: Callable[[], bool]) -> None:
    """Skyline search alone, large instances: each capacity gets half the time left (all of it for
    the last candidate), the lower bound first, then bisection towards the best placement."""
    restarts = [0]
    while b.untried < b.peak and not done() and time.perf_counter() < deadline:
        left = deadline - time.perf_counter()
        until = deadline if capacity == b.peak - 1 else time.perf_counter() + left / 2
        restarts[0] = 0
        out = _skyline(sec, capacity, until, rng, stats, restarts)
        if out.offsets is not None:
            b.found(out.offsets)
        elif out.exhausted:
            b.infeasible(capacity)
        else:
            b.untried = capacity + 1  # out of time: aim higher, where placements are easier to find
        capacity = (b.untried + b.peak) // 2


def _ladder(sec: _Sections, b: _Bounds, target: int | None, deadline: float, rng: random.Random,
            stats: dict[str, int], done: Callable[[], bool]) -> None:
    """NOTE [Capacity ladder]: rounds of doubling node limits; each round probes a few capacities
    spread from the largest not yet proven out of reach to just below the best placement."""
    restarts = [0]
    k = 0
    while b.untried < b.peak and not done() and time.perf_counter() < deadline:
        k += 1
        lo, hi = b.untried, b.peak - 1
        if target is not None and lo <= target:
            probes = [min(target, hi)]
        else:
            probes = sorted({lo + (hi - lo) * j // (LADDER_PROBES - 1) for j in range(LADDER_PROBES)})
        for capacity in probes:
            if capacity < b.untried or capacity >= b.peak:
                continue
            out = _round(sec, capacity, k, deadline, rng, stats, restarts)
            if out.offsets is not None:
                b.found(out.offsets)
            elif out.exhausted:
                b.infeasible(capacity)
            if done() or time.perf_counter() >= deadline:
                break


def search(items: Sequence[Item], warm: DSAResult, *, time_limit: float, seed: int = 0,
           target: int | None = None) -> DSAResult:
    """Smallest peak the canonical searches find between the lower bound and ``warm``'s peak.

    Up to MAX_OFFSET_ORDER_ITEMS items both searches probe a ladder of capacities (NOTE
    [Capacity ladder]); above, the skyline search tries the lower bound first, then bisects
    between the largest capacity proven infeasible and the best placement. Never returns
    worse than ``warm``.

    Args:
        target: a capacity to reach rather than a peak to minimise: the only one tried while
            it may be reached, and the search stops as soon as a placement fits it. When it is
            proven out of reach, the search minimises above it as usual.

    Returns a DSAResult whose ``optimal`` is True when the peak is proven minimal;
    ``extra["bound"]`` is the largest peak proven necessary (the lower bound, or more where a
    capacity was proven infeasible) and ``extra["gap"]`` the peak's relative distance to it.
    """
    _require_lifetimes(items)
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    rng = random.Random(seed)
    b = _Bounds(items, warm)
    stats = {"nodes": 0, "runs": 0}

    def done() -> bool:
        return target is not None and b.peak <= target

    # The instance is only set up when there is a gap to search (warm starts often sit at the bound).
    if b.proven < b.peak and not done():
        sec = _Sections(items)
        if sec.n <= MAX_OFFSET_ORDER_ITEMS:
            _ladder(sec, b, target, deadline, rng, stats, done)
        else:
            start = b.proven if target is None else max(b.proven, min(target, b.peak - 1))
            _bisect(sec, b, start, deadline, rng, stats, done)
    optimal = b.peak <= b.proven
    status = "optimal" if optimal else ("target reached" if done() else "time limit")
    gap = (b.peak - b.proven) / b.proven if b.proven else 0.0
    return DSAResult(b.offsets, b.peak, "search", time.perf_counter() - t0, status=status,
                     optimal=optimal, extra={"fallback": False, "bound": b.proven, "gap": gap, **stats})
