"""The 512-byte block alignment is defined once (memo.units.ALIGNMENT, NOTE [Block alignment]) and
every Python user imports it; the native allocator's own constant is checked equal to it."""

from __future__ import annotations

import memo.planner as planner
import memo.planner.plan as plan_module
from memo.planner.dsa import Item
from memo.planner.synthetic import items_to_trace

from memo.units import ALIGNMENT


def test_python_users_share_the_one_definition() -> None:
    # memo.allocator checks no offsets itself: the native core does (NOTE [Plan tables are checked in
    # the core]), with the alignment test_the_native_allocator_uses_the_same_alignment compares.
    assert planner.ALIGNMENT is ALIGNMENT and plan_module.ALIGNMENT is ALIGNMENT


def test_the_native_allocator_uses_the_same_alignment() -> None:
    from memo import _C  # memo's __getattr__ loads torch first: memo._C links libtorch

    assert _C.allocator.BLOCK_ALIGNMENT == ALIGNMENT


def test_synthetic_traces_count_sizes_in_alignment_units() -> None:
    trace = items_to_trace([Item(3, 0, 2)])
    assert trace["events"][0]["size"] == 3 * ALIGNMENT
