"""Rounding buffers sized for the largest offloaded layer (NOTE [Sizing the host arena]).

A frozen layer saves less than a trained one, and a layer in train mode saves its dropout
mask, so the first layer's bytes do not size the others. Fine-tuning with frozen layers,
unfreezing between steps and switching to train mode must train and match the unwrapped
model; a change inside a forward, or one that outgrows a plan, is refused naming its cause.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memo.runtime as mr
from memo.adapters import AnatomyAdapter, register_adapter, unregister_adapter
from memo.errors import MemoError, PlanMismatchError
from memo.models import attention
from memo.runtime import BufferState
from tests.grads import assert_same_step, random_batch, small_model, train_step

DELAY_US = 200

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _freeze(model: nn.Module, k: int) -> None:
    """Freeze the embedding and the first k layers (the usual fine-tuning pattern)."""
    model.embedding.requires_grad_(False)
    for layer in model.layers[:k]:
        layer.requires_grad_(False)


@pytest.mark.parametrize("policy", [None, ["memo"] * 4], ids=["default", "all-memo"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_frozen_embedding_and_first_layers_train_and_match(k: int, policy: list[str] | None) -> None:
    ref = small_model("gpt")
    _freeze(ref, k)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, policy=policy, debug_copy_delay_us=DELAY_US)
    rt = mr.runtime_of(model)
    for it in range(2):
        batch = random_batch(512, 2, 16, it)
        assert_same_step(train_step(model, *batch), train_step(ref, *batch))
    sizes = rt.layer_sizes
    assert len(sizes) == rt.n_offloaded and rt.layer_bytes == max(sizes)
    assert rt.host_bytes == rt.n_offloaded * rt.layer_bytes
    if 0 < k < rt.n_offloaded:  # a frozen layer saves less than a trained one
        assert sizes[0] < sizes[k] == rt.layer_bytes
    assert rt.describe()["layer_sizes"] == sizes


def test_unfreezing_between_steps_grows_the_buffers() -> None:
    ref = small_model("gpt")
    _freeze(ref, 4)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, policy=["memo"] * 4, debug_copy_delay_us=DELAY_US)
    rt = mr.runtime_of(model)
    batch = random_batch(512, 2, 16, 0)
    assert_same_step(train_step(model, *batch), train_step(ref, *batch))
    frozen_bytes = rt.layer_bytes
    for m in (model, ref):  # gradual unfreezing: the top layers first
        m.layers[2:].requires_grad_(True)
    batch = random_batch(512, 2, 16, 1)
    assert_same_step(train_step(model, *batch), train_step(ref, *batch))
    assert rt.layer_bytes > frozen_bytes
    assert rt.layer_sizes[:2] == [frozen_bytes] * 2 and rt.layer_sizes[2] == rt.layer_bytes
    grown = rt.layer_bytes
    for m in (model, ref):  # freezing again never shrinks the buffers
        m.requires_grad_(True)
        m.layers[3].requires_grad_(False)
    batch = random_batch(512, 2, 16, 2)
    assert_same_step(train_step(model, *batch), train_step(ref, *batch))
    assert rt.layer_bytes == grown and rt.layer_sizes[3] == frozen_bytes
    assert all(rt.buffers.state(i) is BufferState.IDLE for i in range(rt.n_offloaded))


def test_change_inside_a_forward_names_its_cause() -> None:
    model = small_model("gpt")
    model.layers.requires_grad_(False)
    mr.wrap(model, alpha=0.5, policy=["memo"] * 4)
    train_step(model, *random_batch(512, 2, 16, 0))
    handle = model.layers[1].register_forward_pre_hook(lambda m, args: m.requires_grad_(True) and None)
    with pytest.raises(MemoError, match=r"layer 1 offloads more than the [\d,]+ bytes its rounding buffer "
                                        r"was sized for .*parameter '[\w.]+' was unfrozen "
                                        r"\(requires_grad False -> True\)"):
        train_step(model, *random_batch(512, 2, 16, 1))
    handle.remove()
    mr.runtime_of(model).reset()
    # the next iteration sizes the buffers for the unfrozen layer
    train_step(model, *random_batch(512, 2, 16, 2))
    rt = mr.runtime_of(model)
    assert rt.layer_sizes[1] == rt.layer_bytes > rt.layer_sizes[0]


def test_plan_host_bytes_is_checked_against_the_largest_layer() -> None:
    ref = small_model("gpt")
    _freeze(ref, 1)
    probe = mr.wrap(copy.deepcopy(ref), alpha=0.5, policy=["memo"] * 4)
    train_step(probe, *random_batch(512, 2, 16, 0))
    small, big = mr.runtime_of(probe).layer_sizes[:2]
    assert small < big
    short = mr.wrap(copy.deepcopy(ref), plan={"alpha": 0.5, "host_bytes": 4 * small, "policy": ["memo"] * 4})
    expected = (rf"host_bytes={4 * small:,} but this job offloads {4 * big:,} \(4 layers x [\d,]+ bytes, "
                r"the largest offloaded layer's \(layer 1\)")
    with pytest.raises(PlanMismatchError, match=expected):
        train_step(short, *random_batch(512, 2, 16, 0))
    exact = mr.wrap(copy.deepcopy(ref), plan={"alpha": 0.5, "host_bytes": 4 * big, "policy": ["memo"] * 4})
    batch = random_batch(512, 2, 16, 0)
    assert_same_step(train_step(exact, *batch), train_step(ref, *batch))

    # A plan made with every layer frozen is outgrown when one is unfrozen: refused, naming why.
    frozen = small_model("gpt")
    frozen.layers.requires_grad_(False)
    mr.wrap(frozen, plan={"alpha": 0.5, "host_bytes": 4 * small, "policy": ["memo"] * 4})
    train_step(frozen, *random_batch(512, 2, 16, 0))
    frozen.layers[2].requires_grad_(True)
    with pytest.raises(PlanMismatchError, match=r"\(it grew after layer 2: parameter '[\w.]+' was unfrozen"):
        train_step(frozen, *random_batch(512, 2, 16, 1))


class DropoutLayer(nn.Module):
    """A layer with the anatomy and dropout after its attention projection."""

    def __init__(self, h: int = 16, n: int = 2) -> None:
        super().__init__()
        self.n, self.d = n, h // n
        self.norm = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.drop = nn.Dropout(0.25)
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))

    def pre(self, x: torch.Tensor, offset: int = 0):
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return tuple(t.reshape(s, b, self.n, self.d) for t in (q, k, v))

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x + self.drop(self.proj(o))
        return y + self.mlp(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(attention(*self.pre(x)).flatten(2), x)


class DropoutModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropoutLayer() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_dropout_turned_on_after_the_first_step() -> None:
    register_adapter(DropoutLayer, AnatomyAdapter())
    try:
        ref = DropoutModel()
        # alpha = 1: one dropout draw per layer, as unwrapped (the split draws of 0 < alpha < 1 are
        # issue 12's item 5).
        model = mr.wrap(copy.deepcopy(ref), alpha=1.0, debug_copy_delay_us=DELAY_US)
        rt = mr.runtime_of(model)
        x = torch.randn(12, 2, 16)
        for mode in ("eval", "train", "train"):
            grads = []
            for m in (model, ref):
                getattr(m, mode)()
                m.zero_grad(set_to_none=True)
                torch.manual_seed(7)
                loss = m(x)
                loss.backward()
                grads.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
            assert_same_step(*grads)
            if mode == "eval":
                eval_bytes = rt.layer_bytes
        assert rt.layer_bytes > eval_bytes  # the dropout masks are offloaded too
    finally:
        unregister_adapter(DropoutLayer)
