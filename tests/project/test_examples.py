"""The long-context example runs as a user would run it: planned hits, no deviations, learning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_long_context_replays_its_plan_exactly() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_long_context.py"), "--model", "tiny",
         "--seq-len", "128", "--steps", "4"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout
    steps = re.findall(r"step +(\d+) +loss ([\d.]+) .* planned (\d+) +deviations (\d+)", out)
    assert [int(s[0]) for s in steps] == [1, 2, 3, 4], out
    losses = [float(s[1]) for s in steps]
    planned = [int(s[2]) for s in steps]
    assert losses[-1] < losses[0]
    assert all(int(s[3]) == 0 for s in steps), out  # every planned request served from the plan
    per_step = {b - a for a, b in zip([0, *planned], planned, strict=False)}
    assert len(per_step) == 1 and per_step.pop() > 0, planned  # the same planned hits every step
    assert re.search(r"alpha [\d.]+ \((alpha<=1|bandwidth|host_memory|device_memory|none)\)", out), out


def test_the_trainer_example_trains_as_without_memo() -> None:
    """examples/trainer_hf.py: HF Trainer + PEFT LoRA (with dropout) + packed batches of varying
    lengths + memo.wrap on a tiny random Llama, four steps: the same training losses as the same
    Trainer run without memo (issue 30)."""
    pytest.importorskip("peft")
    pytest.importorskip("accelerate")
    import importlib.util

    spec = importlib.util.spec_from_file_location("trainer_hf", ROOT / "examples" / "trainer_hf.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with_memo = example.train(use_memo=True, seq=128, steps=4)
    without = example.train(use_memo=False, seq=128, steps=4)
    assert len(with_memo) == 4 and with_memo == pytest.approx(without, rel=1e-5)
