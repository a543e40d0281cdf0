"""The canonical-placement search (planner/search.py) against brute force and hard instances."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memo.planner.dsa import DSAResult, Item, check_placement, greedy, lower_bound, overlapping_pairs
from memo.planner.search import count_overlapping_pairs, fits, search
from memo.planner.synthetic import guillotine_instance

from memo import _planner_native


def brute_force_optimum(items: list[Item]) -> int:
    """Smallest peak over every placement order, each item at its lowest free offset.

    Placing the items of an optimal placement in order of their offsets, each at its lowest
    free offset, puts every item at or below its optimal offset, so this is exact.
    """
    best = sum(it.size for it in items)
    for order in itertools.permutations(range(len(items))):
        placed: list[tuple[int, int]] = []  # (item, offset)
        peak = 0
        for i in order:
            it = items[i]
            busy = sorted((o, o + items[j].size) for j, o in placed
                          if items[j].start < it.end and it.start < items[j].end)
            off = 0
            for lo, hi in busy:
                if off + it.size <= lo:
                    break
                off = max(off, hi)
            placed.append((i, off))
            peak = max(peak, off + it.size)
        best = min(best, peak)
    return best


item_lists = st.lists(
    st.tuples(st.integers(1, 9), st.integers(0, 8), st.integers(1, 5)).map(
        lambda t: Item(size=t[0], start=t[1], end=t[1] + t[2])),
    min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(item_lists)
def test_search_finds_the_exact_optimum(items):
    warm = greedy(items)
    result = search(items, warm, time_limit=30)
    assert check_placement(items, result.offsets, result.peak) is None
    assert result.optimal
    assert result.peak == brute_force_optimum(items)


def test_an_infeasible_capacity_is_proven_so():
    # 6 units are live at the busiest instant, but no placement fits in 6 (found by random
    # search, confirmed by brute force below).
    items = [Item(2, 1, 3), Item(1, 1, 4), Item(3, 4, 6), Item(3, 0, 1), Item(3, 0, 2), Item(3, 3, 5),
             Item(1, 2, 4)]
    optimum = brute_force_optimum(items)
    assert optimum > lower_bound(items)
    out = fits(items, optimum - 1, deadline=time.perf_counter() + 30)
    assert out.offsets is None and out.exhausted
    out = fits(items, optimum, deadline=time.perf_counter() + 30)
    assert out.offsets is not None
    assert check_placement(items, out.offsets, optimum) is None


@pytest.mark.parametrize("seed", [1, 2, 3, 7])
def test_search_reaches_the_lower_bound_on_hard_300_buffer_instances(seed):
    # Tilings of a full strip: the optimum equals the lower bound; greedy ends 35-60% above it.
    items = guillotine_instance(300, seed=seed)
    lb = lower_bound(items)
    warm = greedy(items)
    assert warm.peak >= 1.3 * lb
    result = search(items, warm, time_limit=30)
    assert check_placement(items, result.offsets, result.peak) is None
    assert result.peak == lb and result.optimal


def test_search_never_returns_worse_than_its_warm_start():
    items = guillotine_instance(300, seed=0)
    warm = greedy(items)
    # No time at all: the warm start comes back unchanged, not proven optimal.
    result = search(items, warm, time_limit=0.0)
    assert result.peak == warm.peak and result.offsets == warm.offsets
    assert not result.optimal
    # A warm start already at the lower bound is proven optimal without any search.
    items = guillotine_instance(300, seed=1)
    tiled = search(items, greedy(items), time_limit=30)
    again = search(items, DSAResult(tiled.offsets, tiled.peak, "given", 0.0), time_limit=30)
    assert again.optimal and again.offsets == tiled.offsets and again.extra["runs"] == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 8)), max_size=30))
def test_pair_count_matches_the_pair_list(spans):
    items = [Item(1, s, s + d) for s, d in spans]
    assert count_overlapping_pairs(items) == len(overlapping_pairs(items))


def test_an_empty_lifetime_is_refused():
    with pytest.raises(ValueError, match="item 0 .* ends before it starts"):
        search([Item(3, 5, 5), Item(2, 0, 4)], greedy([Item(2, 0, 4), Item(2, 0, 4)]), time_limit=1)


def test_the_native_run_refuses_arrays_that_do_not_fit_together():
    native_search = _planner_native.DsaSearch
    one = np.array([1], dtype=np.int64)
    zero = np.array([0], dtype=np.int64)
    none = np.array([], dtype=np.int64)
    with pytest.raises(ValueError, match="size, first and last must have one entry per item"):
        native_search(one, zero, np.array([1, 1]), zero, zero, one, np.array([0, 0]), none, one)
    with pytest.raises(ValueError, match="item 0 spans sections \\[0, 2\\)"):
        native_search(one, zero, np.array([2]), zero, zero, one, np.array([0, 0]), none, one)
    with pytest.raises(ValueError, match="neighbour_items entry 0 is not an item index"):
        native_search(one, zero, one, zero, zero, one, np.array([0, 1]), np.array([5]), one)
    with pytest.raises(ValueError, match="length must have one entry per item, got 0 for 1"):
        native_search(one, zero, one, zero, zero, one, np.array([0, 0]), none, none)
    native = native_search(one, zero, one, zero, zero, one, np.array([0, 0]), none, one)
    with pytest.raises(ValueError, match="rank must have one entry per item, got 2 for 1"):
        native.run(1, np.array([0, 1]), 1.0, None)
    with pytest.raises(ValueError, match="node_limit must be >= 0 or None"):
        native.run(1, zero, 1.0, -3)
    with pytest.raises(ValueError, match="rank must have one entry per item, got 2 for 1"):
        native.run_by_offset(1, np.array([0, 1]), 1.0, None)
    with pytest.raises(ValueError, match="keys must be letters of TWACZ"):
        native.run_by_offset(1, zero, 1.0, None, "TX")
    assert native.run(1, zero, 1.0, None) == ([0], False, 1)
    assert native.run_by_offset(1, zero, 1.0, None, "TWA") == ([0], False, 2)  # the root and the leaf
    assert native.run_by_offset(0, zero, 1.0, None) == (None, True, 0)
    assert native.run(0, zero, 1.0, None) == (None, True, 0)
