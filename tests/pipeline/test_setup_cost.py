"""The profile's setup cost (issue 45): a CPU recording after the job's first runs no warm-up
iteration, yet logs the same requests (NOTE [Warm-up before logging] in memo/pipeline/step.py)."""

from __future__ import annotations

import pytest
import torch

from memo import runtime
from memo.models import build_model
from memo.pipeline.step import ModelStep, record_step
from memo.profiler.record import model_parts

#: every kind of layer the runtime sizes buffers for, and two it does not
POLICY = ["input-only", "memo", "recompute", "keep"]


def _events(trace: dict) -> list[tuple]:
    return [(e["op"], e.get("id"), e.get("size"), e.get("phase")) for e in trace["events"]]


@pytest.fixture(scope="module")
def job(one_thread):
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 256))
    return model, (ids, torch.randint(0, 512, (1, 256)))


def test_prepared_recording_is_the_warmed_one(job):
    model, batch = job
    heads = []
    hook = model_parts(model).head[0].register_forward_hook(lambda *_: heads.append(1))
    try:
        traces = []
        for warmed in (False, True):
            runtime.wrap(model, alpha=0.25, policy=POLICY, recompute_chunk_tokens=64)
            try:
                heads.clear()
                traces.append(record_step(ModelStep(model, batch), torch.device("cpu"), {}, warmed=warmed))
                # the warm-up is a whole iteration; a prepared recording runs the head once, logged
                assert len(heads) == (1 if warmed else 2)
            finally:
                runtime.unwrap(model, force=True)
    finally:
        hook.remove()
    cold, prepared = traces
    assert len(cold["events"]) > 100
    assert _events(prepared) == _events(cold)
    assert all(p.grad is None for p in model.parameters())
