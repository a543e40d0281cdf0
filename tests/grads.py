"""Comparing a wrapped model with the unwrapped one: loss and every gradient, fp32 relative error."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

#: The project's bar for memo against the unwrapped model (fp32).
RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms; ``|b|`` floored so that zero tensors compare)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_same_step(got: tuple[torch.Tensor, dict[str, torch.Tensor]],
                     want: tuple[torch.Tensor, dict[str, torch.Tensor]], rtol: float = RTOL) -> None:
    """``(loss, {name: grad})`` of two steps agree: the same parameters got gradients, each within
    ``rtol``; the message names the worst gradient."""
    assert rel_err(got[0], want[0]) < rtol, (got[0], want[0])
    assert got[1].keys() == want[1].keys()
    worst = max((rel_err(got[1][n], g), n) for n, g in want[1].items())
    assert worst[0] < rtol, f"gradient of {worst[1]} differs: relative error {worst[0]:.3g}"


def small_model(arch: str, n_layers: int = 4, seed: int | None = None) -> nn.Module:
    """memo's ``tiny`` (GPT) or ``llama-tiny`` at ``n_layers`` layers, float32; initialised after
    ``torch.manual_seed(seed)`` when ``seed`` is given (else from the global generator as it stands)."""
    from memo.models import build_model, get_config

    name = "tiny" if arch == "gpt" else "llama-tiny"
    cfg = dataclasses.replace(get_config(name), n_layers=n_layers, name=f"{name}-{n_layers}")
    if seed is not None:
        torch.manual_seed(seed)
    return build_model(cfg, dtype=torch.float32)


def random_batch(vocab: int | nn.Module, b: int, s: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` of shape ``[b, s]``, both drawn from one generator seeded ``seed`` (ids first);
    ``vocab`` is a vocabulary size or a memo model (its ``config.vocab_size``)."""
    v = vocab if isinstance(vocab, int) else vocab.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, v, (b, s), generator=g), torch.randint(0, v, (b, s), generator=g)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: grad}`` (copies) of the parameters that have a gradient."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def train_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward of a memo model from no gradients: ``(loss, {name: grad})``."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), grads_of(model)


def fused_qkv_views(s: int, b: int, n: int, n_kv: int, d: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v ``[s, b, heads, d]`` as views of one fused projection, as the reference layers make
    them (not contiguous), and an incoming gradient of the attention output."""
    qkv = torch.randn(s, b, n + 2 * n_kv, d, dtype=dtype)
    grad_o = torch.randn(s, b, n, d, dtype=dtype)
    return qkv[:, :, :n], qkv[:, :, n:n + n_kv], qkv[:, :, n + n_kv:], grad_o
