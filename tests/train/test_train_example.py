"""examples/train_gpt.py end to end: a few steps of `tiny` on CPU, checked through its --report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memo.utils.flops import detect_peak_flops, flops_per_sample, mfu

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_train_example_report(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = _run(
        "--model", "tiny", "--seq-len", "128", "--micro-batch", "2", "--steps", "6",
        "--report", str(report_path), "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(report_path.read_text())
    assert report["strategy"] == "none"  # its schema: test_train_cli.py
    assert report["model"] == "tiny" and report["seq_len"] == 128 and report["micro_batch"] == 2
    assert report["num_parameters"] > 0 and report["flops_per_sample"] > 0
    steps = report["steps"]
    assert len(steps) == 6
    for step in steps:
        assert {"loss", "step_time_s", "tgs", "mfu"} <= step.keys()
        assert step["loss"] > 0 and step["step_time_s"] > 0 and step["tgs"] > 0
        assert step["mfu"] is None  # CPU without --peak-tflops: unknown peak, reported as n/a
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3
    assert "mfu n/a" in proc.stdout and "loss" in proc.stdout


def test_train_example_peak_override_recompute_and_bytes(tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    report_path = tmp_path / "r.json"
    proc = _run(
        "--model", "llama-tiny", "--seq-len", "64", "--steps", "3", "--strategy", "full-recompute",
        "--peak-tflops", "1.0", "--data", str(data), "--report", str(report_path), "--no-progress",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(report_path.read_text())
    assert report["data"] == str(data) and report["strategy"] == "full-recompute"
    assert all(0 < s["mfu"] < 1 for s in report["steps"])


def test_train_example_errors_are_clear(tmp_path: Path) -> None:
    proc = _run("--model", "gpt-8b", "--steps", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2 and "valid names" in proc.stderr


def test_flops_formula_and_mfu() -> None:
    # 6·s·P + 6·n·h·s² with P = 6,666,792,960 - 4096·4096 (gpt-7b without its position table)
    p = 6_666_792_960 - 4096 * 4096
    assert flops_per_sample("gpt-7b", 1024) == pytest.approx(6 * 1024 * p + 6 * 32 * 4096 * 1024**2)
    assert detect_peak_flops("cpu", None) is None  # type: ignore[arg-type]
    assert detect_peak_flops("cpu", None, override=2e12) == 2e12  # type: ignore[arg-type]
    assert mfu(1e12, 2, 1.0, 4e12) == pytest.approx(0.5)
    assert mfu(1e12, 2, 1.0, None) is None
