"""Exact DSA solvers: the DSA MIP of the Memo paper through PuLP, warm-started from the
heuristic (:func:`mip`), and MIPs over neighbourhoods of a placement for instances too large for
one MIP (:func:`mip_neighbourhoods`). Items, bounds and the heuristic are in :mod:`memo.planner.dsa`.

NOTE [Early stop at the lower bound]
The MIP minimises ``peak`` with ``peak >= lower_bound`` as an explicit
constraint. The LP relaxation of the big-M model is weak (it lets every pair
overlap fractionally), so without that constraint CBC's bound would sit near
the largest single item and it could never prove optimality. With it, the root
bound is the lower bound, so the moment an incumbent reaches the lower bound
the gap is 0 and CBC stops on its own, well before the time limit.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import numpy as np

from .dsa import (
    DSAResult,
    Item,
    _arrays,
    _greedy_order,
    check_placement,
    greedy,
    lower_bound,
    overlapping_pairs,
)
from .solvers import quiet_pulp, solver_command

__all__ = ["MAX_WINDOW_PAIRS", "mip", "mip_neighbourhoods"]


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
    cmd = solver_command(solver, remaining, threads, msg)
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
        prob.solve(solver_command(solver, time_limit, threads, False))
    except pulp.PulpSolverError:
        return None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    return [int(round(x[i].varValue)) for i in free]


def _restart(items: Sequence[Item], arrays: tuple[np.ndarray, np.ndarray, np.ndarray], order: list[int],
             order_peak: int, offsets: list[int], peak: int, rng: random.Random
             ) -> tuple[list[int], int, list[int], int, int]:
    """A new starting point for the search once its neighbourhoods look exhausted.

    NOTE [Restarts]: the neighbourhoods around this placement look exhausted. A hill
    climb on the greedy's placement order (move a few items earlier) gives the search
    a new starting point whenever it is at least as good as the current placement.
    Returns the (possibly better) order and its peak, the placement and its peak, and
    the number of orders tried.
    """
    size_a, start_a, end_a = arrays
    n = len(items)
    tries = 0
    for _ in range(40):
        # Hill-climb on the greedy's placement order: move a few items earlier.
        cand = list(order)
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(n)
            item = cand.pop(a)
            cand.insert(rng.randrange(a + 1), item)
        cand_offsets, cand_peak = _greedy_order(items, cand, size_a, start_a, end_a)
        tries += 1
        if cand_peak <= order_peak:
            order, order_peak = cand, cand_peak
        if cand_peak <= peak:
            offsets, peak = cand_offsets, cand_peak
            break
    return order, order_peak, offsets, peak, tries


def _window(items: Sequence[Item], offsets: list[int], peak: int, neighbours: list[list[int]], window: int,
            column: bool, rng: random.Random) -> list[int]:
    """The items freed in one neighbourhood: a random item at the peak and about ``window`` of its
    neighbours, chosen as a column (``column``) or from its top region, then at random."""
    critical = [i for i in range(len(items)) if offsets[i] + items[i].size == peak]
    c = rng.choice(critical)
    k = max(2, window - rng.randint(0, window // 3))
    if column:
        # A column: the items alive at one instant of the critical item's life, plus
        # random neighbours of the critical item; a column can be re-stacked as a whole.
        t = rng.randrange(items[c].start, items[c].end)
        col = [j for j in neighbours[c] if items[j].start <= t < items[j].end]
        rng.shuffle(col)
        free = [c] + col[: k - 1]
    else:
        # The critical item, the neighbours sharing its top region first, then random neighbours.
        cand = sorted(neighbours[c], key=lambda j: (-(offsets[j] + items[j].size), rng.random()))
        free = [c] + cand[: k // 2]
    rest = [j for j in neighbours[c] if j not in free]
    rng.shuffle(rest)
    free += rest[: max(0, k - len(free))]
    return free


def _placed_window(items: Sequence[Item], offsets: list[int], free: list[int], new: list[int],
                   pairs: list[tuple[int, int]]) -> tuple[list[int], int] | None:
    """The placement with the window's items at their new offsets, compacted, and its peak; None
    when the window's new top is above its old one."""
    old_top = max(offsets[i] + items[i].size for i in free)
    trial = list(offsets)
    for i, o in zip(free, new, strict=True):
        trial[i] = o
    new_top = max(trial[i] + items[i].size for i in free)
    if new_top > old_top:
        return None
    # _compact keeps the trial's vertical order and is valid by construction, so no full
    # placement check is needed here (the plan is validated once at the end).
    compacted = _compact(items, trial, pairs)
    return compacted, max(o + it.size for o, it in zip(compacted, items, strict=True))


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
    arrays = _arrays(items)
    size_a, start_a, end_a = arrays
    order = sorted(range(n), key=lambda i: (-size_a[i], start_a[i]))
    order_peak = _greedy_order(items, order, size_a, start_a, end_a)[1]
    while peak - lb > gap_tolerance * lb and time.perf_counter() - t0 < time_limit - 0.5:
        if stuck >= 2 * window:
            stuck = 0
            old_peak = peak
            order, order_peak, offsets, peak, tries = _restart(items, arrays, order, order_peak, offsets,
                                                               peak, rng)  # NOTE [Restarts]
            restarts += tries
            improved += peak < old_peak
            continue
        free = _window(items, offsets, peak, neighbours, window, bool(solves % 2), rng)
        if sum(len(neighbours[i]) for i in free) > MAX_WINDOW_PAIRS:
            # NOTE [Window size]: an item alive for the whole iteration overlaps every other one,
            # so freeing it would make a model with tens of thousands of binaries, on which CBC
            # spends minutes in its root node without looking at the time limit. Skipped.
            skipped += 1
            stuck += 1
            continue
        budget = min(5.0, max(0.5, time_limit - (time.perf_counter() - t0) - 0.5))
        new = _neighbourhood_mip(items, offsets, free, neighbours, peak, solver, threads, budget)
        solves += 1
        stuck += 1
        if new is None:
            failures += 1
            continue
        placed = _placed_window(items, offsets, free, new, pairs)
        if placed is None or placed[1] > peak:
            continue
        if placed[1] < peak:
            improved += 1
            stuck = 0
        offsets, peak = placed
    seconds = time.perf_counter() - t0
    optimal = peak == lb
    # Every neighbourhood solve failed: the solver does not work here, whatever the restarts found.
    broken = solves > 0 and failures == solves
    status = "optimal" if optimal else ("solver failed on every neighbourhood" if broken else "time limit")
    return DSAResult(offsets, peak, "mip-lns", seconds, status=status,
                     optimal=optimal, extra={"fallback": broken, "solves": solves, "improvements": improved,
                                             "restarts": restarts, "skipped_windows": skipped,
                                             "pairs": len(pairs)})
