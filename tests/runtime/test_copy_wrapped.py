"""copy.deepcopy and torch.save/torch.load of a wrapped model (NOTE [Copying a wrapped model]).

After its first forward a wrapped model holds a copy engine (threads, pinned memory) and
rounding buffers. Its copies must still be possible, be wrapped with a runtime of their
own, compute what the original computes, and leave the original training correctly.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import memo.runtime as mr
from memo.runtime import BufferState
from tests.grads import RTOL, assert_same_step, random_batch, rel_err, small_model, train_step

DELAY_US = 200
POLICY = ["memo", "memo", "recompute", "keep", "keep"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _train_step(model: nn.Module, seed: int, lr: float = 0.1) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of one batch, then an SGD update (so that later steps see new weights)."""
    loss, grads = train_step(model, *random_batch(512, 2, 16, seed))
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return loss, grads


def _assert_own_runtime(clone: nn.Module, original: nn.Module) -> None:
    assert mr.is_wrapped(clone)
    rt, rt0 = mr.runtime_of(clone), mr.runtime_of(original)
    assert rt is not rt0 and rt.buffers is None and rt.engine is None and rt.layer_bytes is None
    assert (rt.alpha, rt.policy) == (rt0.alpha, rt0.policy)
    assert rt.stats.layer_forwards == 0 < rt0.stats.layer_forwards
    for call, layer in zip(rt.calls, clone.layers, strict=True):
        assert call.layer is layer and call.runtime is rt and layer._memo_call is call
        assert layer.forward.args[0] is call  # the wrapped forward runs the copy's own layer


def _copy_via_torch_save(model: nn.Module) -> nn.Module:
    f = io.BytesIO()
    torch.save(model, f)
    f.seek(0)
    return torch.load(f, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_after_a_step_is_wrapped_and_trains_like_the_original(how: str) -> None:
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, policy=POLICY, debug_copy_delay_us=DELAY_US)
    assert_same_step(_train_step(model, 0), _train_step(ref, 0))
    clone = copy.deepcopy(model) if how == "deepcopy" else _copy_via_torch_save(model)
    _assert_own_runtime(clone, model)
    ref_clone = copy.deepcopy(ref)
    # The copy computes what the original does, and trains on its own ...
    for seed in (1, 2):
        assert_same_step(_train_step(clone, seed), _train_step(ref_clone, seed))
    assert mr.runtime_of(clone).host_bytes == mr.runtime_of(model).host_bytes > 0
    # ... while the original keeps training correctly, untouched by the copy's steps.
    for seed in (3, 4):
        assert_same_step(_train_step(model, seed), _train_step(ref, seed))
    rt = mr.runtime_of(model)
    assert all(rt.buffers.state(i) is BufferState.IDLE for i in range(rt.n_offloaded))
    # unwrap of the copy gives a plain model with the copy's weights.
    mr.unwrap(clone)
    assert all("forward" not in layer.__dict__ for layer in clone.layers)
    assert not mr.is_wrapped(clone)
    with torch.no_grad():
        assert torch.equal(clone(*random_batch(512, 2, 16, 5)), ref_clone(*random_batch(512, 2, 16, 5)))


def test_copy_with_a_forward_in_flight() -> None:
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, policy=POLICY, debug_copy_delay_us=DELAY_US)
    _train_step(model, 0)
    _train_step(ref, 0)
    loss = model(*random_batch(512, 2, 16, 1))  # layers offloaded, backward pending
    clone = copy.deepcopy(model)
    saved = _copy_via_torch_save(model)
    model.zero_grad(set_to_none=True)
    loss.backward()
    want = _train_step(copy.deepcopy(ref), 1)
    assert rel_err(loss.detach(), want[0]) < RTOL
    for n, p in model.named_parameters():
        assert rel_err(p.grad, want[1][n]) < RTOL, n
    for other in (clone, saved):  # the copies start idle: their first step is a whole iteration
        _assert_own_runtime(other, model)
        assert_same_step(_train_step(other, 1), want)


def test_copy_before_the_first_forward_unwraps_to_a_plain_model() -> None:
    model = mr.wrap(small_model("gpt", 5), alpha=0.25)
    clone = _copy_via_torch_save(copy.deepcopy(model))
    assert mr.is_wrapped(clone) and mr.runtime_of(clone).alpha == 0.25
    mr.unwrap(clone)
    assert all(not hasattr(layer, "_memo_saved_forward") for layer in clone.layers)
    assert all("forward" not in layer.__dict__ for layer in clone.layers)
