"""NOTE [Partial backward is refused]: autograd.grad and backward(inputs=...) over memo layers.

memo's backward writes every parameter's .grad, so a partial backward would be silently wrong;
it is refused with a clear error instead, nothing is written, and the model trains on.
"""

from __future__ import annotations

import copy

import pytest
import torch

import memo.runtime as mr
from memo.errors import MemoError
from memo.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _models():
    ref = build_model("tiny", dtype=torch.float32)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, policy=["memo", "memo", "recompute", "keep"])
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return ref, model, ids


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("how", ["grad_params", "grad_one_memo_param", "grad_embedding_output",
                                 "backward_one_input", "backward_every_input"])
def test_partial_backward_is_refused_writes_nothing_and_training_goes_on(how: str) -> None:
    ref, model, ids = _models()
    model.zero_grad(set_to_none=True)
    captured = {}
    handle = model.embedding.register_forward_hook(lambda m, a, out: captured.setdefault("x", out))
    loss = model(ids, ids)
    handle.remove()
    params = list(model.parameters())
    with pytest.raises(MemoError, match=r"reached memo-wrapped layer [01].*loss\.backward\(\)"):
        if how == "grad_params":
            torch.autograd.grad(loss, params, allow_unused=True)
        elif how == "grad_embedding_output":
            torch.autograd.grad(loss, captured["x"])
        elif how == "grad_one_memo_param":
            torch.autograd.grad(loss, model.layers[0].qkv.weight)
        elif how == "backward_one_input":
            loss.backward(inputs=[model.layers[0].qkv.weight])
        else:  # memo's parameters hang off its own sub-graphs: even every parameter is refused
            loss.backward(inputs=params)
    # Nothing was written by memo's layers, and the next step matches the unwrapped model.
    assert all(p.grad is None for layer in model.layers[:2] for p in layer.parameters())
    del loss
    captured.clear()
    model.zero_grad(set_to_none=True)
    model(ids, ids).backward()
    ref.zero_grad(set_to_none=True)
    ref(ids, ids).backward()
    got, want = _grads(model), _grads(ref)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7), n
