"""End to end on CPU: profile one iteration with the logging allocator, plan it,
replay later iterations from the plan, and compare with plain PyTorch bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from memo.planner import make_plan as planner_make_plan

import memo.allocator as ma
from memo import _C
from memo.errors import MemoError
from memo.models import build_model
from memo.phases import PhaseTracker

ALIGN = 512
SEQ = 64
BATCH = 2


def make_plan(trace: dict[str, Any]) -> Any:
    """memo.planner's bi-level plan (greedy levels: the MIP is the planner's own tests' business)."""
    return planner_make_plan(trace, use_mip=False, progress=False, unphased="fallback")


def round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_tables_and_peak(plan: Any) -> tuple[dict[str, list[tuple[int, int | None]]], int]:
    return ma.normalize_plan(plan)


class Run:
    """One model + optimizer-free training loop; records loss and gradients per iteration."""

    def __init__(self, name: str, seq: int = SEQ) -> None:
        torch.manual_seed(0)
        self.model = build_model(name)
        self.seq = seq
        self.tracker = PhaseTracker(self.model.embedding, self.model.layers, self.model.head)
        self.tracker.add_listener(ma.set_phase)
        vocab = self.model.head.weight.shape[0]
        gen = torch.Generator().manual_seed(1)
        self.batches = [
            (
                torch.randint(0, vocab, (BATCH, seq), generator=gen),
                torch.randint(0, vocab, (BATCH, seq), generator=gen),
            )
            for _ in range(4)
        ]

    def step(self, i: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in self.model.parameters():
            p.grad = None  # frees last iteration's gradients (outside phases)
        ids, labels = self.batches[i]
        with self.tracker.iteration():
            loss = self.model(ids, labels)
            loss.backward()
        out = loss.detach().clone(), [p.grad.clone() for p in self.model.parameters()]
        del loss
        return out

    def close(self) -> None:
        self.tracker.remove()


def reference(name: str, iters: int, seq: int = SEQ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    run = Run(name, seq)
    try:
        return [run.step(i) for i in range(iters)]
    finally:
        run.close()


Result = tuple[torch.Tensor, list[torch.Tensor]]


def assert_same(got: Result, want: Result) -> None:
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.equal(g, w)


def profile(run: Run, i: int) -> tuple[dict[str, Any], tuple[torch.Tensor, list[torch.Tensor]]]:
    with ma.logging() as trace:
        result = run.step(i)
    return trace, result


def layer_requests(trace: dict[str, Any]) -> int:
    return sum(1 for e in trace["events"] if e["op"] == "malloc" and e.get("phase", "").startswith("layer."))


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_replay_is_exact_and_fully_planned(name: str) -> None:
    want = reference(name, 4)
    run = Run(name)
    try:
        assert_same(run.step(0), want[0])  # warm-up, plain PyTorch
        trace, got = profile(run, 1)
        assert_same(got, want[1])
        assert trace["kind"] == "memo.trace" and trace["meta"] == {"recorder": "allocator", "device": "cpu"}
        plan = make_plan(trace)
        tables, peak = plan_tables_and_peak(plan)
        planned_requests = sum(1 for rows in tables.values() for _, off in rows if off is not None)
        assert layer_requests(trace) > 0
        with warnings.catch_warnings():
            warnings.simplefilter("error", ma.PlanDeviationWarning)
            for i in (2, 3):
                with ma.planned(plan):
                    got = run.step(i)
                    s = ma.stats()
                assert_same(got, want[i])
                assert s["deviations"] == 0 and s["slot_busy"] == 0 and s["invalid_frees"] == 0
                assert s["planned_hits"] == planned_requests
                assert s["arena_high_water"] == max(off + size for rows in tables.values()
                                                    for size, off in rows if off is not None)
                # The plan's peak is max(offset + size) rounded up to the planner's 512-byte units;
                # allocations outside phases are left to the fallback (unphased="fallback"), so the
                # arena's high-water mark reaches the peak.
                assert round_up(s["arena_high_water"]) == peak
                assert s["arena_bytes"] >= peak
        assert not _C.allocator.cpu_installed()
    finally:
        run.close()


def test_replay_for_another_sequence_length_falls_back_and_warns_once() -> None:
    run = Run("tiny", seq=SEQ)
    run.step(0)
    trace, _ = profile(run, 1)
    plan = make_plan(trace)
    run.close()

    want = reference("tiny", 3, seq=2 * SEQ)
    other = Run("tiny", seq=2 * SEQ)
    try:
        other.step(0)
        other.step(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ma.planned(plan):
                got = other.step(2)
                s = ma.stats()
        assert_same(got, want[2])
        deviations = [w for w in caught if issubclass(w.category, ma.PlanDeviationWarning)]
        assert len(deviations) == 1, [str(w.message) for w in deviations]
        assert s["deviations"] > 0 and s["first_deviation"] is not None
        dev = s["first_deviation"]
        assert dev["actual"] != dev["expected"]
        message = str(deviations[0].message)
        assert str(dev["expected"]) in message and dev["phase"] in message
    finally:
        other.close()


def test_poisoned_replay_is_exact() -> None:
    want = reference("llama-tiny", 3)
    run = Run("llama-tiny")
    try:
        run.step(0)
        trace, _ = profile(run, 1)
        plan = make_plan(trace)
        with ma.planned(plan, poison=True):
            got = run.step(2)
            assert ma.stats()["deviations"] == 0
        assert_same(got, want[2])
    finally:
        run.close()


def test_tensor_kept_alive_is_never_overwritten() -> None:
    """A tensor that outlives its profiled lifetime keeps its bytes; the request that
    the plan put there is served by the fallback and counted."""
    run = Run("tiny")
    try:
        run.step(0)
        trace, _ = profile(run, 1)
        plan = make_plan(trace)
        tables, _ = plan_tables_and_peak(plan)
        size, _ = tables["layer.fwd[0]"][0]
        n = size // 4
        with ma.planned(plan, poison=True):
            run.tracker.set("layer.fwd[0]")
            kept = torch.full((n,), 7.0)  # takes layer.fwd[0]'s first slot and is not freed
            run.tracker.set(None)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ma.PlanDeviationWarning)
                run.step(2)
            s = ma.stats()
        assert s["slot_busy"] >= 1
        assert torch.equal(kept, torch.full((n,), 7.0))
    finally:
        run.close()


def test_context_restores_allocator_on_exception() -> None:
    tables = {"layer.fwd[0]": [(4096, 0)]}
    with pytest.raises(ValueError, match="boom"):
        with ma.planned(tables, peak=4096):
            assert _C.allocator.cpu_installed()
            x = torch.ones(1024)
            raise ValueError("boom")
    assert not _C.allocator.cpu_installed()
    assert torch.equal(x, torch.ones(1024))  # allocated inside, freed after: fine
    del x
    assert ma.stats()["invalid_frees"] == 0


def test_contexts_do_not_nest() -> None:
    with ma.planned({"layer.fwd[0]": [(4096, 0)]}, peak=4096):
        with pytest.raises(MemoError, match="do not nest"):
            with ma.logging():
                pass
    assert not _C.allocator.cpu_installed()


def test_fallback_exhaustion_inside_torch_is_clear() -> None:
    with ma.planned({}, peak=0, fallback_limit=4 << 20):
        ma.empty_cache()
        with pytest.raises(RuntimeError, match=r"fallback pool \(cpu\) cannot serve a request of 67108864 B"):
            torch.empty(16 << 20, dtype=torch.float32)
    assert not _C.allocator.cpu_installed()
    torch.empty(16 << 20)  # plain PyTorch again


def test_trace_format_and_tensors_across_the_swap() -> None:
    before = torch.arange(1000.0)
    with ma.logging() as trace:
        ma.set_phase("layer.fwd[0]")
        a = torch.zeros(256)
        b = torch.empty(1000)  # freed after the context: its free is not in the trace
        del a
        ma.set_phase(None)
        c = torch.ones(8)
    del before, b, c
    events = trace["events"]
    assert events[0] == {"op": "malloc", "id": 0, "size": 1024, "phase": "layer.fwd[0]"}
    assert events[1] == {"op": "malloc", "id": 1, "size": 4000, "phase": "layer.fwd[0]"}
    assert events[2] == {"op": "free", "id": 0}
    assert events[3] == {"op": "malloc", "id": 2, "size": 32}
    assert events[-1] == {"op": "end"}
    assert ma.stats()["invalid_frees"] == 0
