"""`memo train`: the flags reach the strategy and the report (alpha, host bytes, recomputed tokens,
planned allocations), the report follows its schema, the loss plot is drawn, and bad flags or
plans are refused with clear messages.

The numerics of memo's wrapper against plain autograd are test_runtime.py's; the runs here are as
short as the checks allow.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from memo.cli.main import main
from memo.errors import MemoError
from memo.models import fingerprint, get_config
from memo.train import load_report, validate_report

STEPS = 2
COMMON = ["--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--steps", str(STEPS), "--no-progress",
          "--lr", "3e-3"]


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Four 2-step runs of tiny: the baseline and memo at alpha 0, 0.25 and 1."""
    torch.set_num_threads(1)  # nested backward calls crawl with oversubscribed intra-op threads
    out = tmp_path_factory.mktemp("curves")
    runs = {"none": ["--strategy", "none"]}
    runs |= {f"memo-{a}": ["--strategy", "memo", "--alpha", a] for a in ("0", "0.25", "1")}
    reports = {}
    for name, flags in runs.items():
        path = out / f"{name}.json"
        extra = []
        if name == "memo-1":  # the last run draws every curve
            extra = ["--plot", str(out / "loss.png"), "--compare",
                     *(str(out / f"{n}.json") for n in runs if n != name)]
        assert main(["train", *COMMON, *flags, "--report", str(path), *extra]) == 0
        reports[name] = load_report(path)
    reports["_dir"] = {"path": str(out)}
    return reports


def test_alpha_reaches_the_run_and_its_report(curves: dict[str, dict]) -> None:
    base = [s["loss"] for s in curves["none"]["steps"]]
    assert len(base) == STEPS
    for alpha in ("0", "0.25", "1"):
        rep = curves[f"memo-{alpha}"]
        assert rep["alpha"] == float(alpha)
        # Step 2 follows an optimizer step: the profile before training left no gradients behind.
        losses = [s["loss"] for s in rep["steps"]]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, base, strict=True))
        assert worst < 1e-5, f"alpha={alpha}: loss differs from the baseline by {worst:.2e} (relative)"
        # tiny has 4 layers: two offload (the last two never do), so the machinery really ran.
        assert rep["host_pinned_bytes"] > 0
        assert rep["allocator"]["planned"] > 0 and rep["allocator"]["fallback"] == 0
    # More offloaded tokens -> more pinned host bytes, fewer recomputed tokens.
    hosts = [curves[f"memo-{a}"]["host_pinned_bytes"] for a in ("0", "0.25", "1")]
    assert hosts[0] < hosts[1] < hosts[2]
    recomputed = [curves[f"memo-{a}"]["steps"][-1]["recomputed_tokens"] for a in ("0", "0.25", "1")]
    assert recomputed[0] > recomputed[1] > recomputed[2] == 0
    assert all(s["bytes_offloaded"] > 0 for s in curves["memo-0"]["steps"])


def test_loss_plot_is_written(curves: dict[str, dict]) -> None:
    png = Path(curves["_dir"]["path"]) / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_follows_its_schema(curves: dict[str, dict]) -> None:
    rep = curves["memo-0.25"]
    validate_report(rep)
    assert rep["version"] == 1 and rep["kind"] == "memo.report"
    assert (rep["model"], rep["seq_len"], rep["micro_batch"], rep["strategy"]) == ("tiny", 64, 2, "memo")
    assert rep["peak_device_bytes"] == max(s["peak_device_bytes"] for s in rep["steps"])
    for step in rep["steps"]:
        assert step["tgs"] == pytest.approx(64 * 2 / step["step_time_s"])
    # The schema bites: a report missing a field, or with a bad value, is refused.
    for mutate, needle in (
        (lambda r: r.pop("allocator"), "allocator"),
        (lambda r: r.update(alpha=1.5), "alpha"),
        (lambda r: r.update(version=2), "version"),
        (lambda r: r["steps"][0].update(loss="nan"), "loss"),
        (lambda r: r.update(steps=[]), "steps"),
    ):
        bad = copy.deepcopy(rep)
        mutate(bad)
        with pytest.raises(MemoError, match=needle):
            validate_report(bad)


def test_report_file_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1, "kind": "memo.report", "steps": [')
    with pytest.raises(MemoError, match="not valid JSON"):
        load_report(broken)
    broken.write_text(json.dumps({"version": 1, "kind": "memo.report"}))
    with pytest.raises(MemoError, match="no 'model' field"):
        load_report(broken)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--alpha", "1.5"], "must be in [0, 1]"),
        (["--alpha", "lots"], "'auto' or a number"),
        (["--seq-len", "0"], "positive"),
        (["--seq-len", "-5"], "positive"),
        (["--seq-len", "12x"], "positive integer"),
        (["--steps", "0"], "positive integer"),
        (["--strategy", "magic"], "invalid choice"),
        (["--model", "gpt-9000"], "gpt-9000"),
    ],
)
def test_bad_flags_are_refused(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        code = main(["train", "--steps", "1", "--no-progress", *flags])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--strategy", "none", "--alpha", "0.5"], "apply to --strategy memo only"),
        (["--strategy", "full-recompute", "--plan", "p.json"], "apply to --strategy memo only"),
        (["--plan", "p.json", "--alpha", "0.5"], "not both"),
        (["--compare", "nothing.json"], "does not exist; write one with `memo train --report`"),
        (["--ulysses-head-chunks", "2"], "needs --cp > 1 and --cp-comm a2a"),
        (["--engine", "fsdp2", "--cp", "2", "--cp-comm", "a2a", "--model", "llama-tiny",
          "--ulysses-head-chunks", "3"], "do not split into 3 chunks"),
    ],
)
def test_bad_flag_combinations_are_refused(flags: list[str], needle: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--steps", "1", "--no-progress", *flags]) == 2
    assert needle in capsys.readouterr().err


def test_plan_for_another_model_or_length_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    assert main(["profile", "--model", "tiny", "--seq-len", "64", "--device", "cpu", "--dtype", "float32",
                 "-o", str(plan), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", "--model", "llama-tiny", "--seq-len", "64", "--steps", "1", "--no-progress",
                 "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "model=tiny" in err and "model=llama-tiny" in err and "memo profile" in err
    tiny, llama = (fingerprint(get_config(name)) for name in ("tiny", "llama-tiny"))
    assert f"fingerprint {tiny}" in err and f"fingerprint {llama}" in err
    # The fingerprint decides, not the name: the same shapes under another name replay the plan.
    renamed = tmp_path / "tiny-copy.json"
    renamed.write_text(json.dumps({**dataclasses.asdict(get_config("tiny")), "name": "tiny-copy"}))
    assert main(["train", "--model", str(renamed), "--seq-len", "64", "--steps", "1", "--no-progress",
                 "--plan", str(plan)]) == 0
    capsys.readouterr()
    assert main(["train", "--model", "tiny", "--seq-len", "128", "--steps", "1", "--no-progress",
                 "--plan", str(plan)]) == 2
    assert "seq_len=64" in capsys.readouterr().err
