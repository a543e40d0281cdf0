"""Offline dynamic storage allocation (DSA): place rectangles (lifetime x size) in an arena.

Everything here works on abstract items ``(size, start, end)`` with half-open
lifetimes ``[start, end)`` and integer sizes in *units* (the planner uses
512-byte units so every offset is aligned). Three solvers:

* :func:`lower_bound` -- the most units live at one instant; no placement needs less.
* :func:`greedy` -- "greedy by size with best offset" (Pisarchyk & Lee 2020, used by
  TFLite): items in decreasing size, each put into the tightest gap among the items
  it overlaps in time. Tries a few orderings and keeps the best. Thousands of items
  in seconds (numpy overlap test).
* :func:`mip` -- the DSA MIP of the Memo paper through PuLP, warm-started from the
  heuristic.

NOTE [Early stop at the lower bound]
The MIP minimises ``peak`` with ``peak >= lower_bound`` as an explicit
constraint. The LP relaxation of the big-M model is weak (it lets every pair
overlap fractionally), so without that constraint CBC's bound would sit near
the largest single item and it could never prove optimality. With it, the root
bound is the lower bound, so the moment an incumbent reaches the lower bound
the gap is 0 and CBC stops on its own, well before the time limit.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import numpy as np

from memo.errors import MemoError

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["DSAResult", "Item", "check_placement", "greedy", "lower_bound", "mip", "overlapping_pairs"]


@dataclass(frozen=True)
class Item:
    """One rectangle: ``size`` units, alive on ``[start, end)``."""

    size: int
    start: int
    end: int


@dataclass
class DSAResult:
    """A placement: ``offsets[i]`` for item i, its ``peak`` and how it was found."""

    offsets: list[int]
    peak: int
    method: str
    seconds: float
    status: str = "heuristic"
    optimal: bool = False
    extra: dict = field(default_factory=dict)


def quiet_pulp(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` without PuLP 3.x's notices about its 4.0 API.

    memo uses the 3.x API and its bundled CBC (docs/formats.md, "Solvers").
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*PuLP 4", category=DeprecationWarning)
            return fn(*args, **kwargs)

    return wrapper


def _arrays(items: Sequence[Item]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    size = np.fromiter((it.size for it in items), dtype=np.int64, count=len(items))
    start = np.fromiter((it.start for it in items), dtype=np.int64, count=len(items))
    end = np.fromiter((it.end for it in items), dtype=np.int64, count=len(items))
    return size, start, end


def lower_bound(items: Sequence[Item]) -> int:
    """Largest total size live at one instant (sweep over starts and ends)."""
    if not items:
        return 0
    deltas: dict[int, int] = {}
    for it in items:
        deltas[it.start] = deltas.get(it.start, 0) + it.size
        deltas[it.end] = deltas.get(it.end, 0) - it.size
    live = best = 0
    for t in sorted(deltas):
        live += deltas[t]
        best = max(best, live)
    return best


def overlapping_pairs(items: Sequence[Item]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, i < j, whose lifetimes intersect (sweep line, output-sensitive)."""
    order = sorted(range(len(items)), key=lambda i: items[i].start)
    active: list[int] = []
    pairs = []
    for i in order:
        s = items[i].start
        active = [j for j in active if items[j].end > s]
        for j in active:
            pairs.append((min(i, j), max(i, j)))
        active.append(i)
    return pairs


def check_placement(items: Sequence[Item], offsets: Sequence[int], peak: int) -> str | None:
    """Return a description of the first violation, or None when the placement is valid."""
    if len(offsets) != len(items):
        return f"{len(offsets)} offsets for {len(items)} items"
    for i, (it, off) in enumerate(zip(items, offsets, strict=True)):
        if off < 0 or off + it.size > peak:
            return f"item {i} at [{off}, {off + it.size}) is outside the arena [0, {peak})"
    if not items:
        return None
    if peak >= 2**63:
        # The clash test below adds offsets and sizes in int64; inside an arena below 2**63 no sum
        # overflows (NOTE [Byte counts are bounded] in memo/units.py).
        return f"the arena [0, {peak}) is beyond 2**63, more than int64 can address"
    size, start, end = _arrays(items)
    off = np.asarray(offsets, dtype=np.int64)
    order = np.argsort(start, kind="stable")
    # Sweep: each item against the items started earlier that are still alive.
    active: list[int] = []
    for i in order.tolist():
        active = [j for j in active if end[j] > start[i]]
        if active:
            act = np.asarray(active)
            clash = (off[act] < off[i] + size[i]) & (off[i] < off[act] + size[act])
            if clash.any():
                j = int(act[np.argmax(clash)])
                return (f"items {j} and {i} overlap in time ([{start[j]}, {end[j]}) and "
                        f"[{start[i]}, {end[i]})) "
                        f"and in memory ([{off[j]}, {off[j] + size[j]}) and [{off[i]}, {off[i] + size[i]}))")
        active.append(i)
    return None


def _tightest_gap(lo: np.ndarray, hi: np.ndarray, size: int, floor: int) -> int:
    """Best fit: the bottom of the tightest free gap, at or above ``floor``, that holds ``size``
    among the occupied intervals ``[lo, hi)``; the open gap on top is the last resort."""
    srt = np.argsort(lo, kind="stable")
    lo, hi = lo[srt], hi[srt]
    # Free gaps between the occupied intervals: [top of everything below, next start).
    gap_lo = np.maximum(np.concatenate(([0], np.maximum.accumulate(hi))), floor)
    gap_hi = np.concatenate((lo, [np.iinfo(np.int64).max]))
    width = gap_hi - gap_lo
    fits = np.nonzero(width >= size)[0]
    return int(gap_lo[fits[np.argmin(width[fits])]])


def _greedy_order(items: Sequence[Item], order: Sequence[int], size: np.ndarray, start: np.ndarray,
                  end: np.ndarray) -> tuple[list[int], int]:
    n = len(items)
    offs = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    peak = 0
    for i in order:
        s_i, b_i, e_i = int(size[i]), start[i], end[i]
        mask = placed & (start < e_i) & (b_i < end)
        best_off = -1
        if mask.any():
            idx = np.nonzero(mask)[0]
            best_off = _tightest_gap(offs[idx], offs[idx] + size[idx], s_i, 0)
        else:
            best_off = 0
        offs[i] = best_off
        placed[i] = True
        peak = max(peak, best_off + s_i)
    return offs.tolist(), peak


def _best_order(orders: dict[str, Sequence[int]], place: Callable[[Sequence[int]], tuple[list[int], int]],
                lb: int) -> tuple[list[int], int, str]:
    """Place in each order, keep the lowest peak (stop early at the lower bound): offsets, peak, order."""
    best_offs: list[int] = []
    best_peak, best_name = math.inf, ""
    for name, order in orders.items():
        offs, peak = place(order)
        if peak < best_peak:
            best_offs, best_peak, best_name = offs, peak, name
        if peak == lb:
            break
    return best_offs, int(best_peak), best_name


def greedy(items: Sequence[Item]) -> DSAResult:
    """Greedy by size with best offset, over a few orderings; returns the best placement found."""
    t0 = time.perf_counter()
    if not items:
        return DSAResult([], 0, "greedy", 0.0)
    size, start, end = _arrays(items)
    length = end - start
    n = len(items)
    orders = {
        "size": sorted(range(n), key=lambda i: (-size[i], -length[i], start[i])),
        "area": sorted(range(n), key=lambda i: (-size[i] * length[i], -size[i], start[i])),
        "length": sorted(range(n), key=lambda i: (-length[i], -size[i], start[i])),
        "start": sorted(range(n), key=lambda i: (start[i], -size[i])),
    }
    lb = lower_bound(items)
    offs, peak, name = _best_order(orders, lambda order: _greedy_order(items, order, size, start, end), lb)
    return DSAResult(offs, peak, "greedy", time.perf_counter() - t0, status="heuristic",
                     optimal=peak == lb, extra={"order": name})


def _compact(items: Sequence[Item], raw: Sequence[float], pairs: Sequence[tuple[int, int]]) -> list[int]:
    """Integer offsets from a MIP solution: keep its vertical order, drop every item as low as it goes.

    The order of each overlapping pair is read from the (possibly fractional) offsets; the
    longest path through that order gives the lowest integer offsets, which never exceed
    the solution's own, so the peak does not grow and solver tolerances cannot create overlaps.
    """
    n = len(items)
    below: list[list[int]] = [[] for _ in range(n)]
    for i, j in pairs:
        key_i = (raw[i], i)
        key_j = (raw[j], j)
        if key_i < key_j:
            below[j].append(i)
        else:
            below[i].append(j)
    offsets = [0] * n
    for i in sorted(range(n), key=lambda k: (raw[k], k)):
        offsets[i] = max((offsets[j] + items[j].size for j in below[i]), default=0)
    return offsets


@quiet_pulp
def mip(items: Sequence[Item], *, time_limit: float = 60.0, solver: str = "cbc", threads: int = 2,
        warm: DSAResult | None = None, msg: bool = False) -> DSAResult:
    """Solve the DSA MIP (minimise peak) with PuLP; warm-started from ``warm`` (or the heuristic).

    Returns the better of the MIP incumbent and the warm start; ``status`` says what the
    solver reported and ``extra["fallback"]`` is True when the heuristic placement was kept
    because the solver failed or found nothing better.
    """
    import pulp

    t0 = time.perf_counter()
    if warm is None:
        warm = greedy(items)
    lb = lower_bound(items)
    if warm.peak <= lb or len(items) <= 1:
        return DSAResult(list(warm.offsets), warm.peak, "greedy", time.perf_counter() - t0,
                         status="optimal (heuristic reached the lower bound)", optimal=True,
                         extra={"fallback": False})
    pairs = overlapping_pairs(items)
    big_m = warm.peak  # the heuristic peak bounds every offset + size in any improving solution
    prob = pulp.LpProblem("dsa", pulp.LpMinimize)
    peak = pulp.LpVariable("peak", lowBound=lb, upBound=big_m)
    x = [pulp.LpVariable(f"x{i}", lowBound=0, upBound=big_m - it.size) for i, it in enumerate(items)]
    z = {p: pulp.LpVariable(f"z{p[0]}_{p[1]}", cat=pulp.LpBinary) for p in pairs}
    prob += peak
    for i, it in enumerate(items):
        prob += x[i] + it.size <= peak
    for (i, j), zij in z.items():
        # zij = 1: i below j; zij = 0: j below i.
        prob += x[i] + items[i].size <= x[j] + big_m * (1 - zij)
        prob += x[j] + items[j].size <= x[i] + big_m * zij
    # Warm start values: the heuristic placement, with the pair orders it implies.
    peak.setInitialValue(warm.peak)
    for i, var in enumerate(x):
        var.setInitialValue(warm.offsets[i])
    for (i, j), zij in z.items():
        zij.setInitialValue(1 if warm.offsets[i] < warm.offsets[j] else 0)
    remaining = max(1.0, time_limit - (time.perf_counter() - t0))
    cmd = _solver_cmd(solver, remaining, threads, msg)
    try:
        prob.solve(cmd)
        status = pulp.LpStatus[prob.status]
    except pulp.PulpSolverError as err:
        return DSAResult(list(warm.offsets), warm.peak, "greedy", time.perf_counter() - t0,
                         status=f"solver error: {err}", extra={"fallback": True, "pairs": len(pairs)})
    raw = [v.varValue for v in x]
    seconds = time.perf_counter() - t0
    if status not in ("Optimal", "Not Solved") or any(r is None for r in raw):
        return DSAResult(list(warm.offsets), warm.peak, "greedy", seconds, status=f"solver: {status}",
                         extra={"fallback": True, "pairs": len(pairs)})
    offsets = _compact(items, raw, pairs)
    found = max(o + it.size for o, it in zip(offsets, items, strict=True))
    if check_placement(items, offsets, found) is not None or found > warm.peak:
        return DSAResult(list(warm.offsets), warm.peak, "greedy", seconds,
                         status=f"solver: {status}, incumbent not better than the heuristic",
                         extra={"fallback": True, "pairs": len(pairs)})
    # sol_status 1 is a proven optimum; 2 is an incumbent the solver stopped on (time limit).
    optimal = found == lb or prob.sol_status == pulp.LpSolutionOptimal
    return DSAResult(offsets, found, "mip", seconds, status="optimal" if optimal else "time limit",
                     optimal=optimal, extra={"fallback": False, "pairs": len(pairs),
                                             "solver_status": status})


#: Most overlapping pairs one neighbourhood MIP may have (NOTE [Window size]).
MAX_WINDOW_PAIRS = 2000


@quiet_pulp
def _neighbourhood_mip(items: Sequence[Item], offsets: list[int], free: list[int],
                       neighbours: list[list[int]], peak: int, solver: str, threads: int,
                       time_limit: float) -> list[int] | None:
    """Re-place the ``free`` items (all others fixed) to minimise their highest top; None if unsolved."""
    import pulp

    freeset = set(free)
    prob = pulp.LpProblem("dsa_window", pulp.LpMinimize)
    top = pulp.LpVariable("top", lowBound=0, upBound=peak)
    x = {i: pulp.LpVariable(f"x{i}", lowBound=0, upBound=peak - items[i].size) for i in free}
    prob += top
    for i in free:
        prob += x[i] + items[i].size <= top
        for j in neighbours[i]:
            if j in freeset:
                if j < i:
                    continue
                z = pulp.LpVariable(f"z{i}_{j}", cat=pulp.LpBinary)
                prob += x[i] + items[i].size <= x[j] + peak * (1 - z)
                prob += x[j] + items[j].size <= x[i] + peak * z
            else:
                # A fixed neighbour is an obstacle: i ends below it or starts above it.
                lo, hi = offsets[j], offsets[j] + items[j].size
                if hi + items[i].size > peak:
                    prob += x[i] + items[i].size <= lo
                    continue
                if lo < items[i].size:
                    prob += x[i] >= hi
                    continue
                z = pulp.LpVariable(f"w{i}_{j}", cat=pulp.LpBinary)
                prob += x[i] + items[i].size <= lo + peak * (1 - z)
                prob += x[i] >= hi - peak * z
    try:
        prob.solve(_solver_cmd(solver, time_limit, threads, False))
    except pulp.PulpSolverError:
        return None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    return [int(round(x[i].varValue)) for i in free]


def mip_neighbourhoods(items: Sequence[Item], warm: DSAResult, *, time_limit: float = 60.0,
                       solver: str = "cbc", threads: int = 2, window: int = 10, seed: int = 0,
                       gap_tolerance: float = 0.0) -> DSAResult:
    """Large-neighbourhood search: repeatedly re-solve a small DSA MIP around the items at the peak.

    NOTE [Why neighbourhoods]
    The big-M DSA MIP has a weak LP relaxation: past a few dozen items CBC's
    search is blind and rarely improves the warm start within minutes. Solving the
    same MIP on ``window`` free items at a time, with every other item fixed as an
    obstacle, is exact on the neighbourhood and fast (well under a second), and
    repeated around whatever reaches the peak it removes the peak's items one by one.
    """
    import random

    t0 = time.perf_counter()
    rng = random.Random(seed)
    lb = lower_bound(items)
    n = len(items)
    offsets = list(warm.offsets)
    pairs = overlapping_pairs(items)
    neighbours: list[list[int]] = [[] for _ in range(n)]
    for i, j in pairs:
        neighbours[i].append(j)
        neighbours[j].append(i)
    peak = max(o + it.size for o, it in zip(offsets, items, strict=True))
    solves = improved = restarts = stuck = failures = skipped = 0
    size_a, start_a, end_a = _arrays(items)
    order = sorted(range(n), key=lambda i: (-size_a[i], start_a[i]))
    order_peak = _greedy_order(items, order, size_a, start_a, end_a)[1]
    while peak - lb > gap_tolerance * lb and time.perf_counter() - t0 < time_limit - 0.5:
        if stuck >= 2 * window:
            # NOTE [Restarts]: the neighbourhoods around this placement look exhausted. A hill
            # climb on the greedy's placement order (move a few items earlier) gives the search
            # a new starting point whenever it is at least as good as the current placement.
            stuck = 0
            for _ in range(40):
                # Hill-climb on the greedy's placement order: move a few items earlier.
                cand = list(order)
                for _ in range(rng.randint(1, 3)):
                    a = rng.randrange(n)
                    item = cand.pop(a)
                    cand.insert(rng.randrange(a + 1), item)
                cand_offsets, cand_peak = _greedy_order(items, cand, size_a, start_a, end_a)
                restarts += 1
                if cand_peak <= order_peak:
                    order, order_peak = cand, cand_peak
                if cand_peak <= peak:
                    improved += cand_peak < peak
                    offsets, peak = cand_offsets, cand_peak
                    break
            continue
        critical = [i for i in range(n) if offsets[i] + items[i].size == peak]
        c = rng.choice(critical)
        k = max(2, window - rng.randint(0, window // 3))
        if solves % 2:
            # A column: the items alive at one instant of the critical item's life, plus
            # random neighbours of the critical item; a column can be re-stacked as a whole.
            t = rng.randrange(items[c].start, items[c].end)
            column = [j for j in neighbours[c] if items[j].start <= t < items[j].end]
            rng.shuffle(column)
            free = [c] + column[: k - 1]
        else:
            # The critical item, the neighbours sharing its top region first, then random neighbours.
            cand = sorted(neighbours[c], key=lambda j: (-(offsets[j] + items[j].size), rng.random()))
            free = [c] + cand[: k // 2]
        rest = [j for j in neighbours[c] if j not in free]
        rng.shuffle(rest)
        free += rest[: max(0, k - len(free))]
        if sum(len(neighbours[i]) for i in free) > MAX_WINDOW_PAIRS:
            # NOTE [Window size]: an item alive for the whole iteration overlaps every other one,
            # so freeing it would make a model with tens of thousands of binaries, on which CBC
            # spends minutes in its root node without looking at the time limit. Skipped.
            skipped += 1
            stuck += 1
            continue
        old_top = max(offsets[i] + items[i].size for i in free)
        budget = min(5.0, max(0.5, time_limit - (time.perf_counter() - t0) - 0.5))
        new = _neighbourhood_mip(items, offsets, free, neighbours, peak, solver, threads, budget)
        solves += 1
        stuck += 1
        if new is None:
            failures += 1
            continue
        trial = list(offsets)
        for i, o in zip(free, new, strict=True):
            trial[i] = o
        new_top = max(trial[i] + items[i].size for i in free)
        if new_top > old_top:
            continue
        # _compact keeps the trial's vertical order and is valid by construction, so no full
        # placement check is needed here (the plan is validated once at the end).
        compacted = _compact(items, trial, pairs)
        new_peak = max(o + it.size for o, it in zip(compacted, items, strict=True))
        if new_peak > peak:
            continue
        if new_peak < peak:
            improved += 1
            stuck = 0
        offsets, peak = compacted, new_peak
    seconds = time.perf_counter() - t0
    optimal = peak == lb
    # Every neighbourhood solve failed: the solver does not work here, whatever the restarts found.
    broken = solves > 0 and failures == solves
    status = "optimal" if optimal else ("solver failed on every neighbourhood" if broken else "time limit")
    return DSAResult(offsets, peak, "mip-lns", seconds, status=status,
                     optimal=optimal, extra={"fallback": broken, "solves": solves, "improvements": improved,
                                             "restarts": restarts, "skipped_windows": skipped,
                                             "pairs": len(pairs)})


def require_solver(solver: str) -> None:
    """Raise a clear error now when ``solver`` is unknown or not installed (not minutes into a plan)."""
    if solver == "cbc":
        return
    if solver == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError:
            raise MemoError("memo.planner: solver 'highs' needs the highspy package "
                            "(`pip install highspy`, or `pip install memo[highs]`); or use --solver cbc") \
                from None
        return
    raise MemoError(f"memo.planner: unknown solver {solver!r}; choose 'cbc' or 'highs'")


def _solver_cmd(solver: str, time_limit: float, threads: int, msg: bool):
    import pulp

    require_solver(solver)
    if solver == "cbc":
        return pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit, threads=threads, warmStart=True, gapRel=0.0)
    return pulp.HiGHS(msg=msg, timeLimit=time_limit, threads=threads, warmStart=True, gapRel=0.0)


# ------------------------------------------------------------------------------- rigid groups
#: A rigid group: members ``(relative offset, item)``; the group placed at ``o`` puts each at ``o + rel``.
Group = Sequence[tuple[int, Item]]

__all__ += ["Group", "compact_groups", "expand_groups", "greedy_groups"]


def expand_groups(groups: Sequence[Group], offsets: Sequence[int]) -> tuple[list[Item], list[int]]:
    """The members of ``groups`` placed at ``offsets``, as plain items and their offsets."""
    items: list[Item] = []
    offs: list[int] = []
    for group, base in zip(groups, offsets, strict=True):
        for rel, it in group:
            items.append(it)
            offs.append(base + rel)
    return items, offs


class _Members:
    """The members of rigid groups as flat arrays (group g owns ``first[g]:first[g + 1]``), time-indexed.

    NOTE [Time index for groups]
    Level 2 of a long sequence has tens of thousands of items, most alive for a few
    events. Testing each placement against every placed member costs a pass over all of
    them per item (seconds per ordering). Members at most ``cut`` long are kept sorted by
    start, so those that can meet a window ``[s, e)`` start in ``(s - cut, e)``: one slice.
    The few longer ones are tested every time. ``cut`` minimises the expected work
    (long members + members per window).
    """

    def __init__(self, groups: Sequence[Group]) -> None:
        n = len(groups)
        counts = np.fromiter((len(g) for g in groups), dtype=np.int64, count=n)
        self.first = np.concatenate(([0], np.cumsum(counts)))
        members = [m for g in groups for m in g]
        self.items = [it for _, it in members]
        self.rel = np.fromiter((r for r, _ in members), dtype=np.int64, count=len(members))
        if self.rel.size and self.rel.min() < 0:
            raise MemoError("memo.planner: a rigid group has a member below its base (negative relative "
                            "offset); relative offsets come from a level-1 placement and are >= 0")
        self.size, self.start, self.end = _arrays(self.items)
        # Per-group keys: reduceat needs non-empty groups, so empty ones keep zeros.
        nonempty = counts > 0
        self.height = np.zeros(n, dtype=np.int64)
        self.g_start = np.zeros(n, dtype=np.int64)
        self.g_end = np.zeros(n, dtype=np.int64)
        self.area = np.zeros(n, dtype=np.int64)
        self.g_lo = np.zeros(n, dtype=np.int64)
        self.g_hi = np.zeros(n, dtype=np.int64)
        self.long = np.zeros(0, dtype=np.int64)
        self.by_start = np.zeros(0, dtype=np.int64)
        if not members:
            return
        at = self.first[:-1][nonempty]
        self.height[nonempty] = np.maximum.reduceat(self.rel + self.size, at)
        self.g_start[nonempty] = np.minimum.reduceat(self.start, at)
        self.g_end[nonempty] = np.maximum.reduceat(self.end, at)
        self.area[nonempty] = np.add.reduceat(self.size * (self.end - self.start), at)
        length = self.end - self.start
        lengths = np.sort(length)
        span = max(1, int(self.end.max() - self.start.min()))
        n_members = len(lengths)
        work = (n_members - np.searchsorted(lengths, lengths, side="right")) + n_members * lengths / span
        cut = int(lengths[int(np.argmin(work))])
        self.long = np.nonzero(length > cut)[0]
        short = np.nonzero(length <= cut)[0]
        self.by_start = short[np.argsort(self.start[short], kind="stable")]
        sorted_start = self.start[self.by_start]
        self.g_lo = np.searchsorted(sorted_start, self.g_start - cut, side="right")
        self.g_hi = np.searchsorted(sorted_start, self.g_end, side="left")

    def near(self, g: int, placed: np.ndarray) -> np.ndarray:
        """Placed members that may overlap group g in time (a superset; callers test exactly)."""
        cand = np.concatenate((self.by_start[self.g_lo[g]:self.g_hi[g]], self.long))
        return cand[placed[cand]]


def _lowest_free(lo: np.ndarray, hi: np.ndarray) -> int:
    """Lowest offset >= 0 inside none of the open intervals ``(lo, hi)``."""
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    # Sweeping up from 0, an interval containing the current candidate moves it to the interval's
    # right end; the candidate before interval k is the highest right end of intervals 0..k-1.
    reach = np.maximum.accumulate(np.maximum(hi, 0))
    before = np.concatenate(([0], reach[:-1]))
    stop = np.nonzero(lo >= before)[0]
    return int(before[stop[0]]) if stop.size else int(reach[-1])


def _groups_order(m: _Members, order: Sequence[int], best_fit: bool) -> tuple[list[int], int]:
    """Place the groups in ``order``; one-member groups by best fit when ``best_fit``, all else lowest."""
    off = np.zeros(len(m.size), dtype=np.int64)  # absolute offsets of placed members
    placed = np.zeros(len(m.size), dtype=bool)
    offsets = [0] * len(m.height)
    peak = 0
    for g in order:
        a, b = int(m.first[g]), int(m.first[g + 1])
        if a == b:
            continue
        near = m.near(g, placed)
        if b - a == 1 and best_fit:
            # One member: the tightest gap that holds it, as in _greedy_order.
            r, s, s_i, e_i = int(m.rel[a]), int(m.size[a]), m.start[a], m.end[a]
            idx = near[(m.start[near] < e_i) & (s_i < m.end[near])]
            if idx.size:
                # The member may not sit below its own relative offset (the base is >= 0).
                base = _tightest_gap(off[idx], off[idx] + m.size[idx], s, r) - r
            else:
                base = 0
        else:
            # The lowest base at which no member meets a placed member: member i and placed j
            # collide for bases in the open interval (off_j - rel_i - size_i, off_j + size_j - rel_i).
            rel, size = m.rel[a:b], m.size[a:b]
            mi, pj = np.nonzero((m.start[near][None, :] < m.end[a:b, None])
                                & (m.start[a:b, None] < m.end[near][None, :]))
            pj = near[pj]
            lo = off[pj] - rel[mi] - size[mi]
            hi = off[pj] + m.size[pj] - rel[mi]
            keep = lo < hi
            base = _lowest_free(lo[keep], hi[keep]) if keep.any() else 0
        offsets[g] = base
        off[a:b] = base + m.rel[a:b]
        placed[a:b] = True
        peak = max(peak, base + int(m.height[g]))
    return offsets, peak


def greedy_groups(groups: Sequence[Group]) -> DSAResult:
    """Place rigid groups (NOTE [Bi-level plan] in core.py says why): ``offsets[g]`` is group g's base.

    Two groups collide only where members overlap in time and in memory, so a group's
    members can sit in the holes between another group's members. A one-member group
    goes into the tightest gap that holds it (as :func:`greedy`), a larger one at the
    lowest base where none of its members meets a placed member. Tries the orderings of
    :func:`greedy` (by height, area, length, start) and keeps the best; ``peak`` is the
    highest member top, ``optimal`` means the members' lower bound was reached.
    """
    t0 = time.perf_counter()
    if not groups:
        return DSAResult([], 0, "greedy-groups", 0.0)
    m = _Members(groups)
    length = m.g_end - m.g_start
    orders = {
        "size": np.lexsort((m.g_start, -length, -m.height)),
        "area": np.lexsort((m.g_start, -m.height, -m.area)),
        "length": np.lexsort((m.g_start, -m.height, -length)),
        "start": np.lexsort((-m.height, m.g_start)),
    }
    lb = lower_bound(m.items)
    offs, peak, name = _best_order(
        orders, lambda order: _groups_order(m, np.asarray(order).tolist(), best_fit=True), lb)
    return DSAResult(offs, peak, "greedy-groups", time.perf_counter() - t0, status="heuristic",
                     optimal=peak == lb, extra={"order": name})


def compact_groups(groups: Sequence[Group], offsets: Sequence[int]) -> DSAResult:
    """Drop each group as low as it goes, lowest ``offsets`` first.

    With ``offsets`` a valid placement of the groups' bounding rectangles (height =
    highest member top, alive from the first member's start to the last one's end), no
    group ends above its given offset: every group placed before it and alive at the
    same time sat below it there and has only moved down. So the result's peak is at most
    the rectangles', and a rectangle placement the MIP improved carries over to shapes.
    """
    t0 = time.perf_counter()
    if not groups:
        return DSAResult([], 0, "greedy-groups", 0.0)
    m = _Members(groups)
    order = sorted(range(len(groups)), key=lambda g: (offsets[g], g))
    offs, peak = _groups_order(m, order, best_fit=False)
    lb = lower_bound(m.items)
    return DSAResult(offs, peak, "greedy-groups", time.perf_counter() - t0, status="heuristic",
                     optimal=peak == lb, extra={"order": "compacted"})
