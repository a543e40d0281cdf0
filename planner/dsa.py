"""Offline dynamic storage allocation (DSA): place rectangles (lifetime x size) in an arena.

Everything here works on abstract items ``(size, start, end)`` with half-open
lifetimes ``[start, end)`` and integer sizes in *units* (the planner uses
512-byte units so every offset is aligned). This module holds the primitives and the heuristic:

* :func:`lower_bound` -- the most units live at one instant; no placement needs less.
* :func:`overlapping_pairs`, :func:`check_placement` -- which items meet in time; is a placement valid.
* :func:`greedy` -- "greedy by size with best offset" (Pisarchyk & Lee 2020, used by
  TFLite): items in decreasing size, each put into the tightest gap among the items
  it overlaps in time. Tries a few orderings and keeps the best. Thousands of items
  in seconds (numpy overlap test).

The exact solvers are in :mod:`memo.planner.dsa_mip` (the DSA MIP of the Memo paper, and
MIPs over neighbourhoods of a placement), rigid groups of items in :mod:`memo.planner.groups`,
and the PuLP glue both MIPs use in :mod:`memo.planner.solvers`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

__all__ = ["DSAResult", "Item", "check_placement", "greedy", "lower_bound", "overlapping_pairs"]

#: An order to place items in: a list of indices (greedy) or an index array (greedy_groups).
OrderT = TypeVar("OrderT")


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
    extra: dict[str, Any] = field(default_factory=dict)


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
    for i, (it, offset) in enumerate(zip(items, offsets, strict=True)):
        if offset < 0 or offset + it.size > peak:
            return f"item {i} at [{offset}, {offset + it.size}) is outside the arena [0, {peak})"
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


def _best_order(orders: Mapping[str, OrderT], place: Callable[[OrderT], tuple[list[int], int]],
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
