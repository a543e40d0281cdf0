"""Planning a trace: flat (heuristic or MIP) and bi-level (layer blocks), and the one entry point.

NOTE [Bi-level plan]
Level 1 plans the *transient* allocations of one ``layer.fwd`` and one
``layer.bwd`` pass as a DSA instance on their own event order; its peak is the
height of a *layer block*. Level 2 plans the whole iteration where each layer
pass is one block (alive from its first transient malloc to its last
transient free), plus every other allocation (skeletal tensors, embedding,
head, optimizer, unphased) as an individual item. Every layer pass whose
signature (sizes, transient/skeletal, order of its own mallocs and frees)
equals the most common one of its kind reuses the shared level-1 solution; a
pass that differs is planned on its own (its own level-1 solve, its own block
height, its offsets stored individually) with a warning naming the phase.
A phase instance that appears in more than one run is planned as flat items.

Level 2 places each block twice and keeps the lower peak: as a rectangle (height =
level-1 peak, through the MIP where it is worth it) and as its exact shape, a rigid
group of its transients at their level-1 offsets, each alive only for its own
lifetime (:func:`~memo.planner.groups.greedy_groups`). The rectangle alone wastes
memory where a pass's transient usage grows while the live skeletal tensors
shrink, as in a backward pass that frees its layer's activations as it goes: the
rectangle reserves the pass's highest transient usage from its first malloc to its
last free, so nothing may use that space early in the pass, when the skeletal
tensors still need it. The shape leaves those holes to other items, which is what
brings the plan near the lower bound (tiny at 1M tokens: 1.057 x the lower bound
with rectangles, 1.001 with shapes). The rectangles are still solved because the
MIP works on them: their placement, with each shape then dropped as low as it goes
(:func:`~memo.planner.groups.compact_groups`), is never worse than the rectangles and
sometimes better than the shaped greedy. Either way every shared pass keeps the
same relative offsets, so the plan stores one base offset per block.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from memo.errors import MemoError
from memo.phase_names import phase_kind

from .dsa import DSAResult, Item, greedy
from .dsa import lower_bound as _units_lower_bound
from .dsa_mip import mip, mip_neighbourhoods
from .groups import compact_groups, expand_groups, greedy_groups
from .outliving import GRADIENT_PLACES, gradients, left_to_fallback, outliving
from .plan import ALIGNMENT, LAYER_KINDS, UNPHASED_MODES, Plan, validate_plan, without_unphased
from .search import MAX_OFFSET_ORDER_ITEMS, count_overlapping_pairs, search
from .solvers import require_solver
from .trace import Allocation, Trace

__all__ = ["lower_bound", "make_plan", "outliving", "plan_bilevel", "plan_heuristic", "plan_mip",
           "solve_items"]

#: One event of a layer pass's signature (:func:`_phase_events`): a free ("f", request) or a
#: malloc ("m", size, transient).
_PassEvent = tuple[Literal["f"], int] | tuple[Literal["m"], int, bool]
#: A layer pass's signature: its events in order; passes with equal signatures share a solution.
_Signature = tuple[_PassEvent, ...]


class _ProgressBar(Protocol):
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


def _as_trace(trace: Trace | Mapping[str, Any]) -> Trace:
    if isinstance(trace, Trace):
        return trace
    return Trace.from_dict(trace)


def _units(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT)


def lower_bound(trace: Trace | Mapping[str, Any]) -> int:
    """Most bytes live at one instant of the trace: no plan can need a smaller arena."""
    t = _as_trace(trace)
    return _units_lower_bound([Item(a.size, a.start, a.end) for a in t.allocations])


def _progress(total: int, desc: str, enabled: bool | None) -> _ProgressBar:
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    bar: _ProgressBar = tqdm(total=total, desc=desc, disable=not enabled, leave=False, file=sys.stderr)
    return bar


# NOTE [Search before MIP]
# On a layered trace greedy is within a fraction of a percent of the lower bound and nothing
# below runs. Where it is not (flat traces, packings without slack), the exact search of
# planner/search.py goes first: it reaches the lower bound on instances of hundreds of buffers
# in about a second, where the big-M MIP's weak relaxation leaves CBC blind past a few dozen
# items. The MIP (whole, for small instances) and its neighbourhood search then refine
# whatever the search left above the lower bound, warm-started from it.
def _solve(items: Sequence[Item], *, use_mip: bool, time_limit: float, solver: str, threads: int,
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
    return _solve(items, use_mip=True, time_limit=time_limit, solver=solver, threads=threads, target=capacity)


def _record(result: DSAResult, lb_units: int) -> dict[str, Any]:
    gap = (result.peak - lb_units) / lb_units if lb_units else 0.0
    bound = max(lb_units, int(result.extra.get("bound", lb_units)))
    # optimality_gap: how far the peak may still be above the optimum (0 once proven optimal).
    opt_gap = 0.0 if result.optimal else ((result.peak - bound) / bound if bound else 0.0)
    return {"method": result.method, "status": result.status, "seconds": round(result.seconds, 3),
            "gap_to_lower_bound": round(gap, 6), "optimal": bool(result.optimal),
            "optimality_gap": round(opt_gap, 6),
            "heuristic_fallback": bool(result.extra.get("fallback", False)), "items": None}


def _finish(t: Trace, offsets: list[int | None], solver: dict[str, Any], *, outliving: str,
            **fields: Any) -> Plan:
    """The plan of ``t`` at ``offsets``; ``outliving`` (:data:`OUTLIVING_MODES`) says which
    allocations were left to the fallback: no offset, no arena space."""
    left_out = left_to_fallback(t, outliving)
    top = max((o + a.size for a, o in zip(t.allocations, offsets, strict=True) if o is not None), default=0)
    peak = _units(top) * ALIGNMENT
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


def _target_units(capacity: int | None) -> int | None:
    """A capacity in bytes as the most whole alignment units it holds (None: minimise)."""
    return None if capacity is None else capacity // ALIGNMENT


def _flat(t: Trace, *, use_mip: bool, time_limit: float, solver: str, threads: int,
          progress: bool | None = False, outliving: str = "plan", capacity: int | None = None
          ) -> Plan:
    t0 = time.perf_counter()
    left_out = left_to_fallback(t, outliving)
    planned = [a for a in t.allocations if not left_out or a.index not in left_out]
    items = [Item(_units(a.size), a.start, a.end) for a in planned]
    bar = _progress(1, "memo plan", progress)
    bar.set_postfix_str(f"flat ({len(items)} allocations"
                        + (f", up to {time_limit:.0f} s)" if math.isfinite(time_limit) else ")"))
    result = _solve(items, use_mip=use_mip, time_limit=time_limit, solver=solver, threads=threads,
                    target=_target_units(capacity))
    bar.update(1)
    bar.close()
    info = _record(result, _units_lower_bound(items))
    info.update(kind="flat", solver=solver if use_mip else None, items=len(items),
                seconds=round(time.perf_counter() - t0, 3))
    offsets: list[int | None] = [None] * len(t.allocations)
    for a, off in zip(planned, result.offsets, strict=True):
        offsets[a.index] = off * ALIGNMENT
    return _finish(t, offsets,
                   {"kind": "flat", "solver": info["solver"], "seconds": info["seconds"],
                    "heuristic_fallback": info["heuristic_fallback"], "total": info}, outliving=outliving)


def plan_heuristic(trace: Trace | Mapping[str, Any], *, outliving: str = "plan",
                   time_limit: float = math.inf) -> Plan:
    """Flat greedy-by-size plan of every allocation (fast: thousands of allocations in seconds).

    ``outliving`` (:data:`OUTLIVING_MODES`) says which allocations never freed in the trace go to the
    fallback allocator (NOTE [Allocations that outlive the iteration]), as :func:`make_plan` does
    for replay. ``time_limit``: the greedy's orderings after the first are tried only within it.
    """
    return _flat(_as_trace(trace), use_mip=False, time_limit=time_limit, solver="cbc", threads=1,
                 outliving=outliving)


def plan_mip(trace: Trace | Mapping[str, Any], *, time_limit: float = 60.0, solver: str = "cbc",
             threads: int = 2, outliving: str = "plan", capacity: int | None = None) -> Plan:
    """Flat plan: heuristic warm start refined by the exact search and the DSA MIP within
    ``time_limit`` seconds (``outliving`` as in :func:`plan_heuristic`; ``capacity``
    as in :func:`make_plan`)."""
    return _flat(_as_trace(trace), use_mip=True, time_limit=time_limit, solver=solver, threads=threads,
                 outliving=outliving, capacity=capacity)


# ------------------------------------------------------------------------------- bi-level
def _phase_events(t: Trace, allocs: list[Allocation]) -> tuple[_Signature, list[Item]]:
    """Signature of a layer pass and its level-1 items (transients on the pass's own event order)."""
    events = []
    for a in allocs:
        events.append((a.start, 0, a))
        if a.transient:
            events.append((a.end, 1, a))
    events.sort(key=lambda e: (e[0], e[1]))
    rank_start: dict[int, int] = {}
    rank_end: dict[int, int] = {}
    signature: list[_PassEvent] = []
    for r, (_, is_free, a) in enumerate(events):
        if is_free:
            rank_end[a.request] = r
            signature.append(("f", a.request))
        else:
            rank_start[a.request] = r
            signature.append(("m", a.size, a.transient))
    items = [Item(_units(a.size), rank_start[a.request], rank_end[a.request]) if a.transient
             else Item(0, 0, 0) for a in allocs]
    return tuple(signature), items


def _describe_difference(sig: _Signature, ref: _Signature) -> str:
    for k, (mine, theirs) in enumerate(zip(sig, ref, strict=False)):
        if mine != theirs:
            return f"event {k} of the pass is {mine} where the others have {theirs}"
    return f"the pass has {len(sig)} events where the others have {len(ref)}"


@dataclass
class _Level1:
    """What the level-1 solves hand to level 2 (NOTE [Bi-level plan]); offsets relative to a block."""

    #: Layer kind -> the shared solution's offsets (bytes) of each allocation of the pass (None: skeletal).
    level1: dict[str, list[int | None]] = field(default_factory=dict)
    #: Layer kind -> the shared solution's peak (bytes).
    level1_peak: dict[str, int] = field(default_factory=dict)
    #: Phase instance -> its block height (units).
    block_height: dict[str, int] = field(default_factory=dict)
    #: Phases planned on their own -> their relative offsets (units).
    own_offsets: dict[str, list[int | None]] = field(default_factory=dict)

    def relative_units(self, phase: str) -> list[int | None]:
        """The offsets (units) of ``phase``'s allocations within its block: its own or its kind's."""
        if phase in self.own_offsets:
            return self.own_offsets[phase]
        return [None if o is None else o // ALIGNMENT for o in self.level1[phase_kind(phase)]]


def _layer_passes(t: Trace, notes: list[str]) -> tuple[dict[str, list[Allocation]], dict[str, list[str]]]:
    """Each phase's allocations, and per layer kind the passes planned as blocks: those run once
    that have transients. A pass interrupted by other phases is noted in ``notes``; its
    allocations are planned as individual items."""
    by_phase: dict[str, list[Allocation]] = {}
    for a in t.allocations:
        if a.phase is not None:
            by_phase.setdefault(a.phase, []).append(a)
    run_count = Counter(r.phase for r in t.runs if r.phase is not None)
    layered: dict[str, list[str]] = {k: [] for k in LAYER_KINDS}
    for phase in by_phase:
        kind = phase_kind(phase)
        if kind not in LAYER_KINDS:
            continue
        if run_count[phase] != 1:
            notes.append(f"phase {phase} is interrupted by other phases ({run_count[phase]} runs); "
                         "its allocations are planned individually")
            continue
        if any(a.transient for a in by_phase[phase]):
            layered[kind].append(phase)
    return by_phase, layered


def _share_passes(layered: dict[str, list[str]], signatures: dict[str, tuple[_Signature, list[Item]]],
                  notes: list[str]) -> tuple[dict[str, list[str]], list[tuple[str, str, str]]]:
    """Which passes share one level-1 solution (those with their kind's most common signature), and
    the level-1 solves to run as (kind, key, sample phase): key is the kind for the shared solution,
    or the phase for a pass that differs, which is warned about and noted in ``notes``."""
    shared: dict[str, list[str]] = {}
    all_groups: list[tuple[str, str, str]] = []
    for kind, phases in layered.items():
        if not phases:
            continue
        counts = Counter(signatures[p][0] for p in phases)
        ref_sig = counts.most_common(1)[0][0]
        shared[kind] = [p for p in phases if signatures[p][0] == ref_sig]
        for p in phases:
            if signatures[p][0] != ref_sig:
                msg = (f"memo.planner: phase {p} differs from the other {kind} passes "
                       f"({_describe_difference(signatures[p][0], ref_sig)}); it is planned on its own")
                # stacklevel 3: the warning points at plan_bilevel's caller.
                warnings.warn(msg, stacklevel=3)
                notes.append(msg)
        all_groups += [(kind, kind, shared[kind][0])]
        all_groups += [(kind, p, p) for p in phases if signatures[p][0] != ref_sig]
    return shared, all_groups


def _solve_level1(all_groups: list[tuple[str, str, str]], by_phase: dict[str, list[Allocation]],
                  signatures: dict[str, tuple[_Signature, list[Item]]], shared: dict[str, list[str]],
                  stats: dict[str, Any], bar: _ProgressBar, *, deadline: float, use_mip: bool, solver: str,
                  threads: int) -> _Level1:
    """Solve each level-1 group's transients on the pass's own event order; record each solve in
    ``stats`` and tick ``bar``.

    time_limit is for the whole plan: every solve (level 1 groups, then level 2) gets an equal
    share of what is left, so a trace with many distinct passes still plans in time.
    """
    lv = _Level1()
    n_left = len(all_groups) + 1
    for kind, key, sample in all_groups:
        allocs = by_phase[sample]
        items = signatures[sample][1]
        idx = [k for k, a in enumerate(allocs) if a.transient]
        sub = [items[k] for k in idx]
        bar.set_postfix_str(f"level 1 {key} ({len(sub)} tensors)")
        share = max(0.5, (deadline - time.perf_counter()) / n_left)
        n_left -= 1
        result = _solve(sub, use_mip=use_mip, time_limit=share, solver=solver, threads=threads)
        rel: list[int | None] = [None] * len(allocs)
        for k, off in zip(idx, result.offsets, strict=True):
            rel[k] = off
        info = _record(result, _units_lower_bound(sub))
        info["items"] = len(sub)
        stats[f"level1 {key}"] = info
        bar.update(1)
        if key == kind:
            lv.level1[kind] = [None if o is None else o * ALIGNMENT for o in rel]
            lv.level1_peak[kind] = result.peak * ALIGNMENT
            for p in shared[kind]:
                lv.block_height[p] = result.peak
        else:
            lv.own_offsets[key] = rel
            lv.block_height[key] = result.peak
    return lv


def _level2_items(t: Trace, by_phase: dict[str, list[Allocation]], lv: _Level1,
                  left_out: frozenset[int] | None
                  ) -> tuple[list[list[tuple[int, Item]]], list[Item], list[tuple[str, Any]]]:
    """Level 2's instance (NOTE [Bi-level plan]): each layer pass as a block, both as a group of its
    transients at their relative offsets (its shape) and as one rectangle item; every other
    allocation not left out as an item (and a group) of its own. Returns the groups, the
    rectangle items and each one's owner: ("block", phase) or ("alloc", allocation index)."""
    blocked = sorted(lv.block_height, key=lambda p: by_phase[p][0].index)
    groups: list[list[tuple[int, Item]]] = []
    items2: list[Item] = []
    owner: list[tuple[str, Any]] = []  # ("block", phase) or ("alloc", allocation index)
    for p in blocked:
        rel_units = lv.relative_units(p)
        members = [(r, Item(_units(a.size), a.start, a.end))
                   for a, r in zip(by_phase[p], rel_units, strict=True) if r is not None]
        groups.append(members)
        items2.append(Item(lv.block_height[p], min(it.start for _, it in members),
                           max(it.end for _, it in members)))
        owner.append(("block", p))
    blocked_set = set(blocked)
    for a in t.allocations:
        if (a.phase in blocked_set and a.transient) or (left_out and a.index in left_out):
            continue  # in a block, or left to the fallback (offset None)
        item = Item(_units(a.size), a.start, a.end)
        groups.append([(0, item)])
        items2.append(item)
        owner.append(("alloc", a.index))
    return groups, items2, owner


def _solve_level2(groups: list[list[tuple[int, Item]]], items2: list[Item], *, deadline: float,
                  use_mip: bool, solver: str, threads: int, capacity: int | None
                  ) -> tuple[DSAResult, dict[str, Any]]:
    """Place the level-2 blocks as shapes and as rectangles (NOTE [Bi-level plan]) and keep the
    lower peak; returns that placement and its record for the plan's stats."""
    shaped = greedy_groups(groups)
    members_lb = _units_lower_bound(expand_groups(groups, shaped.offsets)[0])
    rect_lb = _units_lower_bound(items2)
    if shaped.peak <= rect_lb:
        # No placement of the rectangles can beat the shapes: the MIP would only spend time.
        rect = greedy(items2, deadline)
    else:
        share = max(0.5, deadline - time.perf_counter())
        rect = _solve(items2, use_mip=use_mip, time_limit=share, solver=solver, threads=threads,
                      target=_target_units(capacity))
    # The rectangles' placement, shapes dropped as low as they go, is never above the rectangles'.
    compacted = compact_groups(groups, rect.offsets)
    if compacted.peak < shaped.peak:
        compacted.seconds += rect.seconds
        compacted.status = f"{rect.method} rectangle placement ({rect.status}), compacted as shapes"
        compacted.extra["fallback"] = rect.extra.get("fallback", False)
        shaped = compacted
    use_shapes = shaped.peak < rect.peak
    result2 = shaped if use_shapes else rect
    info2 = _record(result2, members_lb if use_shapes else rect_lb)
    info2.update(items=len(items2), shapes=use_shapes, shaped_peak=shaped.peak * ALIGNMENT,
                 rectangle_peak=rect.peak * ALIGNMENT)
    return result2, info2


def _bilevel_offsets(t: Trace, by_phase: dict[str, list[Allocation]], lv: _Level1,
                     owner: list[tuple[str, Any]], placed: Sequence[int]
                     ) -> tuple[list[int | None], dict[str, int]]:
    """Every allocation's offset (bytes) from level 2's placement (units) of blocks and items, and
    the base offset (bytes) of each block that shares its kind's level-1 solution."""
    offsets: list[int | None] = [None] * len(t.allocations)
    level2: dict[str, int] = {}
    for (what, key), off in zip(owner, placed, strict=True):
        if what == "alloc":
            offsets[key] = off * ALIGNMENT
            continue
        if key not in lv.own_offsets:
            level2[key] = off * ALIGNMENT
        for a, r in zip(by_phase[key], lv.relative_units(key), strict=True):
            if r is not None:
                offsets[a.index] = (off + r) * ALIGNMENT
    return offsets, level2


def plan_bilevel(trace: Trace | Mapping[str, Any], *, time_limit: float = 60.0, solver: str = "cbc",
                 threads: int = 2, use_mip: bool = True, progress: bool | None = None,
                 outliving: str = "plan", capacity: int | None = None) -> Plan:
    """Bi-level plan (see NOTE [Bi-level plan]) within about ``time_limit`` seconds in all: every
    solve gets an equal share of the time left. ``outliving`` as in :func:`plan_heuristic`:
    allocations never freed are skeletal, so they are level-2 items, and those are left out."""
    t = _as_trace(trace)
    t0 = time.perf_counter()
    left_out = left_to_fallback(t, outliving)
    notes: list[str] = []
    by_phase, layered = _layer_passes(t, notes)
    if not any(layered.values()):
        plan = _flat(t, use_mip=use_mip, time_limit=time_limit, solver=solver, threads=threads,
                     progress=progress, outliving=outliving, capacity=capacity)
        plan.warnings.extend(notes)
        return plan

    signatures = {p: _phase_events(t, by_phase[p]) for ps in layered.values() for p in ps}
    shared, all_groups = _share_passes(layered, signatures, notes)
    stats: dict[str, Any] = {}
    deadline = t0 + time_limit
    bar = _progress(len(all_groups) + 1, "memo plan", progress)
    lv = _solve_level1(all_groups, by_phase, signatures, shared, stats, bar, deadline=deadline,
                       use_mip=use_mip, solver=solver, threads=threads)

    # Level 2 (NOTE [Bi-level plan]): each layer pass is a block, as a rectangle and as its exact
    # shape; every other allocation is an item of its own. Both are placed; the lower peak wins.
    groups, items2, owner = _level2_items(t, by_phase, lv, left_out)
    bar.set_postfix_str(f"level 2 ({len(items2)} items)")
    result2, stats["level2"] = _solve_level2(groups, items2, deadline=deadline, use_mip=use_mip,
                                             solver=solver, threads=threads, capacity=capacity)
    bar.update(1)
    bar.close()

    offsets, level2 = _bilevel_offsets(t, by_phase, lv, owner, result2.offsets)
    fallback = any(s.get("heuristic_fallback") for s in stats.values())
    solver_info = {
        "kind": "bilevel",
        "solver": solver if use_mip else None,
        "seconds": round(time.perf_counter() - t0, 3),
        "heuristic_fallback": fallback,
        "shared_phases": {k: len(v) for k, v in shared.items()},
        "own_phases": sorted(lv.own_offsets),
        "stages": stats,
    }
    return _finish(t, offsets, solver_info, outliving=outliving, level1=lv.level1,
                   level1_peak=lv.level1_peak, level2=level2, warnings=notes)


def _check_plan_arguments(capacity: int | None, time_limit: float, use_mip: bool, solver: str,
                          unphased: str, gradients: str) -> None:
    """Refuse :func:`make_plan`'s arguments that are out of range before any work (a missing
    solver too, where one is asked for)."""
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity <= 0):
        raise MemoError("memo.planner: capacity must be a positive number of bytes (an int), "
                        f"got {capacity!r}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise MemoError(f"memo.planner: time_limit must be a positive number of seconds, got {time_limit!r}")
    if use_mip or solver not in ("cbc", "highs"):
        require_solver(solver)
    if unphased not in UNPHASED_MODES:
        raise MemoError(f"memo.planner: unphased must be 'plan' or 'fallback', got {unphased!r}")
    if gradients not in GRADIENT_PLACES:
        raise MemoError(f"memo.planner: gradients must be 'fallback' or 'arena', got {gradients!r}")


def _smaller_of_flat(plan: Plan, t: Trace, outliving: str, deadline: float) -> Plan:
    """The bi-level ``plan``, or the flat heuristic's plan of ``t`` where that is smaller.

    Blocks cost a little where skeletal tensors grow inside a pass; the flat heuristic
    costs a second, so keep it when it is smaller (the allocator only needs phase tables).
    The flat plan kept carries the bi-level plan's warnings and a record of what it replaced.
    """
    left = deadline - time.perf_counter()
    if left <= 0:  # the time limit is the whole plan's: the bi-level plan it has is the answer
        plan.solver["flat_comparison"] = "skipped: the time limit was reached"
        return plan
    flat = plan_heuristic(t, outliving=outliving, time_limit=left)
    if flat.peak >= plan.peak:
        return plan
    flat.warnings.extend(plan.warnings)
    flat.solver["replaced"] = {"kind": "bilevel", "peak": plan.peak, "seconds":
                               plan.solver.get("seconds"), "stages": plan.solver.get("stages")}
    flat.solver["note"] = (f"flat heuristic peak {flat.peak} < bi-level peak {plan.peak}; "
                           "kept the flat plan")
    return flat


def _record_alpha(plan: Plan, alpha_solution: Any, host_bytes: int | None) -> int | None:
    """Record the alpha solution in ``plan``; returns the host bytes: those given, else its own."""
    plan.alpha = float(alpha_solution.alpha)
    plan.alpha_binding = str(alpha_solution.binding)
    plan.alpha_detail = alpha_solution.to_dict()
    if host_bytes is None:
        host_bytes = int(alpha_solution.host_bytes)
    return host_bytes


def make_plan(trace: Trace | Mapping[str, Any], alpha_solution: Any = None, *, time_limit: float = 60.0,
              solver: str = "cbc", use_mip: bool = True, method: str = "auto", threads: int = 2,
              host_bytes: int | None = None, progress: bool | None = None, unphased: str = "plan",
              capacity: int | None = None, gradients: str = "fallback") -> Plan:
    """Plan a trace (a Trace or its JSON dict): the one call `memo profile` and `memo plan` make.

    Args:
        trace: the iteration's allocation trace.
        alpha_solution: an :class:`AlphaSolution` to record in the plan (alpha, binding
            constraint, host bytes), or None.
        time_limit: seconds for the whole plan; the level-1 and level-2 solves share them.
        solver: "cbc" (bundled with PuLP) or "highs" (needs highspy).
        use_mip: False keeps the greedy heuristic everywhere (fast: no search, no MIP).
        method: "auto" (bi-level when the trace has layer phases, flat otherwise; the flat
            heuristic replaces the bi-level plan when it is smaller), "bilevel", "flat" or
            "heuristic".
        host_bytes: pinned host bytes the runtime needs (defaults to the alpha solution's).
        unphased: "plan" gives allocations outside phases an address too (any DSA instance);
            "fallback" leaves them out, for plans memo's allocator replays
            (NOTE [Unphased allocations are not planned for replay] in planner/plan.py), and with
            them the phased allocations never freed in the trace, such as parameter gradients: their
            phase-table entries keep their request index with offset None
            (NOTE [Allocations that outlive the iteration]).
        gradients: where a replay plan puts the parameter gradients made in backward (those of its
            allocations that outlive the iteration in a backward phase): "fallback" (default), or
            "arena", live from their backward pass to the iteration's end, sharing the arena's bytes
            with the activations freed before them. "arena" is for training that sets the gradients
            to None after each optimizer step (no gradient accumulation; NOTE [Allocations that
            outlive the iteration]).
        capacity: bytes the arena may take. None (default) minimises the peak; a capacity is a
            target instead: the exact search stops at the first placement within it (a decision
            is often much easier than the minimum; NOTE [Capacity ladder] in search.py), and
            minimises as usual when it proves the capacity out of reach.
    """
    _check_plan_arguments(capacity, time_limit, use_mip, solver, unphased, gradients)
    started = time.perf_counter()
    t = _as_trace(trace)
    left_out = None
    outliving = "plan"
    if unphased == "fallback":
        t, count, nbytes = without_unphased(t)
        left_out = {"allocations": count, "bytes": nbytes}
        outliving = "gradients-in-arena" if gradients == "arena" else "fallback"
    if method == "heuristic":
        plan = plan_heuristic(t, outliving=outliving)
    elif method == "flat":
        plan = _flat(t, use_mip=use_mip, time_limit=time_limit, solver=solver, threads=threads,
                     progress=progress, outliving=outliving, capacity=capacity)
    elif method == "bilevel":
        plan = plan_bilevel(t, time_limit=time_limit, solver=solver, threads=threads, use_mip=use_mip,
                            progress=progress, outliving=outliving, capacity=capacity)
    elif method == "auto":
        plan = plan_bilevel(t, time_limit=time_limit, solver=solver, threads=threads, use_mip=use_mip,
                            progress=progress, outliving=outliving, capacity=capacity)
        if plan.solver.get("kind") == "bilevel":
            plan = _smaller_of_flat(plan, t, outliving, started + time_limit)
    else:
        raise MemoError(f"memo.planner: unknown method {method!r}; choose auto, bilevel, flat or heuristic")
    if alpha_solution is not None:
        host_bytes = _record_alpha(plan, alpha_solution, host_bytes)
    plan.host_bytes = host_bytes
    plan.unphased = unphased
    if left_out is not None:
        plan.solver["unphased_left_to_fallback"] = left_out  # what `memo plan` reports
    return plan
