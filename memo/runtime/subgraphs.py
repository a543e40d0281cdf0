"""The backward of a memo layer's sub-graphs through the autograd engine, summing the parameters'
gradients (NOTE [Gradients through the engine] in memo/runtime/layer.py)."""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["SubGraphs"]


class SubGraphs:
    """Runs memo's sub-graphs' backward with torch.autograd.grad; sums the parameters' gradients."""

    def __init__(self, params: tuple[torch.Tensor, ...], anchor: torch.Tensor) -> None:
        self.params = list(params)
        self.anchor = anchor
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)

    def __call__(self, roots: list[GradientEdge], grads: list[torch.Tensor],
                 leaves: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor | None, ...]:
        """Backward of ``roots`` with ``grads``; returns the gradients of ``leaves`` (None: unused)."""
        n = len(self.params)
        out = torch.autograd.grad(roots, [*self.params, self.anchor, *leaves], grads, allow_unused=True)
        for j, g in enumerate(out[:n]):
            if g is not None:
                self.sums[j] = g if self.sums[j] is None else self.sums[j] + g
        return out[n + 1:]
