"""memo's CUDA allocator on a real device. Each test runs in a fresh interpreter:
PyTorch lets the CUDA allocator change only before its first CUDA allocation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(body: str) -> str:
    code = textwrap.dedent(body)
    cmd = [sys.executable, "-c", code]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.gpu
def test_too_late_install_is_a_clear_error() -> None:
    out = run_script(
        """
        import torch, memo.allocator as ma
        from memo.errors import MemoError
        torch.ones(1, device="cuda")
        try:
            ma.install_cuda()
        except MemoError as exc:
            assert "too late" in str(exc) and "before the first CUDA tensor" in str(exc), exc
            print("ok")
        """
    )
    assert "ok" in out


@pytest.mark.gpu
def test_cuda_profile_plan_replay_exact() -> None:
    out = run_script(
        """
        import torch, warnings, memo.allocator as ma
        from memo.models import build_model
        from memo.phases import PhaseTracker
        from memo.planner import make_plan
        ma.install_cuda()
        torch.manual_seed(0)
        model = build_model("llama-tiny", device="cuda")
        tracker = PhaseTracker(model.embedding, model.layers, model.head, listeners=[ma.set_phase])
        ids = torch.randint(0, 512, (2, 256), device="cuda")
        def step():
            for p in model.parameters():
                p.grad = None
            with tracker.iteration():
                loss = model(ids, ids)
                loss.backward()
            torch.cuda.synchronize()
            return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]
        want = step()
        with ma.logging(device="cuda") as trace:
            step()
        plan = make_plan(trace, use_mip=False, progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ma.PlanDeviationWarning)
            for poison in (False, True):
                with ma.planned(plan, device="cuda", poison=poison):
                    got = step()
                    s = ma.stats("cuda")
                assert s["deviations"] == 0 and s["planned_hits"] > 0, s
                assert torch.equal(got[0], want[0])
                assert all(torch.equal(g, w) for g, w in zip(got[1], want[1]))
        print("ok", s["planned_hits"], s["segment_allocs"])
        """
    )
    assert "ok" in out


@pytest.mark.gpu
def test_cuda_fallback_limit_error_has_numbers() -> None:
    out = run_script(
        """
        import torch, memo.allocator as ma
        ma.install_cuda()
        with ma.planned({}, peak=0, device="cuda", fallback_limit=64 << 20):
            try:
                torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
            except RuntimeError as exc:
                msg = str(exc)
                assert "fallback pool (cuda) cannot serve a request of 134217728 B" in msg, msg
                assert "limit 67108864" in msg, msg
                print("ok")
        """
    )
    assert "ok" in out
