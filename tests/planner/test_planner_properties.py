"""Property tests of the planner's exact searches on small random DSA instances (issue 18).

Every plan is valid (no two items overlap in both time and address), never worse than greedy
and never below the lower bound; a capacity target is met whenever it can be; the two exact
searches (skyline, NOTE [Canonical placements]; offset order, NOTE [Offset-order search])
agree on every "does it fit in C?" they both settle.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memo.planner import make_plan, solve_items
from memo.planner.dsa import Item, check_placement, greedy, lower_bound
from memo.planner.search import OFFSET_ORDER_KEYS, _Sections, search
from memo.planner.synthetic import guillotine_instance, items_to_trace

from memo.errors import MemoError

# Items: (size, start, length); small enough that the searches finish, varied enough to need them.
items_st = st.lists(st.tuples(st.integers(1, 9), st.integers(0, 12), st.integers(1, 8)),
                    min_size=1, max_size=12).map(lambda spans: [Item(s, t, t + d) for s, t, d in spans])


def _decided(sec: _Sections, capacity: int, run) -> bool | None:
    """True/False when the run settles whether ``capacity`` fits, None when it runs out of time."""
    offsets, exhausted, _ = run(capacity)
    if offsets is not None:
        assert check_placement(sec.items, offsets, capacity) is None
        return True
    return False if exhausted else None


@settings(max_examples=60, deadline=None)
@given(items_st)
def test_plans_are_valid_and_never_worse_than_greedy(items):
    result = solve_items(items, time_limit=5.0)
    assert check_placement(items, result.offsets, result.peak) is None
    assert lower_bound(items) <= result.peak <= greedy(items).peak
    assert result.extra["bound"] <= result.peak
    if result.optimal:
        assert result.extra["bound"] == result.peak


@settings(max_examples=60, deadline=None)
@given(items_st, st.integers(0, 6))
def test_a_reachable_capacity_is_met(items, slack):
    best = search(items, greedy(items), time_limit=5.0)
    capacity = best.peak + slack  # a placement within it exists
    result = solve_items(items, time_limit=5.0, capacity=capacity)
    assert check_placement(items, result.offsets, result.peak) is None
    assert result.peak <= capacity
    assert result.peak <= greedy(items).peak


@settings(max_examples=100, deadline=None)
@given(items_st, st.integers(-3, 3))
def test_both_searches_agree_on_what_fits(items, delta):
    sec = _Sections(items)
    sec.items = items
    capacity = max(1, lower_bound(items) + delta)
    ties = np.arange(sec.n, dtype=np.int64)
    rank = np.argsort(np.argsort(-sec.size, kind="stable"), kind="stable").astype(np.int64)
    skyline = _decided(sec, capacity, lambda c: sec.native.run(c, rank, 10.0, None))
    for keys in (*OFFSET_ORDER_KEYS, ""):
        run = sec.native.run_by_offset
        by_offset = _decided(sec, capacity, lambda c, k=keys, run=run: run(c, ties, 10.0, None, k))
        assert by_offset == skyline, (keys, capacity, items)


def test_make_plan_meets_a_capacity_target_and_refuses_a_bad_one():
    items = guillotine_instance(40, seed=1)
    trace = items_to_trace(items)
    lb = lower_bound(items) * 512
    plan = make_plan(trace, time_limit=10.0, capacity=lb)
    assert plan.peak <= lb
    assert plan.solver["total"]["optimal"] and plan.solver["total"]["optimality_gap"] == 0.0
    with pytest.raises(MemoError, match="capacity must be a positive number of bytes"):
        make_plan(trace, capacity=0)
