"""Taps: where the gradient reaching an input of one of a memo layer's sub-graphs comes out."""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

__all__ = ["Tap", "TapGrads"]


class TapGrads:
    """Gradients that reached the ``[0:a]`` inputs of a layer's sub-graphs (summed per name)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def add(self, name: str, grad: torch.Tensor) -> None:
        prev = self.grads.get(name)
        self.grads[name] = grad if prev is None else prev + grad

    def pop(self, name: str) -> torch.Tensor | None:
        return self.grads.pop(name, None)


class Tap(torch.autograd.Function):
    """``t`` (no grad) -> a view of it inside a graph; its gradient goes to ``taps[name]``.

    ``anchor`` is a zero-size tensor that requires grad, so the output gets a
    ``grad_fn``; nothing big is held by the node (NOTE [Token-wise recompute] in
    memo/runtime/layer.py).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, taps: TapGrads, name: str, anchor: torch.Tensor,
                t: torch.Tensor) -> torch.Tensor:
        ctx.taps, ctx.name = taps, name
        return t.view_as(t)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.taps.add(ctx.name, grad)
        return None, None, None, None
