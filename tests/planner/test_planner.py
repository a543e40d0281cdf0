"""Planner: lower bound, heuristic, MIP, validation, plan files and the allocator contract."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memo.planner import (
    ALIGNMENT,
    Trace,
    load_plan,
    lower_bound,
    make_plan,
    plan_heuristic,
    plan_mip,
    save_plan,
    validate_plan,
)
from memo.planner.dsa import check_placement, greedy
from memo.planner.dsa import lower_bound as units_lower_bound
from memo.planner.dsa_mip import mip
from memo.planner.synthetic import guillotine_instance, items_to_trace, layered_trace

from memo.errors import MemoError, PlanMismatchError


def _random_events(rng: random.Random, n: int, phased: bool) -> list[dict]:
    events, live, next_id = [], [], 0
    phases = ["embed.fwd", "layer.fwd[0]", "layer.fwd[1]", "head.fwd", "layer.bwd[1]", "layer.bwd[0]"]
    for _ in range(n):
        if live and rng.random() < 0.45:
            events.append({"op": "free", "id": live.pop(rng.randrange(len(live)))})
        else:
            ev = {"op": "malloc", "id": next_id, "size": rng.choice([1, 100, 511, 512, 513, 4096, 70000])}
            if phased:
                ev["phase"] = phases[min(len(phases) - 1, len(events) * len(phases) // n)]
            events.append(ev)
            live.append(next_id)
            next_id += 1
    return events


@pytest.mark.filterwarnings("ignore:memo.planner. phase:UserWarning")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(1, 60), phased=st.booleans())
def test_every_plan_is_valid_and_above_lower_bound(seed, n, phased):
    events = _random_events(random.Random(seed), n, phased)
    trace = Trace.from_dict({"version": 1, "events": events})
    lb = lower_bound(trace)
    for plan in (plan_heuristic(trace), make_plan(trace, use_mip=False)):
        validate_plan(plan, trace)
        assert plan.peak >= lb == plan.lower_bound
        assert plan.peak % ALIGNMENT == 0
        assert all(o % ALIGNMENT == 0 for o in plan.offsets)
        assert plan.no_reuse_bytes == sum(a.size for a in trace.allocations)


def test_lower_bound_counts_live_bytes():
    trace = Trace.from_dict({"version": 1, "events": [
        {"op": "malloc", "id": 1, "size": 100}, {"op": "malloc", "id": 2, "size": 50},
        {"op": "free", "id": 1}, {"op": "malloc", "id": 3, "size": 70}, {"op": "free", "id": 2}]})
    assert lower_bound(trace) == 150


def test_greedy_is_fast_on_thousands():
    rng = random.Random(1)
    trace = Trace.from_dict({"version": 1, "events": _random_events(rng, 6000, False)})
    plan = plan_heuristic(trace)
    assert plan.solver["total"]["seconds"] < 20
    assert plan.peak >= plan.lower_bound


def test_mip_closes_the_gap_on_a_hard_instance():
    # 32 rectangles tiling [0, 1000) x [0, 1000): the optimum equals the lower bound.
    items = guillotine_instance(32, seed=11)
    assert units_lower_bound(items) == 1000
    heuristic = greedy(items)
    assert heuristic.peak >= 1150  # greedy misses the tiling by > 15 %
    # The whole MIP on its own (the flat plan runs the exact search before it).
    result = mip(items, time_limit=20, threads=1, warm=heuristic)
    assert check_placement(items, result.offsets, result.peak) is None
    gap_closed = (heuristic.peak - result.peak) / (heuristic.peak - 1000)
    assert gap_closed >= 0.8, result
    assert result.method == "mip"


def test_flat_plan_reaches_the_lower_bound_on_a_300_buffer_instance():
    # The hard case: a few hundred buffers, greedy 30-50 % above an optimum equal to the
    # lower bound.
    items = guillotine_instance(300, seed=1)
    heuristic = greedy(items)
    assert heuristic.peak >= 1.3 * units_lower_bound(items)
    trace = Trace.from_dict(items_to_trace(items))
    plan = plan_mip(trace, time_limit=20)
    assert plan.peak == plan.lower_bound
    info = plan.solver["total"]
    assert info["method"] == "search" and info["optimal"] and not info["heuristic_fallback"]
    # The summary `memo show` prints reads these (it said "heuristic only" before they existed).
    assert plan.solver["solver"] == "cbc" and plan.solver["heuristic_fallback"] is False


def test_validation_catches_overlap_misalignment_and_arena():
    plan = make_plan(layered_trace(2), use_mip=False)
    validate_plan(plan)
    i, j = next((a.index, b.index) for a in plan.allocations for b in plan.allocations
                if a.index < b.index and a.start < b.end and b.start < a.end)
    bad = plan.offsets.copy()
    bad[j] = bad[i]
    plan.offsets = bad
    with pytest.raises(MemoError, match="overlap in time"):
        validate_plan(plan)
    plan.offsets[j] = 100
    with pytest.raises(MemoError, match="not a multiple of 512"):
        validate_plan(plan)
    plan.offsets[j] = plan.peak
    with pytest.raises(MemoError, match="outside the arena"):
        validate_plan(plan)


def test_plan_file_round_trip_and_contract(tmp_path):
    trace = Trace.from_dict(layered_trace(3))
    plan = make_plan(trace, use_mip=False)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    back = load_plan(path, fingerprint=trace.meta["fingerprint"], seq_len=128, micro_batch=1,
                     dtype="bfloat16")
    assert back.offsets == plan.offsets and back.peak == plan.peak
    validate_plan(back, trace)
    tables = back.phase_tables()
    assert "layer.fwd[1]" in tables and "" not in tables
    for a, off in zip(trace.allocations, back.offsets, strict=True):
        if a.phase is not None:
            assert tables[a.phase][a.request] == (a.size, off)
    assert "" in back.phase_tables(include_unphased=True)
    addresses = back.addresses()
    assert len(addresses) == len(trace.allocations)
    assert all(addresses[a.id] == off for a, off in zip(trace.allocations, back.offsets, strict=True))
    data = json.loads(path.read_text())
    assert data["kind"] == "memo.plan" and data["version"] == 1
    assert set(data["level1"]) == {"layer.fwd", "layer.bwd"} and "layer.fwd[2]" in data["level2"]


@pytest.mark.parametrize(("field", "value"), [("fingerprint", "other"), ("seq_len", 256),
                                              ("micro_batch", 2), ("dtype", "float32")])
def test_plan_mismatch_names_the_field(tmp_path, field, value):
    plan = make_plan(layered_trace(2), use_mip=False)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    with pytest.raises(PlanMismatchError) as info:
        load_plan(path, **{field: value})
    msg = str(info.value)
    if field == "fingerprint":  # named with the model: "model=m (fingerprint f)"
        assert f"(fingerprint {plan.meta[field]})" in msg and f"(fingerprint {value})" in msg, msg
    else:
        assert f"{field}={plan.meta[field]!r}" in msg and f"{field}={value!r}" in msg, msg
    assert "memo profile" in msg


def test_bad_plan_files(tmp_path):
    plan = make_plan(layered_trace(2), use_mip=False)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    for mutate, needle in [
        (lambda d: d.update(version=9), "unknown plan version 9"),
        (lambda d: d.update(kind="memo.trace"), "expected kind"),
        (lambda d: d.pop("allocations"), "no 'allocations' field"),
        (lambda d: d.update(peak=512), "outside the arena"),
        (lambda d: d["level2"].update({"layer.fwd[1]": 100}), "not a multiple of 512"),
    ]:
        broken = json.loads(json.dumps(data))
        mutate(broken)
        path.write_text(json.dumps(broken))
        with pytest.raises(MemoError, match=needle):
            load_plan(path)
    path.write_text("{")
    with pytest.raises(MemoError, match="not valid JSON"):
        load_plan(path)
    with pytest.raises(MemoError, match="does not exist"):
        load_plan(tmp_path / "nope.json")


def test_reused_ids_expand_with_suffixes():
    trace = Trace.from_dict({"version": 1, "events": [
        {"op": "malloc", "id": 5, "size": 10}, {"op": "free", "id": 5},
        {"op": "malloc", "id": 5, "size": 10}]})
    plan = plan_heuristic(trace)
    assert set(plan.expanded()) == {"5", "5.1"}
    with pytest.raises(MemoError, match="more than one allocation"):
        plan.addresses()


def test_make_plan_rejects_bad_arguments():
    with pytest.raises(MemoError, match="unknown solver"):
        make_plan(layered_trace(1), solver="gurobi")
    with pytest.raises(MemoError, match="time_limit"):
        make_plan(layered_trace(1), time_limit=0)
    with pytest.raises(MemoError, match="unknown method"):
        make_plan(layered_trace(1), method="magic")


def test_highs_without_highspy_is_a_clear_error():
    try:
        import highspy  # noqa: F401
    except ImportError:
        items = guillotine_instance(32, seed=11)
        with pytest.raises(MemoError, match="highspy"):
            plan_mip(Trace.from_dict(items_to_trace(items)), solver="highs", time_limit=5)
    else:
        pytest.skip("highspy is installed")


def test_solver_failure_keeps_the_heuristic_flagged(monkeypatch):
    import memo.planner.dsa_mip as dsa_mip
    import memo.planner.flat as flat
    import pulp

    class Broken:
        def actualSolve(self, *args, **kwargs):  # noqa: N802 - PuLP's solver interface
            raise pulp.PulpSolverError("solver binary missing")

    monkeypatch.setattr(dsa_mip, "solver_command", lambda *args: Broken())
    # The exact search would find the tiling before any MIP runs: take it out of the way.
    monkeypatch.setattr(flat, "search", lambda items, warm, **kwargs: warm)
    items = guillotine_instance(32, seed=11)
    trace = Trace.from_dict(items_to_trace(items))
    plan = plan_mip(trace, time_limit=3)
    info = plan.solver["total"]
    assert info["heuristic_fallback"] is True
    assert plan.peak <= greedy(items).peak * ALIGNMENT
    validate_plan(plan, trace)
