"""memo's RMSNorm (NOTE [Lean RMSNorm] in memo/models/norms.py) against torch.nn.RMSNorm: the same
function, the same state dict, and a backward that keeps only the input and a float32 rstd per token."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from memo.errors import MemoError
from memo.models import build_model
from memo.models.norms import RMSNorm, rms_norm
from tests.grads import rel_err

S, B, H = 37, 3, 64


def _pair(dtype: torch.dtype, h: int = H, **kw: object) -> tuple[nn.RMSNorm, RMSNorm]:
    ref = nn.RMSNorm(h, dtype=dtype, **kw)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    mine = RMSNorm(h, dtype=dtype, **kw)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def _step(norm: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    norm.zero_grad(set_to_none=True)
    y = norm(x)
    y.backward(g)
    return y.detach(), x.grad, norm.weight.grad


def _saved(fn: object, x: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The non-parameter tensors autograd saves while ``fn(x)`` runs."""
    out: list[torch.Tensor] = []
    ids = {id(p) for p in params}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in ids:
            out.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)  # type: ignore[operator]
    return out


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_float32_matches_nn_rmsnorm() -> None:
    ref, mine = _pair(torch.float32, eps=1e-5)
    x, g = torch.randn(S, B, H) * 3, torch.randn(S, B, H)
    for got, want in zip(_step(mine, x, g), _step(ref, x, g), strict=True):
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_is_as_close_to_float64_as_nn_rmsnorm(dtype: torch.dtype) -> None:
    ref, mine = _pair(dtype)  # eps=None: torch takes float32's epsilon for 16-bit inputs
    exact = nn.RMSNorm(H, dtype=torch.float64)
    exact.load_state_dict({"weight": ref.weight.double()})
    x, g = (torch.randn(S, B, H) * 3).to(dtype), torch.randn(S, B, H).to(dtype)
    truth = _step(exact, x.double(), g.double())
    for got, theirs, want in zip(_step(mine, x, g), _step(ref, x, g), truth, strict=True):
        assert got.dtype == theirs.dtype == dtype
        assert rel_err(got.double(), want) <= 2 * rel_err(theirs.double(), want) + 1e-3
    assert torch.equal(mine(x), ref(x))  # forward rounds once, from the same float32 values


def test_float64_gradcheck_and_several_normalized_dims() -> None:
    x = torch.randn(5, 2, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, (4, 6), w, 1e-5), (x, w))
    ref = nn.RMSNorm((4, 6), elementwise_affine=False, dtype=torch.float64)
    mine = RMSNorm((4, 6), elementwise_affine=False, dtype=torch.float64)
    g = torch.randn_like(x)
    got = torch.autograd.grad(mine(x), x, g)[0]
    want = torch.autograd.grad(ref(x), x, g)[0]
    assert rel_err(got, want) <= 1e-12 and mine.weight is None
    with pytest.raises(MemoError, match="does not end in the normalized shape"):
        rms_norm(x, (6, 4))


def test_saves_only_the_input_and_a_float32_rstd_per_token() -> None:
    ref, mine = _pair(torch.bfloat16)
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved(mine, x, [mine.weight])
    assert len(saved) == 2
    kept_x, rstd = saved
    assert kept_x is x
    assert rstd.dtype == torch.float32 and rstd.numel() == S * B
    lean = _storage_bytes(saved)
    assert lean == S * B * (2 * H + 4)
    # nn.RMSNorm keeps the upcast input and the normalised input in float32 (and the rstd).
    composite = _storage_bytes(_saved(ref, x, [ref.weight]))
    assert composite - lean == S * B * (4 * H + 4 * H - 2 * H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_device(dtype: torch.dtype) -> None:
    norm = RMSNorm(H, eps=1e-6, device="meta", dtype=dtype)
    x = torch.empty(S, B, H, device="meta", dtype=dtype, requires_grad=True)
    y = norm(x)
    assert y.device.type == "meta" and y.dtype == dtype and y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert norm.weight.grad.shape == (H,) and norm.weight.grad.dtype == dtype


def test_state_dict_moves_between_the_two_unchanged() -> None:
    ref, mine = _pair(torch.float32, eps=1e-6)
    assert mine.state_dict().keys() == ref.state_dict().keys() == {"weight"}
    back = nn.RMSNorm(H, eps=1e-6)
    back.load_state_dict(mine.state_dict(), strict=True)
    x = torch.randn(4, H)
    assert torch.equal(back(x), ref(x)) and torch.equal(mine(x), ref(x))
    assert repr(mine) == repr(ref)
    fresh = RMSNorm(H)
    assert torch.equal(fresh.weight, torch.ones(H))
    assert RMSNorm(H, elementwise_affine=False).state_dict().keys() == set()


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # nn.RMSNorm's, on bf16
def test_cpu_autocast_output_dtype_is_nn_rmsnorm_s() -> None:
    ref, mine = _pair(torch.float32)
    linear = nn.Linear(H, H)
    x = torch.randn(S, B, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for inp in (x, x.bfloat16(), linear(x)):  # float32, bfloat16, an autocast linear's output
            got, want = mine(inp), ref(inp)
            assert got.dtype == want.dtype == inp.dtype
            assert torch.equal(got, want)
        y = mine(linear(x))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and mine.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_checkpoint(reentrant: bool) -> None:
    _, mine = _pair(torch.float32)
    linear = nn.Linear(H, 5)
    x = torch.randn(S, B, H)

    def step(checkpointed: bool) -> tuple[torch.Tensor, ...]:
        xx = x.clone().requires_grad_()
        mine.zero_grad(set_to_none=True)
        fn = lambda t: linear(mine(t)).square().sum()  # noqa: E731
        loss = torch.utils.checkpoint.checkpoint(fn, xx, use_reentrant=reentrant) if checkpointed else fn(xx)
        loss.backward()
        return xx.grad, mine.weight.grad

    for got, want in zip(step(True), step(False), strict=True):
        assert torch.equal(got, want)


def test_llama_models_use_it() -> None:
    model = build_model("llama-tiny")
    norms = [m for m in model.modules() if isinstance(m, (nn.RMSNorm, RMSNorm))]
    assert len(norms) == 2 * model.config.n_layers + 1
    assert all(type(m) is RMSNorm for m in norms)
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)  # reset_parameters
