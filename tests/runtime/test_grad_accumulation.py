"""Gradient accumulation replays a plan: allocations that outlive the traced iteration
(parameter gradients) are left to the fallback allocator, so micro-batch 2 finds no slot busy; or,
for training that sets the gradients to None every step, placed in the arena beside the activations
freed before them (NOTE [Allocations that outlive the iteration] in planner/core.py)."""

from __future__ import annotations

import copy
import gc
import warnings
from typing import Any

import pytest
import torch
from memo.planner import Plan, Trace, make_plan, validate_plan
from memo.planner.synthetic import layered_trace

import memo.allocator as ma
from memo.errors import MemoError
from memo.models import build_model
from memo.phases import PhaseTracker

SEQ = 32
BATCH = 2
MICRO_BATCHES = 3
STEPS = 2


# ------------------------------------------------------------------------------ synthetic
def _small_trace() -> dict[str, Any]:
    return {"version": 1, "kind": "memo.trace", "events": [
        {"op": "malloc", "id": 1, "size": 100_000},                          # a parameter: unphased
        {"op": "malloc", "id": 2, "size": 4096, "phase": "embed.fwd"},
        {"op": "malloc", "id": 3, "size": 1 << 20, "phase": "layer.bwd[0]"},  # a gradient: never freed
        {"op": "malloc", "id": 4, "size": 8192, "phase": "layer.bwd[0]"},
        {"op": "free", "id": 2},
        {"op": "malloc", "id": 5, "size": 2048, "phase": "layer.bwd[0]"},
        {"op": "free", "id": 4},
        {"op": "free", "id": 5},
        {"op": "end"}]}


@pytest.mark.parametrize("method", ["auto", "flat", "bilevel", "heuristic"])
def test_never_freed_phased_allocation_is_left_to_the_fallback(method: str) -> None:
    trace = Trace.from_dict(_small_trace())
    plan = make_plan(trace, use_mip=False, method=method, unphased="fallback")
    validate_plan(plan, trace)
    tables = plan.phase_tables()
    rows = tables["layer.bwd[0]"]
    # Request indices are kept: the gradient is request 0, with no offset; 1 and 2 are planned.
    assert [size for size, _ in rows] == [1 << 20, 8192, 2048]
    assert rows[0][1] is None
    assert rows[1][1] is not None and rows[2][1] is not None
    assert tables["embed.fwd"][0][1] is not None
    # The arena holds only what is freed inside the iteration: 4096 + 8192 live together at most.
    assert plan.peak == 4096 + 8192
    assert plan.lower_bound == 4096 + 8192
    assert plan.no_reuse_bytes == 4096 + 8192 + 2048
    assert plan.solver["persistent_left_to_fallback"] == {"allocations": 1, "bytes": 1 << 20}
    assert plan.solver["unphased_left_to_fallback"] == {"allocations": 1, "bytes": 100_000}
    # The plan file keeps the gap: the request stays, as null.
    data = plan.to_dict()
    back = Plan.from_dict(data)
    validate_plan(back, trace)
    assert back.phase_tables() == tables
    assert back.solver["persistent_left_to_fallback"] == plan.solver["persistent_left_to_fallback"]


def _with_a_cache() -> dict[str, Any]:
    """_small_trace and a forward-made allocation that is never freed (a cache, not a gradient)."""
    data = _small_trace()
    data["events"].insert(2, {"op": "malloc", "id": 6, "size": 12_288, "phase": "embed.fwd"})
    return data


@pytest.mark.parametrize("method", ["auto", "flat", "bilevel", "heuristic"])
def test_gradients_in_the_arena_share_it_with_the_activations(method: str) -> None:
    trace = Trace.from_dict(_with_a_cache())
    plan = make_plan(trace, use_mip=False, method=method, unphased="fallback", gradients="arena")
    validate_plan(plan, trace)
    rows = plan.phase_tables()["layer.bwd[0]"]
    assert rows[0][0] == 1 << 20 and rows[0][1] is not None  # the gradient has an offset
    assert plan.phase_tables()["embed.fwd"][1] == (12_288, None)  # the cache is the fallback's
    assert plan.solver["gradients_in_arena"] == {"allocations": 1, "bytes": 1 << 20}
    assert plan.solver["persistent_left_to_fallback"] == {"allocations": 1, "bytes": 12_288}
    # The gradient lives from its backward pass on: with it, 4096 and 8192 are live at once at most.
    assert plan.lower_bound == (1 << 20) + 4096 + 8192
    assert plan.peak >= plan.lower_bound
    back = Plan.from_dict(plan.to_dict())
    validate_plan(back, trace)
    assert back.phase_tables() == plan.phase_tables()


def test_gradients_in_the_arena_are_validated() -> None:
    trace = Trace.from_dict(_with_a_cache())
    plan = make_plan(trace, use_mip=False, unphased="fallback", gradients="arena")
    data = copy.deepcopy(plan.to_dict())
    data["solver"]["gradients_in_arena"] = {"allocations": 2, "bytes": 1 << 20}
    with pytest.raises(MemoError, match="gradients_in_arena"):
        Plan.from_dict(data)
    bad = copy.deepcopy(plan)
    bad.offsets[[a.id for a in bad.allocations].index(3)] = None  # the gradient lost its offset
    with pytest.raises(MemoError, match="gradient"):
        validate_plan(bad, trace)
    with pytest.raises(MemoError, match="gradients must be"):
        make_plan(trace, use_mip=False, unphased="fallback", gradients="host")


def test_default_plan_still_places_every_allocation() -> None:
    trace = Trace.from_dict(_small_trace())
    plan = make_plan(trace, use_mip=False)
    validate_plan(plan, trace)
    assert all(off is not None for off in plan.offsets)
    assert "persistent_left_to_fallback" not in plan.solver
    assert plan.peak >= (1 << 20) + 100_000


def test_old_plan_files_without_the_key_still_load() -> None:
    trace = Trace.from_dict(_small_trace())
    plan = make_plan(trace, use_mip=False, unphased="fallback")
    data = copy.deepcopy(plan.to_dict())
    # A plan from before: the gradient had an arena offset and no record of what was left out (nor the
    # summary fields of NOTE [A plan's summary], which later plans carry).
    del data["solver"]["persistent_left_to_fallback"], data["allocation_count"], data["phase_peaks"]
    data["items"]["layer.bwd[0]"]["0"] = plan.peak
    data["peak"] = plan.peak + (1 << 20)
    old = Plan.from_dict(data)
    assert old.phase_tables()["layer.bwd[0]"][0] == (1 << 20, plan.peak)


def test_the_unphased_mode_is_a_field_of_the_plan_and_of_its_file() -> None:
    trace = Trace.from_dict(_small_trace())
    replay = make_plan(trace, use_mip=False, unphased="fallback")
    whole = make_plan(trace, use_mip=False)
    assert (replay.unphased, whole.unphased) == ("fallback", "plan")
    assert Plan.from_dict(replay.to_dict()).unphased == "fallback"
    assert Plan.from_dict(whole.to_dict()).unphased == "plan"
    # Checked against a trace, validation branches on the field, not on the solver record.
    validate_plan(whole, trace)
    record_only = copy.deepcopy(whole)
    record_only.solver["unphased_left_to_fallback"] = {"allocations": 1, "bytes": 100_000}
    validate_plan(record_only, trace)
    wrong = copy.deepcopy(replay)
    wrong.unphased = "plan"
    with pytest.raises(MemoError, match="does not match the trace"):
        validate_plan(wrong, trace)
    wrong.unphased = "sometimes"
    with pytest.raises(MemoError, match="unphased must be"):
        validate_plan(wrong)
    data = replay.to_dict()
    data["unphased"] = "sometimes"
    with pytest.raises(MemoError, match="unphased"):
        Plan.from_dict(data)
    # Files from before the field: the mode is read from the solver record they carry.
    for plan, mode in ((replay, "fallback"), (whole, "plan")):
        data = plan.to_dict()
        del data["unphased"]
        old = Plan.from_dict(data)
        assert old.unphased == mode
        validate_plan(old, trace)


def test_validation_catches_a_wrong_record() -> None:
    trace = Trace.from_dict(_small_trace())
    plan = make_plan(trace, use_mip=False, unphased="fallback")
    data = copy.deepcopy(plan.to_dict())
    data["solver"]["persistent_left_to_fallback"] = {"allocations": 2, "bytes": 1 << 20}
    with pytest.raises(MemoError, match="persistent_left_to_fallback"):
        Plan.from_dict(data)
    # A planned allocation with no offset in a replay plan is not one the planner leaves out.
    bad = Plan.from_dict(plan.to_dict())
    bad.offsets[bad.offsets.index(None) + 1] = None
    with pytest.raises(MemoError, match="freed"):
        validate_plan(bad, trace)


def _with_gradients(n_layers: int) -> tuple[dict[str, Any], int]:
    """A layered trace whose backward passes each make one never-freed gradient (request 1)."""
    data = layered_trace(n_layers)
    events: list[dict[str, Any]] = []
    seen: set[str] = set()
    next_id = 10_000
    for ev in data["events"]:
        events.append(ev)
        phase = ev.get("phase", "")
        if ev["op"] == "malloc" and phase.startswith("layer.bwd") and phase not in seen:
            seen.add(phase)
            events.append({"op": "malloc", "id": next_id, "size": 3 * 4096, "phase": phase})
            next_id += 1
    data["events"] = events
    return data, len(seen)


@pytest.mark.parametrize("method", ["auto", "flat", "bilevel"])
def test_layered_gradients_keep_request_indices(method: str) -> None:
    data, n_grads = _with_gradients(4)
    trace = Trace.from_dict(data)
    replay = make_plan(trace, use_mip=False, method=method, unphased="fallback")
    validate_plan(replay, trace)
    # The same trace without the gradients: every other request keeps its offset pattern.
    plain = Trace.from_dict({**data, "events": [ev for ev in data["events"] if ev.get("id", 0) < 10_000]})
    reference = make_plan(plain, use_mip=False, method=method, unphased="fallback")
    left = {"allocations": n_grads, "bytes": n_grads * 3 * 4096}
    assert replay.solver["persistent_left_to_fallback"] == left
    assert replay.lower_bound == reference.lower_bound
    assert replay.peak == reference.peak
    got, want = replay.phase_tables(), reference.phase_tables()
    assert set(got) == set(want)
    for phase, rows in got.items():
        if phase.startswith("layer.bwd"):
            assert rows[1] == (3 * 4096, None)
            rows = rows[:1] + rows[2:]
        assert rows == want[phase], phase
    if method == "bilevel":
        assert replay.solver["kind"] == "bilevel" and replay.level2
    back = Plan.from_dict(replay.to_dict())
    validate_plan(back, trace)
    assert back.phase_tables() == got


# ------------------------------------------------------------------------------ end to end
class Accumulation:
    """A reference model trained with ``micro_batches`` micro-batches per optimizer step."""

    def __init__(self, name: str, micro_batches: int = MICRO_BATCHES) -> None:
        self.micro_batches = micro_batches
        torch.manual_seed(0)
        self.model = build_model(name)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.tracker = PhaseTracker(self.model.embedding, self.model.layers, self.model.head)
        self.tracker.add_listener(ma.set_phase)
        vocab = self.model.head.weight.shape[0]
        gen = torch.Generator().manual_seed(1)
        self.batches = [(torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
                         torch.randint(0, vocab, (BATCH, SEQ), generator=gen))
                        for _ in range(1 + STEPS * micro_batches)]

    def micro_step(self, i: int) -> None:
        ids, labels = self.batches[i]
        with self.tracker.iteration():
            loss = self.model(ids, labels)
            (loss / self.micro_batches).backward()
        del loss

    def profile(self) -> dict[str, Any]:
        """One micro-batch as the first of a step: gradients start out as None."""
        self.optimizer.zero_grad(set_to_none=True)
        with ma.logging() as trace:
            self.micro_step(0)
        self.optimizer.zero_grad(set_to_none=True)
        return trace

    def train(self) -> list[list[torch.Tensor]]:
        """STEPS optimizer steps of ``micro_batches`` micro-batches; the accumulated gradients per step."""
        grads = []
        for step in range(STEPS):
            self.optimizer.zero_grad(set_to_none=True)
            for k in range(self.micro_batches):
                self.micro_step(1 + step * self.micro_batches + k)
            grads.append([p.grad.clone() for p in self.model.parameters()])
            self.optimizer.step()
        return grads

    def close(self) -> None:
        self.tracker.remove()


def _reference(name: str, micro_batches: int = MICRO_BATCHES) -> list[list[torch.Tensor]]:
    run = Accumulation(name, micro_batches)
    try:
        run.profile()  # the same warm-up step as the planned run (the optimizer does not move)
        return run.train()
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_gradient_accumulation_replays_the_plan(name: str) -> None:
    want = _reference(name)
    run = Accumulation(name)
    try:
        trace = run.profile()
        plan = make_plan(trace, use_mip=False, progress=False, unphased="fallback")
        left = plan.solver["persistent_left_to_fallback"]
        n_params = sum(1 for _ in run.model.parameters())
        assert left["allocations"] >= n_params - 1  # every gradient (a tied one is made once)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ma.PlanDeviationWarning)
            with ma.planned(plan):
                got = run.train()
                s = ma.stats()
        assert s["slot_busy"] == 0 and s["deviations"] == 0 and s["invalid_frees"] == 0
        assert s["planned_hits"] > 0
    finally:
        run.close()
    for step_got, step_want in zip(got, want, strict=True):
        for g, w in zip(step_got, step_want, strict=True):
            assert torch.equal(g, w)  # the same ops on the same values: bit for bit


@pytest.mark.slow
def test_gradients_in_the_arena_replay_exactly_and_hold_less() -> None:
    """One micro-batch per step (gradients None before each forward): the arena plan replays with
    no deviation and the fallback holds less than with the gradients in it; under accumulation the
    same plan still gives the same gradients, its busy slots going to the fallback."""
    held = {}
    for micro_batches in (1, MICRO_BATCHES):
        want = _reference("llama-tiny", micro_batches)
        for gradients in ("fallback", "arena"):
            run = Accumulation("llama-tiny", micro_batches)
            try:
                plan = make_plan(run.profile(), use_mip=False, unphased="fallback", gradients=gradients)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ma.PlanDeviationWarning)
                    with ma.planned(plan):
                        ma.reset_stats()
                        before = ma.stats()["fallback"]["allocated_bytes"]  # earlier runs' tensors
                        got = run.train()
                        s = ma.stats()
            finally:
                run.close()
            for step_got, step_want in zip(got, want, strict=True):
                for g, w in zip(step_got, step_want, strict=True):
                    assert torch.equal(g, w)
            del got  # its copies live in the fallback pool: they would count in the next run's peak
            gc.collect()
            assert s["invalid_frees"] == 0
            if micro_batches == 1:
                assert s["deviations"] == 0, (gradients, s["first_deviation"])
                held[gradients] = (s["arena_bytes"], s["fallback"]["peak_allocated_bytes"] - before)
            elif gradients == "arena":
                assert s["slot_busy"] > 0  # micro-batch 2 found its gradients' slots still owned
    grads = sum(p.numel() * p.element_size() for p in build_model("llama-tiny").parameters())
    # The fallback no longer holds the gradients...
    assert held["fallback"][1] - held["arena"][1] >= grads * 0.9
    # ...and the arena took few of them on: their bytes were mostly its idle ones at the end of
    # backward, so the device holds less (counted without the fallback's segment rounding, which at
    # this size is one segment either way). Here the whole sequence is one chunk of the loss, whose
    # backward runs the final norm again (NOTE [The final norm in the loss's chunks]): ~0.78.
    assert sum(held["fallback"]) - sum(held["arena"]) >= grads * 0.75


def test_the_optimizers_moment_counts_the_arena_by_the_plans_rule() -> None:
    """NOTE [The optimizer's moment]: the arena (most live at once of what the plan places) beside
    what else outlives the iteration, whichever side the gradients are on (planner/outliving.py)."""
    from memo.pipeline.device import optimizer_moment

    trace = Trace.from_dict(_with_a_cache())
    unphased, cache, grad = 100_000, 12_288, 1 << 20
    # Gradients in the fallback: the arena holds 4096 + 8192 at most.
    assert optimizer_moment(trace, 7, "fallback") == (4096 + 8192) + (unphased + cache + grad) + 7
    # Gradients in the arena: it holds 4096 + the gradient + 8192 at once.
    assert optimizer_moment(trace, 7, "arena") == (4096 + grad + 8192) + (unphased + cache) + 7
