"""The bi-level plan of a trace: each layer pass's transients planned once as a block (level 1), the
blocks and every other allocation placed in the iteration (level 2).

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

import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memo.phase_names import phase_kind

from .dsa import DSAResult, Item, greedy
from .dsa import lower_bound as _units_lower_bound
from .flat import (
    ProgressBar,
    as_trace,
    finished_plan,
    plan_flat,
    progress_bar,
    solve,
    solve_record,
    target_units,
    units,
)
from .groups import compact_groups, expand_groups, greedy_groups
from .outliving import left_to_fallback
from .plan import ALIGNMENT, Plan
from .plan_fields import LAYER_KINDS
from .trace import Allocation, Trace

__all__ = ["plan_bilevel"]


#: A layer pass's signature (:func:`_signature`): its events in order, as the bytes of an int64 array
#: of rows (kind, value, transient): a free (0, its request, 0) or a malloc (1, size, transient).
#: Passes with equal signatures share a level-1 solution.
_Signature = bytes


def _event_ranks(allocs: list[Allocation]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pass's events in order: each allocation's malloc and each transient's free, ranked by
    event index (a malloc before a free at the same index). Returns the transients' mask, the rank
    of each malloc and the rank of each transient's free."""
    n = len(allocs)
    start = np.fromiter((a.start for a in allocs), dtype=np.int64, count=n)
    end = np.fromiter((a.end for a in allocs), dtype=np.int64, count=n)
    transient = np.fromiter((a.transient for a in allocs), dtype=bool, count=n)
    times = np.concatenate((start, end[transient]))
    # Stable: at an equal index the mallocs, listed first, come first.
    rank = np.empty(len(times), dtype=np.int64)
    rank[np.argsort(times, kind="stable")] = np.arange(len(times))
    return transient, rank[:n], rank[n:]


def _signature(allocs: list[Allocation]) -> _Signature:
    """The signature of a layer pass (:data:`_Signature`)."""
    transient, malloc_rank, free_rank = _event_ranks(allocs)
    rows = np.zeros((len(malloc_rank) + len(free_rank), 3), dtype=np.int64)
    rows[malloc_rank, 0] = 1
    rows[malloc_rank, 1] = np.fromiter((a.size for a in allocs), dtype=np.int64, count=len(allocs))
    rows[malloc_rank, 2] = transient
    rows[free_rank, 1] = np.fromiter((a.request for a, t in zip(allocs, transient, strict=True) if t),
                                     dtype=np.int64, count=len(free_rank))
    return rows.tobytes()


def _level1_items(allocs: list[Allocation]) -> list[Item]:
    """A layer pass's level-1 items: its transients on the pass's own event order (its events'
    ranks), an empty item for each skeletal allocation."""
    transient, malloc_rank, free_rank = _event_ranks(allocs)
    ends = iter(free_rank.tolist())
    return [Item(units(a.size), s, next(ends)) if t else Item(0, 0, 0)
            for a, s, t in zip(allocs, malloc_rank.tolist(), transient.tolist(), strict=True)]


def _describe_difference(sig: _Signature, ref: _Signature) -> str:
    def event(row: np.ndarray) -> tuple[str, int] | tuple[str, int, bool]:
        return ("m", int(row[1]), bool(row[2])) if row[0] else ("f", int(row[1]))

    mine, theirs = (np.frombuffer(x, dtype=np.int64).reshape(-1, 3) for x in (sig, ref))
    common = min(len(mine), len(theirs))
    differ = np.nonzero((mine[:common] != theirs[:common]).any(axis=1))[0]
    if differ.size:
        k = int(differ[0])
        return f"event {k} of the pass is {event(mine[k])} where the others have {event(theirs[k])}"
    return f"the pass has {len(mine)} events where the others have {len(theirs)}"


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


def _share_passes(layered: dict[str, list[str]], signatures: dict[str, _Signature],
                  notes: list[str]) -> tuple[dict[str, list[str]], list[tuple[str, str, str]]]:
    """Which passes share one level-1 solution (those with their kind's most common signature), and
    the level-1 solves to run as (kind, key, sample phase): key is the kind for the shared solution,
    or the phase for a pass that differs, which is warned about and noted in ``notes``."""
    shared: dict[str, list[str]] = {}
    all_groups: list[tuple[str, str, str]] = []
    for kind, phases in layered.items():
        if not phases:
            continue
        counts = Counter(signatures[p] for p in phases)
        ref_sig = counts.most_common(1)[0][0]
        shared[kind] = [p for p in phases if signatures[p] == ref_sig]
        for p in phases:
            if signatures[p] != ref_sig:
                msg = (f"memo.planner: phase {p} differs from the other {kind} passes "
                       f"({_describe_difference(signatures[p], ref_sig)}); it is planned on its own")
                # stacklevel 3: the warning points at plan_bilevel's caller.
                warnings.warn(msg, stacklevel=3)
                notes.append(msg)
        all_groups += [(kind, kind, shared[kind][0])]
        all_groups += [(kind, p, p) for p in phases if signatures[p] != ref_sig]
    return shared, all_groups


def _solve_level1(all_groups: list[tuple[str, str, str]], by_phase: dict[str, list[Allocation]],
                  shared: dict[str, list[str]],
                  stats: dict[str, Any], bar: ProgressBar, *, deadline: float, use_mip: bool, solver: str,
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
        items = _level1_items(allocs)
        idx = [k for k, a in enumerate(allocs) if a.transient]
        sub = [items[k] for k in idx]
        bar.set_postfix_str(f"level 1 {key} ({len(sub)} tensors)")
        share = max(0.5, (deadline - time.perf_counter()) / n_left)
        n_left -= 1
        result = solve(sub, use_mip=use_mip, time_limit=share, solver=solver, threads=threads)
        rel: list[int | None] = [None] * len(allocs)
        for k, off in zip(idx, result.offsets, strict=True):
            rel[k] = off
        info = solve_record(result, _units_lower_bound(sub))
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
        members = [(r, Item(units(a.size), a.start, a.end))
                   for a, r in zip(by_phase[p], rel_units, strict=True) if r is not None]
        groups.append(members)
        items2.append(Item(lv.block_height[p], min(it.start for _, it in members),
                           max(it.end for _, it in members)))
        owner.append(("block", p))
    blocked_set = set(blocked)
    for a in t.allocations:
        if (a.phase in blocked_set and a.transient) or (left_out and a.index in left_out):
            continue  # in a block, or left to the fallback (offset None)
        item = Item(units(a.size), a.start, a.end)
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
        rect = solve(items2, use_mip=use_mip, time_limit=share, solver=solver, threads=threads,
                      target=target_units(capacity))
    # The rectangles' placement, shapes dropped as low as they go, is never above the rectangles'.
    compacted = compact_groups(groups, rect.offsets)
    if compacted.peak < shaped.peak:
        compacted.seconds += rect.seconds
        compacted.status = f"{rect.method} rectangle placement ({rect.status}), compacted as shapes"
        compacted.extra["fallback"] = rect.extra.get("fallback", False)
        shaped = compacted
    use_shapes = shaped.peak < rect.peak
    result2 = shaped if use_shapes else rect
    info2 = solve_record(result2, members_lb if use_shapes else rect_lb)
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
    t = as_trace(trace)
    t0 = time.perf_counter()
    left_out = left_to_fallback(t, outliving)
    notes: list[str] = []
    by_phase, layered = _layer_passes(t, notes)
    if not any(layered.values()):
        plan = plan_flat(t, use_mip=use_mip, time_limit=time_limit, solver=solver, threads=threads,
                     progress=progress, outliving=outliving, capacity=capacity)
        plan.warnings.extend(notes)
        return plan

    signatures = {p: _signature(by_phase[p]) for ps in layered.values() for p in ps}
    shared, all_groups = _share_passes(layered, signatures, notes)
    stats: dict[str, Any] = {}
    deadline = t0 + time_limit
    bar = progress_bar(len(all_groups) + 1, "memo plan", progress)
    lv = _solve_level1(all_groups, by_phase, shared, stats, bar, deadline=deadline,
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
    return finished_plan(t, offsets, solver_info, outliving=outliving, level1=lv.level1,
                   level1_peak=lv.level1_peak, level2=level2, warnings=notes)

