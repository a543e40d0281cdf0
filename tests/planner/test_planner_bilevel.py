"""Bi-level planning on synthetic layered traces."""

from __future__ import annotations

import warnings

import pytest
from memo.planner import Trace, make_plan, plan_bilevel, plan_heuristic, validate_plan
from memo.planner.synthetic import layered_trace


def test_identical_layers_share_level1():
    trace = Trace.from_dict(layered_trace(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = plan_bilevel(trace, time_limit=10)
    validate_plan(plan, trace)
    assert plan.solver["shared_phases"] == {"layer.fwd": 6, "layer.bwd": 6}
    assert plan.solver["own_phases"] == []
    assert set(plan.level2) == {f"layer.{d}[{i}]" for d in ("fwd", "bwd") for i in range(6)}
    # Every shared pass replays the same relative offsets from its block.
    tables = plan.phase_tables()
    rel = plan.level1["layer.fwd"]
    for i in range(6):
        base = plan.level2[f"layer.fwd[{i}]"]
        for k, (_, off) in enumerate(tables[f"layer.fwd[{i}]"]):
            if rel[k] is not None:
                assert off == base + rel[k]
    assert plan.peak <= 1.05 * plan.lower_bound


def test_a_different_layer_is_planned_on_its_own_with_a_warning():
    trace = Trace.from_dict(layered_trace(5, odd_layer=3))
    with pytest.warns(UserWarning, match=r"phase layer\.fwd\[3\] differs"):
        plan = plan_bilevel(trace, time_limit=10)
    validate_plan(plan, trace)
    assert plan.solver["own_phases"] == ["layer.fwd[3]"]
    assert "layer.fwd[3]" not in plan.level2
    assert any("layer.fwd[3]" in w for w in plan.warnings)
    assert "(event 11 of the pass is ('m', 81920, True) where the others have ('m', 16384, False))" \
        in plan.warnings[0]
    assert plan.peak <= 1.05 * plan.lower_bound


def test_bilevel_is_not_worse_than_no_reuse_and_scales_to_32_layers():
    trace = Trace.from_dict(layered_trace(32, hidden=256, seq=512))
    plan = make_plan(trace, time_limit=20)
    validate_plan(plan, trace)
    assert plan.solver["kind"] == "bilevel"
    assert plan.peak <= 1.05 * plan.lower_bound
    assert plan.peak < plan.no_reuse_bytes
    assert plan.solver["seconds"] < 60
    assert plan_heuristic(trace).peak >= plan.lower_bound


def test_trace_without_layer_phases_is_planned_flat():
    trace = Trace.from_dict({"version": 1, "events": [
        {"op": "malloc", "id": 1, "size": 1000, "phase": "embed.fwd"},
        {"op": "malloc", "id": 2, "size": 3000}, {"op": "free", "id": 1}, {"op": "free", "id": 2}]})
    plan = make_plan(trace)
    assert plan.solver["kind"] == "flat" and plan.level2 == {}
    validate_plan(plan, trace)


def test_interrupted_layer_phase_is_planned_individually():
    events = [
        {"op": "malloc", "id": 1, "size": 1000, "phase": "layer.fwd[0]"},
        {"op": "malloc", "id": 2, "size": 1000, "phase": "layer.fwd[0]"}, {"op": "free", "id": 2},
        {"op": "malloc", "id": 3, "size": 500, "phase": "head.fwd"},
        {"op": "malloc", "id": 4, "size": 1000, "phase": "layer.fwd[0]"}, {"op": "free", "id": 4},
        {"op": "free", "id": 3}, {"op": "free", "id": 1},
    ]
    trace = Trace.from_dict({"version": 1, "events": events})
    plan = make_plan(trace)
    validate_plan(plan, trace)
    assert any("interrupted" in w for w in plan.warnings)


def test_profiler_trace_plans_within_five_percent():
    from memo.pipeline import profile

    result = profile("gpt-125m", 1024, device="meta", solve=False, plan=False, layer_ms=10.0,
                     bandwidth_gbps=20.0, host_mem_gb=1000)
    trace = Trace.from_dict(result.trace)
    plan = make_plan(trace, time_limit=10)
    validate_plan(plan, trace)
    assert plan.peak <= 1.05 * plan.lower_bound
    tables = plan.phase_tables()
    assert len(tables["layer.fwd[0]"]) == len(trace.phase_allocations("layer.fwd[0]"))
