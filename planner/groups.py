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
        self.owner = np.zeros(0, dtype=np.int64)
        self.multi = np.zeros(0, dtype=np.int64)
        self.footprint: dict[int, tuple[np.ndarray, np.ndarray]] = {}
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
        # NOTE [A group seen whole]: what the blocks look like to an item alive through all of them.
        self.owner = np.repeat(np.arange(n, dtype=np.int64), counts)
        self.last_start = np.zeros(n, dtype=np.int64)
        self.first_end = np.zeros(n, dtype=np.int64)
        self.last_start[nonempty] = np.maximum.reduceat(self.start, at)
        self.first_end[nonempty] = np.minimum.reduceat(self.end, at)
        # Footprints stand for groups of more than one member, all of them of some size (the rule of
        # NOTE [A group seen whole] needs sizes > 0).
        empty = np.zeros(n, dtype=bool)
        empty[self.owner[self.size <= 0]] = True
        self.multi = np.nonzero((counts > 1) & ~empty)[0]
        self.footprint = {int(g): _union(self.rel[self.first[g]:self.first[g + 1]],
                                         self.size[self.first[g]:self.first[g + 1]]) for g in self.multi}

    def near(self, g: int, placed: np.ndarray) -> np.ndarray:
        """Placed members that may overlap group g in time (a superset; callers test exactly)."""
        cand = np.concatenate((self.by_start[self.g_lo[g]:self.g_hi[g]], self.long))
        near: np.ndarray = cand[placed[cand]]  # a boolean mask's selection (numpy types it Any)
        return near

    def seen_whole(self, near: np.ndarray, start: int, end: int, placed_groups: np.ndarray,
                   bases: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """NOTE [A group seen whole]: of the placed members ``near``, those of placed groups none of
        whose members misses ``[start, end)`` in time are replaced by those groups' footprints.
        Returns the other members and the footprints' occupied intervals ``[lo, hi)`` (absolute)."""
        whole = self.multi[placed_groups[self.multi] & (self.last_start[self.multi] < end)
                           & (self.first_end[self.multi] > start)]
        if not whole.size:
            return near, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        mask = np.zeros(len(self.height), dtype=bool)
        mask[whole] = True
        rest: np.ndarray = near[~mask[self.owner[near]]]
        lo = np.concatenate([self.footprint[int(g)][0] + bases[g] for g in whole])
        hi = np.concatenate([self.footprint[int(g)][1] + bases[g] for g in whole])
        return rest, lo, hi


# NOTE [A group seen whole]
# Placing an item (or a group) against a placed group whose every member overlaps it in time, only
# the memory the group's members cover matters, not which member covers it: the one-member best fit
# (_tightest_gap) and the group's lowest base (_lowest_free) both answer from the union of the
# occupied intervals they are given, not from the intervals themselves. So such a group is given as
# its footprint, the union of its members' [rel, rel + size) merged into disjoint intervals (a layer
# block of ~20,000 members covers a few dozen), and the placement is the one the members give,
# offset for offset. An item alive through a whole layer pass (the pass's input, a saved tensor)
# meets every member of the block; testing it member by member was most of level 2's time.
# The rule needs sizes > 0 on both sides: an empty interval at x still splits a free gap at x, and
# the open intervals of touching members leave out the point where they touch. Level 2's items all
# have a size; a group or item without one is tested member by member.


def _union(rel: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals ``[rel, rel + size)`` as disjoint sorted ``[lo, hi)``."""
    order = np.argsort(rel, kind="stable")
    lo, hi = rel[order], rel[order] + size[order]
    reach = np.maximum.accumulate(hi)
    # A new interval starts where one begins above everything before it reaches.
    new = np.concatenate(([True], lo[1:] > reach[:-1]))
    starts = np.nonzero(new)[0]
    ends = np.concatenate((starts[1:], [len(lo)])) - 1
    return lo[starts], reach[ends]


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


#: Members alive longer than this many events are paired with every placed item (_alive_together).
_SHORT = 64


def _alive_together(start: np.ndarray, end: np.ndarray, p_start: np.ndarray, p_end: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (i, j) of intervals ``[start[i], end[i])`` and ``[p_start[j], p_end[j])`` that
    overlap, as two index arrays. The short ``i`` (at most _SHORT long) sorted by start: those that
    can meet j start in ``(p_start[j] - _SHORT, p_end[j])``, one slice each, so the work is the pairs
    and not every i times every j (a layer block has ~20,000 members, mostly a few events long)."""
    length = end - start
    long_i = np.nonzero(length > _SHORT)[0]
    mi, pj = np.nonzero((start[long_i][:, None] < p_end[None, :]) & (p_start[None, :] < end[long_i][:, None]))
    short = np.nonzero(length <= _SHORT)[0]
    short = short[np.argsort(start[short], kind="stable")]
    first = np.searchsorted(start[short], p_start - _SHORT, side="right")
    last = np.searchsorted(start[short], p_end, side="left")
    counts = np.maximum(last - first, 0)
    j = np.repeat(np.arange(len(p_start)), counts)
    # Position k of the expansion is candidate first[j] + (k - where j's run begins).
    run_begin = np.repeat(np.cumsum(counts) - counts, counts)
    i = short[np.repeat(first, counts) + np.arange(int(counts.sum())) - run_begin]
    hit = end[i] > p_start[j]
    return np.concatenate((long_i[mi], i[hit])), np.concatenate((pj, j[hit]))


def _lowest_base(m: _Members, g: int, a: int, b: int, near: np.ndarray, off: np.ndarray,
                 placed_groups: np.ndarray, bases: np.ndarray) -> int:
    """The lowest base of group g (members ``a:b``) at which no member meets a placed one of ``near``:
    member i and placed j collide for bases in the open interval (off_j - rel_i - size_i,
    off_j + size_j - rel_i). A placed item alive through all of g's members meets g's footprint
    (NOTE [A group seen whole]), one interval per footprint piece instead of one per member, and so
    does a one-member g against a placed group whose members are all alive with it."""
    rel, size = m.rel[a:b], m.size[a:b]
    parts_lo, parts_hi = [], []
    if b - a == 1 and size[0] > 0:
        near, whole_lo, whole_hi = m.seen_whole(near, int(m.start[a]), int(m.end[a]), placed_groups, bases)
        parts_lo.append(whole_lo - rel[0] - size[0])
        parts_hi.append(whole_hi - rel[0])
    elif g in m.footprint:
        through = (m.start[near] < m.first_end[g]) & (m.end[near] > m.last_start[g]) & (m.size[near] > 0)
        j = near[through]
        near = near[~through]
        f_lo, f_hi = m.footprint[g]
        parts_lo.append((off[j][:, None] - f_hi[None, :]).ravel())
        parts_hi.append((off[j][:, None] + m.size[j][:, None] - f_lo[None, :]).ravel())
    mi, pj = _alive_together(m.start[a:b], m.end[a:b], m.start[near], m.end[near])
    pj = near[pj]
    parts_lo.append(off[pj] - rel[mi] - size[mi])
    parts_hi.append(off[pj] + m.size[pj] - rel[mi])
    lo, hi = np.concatenate(parts_lo), np.concatenate(parts_hi)
    keep = lo < hi
    return _lowest_free(lo[keep], hi[keep]) if keep.any() else 0


def _groups_order(m: _Members, order: Sequence[int], best_fit: bool) -> tuple[list[int], int]:
    """Place the groups in ``order``; one-member groups by best fit when ``best_fit``, all else lowest."""
    off = np.zeros(len(m.size), dtype=np.int64)  # absolute offsets of placed members
    placed = np.zeros(len(m.size), dtype=bool)
    placed_groups = np.zeros(len(m.height), dtype=bool)
    bases = np.zeros(len(m.height), dtype=np.int64)  # the placed groups' bases
    peak = 0
    for g in order:
        a, b = int(m.first[g]), int(m.first[g + 1])
        if a == b:
            continue
        near = m.near(g, placed)
        if b - a == 1 and best_fit:
            # One member: the tightest gap that holds it, as in _greedy_order.
            r, s, s_i, e_i = int(m.rel[a]), int(m.size[a]), m.start[a], m.end[a]
            whole_lo = whole_hi = np.zeros(0, dtype=np.int64)
            if s > 0:
                near, whole_lo, whole_hi = m.seen_whole(near, int(s_i), int(e_i), placed_groups, bases)
            idx = near[(m.start[near] < e_i) & (s_i < m.end[near])]
            lo = np.concatenate((off[idx], whole_lo))
            if lo.size:
                hi = np.concatenate((off[idx] + m.size[idx], whole_hi))
                # The member may not sit below its own relative offset (the base is >= 0).
                base = _tightest_gap(lo, hi, s, r) - r
            else:
                base = 0
        else:
            base = _lowest_base(m, g, a, b, near, off, placed_groups, bases)
        bases[g] = base
        placed_groups[g] = True
        off[a:b] = base + m.rel[a:b]
        placed[a:b] = True
        peak = max(peak, base + int(m.height[g]))
    return bases.tolist(), peak


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
