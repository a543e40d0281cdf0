"""Flat planning: every allocation of a trace as one DSA item, placed by the greedy heuristic, the
exact search and the MIP (NOTE [Search before MIP]); the solve the bi-level plan runs on each level.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from memo.errors import MemoError

from .dsa import DSAResult, Item, greedy
from .dsa import lower_bound as _units_lower_bound
from .dsa_mip import mip, mip_neighbourhoods
from .outliving import gradients, left_to_fallback
from .plan import ALIGNMENT, Plan, validate_plan
from .search import MAX_OFFSET_ORDER_ITEMS, count_overlapping_pairs, search
from .solvers import require_solver
from .trace import Trace

__all__ = ["ProgressBar", "as_trace", "finished_plan", "lower_bound", "plan_flat", "plan_heuristic",
           "plan_mip", "progress_bar", "solve", "solve_items", "solve_record", "target_units", "units"]


class ProgressBar(Protocol):
    """What the planner uses of a tqdm bar (tqdm has no type information)."""

    def set_postfix_str(self, s: str) -> object: ...
    def update(self, n: int) -> object: ...
    def close(self) -> object: ...


#: Above this many overlapping pairs a MIP does not fit a minute of CBC; the heuristic stands.
MAX_MIP_PAIRS = 40_000
#: A heuristic this close to the lower bound (relative) is kept without any MIP.
GAP_TOLERANCE = 1e-3
#: Up to this many items the whole DSA MIP is tried before the neighbourhood search
#: (see NOTE [Why neighbourhoods] in dsa_mip.py).
MAX_FULL_MIP_ITEMS = 40
#: Above this many overlapping pairs the exact search's per-node work is too slow to pay off.
MAX_SEARCH_PAIRS = 200_000


def as_trace(trace: Trace | Mapping[str, Any]) -> Trace:
    """A trace given as a Trace or as its JSON dict, as a Trace."""
    if isinstance(trace, Trace):
        return trace
    return Trace.from_dict(trace)


def units(nbytes: int) -> int:
    """``nbytes`` in whole alignment units, rounded up: the unit every solve places items in."""
    return -(-nbytes // ALIGNMENT)


def lower_bound(trace: Trace | Mapping[str, Any]) -> int:
    """Most bytes live at one instant of the trace: no plan can need a smaller arena."""
    t = as_trace(trace)
    return _units_lower_bound([Item(a.size, a.start, a.end) for a in t.allocations])


def progress_bar(total: int, desc: str, enabled: bool | None) -> ProgressBar:
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    bar: ProgressBar = tqdm(total=total, desc=desc, disable=not enabled, leave=False, file=sys.stderr)
    return bar


# NOTE [Search before MIP]
# On a layered trace greedy is within a fraction of a percent of the lower bound and nothing
# below runs. Where it is not (flat traces, packings without slack), the exact search of
# planner/search.py goes first: it reaches the lower bound on instances of hundreds of buffers
# in about a second, where the big-M MIP's weak relaxation leaves CBC blind past a few dozen
# items. The MIP (whole, for small instances) and its neighbourhood search then refine
# whatever the search left above the lower bound, warm-started from it.
def solve(items: Sequence[Item], *, use_mip: bool, time_limit: float, solver: str, threads: int,
           target: int | None = None) -> DSAResult:
    """Heuristic, then the exact search and the MIP where they are worth it and fit (NOTE [Search
    before MIP]); never worse than the heuristic. ``time_limit`` covers all of it, the heuristic
    included. ``target`` (units): a peak to reach rather than minimise; the solve stops at the
    first placement within it (NOTE [Capacity ladder] in search.py)."""
    if use_mip:
        require_solver(solver)
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    warm = greedy(items, deadline)
    lb = _units_lower_bound(items)
    warm.extra["bound"] = lb
    if not use_mip or warm.optimal or (target is not None and warm.peak <= target):
        return warm
    if warm.peak - lb <= GAP_TOLERANCE * lb:
        return warm
    result = warm
    pairs = count_overlapping_pairs(items)
    if pairs <= MAX_SEARCH_PAIRS:
        # Up to MAX_OFFSET_ORDER_ITEMS both exact searches run and are stronger than the MIP's
        # neighbourhoods there (NOTE [Two searches, one clock]): they get 3/4 of the time, else half.
        share = 0.75 if len(items) <= MAX_OFFSET_ORDER_ITEMS else 0.5
        result = search(items, warm, time_limit=max(0.0, deadline - time.perf_counter()) * share,
                        target=target)
    bound = result.extra.get("bound", lb)
    reached = target is not None and result.peak <= target
    if not reached and not result.optimal and len(items) <= MAX_FULL_MIP_ITEMS and pairs <= MAX_MIP_PAIRS:
        # Small instances: the whole MIP, given half the time left so the neighbourhood search can follow.
        left = deadline - time.perf_counter()
        whole = mip(items, time_limit=left / 2, solver=solver, threads=threads, warm=result)
        if whole.peak < result.peak or whole.optimal:
            result = whole
    left = deadline - time.perf_counter()
    reached = target is not None and result.peak <= target
    if not reached and not result.optimal and result.peak - lb > GAP_TOLERANCE * lb and left > 1.0:
        lns = mip_neighbourhoods(items, result, time_limit=left, solver=solver, threads=threads,
                                 gap_tolerance=GAP_TOLERANCE)
        if lns.peak < result.peak:
            result = lns
    if result.peak == warm.peak and not result.optimal:
        # Nothing better than the heuristic within the time limit: the heuristic plan stands, flagged.
        result = warm
        result.status = "heuristic (search and MIP found nothing better within the time limit)"
        result.extra["fallback"] = True
    # The largest peak proven necessary: the lower bound, or more where the search proved it.
    result.extra["bound"] = result.peak if result.optimal else max(lb, bound)
    result.seconds = time.perf_counter() - t0
    return result


def solve_items(items: Sequence[Item], *, time_limit: float = 60.0, capacity: int | None = None,
                solver: str = "cbc", threads: int = 2) -> DSAResult:
    """The flat solve :func:`make_plan` runs on a trace's allocations (greedy, exact search, MIP),
    on DSA items directly: sizes in any unit, lifetimes on any integer clock.

    A trace only orders its events, so its lifetimes count events; items keep real durations
    where the caller has them (MiniMalloc's CSVs do), and the exact search's item orders use
    them (lifetime length, area; NOTE [Offset-order search] in search.py). ``capacity`` (same
    unit as the sizes) as in :func:`make_plan`. ``extra["bound"]`` is the largest peak proven
    necessary, so ``peak / bound - 1`` is the optimality gap left.
    """
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise MemoError(f"memo.planner: time_limit must be a positive number of seconds, got {time_limit!r}")
    return solve(items, use_mip=True, time_limit=time_limit, solver=solver, threads=threads, target=capacity)


def solve_record(result: DSAResult, lb_units: int) -> dict[str, Any]:
    gap = (result.peak - lb_units) / lb_units if lb_units else 0.0
    bound = max(lb_units, int(result.extra.get("bound", lb_units)))
    # optimality_gap: how far the peak may still be above the optimum (0 once proven optimal).
    opt_gap = 0.0 if result.optimal else ((result.peak - bound) / bound if bound else 0.0)
    return {"method": result.method, "status": result.status, "seconds": round(result.seconds, 3),
            "gap_to_lower_bound": round(gap, 6), "optimal": bool(result.optimal),
            "optimality_gap": round(opt_gap, 6),
            "heuristic_fallback": bool(result.extra.get("fallback", False)), "items": None}


def finished_plan(t: Trace, offsets: list[int | None], solver: dict[str, Any], *, outliving: str,
            **fields: Any) -> Plan:
    """The plan of ``t`` at ``offsets``; ``outliving`` (:data:`OUTLIVING_MODES`) says which
    allocations were left to the fallback: no offset, no arena space."""
    left_out = left_to_fallback(t, outliving)
    top = max((o + a.size for a, o in zip(t.allocations, offsets, strict=True) if o is not None), default=0)
    peak = units(top) * ALIGNMENT
    planned = [a for a in t.allocations if not left_out or a.index not in left_out]
    if left_out is not None:
        gone = [t.allocations[i] for i in sorted(left_out)]
        solver["persistent_left_to_fallback"] = {"allocations": len(gone), "bytes": sum(a.size for a in gone)}
    if outliving == "gradients-in-arena":
        placed = gradients(t)
        solver["gradients_in_arena"] = {"allocations": len(placed), "bytes": sum(a.size for a in placed)}
    plan = Plan(meta=dict(t.meta), allocations=list(t.allocations), offsets=offsets, peak=peak,
                lower_bound=_units_lower_bound([Item(a.size, a.start, a.end) for a in planned]),
                no_reuse_bytes=sum(a.size for a in planned), solver=solver, end_time=t.end_time, **fields)
    validate_plan(plan, t)
    return plan


def target_units(capacity: int | None) -> int | None:
    """A capacity in bytes as the most whole alignment units it holds (None: minimise)."""
    return None if capacity is None else capacity // ALIGNMENT


def plan_flat(t: Trace, *, use_mip: bool, time_limit: float, solver: str, threads: int,
          progress: bool | None = False, outliving: str = "plan", capacity: int | None = None
          ) -> Plan:
    t0 = time.perf_counter()
    left_out = left_to_fallback(t, outliving)
    planned = [a for a in t.allocations if not left_out or a.index not in left_out]
    items = [Item(units(a.size), a.start, a.end) for a in planned]
    bar = progress_bar(1, "memo plan", progress)
    bar.set_postfix_str(f"flat ({len(items)} allocations"
                        + (f", up to {time_limit:.0f} s)" if math.isfinite(time_limit) else ")"))
    result = solve(items, use_mip=use_mip, time_limit=time_limit, solver=solver, threads=threads,
                    target=target_units(capacity))
    bar.update(1)
    bar.close()
    info = solve_record(result, _units_lower_bound(items))
    info.update(kind="flat", solver=solver if use_mip else None, items=len(items),
                seconds=round(time.perf_counter() - t0, 3))
    offsets: list[int | None] = [None] * len(t.allocations)
    for a, off in zip(planned, result.offsets, strict=True):
        offsets[a.index] = off * ALIGNMENT
    return finished_plan(t, offsets,
                   {"kind": "flat", "solver": info["solver"], "seconds": info["seconds"],
                    "heuristic_fallback": info["heuristic_fallback"], "total": info}, outliving=outliving)


def plan_heuristic(trace: Trace | Mapping[str, Any], *, outliving: str = "plan",
                   time_limit: float = math.inf) -> Plan:
    """Flat greedy-by-size plan of every allocation (fast: thousands of allocations in seconds).

    ``outliving`` (:data:`OUTLIVING_MODES`) says which allocations never freed in the trace go to the
    fallback allocator (NOTE [Allocations that outlive the iteration]), as :func:`make_plan` does
    for replay. ``time_limit``: the greedy's orderings after the first are tried only within it.
    """
    return plan_flat(as_trace(trace), use_mip=False, time_limit=time_limit, solver="cbc", threads=1,
                 outliving=outliving)


def plan_mip(trace: Trace | Mapping[str, Any], *, time_limit: float = 60.0, solver: str = "cbc",
             threads: int = 2, outliving: str = "plan", capacity: int | None = None) -> Plan:
    """Flat plan: heuristic warm start refined by the exact search and the DSA MIP within
    ``time_limit`` seconds (``outliving`` as in :func:`plan_heuristic`; ``capacity``
    as in :func:`make_plan`)."""
    return plan_flat(as_trace(trace), use_mip=True, time_limit=time_limit, solver=solver, threads=threads,
                 outliving=outliving, capacity=capacity)

