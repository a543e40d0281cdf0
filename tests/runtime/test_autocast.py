"""Recompute replays the forward's autocast state (NOTE [Recompute replays autocast]), CPU only.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` memo's loss and gradients are judged
against what plain PyTorch achieves at that precision: both are compared with an fp32 run
of the same model, and memo's error may be at most twice PyTorch's (flash-attn's rule).
A recompute that ignored autocast fails these tests: it runs in float32 against the
bfloat16 attention output (``mat1 and mat2 must have the same dtype``) or in a state
forward never saw, which the spies on the recomputed modules report.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import memo.runtime as mr
from tests.grads import random_batch, rel_err, small_model

N_LAYERS = 5  # memo offloads all but the last two: layers 0..2 are recomputed
S, B = 13, 2  # alpha * 13 is never an integer for alpha in (0, 1)
BF16_DIRECT_RTOL = 1e-2  # memo bf16 vs plain bf16, relative norm


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, fwd_autocast: dict[str, Any],
          bwd_autocast: dict[str, Any] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward under ``torch.autocast("cpu", **fwd_autocast)``; backward outside any autocast
    context, or under ``torch.autocast("cpu", **bwd_autocast)`` when given."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", **fwd_autocast):
        loss = model(ids, labels)
    if bwd_autocast is None:
        loss.backward()
    else:
        with torch.autocast("cpu", **bwd_autocast):
            loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


BF16 = {"dtype": torch.bfloat16}
OFF = {"enabled": False}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_bf16_autocast_matches_unwrapped(arch: str, alpha: float) -> None:
    ref = small_model(arch, N_LAYERS)
    model = mr.wrap(copy.deepcopy(ref), alpha=alpha)
    ids, labels = random_batch(ref, B, S)
    loss32, grads32 = _step(ref, ids, labels, OFF)  # fp32 reference
    loss16, grads16 = _step(ref, ids, labels, BF16)  # plain PyTorch under bf16 autocast
    loss, grads = _step(model, ids, labels, BF16)
    rt = mr.runtime_of(model)
    assert rt.stats.recomputed_tokens == rt.n_offloaded * (S - mr.offload_tokens(alpha, S))

    assert rel_err(loss, loss32) <= 2 * rel_err(loss16, loss32) + 1e-6, (loss, loss16, loss32)
    assert rel_err(loss, loss16) < BF16_DIRECT_RTOL
    assert grads.keys() == grads16.keys()
    for n in grads32:
        memo_err, torch_err = rel_err(grads[n], grads32[n]), rel_err(grads16[n], grads32[n])
        assert memo_err <= 2 * torch_err + 1e-4, (
            f"gradient of {n}: memo's bf16 error {memo_err:.3g} vs PyTorch's {torch_err:.3g}")
        assert rel_err(grads[n], grads16[n]) < BF16_DIRECT_RTOL, n


class _Spy:
    """Records the autocast state and output dtype of every call of the layers' qkv and proj
    (the first runs in pre, the second in post), split into forward and backward calls."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.phase = "forward"
        self.seen: dict[str, set[tuple[Any, ...]]] = {"forward": set(), "backward": set()}
        self.calls = {"forward": 0, "backward": 0}
        self.handles = [getattr(layer, name).register_forward_hook(self._hook)
                        for layer in layers for name in ("qkv", "proj")]

    def _hook(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        self.seen[self.phase].add((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                                   torch.is_autocast_cache_enabled(), out.dtype))
        self.calls[self.phase] += 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _run_spied(arch: str, alpha: float, fwd: dict[str, Any],
               bwd: dict[str, Any] | None) -> tuple[_Spy, tuple[Any, ...]]:
    """One step of the wrapped model with spies; also returns the ambient autocast state after it."""
    model = mr.wrap(small_model(arch, N_LAYERS), alpha=alpha)
    rt = mr.runtime_of(model)
    spy = _Spy(list(model.layers[:rt.n_offloaded]))
    ids, labels = random_batch(model, B, S)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", **fwd):
        loss = model(ids, labels)
    spy.phase = "backward"
    if bwd is None:
        loss.backward()
        after = (torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled())
    else:
        with torch.autocast("cpu", **bwd):
            loss.backward()
            after = (torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled())
    spy.remove()
    assert spy.calls["backward"] > 0, "nothing was recomputed"
    return spy, after


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
@pytest.mark.parametrize("dtype, cache", [(torch.bfloat16, True), (torch.float16, False)])
def test_recompute_sees_forward_autocast_when_backward_runs_outside(arch: str, alpha: float,
                                                                    dtype: torch.dtype, cache: bool) -> None:
    """The usual pattern: ``with autocast: loss = model(...)``, then ``loss.backward()`` outside it."""
    spy, after = _run_spied(arch, alpha, {"dtype": dtype, "cache_enabled": cache}, None)
    assert spy.seen["forward"] == {(True, dtype, cache, dtype)}
    assert spy.seen["backward"] == spy.seen["forward"]
    assert after == (False, True)  # the replay does not leak into the caller's state


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_recompute_stays_fp32_when_backward_runs_inside_autocast(arch: str, alpha: float) -> None:
    """Autocast off in forward stays off in the recompute, even inside an autocast context."""
    spy, after = _run_spied(arch, alpha, OFF, {"dtype": torch.bfloat16, "cache_enabled": False})
    assert {(enabled, out) for enabled, _, _, out in spy.seen["forward"]} == {(False, torch.float32)}
    assert spy.seen["backward"] == spy.seen["forward"]
    assert after == (True, False)  # the caller's autocast context is intact after backward


def test_backward_ops_follow_the_ambient_autocast_like_unwrapped() -> None:
    """Forward fp32, backward inside bf16 autocast: the recompute stays fp32 (the forward's state),
    while the backward ops follow the ambient state, as they do for the unwrapped model. With
    alpha = 0 memo runs the same ops in the same order as the unwrapped model, so the gradients
    agree to fp32 rounding, far below the bf16 error a different state for either would cause."""
    ref = small_model("llama", N_LAYERS)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.0)
    ids, labels = random_batch(ref, B, S)
    loss32, grads32 = _step(ref, ids, labels, OFF)
    loss_ref, grads_ref = _step(ref, ids, labels, OFF, BF16)
    loss, grads = _step(model, ids, labels, OFF, BF16)
    assert torch.equal(loss, loss_ref)
    assert max(rel_err(grads_ref[n], grads32[n]) for n in grads32) > 1e-3  # the backward ops ran in bf16
    worst = max((rel_err(grads[n], grads_ref[n]), n) for n in grads_ref)
    assert worst[0] < 1e-5, f"gradient of {worst[1]} differs from the unwrapped model's: {worst[0]:.3g}"
