"""Level 2 with the blocks' exact shapes: the rigid-group greedy and the bi-level plan it gives."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memo.planner import ALIGNMENT, Trace, lower_bound, plan_bilevel, validate_plan
from memo.planner.dsa import Item, check_placement, greedy
from memo.planner.dsa import lower_bound as units_lower_bound
from memo.planner.groups import compact_groups, expand_groups, greedy_groups


def _random_groups(rng: random.Random, n_groups: int) -> list[list[tuple[int, Item]]]:
    """Groups whose members are packed among themselves by the greedy, as level 1 packs a pass."""
    groups = []
    for _ in range(n_groups):
        t0 = rng.randrange(0, 40)
        members = [Item(rng.randint(0, 9), s := t0 + rng.randrange(0, 15), s + rng.randint(1, 12))
                   for _ in range(rng.choice([1, 1, 2, 4, 7]))]
        rel = greedy(members).offsets
        groups.append(list(zip(rel, members, strict=True)))
    return groups


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 100_000), n_groups=st.integers(1, 25))
def test_greedy_groups_never_overlaps(seed: int, n_groups: int):
    groups = _random_groups(random.Random(seed), n_groups)
    result = greedy_groups(groups)
    assert len(result.offsets) == len(groups) and min(result.offsets) >= 0
    items, offsets = expand_groups(groups, result.offsets)
    assert check_placement(items, offsets, result.peak) is None
    assert result.peak == max(o + it.size for o, it in zip(offsets, items, strict=True))
    assert result.peak >= units_lower_bound(items)
    assert result.optimal == (result.peak == units_lower_bound(items))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 100_000), n_groups=st.integers(1, 25))
def test_compacting_a_rectangle_placement_never_raises_a_group(seed: int, n_groups: int):
    groups = [g for g in _random_groups(random.Random(seed), n_groups) if g]
    rects = [Item(max(r + it.size for r, it in g), min(it.start for _, it in g), max(it.end for _, it in g))
             for g in groups]
    placed = greedy(rects)
    result = compact_groups(groups, placed.offsets)
    assert all(0 <= mine <= theirs for mine, theirs in zip(result.offsets, placed.offsets, strict=True))
    assert result.peak <= placed.peak
    items, offsets = expand_groups(groups, result.offsets)
    assert check_placement(items, offsets, result.peak) is None


def test_single_items_are_placed_as_the_plain_greedy_places_them():
    rng = random.Random(3)
    items = [Item(rng.randint(1, 20), s := rng.randrange(50), s + rng.randint(1, 20)) for _ in range(80)]
    plain = greedy(items)
    grouped = greedy_groups([[(0, it)] for it in items])
    assert grouped.offsets == plain.offsets and grouped.peak == plain.peak


def test_a_group_fills_the_hole_in_another_groups_shape():
    # A staircase: 4 units low on [0, 10), 4 units high on [10, 20). Its rectangle would be 8 x [0, 20);
    # the second group (4 units on [10, 20)) fits under the upper step, so the peak stays 8.
    stairs = [(0, Item(4, 0, 10)), (4, Item(4, 10, 20))]
    under = [(0, Item(4, 10, 20)), (0, Item(1, 20, 25))]
    result = greedy_groups([stairs, under])
    assert result.offsets == [0, 0]
    assert result.peak == 8


def _shrinking_skeleton_trace(n_layers: int, unit: int = 64 * ALIGNMENT) -> dict:
    """Each forward keeps a 4-unit activation; each backward frees it between a small and a big transient.

    Backward of layer i: malloc t1 (1 unit), free the activation, malloc t2 (4 units), free t1, t2.
    Level 1 stacks t1 and t2 (they overlap): a 5-unit block that, as a rectangle, also covers the
    moment before the activation is freed. The true peak is 4 n + 1 units; rectangles need 4 n + 5.
    """
    events: list[dict] = []
    ids = iter(range(1, 10_000))

    def malloc(size: int, phase: str) -> int:
        ident = next(ids)
        events.append({"op": "malloc", "id": ident, "size": size * unit, "phase": phase})
        return ident

    def free(ident: int) -> None:
        events.append({"op": "free", "id": ident})

    acts = []
    for i in range(n_layers):
        acts.append(malloc(4, f"layer.fwd[{i}]"))
        free(malloc(1, f"layer.fwd[{i}]"))
    for i in reversed(range(n_layers)):
        phase = f"layer.bwd[{i}]"
        t1 = malloc(1, phase)
        free(acts[i])
        t2 = malloc(4, phase)
        free(t1)
        free(t2)
    return {"version": 1, "events": events}


def test_shapes_beat_the_rectangles_where_skeletal_tensors_shrink():
    n_layers, unit = 4, 64 * ALIGNMENT
    trace = Trace.from_dict(_shrinking_skeleton_trace(n_layers, unit))
    plan = plan_bilevel(trace, time_limit=5, progress=False)
    validate_plan(plan, trace)
    assert plan.lower_bound == (4 * n_layers + 1) * unit
    # The best any rectangle placement can do: the most block heights and items live at one instant.
    rectangles = []
    for a in trace.allocations:
        if not a.transient:
            rectangles.append(Item(a.size // ALIGNMENT, a.start, a.end))
    for phase in {a.phase for a in trace.allocations}:
        trans = trace.transient(phase)
        height = plan.level1_peak[phase.split("[")[0]] // ALIGNMENT
        rectangles.append(Item(height, min(a.start for a in trans), max(a.end for a in trans)))
    rectangle_bound = units_lower_bound(rectangles) * ALIGNMENT
    assert rectangle_bound == (4 * n_layers + 5) * unit
    assert plan.peak < rectangle_bound
    assert plan.peak == lower_bound(trace)
    level2 = plan.solver["stages"]["level2"]
    assert level2["shapes"] is True
    assert level2["shaped_peak"] == plan.peak and level2["rectangle_peak"] >= rectangle_bound
    # The plan format is unchanged: shared passes sit at their block's base plus the level-1 offsets.
    tables = plan.phase_tables()
    for phase, base in plan.level2.items():
        rel = plan.level1[phase.split("[")[0]]
        for k, (_, off) in enumerate(tables[phase]):
            if rel[k] is not None:
                assert off == base + rel[k]
