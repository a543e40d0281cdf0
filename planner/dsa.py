"""Offline dynamic storage allocation (DSA): place rectangles (lifetime x size) in an arena.

Everything here works on abstract items ``(size, start, end)`` with half-open
lifetimes ``[start, end)`` and integer sizes in *units* (the planner uses
512-byte units so every offset is aligned). This module holds the primitives and the heuristic:

* :func:`lower_bound` -- the most units live at one instant; no placement needs less.
* :func:`overlapping_pairs`, :func:`check_placement` -- which items meet in time; is a placement valid.
* :func:`greedy` -- "greedy by size with best offset" (Pisarchyk & Lee 2020, used by
  TFLite): items in decreasing size, each put into the tightest gap among the items
  it overlaps in time. Tries a few orderings and keeps the best. A hundred thousand items
  in a second or so per ordering (native, over an interval structure).

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

try:
    # NOTE [A torch-free planner module] (csrc/planner/module.cpp): links no libtorch.
    from memo import _planner_native
except ImportError as err:
    raise ImportError(f"memo.planner: its native module memo._planner_native cannot be loaded ({err}); "
                      "build it with `make install` (or `pip install --no-build-isolation --no-deps -e .`; "
                      "torch is not needed for it)") from err

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
    size, start, end = _arrays(items)
    times = np.concatenate((start, end))
    order = np.argsort(times, kind="stable")
    times = times[order]
    # Live bytes after every change at an instant (ends and starts at one instant all counted: an item
    # ending at t and one starting at t do not meet), in int64: exact for any trace (NOTE [Byte counts
    # are bounded] in memo/units.py).
    live = np.cumsum(np.concatenate((size, -size))[order])
    last = np.append(times[1:] != times[:-1], True)
    return max(0, int(live[last].max()))


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
    # A sweep by start with the live items ordered by offset (NOTE [Greedy over an interval
    # structure] in csrc/core/dsa_greedy.h): O(n log n), where comparing each item with every live
    # one took seconds per validation of a 100,000-allocation plan.
    j, i = _planner_native.first_clash(size, start, end, off)
    if i < 0:
        return None
    return (f"items {j} and {i} overlap in time ([{start[j]}, {end[j]}) and [{start[i]}, {end[i]})) "
            f"and in memory ([{off[j]}, {off[j] + size[j]}) and [{off[i]}, {off[i] + size[i]}))")


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
    """Best fit in ``order``: each item at the bottom of the tightest gap among the placed items it
    overlaps in time (:func:`_tightest_gap`'s rule), natively over an interval structure (NOTE
    [Greedy over an interval structure] in csrc/core/dsa_greedy.h)."""
    ranks = np.asarray(order, dtype=np.int64)
    offs, peak, _ = _planner_native.greedy_place(size, start, end, ranks, 0.0, False)
    return offs, int(peak)


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


def greedy(items: Sequence[Item], deadline: float | None = None) -> DSAResult:
    """Greedy by size with best offset, over a few orderings; returns the best placement found.

    ``deadline`` (a ``time.perf_counter()`` instant): the first ordering always completes, as a
    plan needs one placement; the others are tried only while time is left, and one the deadline
    interrupts is dropped (``extra["orders"]`` lists those that completed)."""
    t0 = time.perf_counter()
    if not items:
        return DSAResult([], 0, "greedy", 0.0)
    size, start, end = _arrays(items)
    length = end - start
    n = len(items)
    orders = {
        "size": np.lexsort((start, -length, -size)),
        "area": np.lexsort((start, -size, -size * length)),
        "length": np.lexsort((start, -size, -length)),
        "start": np.lexsort((-size, start)),
    }
    lb = lower_bound(items)
    best_offs: list[int] = []
    best_peak, best_name = math.inf, ""
    done: list[str] = []
    for name, order in orders.items():
        left = math.inf if deadline is None else deadline - time.perf_counter()
        if done and left <= 0:
            break
        offs, peak, complete = _planner_native.greedy_place(size, start, end, order,
                                                             min(left, 1e9), bool(done))
        if not complete:
            break
        done.append(name)
        if peak < best_peak:
            best_offs, best_peak, best_name = offs, int(peak), name
        if peak == lb:
            break
    return DSAResult(best_offs, int(best_peak), "greedy", time.perf_counter() - t0, status="heuristic",
                     optimal=best_peak == lb, extra={"order": best_name, "orders": done, "items": n})
