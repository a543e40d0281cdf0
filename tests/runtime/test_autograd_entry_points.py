"""NOTE [Gradients through the engine]: every autograd entry point over memo layers.

``torch.autograd.grad`` and ``backward(inputs=...)`` give the unwrapped model's gradients and write
no ``.grad`` they were not asked for; ``backward(create_graph=True)`` is refused with a clear error,
and the model trains on afterwards.
"""

from __future__ import annotations

import copy

import pytest
import torch

import memo.runtime as mr
from memo.errors import MemoError
from memo.models import build_model
from tests.grads import RTOL, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py




def _models(alpha: float = 0.5):
    ref = build_model("tiny", dtype=torch.float32)
    model = mr.wrap(copy.deepcopy(ref), alpha=alpha, policy=["memo", "memo", "recompute", "keep"])
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return ref, model, ids


def _step_grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids, ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_autograd_grad_of_every_parameter_matches_and_writes_no_grad(alpha: float) -> None:
    ref, model, ids = _models(alpha)
    for _ in range(2):  # the runtime serves consecutive calls
        names = [n for n, _ in model.named_parameters()]
        got = torch.autograd.grad(model(ids, ids), list(model.parameters()))
        want = torch.autograd.grad(ref(ids, ids), list(ref.parameters()))
        assert all(p.grad is None for p in model.parameters())
        for name, g, w in zip(names, got, want, strict=True):
            assert rel_err(g, w) < RTOL, name
    assert mr.runtime_of(model).stats.layer_backwards == 4  # two memo layers, twice


def test_autograd_grad_of_the_embedding_output_matches() -> None:
    ref, model, ids = _models()
    outs = {}
    for name, m in (("memo", model), ("ref", ref)):
        m.embedding.register_forward_hook(lambda mod, a, out, name=name: outs.__setitem__(name, out))
    (got,) = torch.autograd.grad(model(ids, ids), outs["memo"])
    (want,) = torch.autograd.grad(ref(ids, ids), outs["ref"])
    assert rel_err(got, want) < RTOL
    assert all(p.grad is None for p in model.parameters())


def test_backward_with_inputs_fills_only_those() -> None:
    ref, model, ids = _models()
    w, w_ref = model.layers[0].qkv.weight, ref.layers[0].qkv.weight
    model(ids, ids).backward(inputs=[w])
    ref(ids, ids).backward(inputs=[w_ref])
    assert rel_err(w.grad, w_ref.grad) < RTOL
    assert all(p.grad is None for p in model.parameters() if p is not w)
    want = _step_grads(ref, ids)
    got = _step_grads(model, ids)
    assert all(rel_err(got[n], want[n]) < RTOL for n in want)


def test_double_backward_is_refused_and_training_goes_on() -> None:
    ref, model, ids = _models()
    # The memo layers alone (the model's head does not support double backward either).
    x = torch.randn(16, 2, model.config.hidden)
    loss = model.layers[1](model.layers[0](x)).square().mean()
    refused = (r"^memo\.runtime: backward\(create_graph=True\) reached a memo-wrapped layer; .* Run that "
               r"computation on memo\.unwrap\(model\)")
    with pytest.raises(MemoError, match=refused):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    del loss
    want = _step_grads(ref, ids)
    got = _step_grads(model, ids)
    assert all(rel_err(got[n], want[n]) < RTOL for n in want)
