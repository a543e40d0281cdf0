"""NOTE [One step, one path] in memo/pipeline/step.py: one calibration loop, one construction path, and
``profile_step(step, request)`` behind ``profile``."""

from __future__ import annotations

import ast
from pathlib import Path

import torch  # noqa: F401  (before memo)

from memo.pipeline import ProfileRequest, profile, profile_step
from memo.pipeline.step import ModelStep, split_policy

ROOT = Path(__file__).resolve().parents[2]


def _calls(name: str) -> list[str]:
    """``file:line`` of every call of a function or method ``name`` in memo/ and planner/."""
    found = []
    for path in sorted([*(ROOT / "memo").rglob("*.py"), *(ROOT / "planner").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_one_calibration_loop() -> None:
    """planner/calibrate.py's probe_policy is the one loop that corrects and chooses again, called from
    one place (memo/pipeline/policy.py's calibrated_choice), for a model and for a pipeline stage."""
    calls = _calls("probe_policy")
    assert len(calls) == 1 and calls[0].startswith("memo/pipeline/policy.py:"), calls
    callers = _calls("calibrated_choice")
    assert callers and all(c.startswith("memo/pipeline/") for c in callers), callers


def test_one_construction_path_for_training() -> None:
    """memo's allocator is entered with a plan (or its fallback alone) for training in one place: Session.
    The training code (memo/train) builds no allocator context, and no phase listener but the one a
    Step gives (StageStep.phases in memo/train/schedule.py)."""
    mine = ("memo/train/", "memo/pipeline/", "memo/session")
    entered = [c for c in _calls("planned") if c.startswith(mine)]
    assert entered and all(c.startswith("memo/session.py:") for c in entered), entered
    trackers = [c for c in _calls("PhaseTracker") + _calls("StagePhases") if c.startswith("memo/train/")]
    assert all(c.startswith("memo/train/schedule.py:") for c in trackers), trackers


def test_profile_is_profile_step_of_a_request() -> None:
    """``profile(name, ...)`` and ``profile_step(name, ProfileRequest(...))`` record the same pass 1."""
    by_args = profile("tiny", 256, device="meta", solve=False)
    by_request = profile_step("tiny", ProfileRequest(seq_len=256, device="meta", solve=False))
    assert by_args.trace["events"] == by_request.trace["events"]
    assert [s.__dict__ for s in by_args.layer_stats] == [s.__dict__ for s in by_request.layer_stats]


def test_a_policy_is_cut_into_each_chunks_share() -> None:
    assert split_policy(["memo", "keep", "recompute"], [2, 1]) == [["memo", "keep"], ["recompute"]]


def test_a_model_step_names_its_layers_and_runs_its_batch() -> None:
    from memo.models import build_model, get_config

    model = build_model(get_config("tiny"), device="cpu", dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    step = ModelStep(model, (ids, ids))
    assert step.chunk_layers() == [len(model.layers)]
    step.run()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
