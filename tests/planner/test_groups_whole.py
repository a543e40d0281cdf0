"""Level 2's rigid-group placement with its shortcuts (NOTE [A group seen whole] in planner/groups.py,
the pairs of _alive_together) gives, offset for offset, the placement of testing every member
against every placed member, which this file writes out directly."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memo.planner.dsa import Item, _tightest_gap, greedy
from memo.planner.groups import _groups_order, _lowest_free, _Members


def _direct_order(groups: list[list[tuple[int, Item]]], order: list[int], best_fit: bool
                  ) -> tuple[list[int], int]:
    """Each group against every placed member that overlaps one of its members in time."""
    placed: list[tuple[int, Item]] = []  # (absolute offset, item)
    offsets, peak = [0] * len(groups), 0
    for g in order:
        members = groups[g]
        if not members:
            continue
        if len(members) == 1 and best_fit:
            rel, it = members[0]
            hits = [(o, p) for o, p in placed if p.start < it.end and it.start < p.end]
            lo = np.array([o for o, _ in hits], dtype=np.int64)
            hi = np.array([o + p.size for o, p in hits], dtype=np.int64)
            base = _tightest_gap(lo, hi, it.size, rel) - rel if hits else 0
        else:
            pairs = [(o - rel - it.size, o + p.size - rel) for rel, it in members for o, p in placed
                     if p.start < it.end and it.start < p.end]
            pairs = [(lo, hi) for lo, hi in pairs if lo < hi]
            base = _lowest_free(np.array([p[0] for p in pairs], dtype=np.int64),
                                np.array([p[1] for p in pairs], dtype=np.int64)) if pairs else 0
        offsets[g] = base
        placed += [(base + rel, it) for rel, it in members]
        peak = max(peak, max(base + rel + it.size for rel, it in members))
    return offsets, peak


def _blocks_and_items(rng: random.Random, zero_sizes: bool) -> list[list[tuple[int, Item]]]:
    """Layer-like blocks (many short members, a few long ones, packed among themselves; empty ones
    with ``zero_sizes``) one after another, and single items, some alive through several blocks, as
    level 2 has them."""
    groups = []
    t = 0
    low = 0 if zero_sizes else 1
    for _ in range(rng.randint(1, 4)):
        members = []
        for _ in range(rng.randint(2, 40)):
            s = t + rng.randrange(0, 80)
            length = rng.choice([1, 2, 3, 5, 8, 70, 100])
            members.append(Item(rng.randint(low, 9), s, s + length))
        groups.append(list(zip(greedy(members).offsets, members, strict=True)))
        t += rng.randrange(40, 100)
    for _ in range(rng.randint(1, 25)):
        s = rng.randrange(0, t + 50)
        # Sized: an empty item's best fit depends on the order of placed items that start together.
        groups.append([(0, Item(rng.randint(1, 12), s, s + rng.choice([1, 4, 30, 150, 400])))])
    rng.shuffle(groups)
    return groups


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1_000_000), zero_sizes=st.booleans())
def test_groups_order_is_the_direct_placement(seed: int, zero_sizes: bool):
    rng = random.Random(seed)
    groups = _blocks_and_items(rng, zero_sizes)
    m = _Members(groups)
    order = list(range(len(groups)))
    rng.shuffle(order)
    for best_fit in (True, False):
        assert _groups_order(m, order, best_fit) == _direct_order(groups, order, best_fit)


def test_footprint_is_used():
    """The shortcut is taken where it should be: a block's footprint merges its members' intervals."""
    members = [Item(2, 0, 3), Item(3, 1, 4), Item(1, 2, 9)]
    m = _Members([[(0, members[0]), (1, members[1]), (6, members[2])], [(0, Item(5, 0, 20))]])
    lo, hi = m.footprint[0]
    assert lo.tolist() == [0, 6] and hi.tolist() == [4, 7]
