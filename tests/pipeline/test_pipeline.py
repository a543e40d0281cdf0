"""One pipeline and one Session (issue 13): the profiler only records, the pipeline plans as the old
``memo.profiler.profile`` did, and a Session undoes everything it did, also on an exception."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import memo
from memo import allocator, runtime
from memo.errors import MemoError
from memo.machine import Machine
from memo.models import build_model
from memo.pipeline import profile

#: Models and lengths whose plans are checked for the invariants every plan keeps.
_MODELS = {"tiny": 512, "gpt-mini": 1024}


def test_profiler_imports_no_runtime_allocator_or_planner() -> None:
    code = ("import memo.profiler, sys; bad = [m for m in sys.modules if m.startswith(('memo.runtime', "
            "'memo.allocator', 'memo.planner', 'memo.pipeline', 'memo.session', 'planner'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_the_pipeline_plan_keeps_its_invariants(name: str) -> None:
    """Invariants instead of golden numbers (which every runtime change moved): the plan's peak lies
    between the trace's lower bound and its own no-reuse size, the device total is the iteration's
    peak plus the model states, the host arena is what the wrapped pass offloaded (every offloaded
    layer's region), alpha is the LP's and in [0, 1], and a policy that offloads offloads bytes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = profile(name, _MODELS[name], 1, "float32", "meta", time_limit=5.0,
                         machine=Machine(bandwidth_gbps=20, layer_ms=5.0, host_mem_gb=64))
    p = result.plan
    assert p.lower_bound <= p.peak <= p.no_reuse_bytes
    states = p.device["model_states"]
    assert p.device["total_bytes"] == p.device["iteration_peak_bytes"] + states["parameters"]["bytes"] + \
        states["optimizer"]["bytes"]
    assert p.device["iteration_peak_bytes"] >= p.peak
    assert 0.0 <= p.alpha <= 1.0 and p.alpha == pytest.approx(result.alpha.alpha)
    n_offloaded = p.offload["offloaded_layers"]
    assert n_offloaded == sum(k in runtime.OFFLOADING_POLICIES for k in p.policy) > 0
    assert p.host_bytes == n_offloaded * p.offload["actual_bytes_per_layer"] > 0


def test_machine_fields_as_keywords_or_a_machine() -> None:
    with pytest.raises(MemoError, match="--bandwidth-gbps must be a positive number"):
        Machine(bandwidth_gbps=0)
    with pytest.raises(MemoError, match="--host-safety"):
        Machine(host_safety=1.5)
    assert Machine(host_mem_gb=10, gpus_per_node=2, host_safety=0.5).host_per_process() == 2_500_000_000


def test_a_model_without_an_adapter_is_refused_by_name() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

    with pytest.raises(MemoError, match=r"no model adapter for .*Encoder.*register_model_adapter\(Encoder"):
        profile(Encoder(), 16, device="cpu", solve=False)
    with pytest.raises(MemoError, match=r"memo.Session: no model adapter for .*Encoder"):
        memo.Session(Encoder())


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_session_trains_and_undoes_everything_on_an_exception() -> None:
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 64))
    hooks = _hooks(model)
    with pytest.raises(RuntimeError, match="boom"):
        with memo.Session(model, alpha=0.5, policy=["memo"] * 4, example=(ids, ids)) as s:
            rt = s.runtime
            assert rt is not None and rt.buffers is not None  # sized before the first step
            assert s.tracker is not None and allocator._api._active.get("cpu") == "planned"
            loss = s.step(ids, ids)
            assert torch.isfinite(loss)
            raise RuntimeError("boom")
    assert not runtime.is_wrapped(model)
    assert _hooks(model) == hooks
    assert "cpu" not in allocator._api._active
    with pytest.raises(MemoError, match="open session"):
        s.step(ids, ids)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_session_undoes_what_it_did_when_set_up_fails(monkeypatch) -> None:
    model = build_model("tiny", dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 64))

    def short(*_args, **_kwargs):
        raise MemoError("memo.runtime: host memory is short (test)")

    monkeypatch.setattr(runtime.MemoRuntime, "allocate", short)
    hooks = _hooks(model)
    with pytest.raises(MemoError, match="host memory is short"):
        with memo.Session(model, alpha=0.5, policy=["memo"] * 4, example=(ids, ids)):
            pass
    assert not runtime.is_wrapped(model) and _hooks(model) == hooks
    assert "cpu" not in allocator._api._active
