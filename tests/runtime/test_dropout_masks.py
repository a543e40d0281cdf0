"""Dropout under memo draws the unwrapped layer's masks (NOTE [Dropout as unwrapped],
memo/runtime/dropout.py): at every alpha and chunk size a step with memo equals the step without it,
the global random stream ends where the unwrapped model leaves it, and a torch.compile'd
bias-dropout-add draws the same masks in forward and in the recompute."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memo.runtime as mr
from memo.adapters import AnatomyAdapter, register_adapter, unregister_adapter
from memo.models import attention
from tests.grads import assert_same_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _eager_bda(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return residual + F.dropout(x, p, training)


class DropoutLayer(nn.Module):
    """An anatomy layer with dropout in pre (functional), after attention (a module) and in the MLP
    (a bias-dropout-add, eager or compiled, as megatron-core's)."""

    def __init__(self, h: int = 16, n: int = 2, bda=_eager_bda) -> None:
        super().__init__()
        self.n, self.d = n, h // n
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.fc = nn.Linear(h, h)
        self.drop = nn.Dropout(0.25)
        self.bda = bda

    def pre(self, x: torch.Tensor, offset: int = 0):
        s, b, _ = x.shape
        q, k, v = F.dropout(self.qkv(x), 0.1, self.training).chunk(3, dim=-1)
        return tuple(t.reshape(s, b, self.n, self.d) for t in (q, k, v))

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x + self.drop(self.proj(o))
        return self.bda(torch.tanh(self.fc(y)), y, 0.5, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(attention(*self.pre(x)).flatten(2), x)


class DropoutModel(nn.Module):
    def __init__(self, n_layers: int = 3, **kw) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropoutLayer(**kw) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (x * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype)).square().mean()


@pytest.fixture(autouse=True)
def _adapter():
    register_adapter(DropoutLayer, AnatomyAdapter())
    yield
    unregister_adapter(DropoutLayer)


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(x)
    loss.backward()
    after = torch.rand(4)  # where the step left the random stream
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["<random stream after the step>"] = after
    return loss.detach(), grads


@pytest.mark.parametrize(("alpha", "chunk"), [(0.0, None), (0.3, None), (0.3, 4), (0.6, 5), (1.0, None)])
def test_a_step_with_dropout_equals_the_unwrapped_step(alpha: float, chunk: int | None) -> None:
    torch.manual_seed(0)
    ref = DropoutModel()
    model = copy.deepcopy(ref)
    mr.wrap(model, runtime=mr.MemoRuntime(alpha, recompute_chunk_tokens=chunk, policy=["memo"] * 3,
                                          debug_copy_delay_us=200))
    x = torch.randn(19, 2, 16)
    for seed in (7, 8):
        assert_same_step(_step(model, x, seed), _step(ref, x, seed))


def test_a_segment_layer_replays_the_masks_of_the_layer_before_it() -> None:
    # NOTE [Segments of two layers]: the forward of layer 0 run again in layer 1's backward draws layer 0's
    # masks, and leaves the random stream where the unwrapped step leaves it.
    torch.manual_seed(0)
    ref = DropoutModel()
    model = copy.deepcopy(ref)
    mr.wrap(model, runtime=mr.MemoRuntime(0.0, recompute_chunk_tokens=4,
                                          policy=["input-only", "segment", "keep"], debug_copy_delay_us=200))
    x = torch.randn(19, 2, 16)
    for seed in (7, 8):
        assert_same_step(_step(model, x, seed), _step(ref, x, seed))


def test_a_compiled_bias_dropout_add_draws_the_eager_masks_in_forward_and_recompute() -> None:
    """The compiled function's dropout runs memo's eager draw (dynamo breaks the graph there), so the
    masks do not depend on grad mode or compilation: memo with the compiled layer equals the
    unwrapped eager layer, step after step (dynamo's recompiles included)."""
    compiled = torch.compile(_eager_bda, backend="aot_eager", dynamic=False)
    torch.manual_seed(0)
    ref = DropoutModel()
    model = DropoutModel(bda=compiled)
    model.load_state_dict(ref.state_dict())
    mr.wrap(model, runtime=mr.MemoRuntime(0.4, recompute_chunk_tokens=3, policy=["memo"] * 3))
    with pytest.warns(UserWarning, match="a dropout runs inside torch.compile'd code; memo draws its mask "
                                         "with PyTorch's eager dropout"):
        for seed in (1, 2):
            x = torch.randn(11, 2, 16)
            assert_same_step(_step(model, x, seed), _step(ref, x, seed))


class RowsDropoutLayer(DropoutLayer):
    """A dropout on a tensor whose rows are not the layer's tokens (heads first)."""

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        o = F.dropout(o.transpose(0, 1), 0.2, self.training).transpose(0, 1)
        return x + self.proj(o)


# The finite differences evaluate the loss through memo (with autograd on) without a backward.
@pytest.mark.filterwarnings("ignore:memo.runtime. a forward's graph was freed")
def test_a_dropout_whose_rows_are_not_tokens_is_said_once_and_stays_exact() -> None:
    register_adapter(RowsDropoutLayer, AnatomyAdapter())
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*(RowsDropoutLayer() for _ in range(2))).double()
        # Tiles of 3 tokens (NOTE [Tiles bounded by memory]): none has as many tokens as the batch's 2
        # rows, so every tile's dropout sees rows that are not its tokens.
        mr.wrap(model, runtime=mr.MemoRuntime(0.5, recompute_chunk_tokens=3, policy=["memo"] * 2))
        x = torch.randn(9, 2, 16, dtype=torch.float64)

        def loss_at(seed: int = 3) -> torch.Tensor:
            torch.manual_seed(seed)
            return model(x).square().sum()

        with pytest.warns(UserWarning, match=r"layer 0: a dropout in post\(\) takes 2 rows for 3 tokens"):
            loss_at().backward()
        w = model[0].proj.weight
        grad = w.grad.clone()
        direction = torch.randn_like(w)
        eps = 1e-6
        with torch.no_grad():
            w += eps * direction
        up = loss_at().item()
        with torch.no_grad():
            w -= 2 * eps * direction
        down = loss_at().item()
        analytic = (grad * direction).sum().item()
        assert abs((up - down) / (2 * eps) - analytic) <= 1e-6 * max(1.0, abs(analytic))
    finally:
        unregister_adapter(RowsDropoutLayer)
