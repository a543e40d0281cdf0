"""Checkpoints that resume exactly (NOTE [Checkpoints] in memo/train/checkpoint.py, NOTE [Exact resume] in
memo/train/run_control.py), memo's engine and strategy in one process: a resumed run repeats the
uninterrupted run's losses bit for bit, also after SIGTERM (``python -m memo train``, exit 143) and after a
save that died half way; a checkpoint of another run is refused in one line. One uninterrupted run (a
module fixture) serves every comparison; it also evaluates, and its metrics file is checked here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memo.errors import MemoError

#: memo's strategy with the machine given, so that every run (and the SIGTERM subprocess) plans alike
MACHINE = {"alpha": "0.5", "layer_ms": 1.0, "bandwidth_gbps": 10.0, "host_mem_gb": 64.0, "time_limit": 0.5}
RUN = {"model": "tiny", "seq_len": 64, "micro_batch": 1}
STEPS = 8
EVAL = {"eval_every": 3, "eval_batches": 2}


def _train(**run: Any) -> list[Any]:
    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    result = train(TrainConfig(**{**RUN, **run}), progress=False,
                   strategy=make_strategy(StrategyOptions(**MACHINE)), log=lambda _line: None)
    return result.steps


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run: STEPS steps, a checkpoint every 2 (the newest 3 kept), evaluations, metrics."""
    root = tmp_path_factory.mktemp("whole")
    eval_data = root / "eval.txt"
    eval_data.write_bytes(bytes(torch.randint(0, 256, (2048,), generator=torch.Generator().manual_seed(1))
                                .tolist()))
    steps = _train(steps=STEPS, save=str(root / "ck"), save_every=2, keep=3, metrics=str(root / "m.jsonl"),
                   eval_data=str(eval_data), **EVAL)
    return {"root": root, "losses": [s.loss for s in steps], "steps": steps, "eval_data": str(eval_data)}


def test_a_resumed_run_repeats_the_uninterrupted_losses(whole: dict[str, Any], tmp_path: Path) -> None:
    ck = whole["root"] / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000004", "step-00000006",
                                                   "step-00000008"]  # --keep 3
    assert (ck / "latest").read_text().strip() == "step-00000008"
    metrics = tmp_path / "m.jsonl"
    shutil.copy(whole["root"] / "m.jsonl", metrics)
    steps = _train(steps=STEPS, resume=str(ck / "step-00000004"), metrics=str(metrics),
                   eval_data=whole["eval_data"], **EVAL)
    assert [s.step for s in steps] == list(range(5, STEPS + 1))
    assert [s.loss for s in steps] == whole["losses"][4:]  # bit for bit
    assert [s.eval_loss for s in steps] == [s.eval_loss for s in whole["steps"][4:]]
    # the resumed run's metrics continue the file: the lines after step 4 replaced by its own
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in lines] == whole["losses"]


def test_metrics_lines_and_evaluation(whole: dict[str, Any]) -> None:
    """Every step's line has its fields; the evaluations (steps 3 and 6) equal a direct no-grad forward of
    the checkpoint's weights at step 6 over the same fixed batches."""
    from memo.adapters.model import model_adapter_for
    from memo.models import DEFAULT_MAX_SEQ_LEN, build_model, get_config
    from memo.train.checkpoint import read_model_state
    from memo.train.data import ByteFileTokens
    from memo.train.metrics import METRIC_FIELDS

    lines = [json.loads(line) for line in (whole["root"] / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for r in lines:
        assert set(METRIC_FIELDS) <= set(r), r
        assert r["lr"] == 1e-3 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
    assert [r["step"] for r in lines if "eval_loss" in r] == [3, 6]
    config = get_config("tiny")
    model = build_model(config, device="cpu", dtype=torch.float32, max_seq_len=DEFAULT_MAX_SEQ_LEN)
    read_model_state(whole["root"] / "ck" / "step-00000006", model)
    batches = iter(ByteFileTokens(whole["eval_data"], config.vocab_size, RUN["seq_len"], 1, 0))
    with torch.no_grad():
        want = sum(float(model_adapter_for(model, "test").loss(model, *next(batches)))
                   for _ in range(EVAL["eval_batches"])) / EVAL["eval_batches"]
    got = lines[5]["eval_loss"]
    assert abs(got - want) <= 1e-6 * want, (got, want)


def test_a_save_that_dies_leaves_the_previous_checkpoint(whole: dict[str, Any], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second save fails after DCP wrote its files (the writer of the rank's record raises): the
    first checkpoint stays whole and ``latest``; resuming it repeats the uninterrupted losses."""
    from memo.train import checkpoint

    real, calls = checkpoint._write_json, []

    def dying(path: Path, data: dict[str, Any]) -> None:
        calls.append(path)
        if "step-00000004.tmp" in str(path):
            raise OSError("disk died mid-save")
        real(path, data)

    monkeypatch.setattr(checkpoint, "_write_json", dying)
    ck = tmp_path / "ck"
    with pytest.raises(OSError, match="mid-save"):
        _train(steps=4, save=str(ck), save_every=2)
    monkeypatch.setattr(checkpoint, "_write_json", real)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000002", "step-00000004.tmp"]
    assert (ck / "latest").read_text().strip() == "step-00000002"
    assert any(p.name.endswith(".distcp") for p in (ck / "step-00000004.tmp").iterdir())  # died half way
    steps = _train(steps=4, resume=str(ck), save=str(ck))  # the latest whole one: step 2
    assert [s.loss for s in steps] == whole["losses"][2:4]
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000002", "step-00000004"]


def test_sigterm_saves_and_exits_143_and_the_resumed_losses_are_the_uninterrupted(
        whole: dict[str, Any], tmp_path: Path) -> None:
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**RUN, **MACHINE}.items()]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "memo", "train", *flags, "--steps", "500", "--no-progress",
                             "--save", str(ck), "--metrics", str(metrics)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("step    2 "):
                proc.send_signal(signal.SIGTERM)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    stopped = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1, err[-2000:]
    k = int(stopped[0].split("after step ")[1].split(",")[0])
    assert 2 <= k <= STEPS - 2, stopped
    assert (ck / "latest").read_text().strip() == f"step-{k:08d}"
    assert [json.loads(line)["loss"] for line in metrics.read_text().splitlines()] == whole["losses"][:k]
    steps = _train(steps=k + 2, resume=str(ck))
    assert [s.loss for s in steps] == whole["losses"][k:k + 2]


def test_a_checkpoint_of_another_run_is_refused_in_one_line(whole: dict[str, Any], tmp_path: Path) -> None:
    step = whole["root"] / "ck" / "step-00000008"
    with pytest.raises(MemoError, match=r"model fingerprint .* \(checkpoint\) vs .* \(this run\)") as other:
        _train(steps=10, resume=str(step), model="gpt-mini")
    copy = tmp_path / "step-00000008"
    shutil.copytree(step, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "world": 2}))
    with pytest.raises(MemoError, match=r"world size 2 \(checkpoint\) vs 1 \(this run\)") as world:
        _train(steps=10, resume=str(copy))
    with pytest.raises(MemoError, match="nothing is left to run") as done:
        _train(steps=STEPS, resume=str(step))
    for err in (other, world, done):
        assert "\n" not in str(err.value)
