"""A pipeline stage's address plan (NOTE [A stage's address plan] in memo/pipeline/stage_plan.py), in
one process: micro-batch phases, the stage's phase tracker, the plan's record of its stage and schedule,
and a planned ``memo train --micro-batches`` run against its measured peak. The two- and four-rank
pipelines are in tests/distributed/test_pipeline_parallel.py and tests/distributed/test_distributed.py."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from memo.errors import MemoError
from memo.phase_names import is_backward_phase, micro_batch_phase, parse_phase, phase_kind, phase_micro_batch
from memo.pipeline.stage_plan import StagePhases, check_stage_plan


def test_micro_batch_phases_keep_their_kind_and_layer() -> None:
    """NOTE [Micro-batch phases]: "layer.fwd[3]@2" is layer 3's forward of micro-batch 2."""
    assert parse_phase("layer.bwd[3]@2") == ("layer.bwd", 3)
    assert phase_kind("head.fwd@0") == "head.fwd" and is_backward_phase("embed.bwd@5")
    assert phase_micro_batch("layer.fwd[3]@12") == 12 and phase_micro_batch("layer.fwd[3]") is None
    assert micro_batch_phase("layer.fwd[0]", 4) == "layer.fwd[0]@4"
    for bad in ("optimizer@1", "layer.fwd[3]@", "layer.fwd[3]@-1", "layer.fwd@1", "layer.fwd[3]@1@2"):
        with pytest.raises(MemoError, match="is not a phase name"):
            parse_phase(bad)
    with pytest.raises(ValueError, match="takes no micro-batch"):
        micro_batch_phase("layer.fwd[0]@1", 2)


class _Chunk(nn.Module):
    """A middle stage's chunk as megatron builds one: no embedding, no head, ``decoder.layers``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.pre_process = self.post_process = False
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.decoder.layers:
            x = layer(x)
        return x


def test_stage_phases_name_each_backward_for_its_forward() -> None:
    """Two chunks (layers numbered on across them), forwards of micro-batches 0 and 1 before the
    backward of 0, as 1F1B runs them: each backward phase carries the micro-batch of its forward, and a
    second step counts from 0 again."""
    chunks = [_Chunk(2), _Chunk(1)]
    told: list[str | None] = []
    phases = StagePhases(chunks, told.append)
    try:
        for _step in range(2):
            told.clear()
            with phases.iteration():
                outs = [chunks[1](chunks[0](torch.randn(2, 4, requires_grad=True))) for _ in range(2)]
                for out in outs:
                    out.sum().backward()
            named = [p for p in told if p is not None]
            assert named == ["layer.fwd[0]@0", "layer.fwd[1]@0", "layer.fwd[2]@0",
                             "layer.fwd[0]@1", "layer.fwd[1]@1", "layer.fwd[2]@1",
                             "layer.bwd[2]@0", "layer.bwd[1]@0", "layer.bwd[0]@0",
                             "layer.bwd[2]@1", "layer.bwd[1]@1", "layer.bwd[0]@1"], named
            assert told[-1] is None
    finally:
        phases.remove()
    told.clear()
    chunks[0](torch.randn(2, 4))
    assert told == [], "removed hooks still told phases"


SCHEDULE = {"stage": 0, "stages": 2, "virtual_stages": 1, "schedule": "1f1b", "micro_batches": 4,
            "chunk_layers": [2]}


def _plan(pipeline: dict[str, Any] | None) -> Any:
    from memo.planner import Trace, make_plan

    events = [{"op": "malloc", "id": 1, "size": 512, "phase": "layer.fwd[0]@0"}, {"op": "free", "id": 1},
              {"op": "end"}]
    plan = make_plan(Trace.from_dict({"version": 1, "kind": "memo.trace", "meta": {}, "events": events}),
                     progress=False)
    plan.pipeline = pipeline
    return plan


def test_a_stage_plan_records_its_stage_and_schedule_and_refuses_bad_ones(tmp_path) -> None:
    from memo.planner import Plan, load_plan, save_plan

    plan = _plan(dict(SCHEDULE))
    save_plan(plan, tmp_path / "stage0.json")
    assert load_plan(tmp_path / "stage0.json").pipeline == SCHEDULE
    for key, bad in (("stage", "0"), ("micro_batches", -1), ("chunk_layers", [2, 0]), ("schedule", 1)):
        data = plan.to_dict()
        data["pipeline"] = {**SCHEDULE, key: bad}
        with pytest.raises(MemoError, match=rf"pipeline\.{key} must be"):
            Plan.from_dict(data)


def test_a_plan_for_another_stage_schedule_or_a_whole_model_is_refused() -> None:
    check_stage_plan(_plan(dict(SCHEDULE)), SCHEDULE)
    with pytest.raises(MemoError, match=r"another stage or schedule: stage 1 \(this run: 0\)"):
        check_stage_plan(_plan({**SCHEDULE, "stage": 1}), SCHEDULE)
    with pytest.raises(MemoError, match=r"schedule '1f1b' \(this run: 'interleaved-1f1b'\)"):
        check_stage_plan(_plan(dict(SCHEDULE)), {**SCHEDULE, "schedule": "interleaved-1f1b"})
    with pytest.raises(MemoError, match="made for one iteration of a whole model"):
        check_stage_plan(_plan(None), SCHEDULE)


def test_save_plan_outside_a_pipelined_run_is_refused() -> None:
    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    with pytest.raises(MemoError, match="--save-plan writes the stages' plans of a pipelined run"):
        train(TrainConfig(model="tiny", seq_len=64, steps=1), progress=False,
              strategy=make_strategy(StrategyOptions(alpha=0.5, save_plan="p{stage}.json")),
              log=lambda _line: None)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_gradient_accumulation_runs_on_its_plan() -> None:
    """``memo train --engine megatron --micro-batches 2`` in one process: the step of two micro-batches
    recorded and planned (NOTE [A stage's address plan]) serves every planned request, its device total
    is within 3% of the measured peak, and the losses are those of the run without a plan."""
    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    config = TrainConfig(engine="megatron", model="tiny", seq_len=256, steps=2, micro_batches=2)
    runs = {}
    for planned in (True, False):
        strategy = make_strategy(StrategyOptions(alpha=0.5, time_limit=1.0, planned_allocator=planned))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = train(config, progress=False, strategy=strategy, log=lambda _line: None)
        runs[planned] = (result, strategy)
    (result, strategy), (plain, _) = runs[True], runs[False]
    assert [s.loss for s in result.steps] == [s.loss for s in plain.steps]
    total = strategy.plan.device["total_bytes"]
    peak = max(s.peak_memory_bytes for s in result.steps)
    assert abs(peak - total) <= 0.03 * total, (peak, total)
    counts = result.steps[-1].extras["allocator"]
    assert counts["planned"] == 2 * sum(1 for a in strategy.plan.allocations if a.phase is not None), counts
    assert counts["fallback"] == 0, counts
    assert strategy.plan.pipeline["schedule"] == "none" and strategy.plan.pipeline["micro_batches"] == 2


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_a_device_no_policy_fits_is_refused_with_what_full_recompute_needs() -> None:
    """NOTE [A stage's calibrated policy]: under a budget that not even full recompute's recorded step
    fits, and no other policy does, the stage stops with the recorded need and what to change."""
    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    config = TrainConfig(engine="megatron", model="tiny", seq_len=256, steps=1, micro_batches=2)
    strategy = make_strategy(StrategyOptions(device_mem_gb=0.001, time_limit=0.5))
    with warnings.catch_warnings(), pytest.raises(MemoError, match=r"stage 0: no layer policy fits "
                                                  r"--device-mem-gb 0.001: full recompute alone records "
                                                  r"[0-9.]+ MiB; give more device memory"):
        warnings.simplefilter("ignore")
        train(config, progress=False, strategy=strategy, log=lambda _line: None)
