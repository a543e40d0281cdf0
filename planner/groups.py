"""Rigid groups of DSA items: a group moves as one, its members at fixed offsets from its base
(the layer blocks of the bi-level plan, NOTE [Bi-level plan] in planner/bilevel.py). Placed by a
greedy over groups (:func:`greedy_groups`) and pushed down member by member
(:func:`compact_groups`); items and the single-item heuristic are in :mod:`memo.planner.dsa`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from memo.errors import MemoError

from .dsa import DSAResult, Item, _arrays, _best_order, _tightest_gap, lower_bound

__all__ = ["Group", "compact_groups", "expand_groups", "greedy_groups"]

#: A rigid group: members ``(relative offset, item)``; the group placed at ``o`` puts each at ``o + rel``.
Group = Sequence[tuple[int, Item]]



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
        near: np.ndarray = cand[placed[cand]]  # a boolean mask's selection (numpy types it Any)
        return near


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
    """Place rigid groups (NOTE [Bi-level plan] in bilevel.py says why): ``offsets[g]`` is group g's base.

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
