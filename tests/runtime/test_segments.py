"""Segments of two layers (NOTE [Segments of two layers] in memo/runtime/segments.py): a "segment" layer's
input is recomputed in its backward from the input-only layer before it. Loss and every gradient equal
the unwrapped model's (fp32, < 1e-5); the host holds one input per segment; the policy must pair them."""

from __future__ import annotations

import copy

import pytest
import torch

import memo.runtime as mr
from memo.errors import MemoError
from tests.grads import assert_same_step, random_batch, small_model, train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

POLICY = ["input-only", "segment", "input-only", "segment", "input-only", "keep"]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_segments_match_unwrapped(arch: str) -> None:
    model = small_model(arch, len(POLICY), seed=0)
    ref = copy.deepcopy(model)
    ids, labels = random_batch(model, 2, 48, seed=3)
    mr.wrap(model, alpha=0.0, policy=POLICY, debug_copy_delay_us=200)
    rt = mr.runtime_of(model)
    for step in range(2):  # the second step reuses the buffers
        torch.manual_seed(step)
        want = train_step(ref, ids, labels)
        torch.manual_seed(step)
        assert_same_step(train_step(model, ids, labels), want, rtol=1e-5)
    # one host region per input-only layer, none for a segment layer
    assert rt.n_offloaded == 5
    assert rt.buffers.region_bytes[1] == rt.buffers.region_bytes[3] == 0
    assert rt.host_bytes == 3 * rt.buffers.region_bytes[0] > 0
    mr.unwrap(model)


def test_segment_must_follow_input_only() -> None:
    model = small_model("llama", 3, seed=0)
    for bad in (["segment", "input-only", "keep"], ["memo", "segment", "keep"]):
        with pytest.raises(MemoError, match="segment layer recomputes its input"):
            mr.wrap(model, alpha=0.0, policy=bad)


def _step_peak(policy: list[str]) -> tuple[int, int]:
    """The most CPU bytes live at once in the second recorded step of a tiny Llama under ``policy`` (the
    first sized the rounding buffers), parameters' gradients included; and the bytes of a layer input."""
    from memo.estimate.rank_numbers import analyse_trace
    from memo.profiler.record import record

    model = small_model("llama", len(policy), seed=0)
    ids, labels = random_batch(model, 1, 256, seed=3)
    mr.wrap(model, alpha=0.0, policy=policy)
    train_step(model, ids, labels)
    peak = analyse_trace(record(model, ids, labels).trace).iteration
    mr.unwrap(model)
    return peak, ids.numel() * model.config.hidden * 4


def test_segments_cost_the_device_what_input_only_does() -> None:
    # NOTE [Segments of two layers]: the recomputed input takes the segment layer's own rounding buffer,
    # so the device holds what input-only layers hold, as the planner and the estimate count it
    # (planner/policy.py's device_need: a segment layer is an input-only one).
    (io, x_bytes), (seg, _) = _step_peak(["input-only"] * 4), _step_peak(["input-only", "segment"] * 2)
    assert abs(seg - io) < x_bytes // 4, (seg, io, x_bytes)  # not one layer input more


def test_memo_train_pairs_layers_where_the_host_binds(tmp_path) -> None:
    # `memo train --strategy memo` with a host that holds one of llama-tiny's two layer inputs (2K tokens,
    # float32: 512 KiB each) and a device budget under full recompute's: the planner pairs the layers
    # (NOTE [Segments in the policy]); the run's losses are the plain model's, one input is pinned, and
    # the measured device peak is the plan's device total within 3%.
    import json

    from memo.cli.main import main

    def train(*extra: str) -> dict:
        report = tmp_path / f"{len(extra)}.json"
        argv = ["train", "--model", "llama-tiny", "--seq-len", "2048", "--steps", "2", "--dtype", "float32",
                "--no-progress", "--report", str(report), *extra]
        assert main(argv) == 0
        return json.loads(report.read_text())

    plain = train("--strategy", "none")
    paired = train("--strategy", "memo", "--host-mem-gb", "0.000983", "--gpus-per-node", "1",
                   "--device-mem-gb", "0.018")
    x_bytes = 2048 * 64 * 4
    assert paired["offloaded_layers"] == 2 and paired["host_pinned_bytes"] == x_bytes
    losses = [s["loss"] for s in plain["steps"]]
    assert [s["loss"] for s in paired["steps"]] == pytest.approx(losses, rel=1e-5)
    planned, measured = paired["plan"]["device_total_bytes"], paired["peak_device_bytes"]
    assert abs(measured - planned) <= 0.03 * planned, (measured, planned)
