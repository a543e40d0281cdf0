"""The rows of a gathered layer in sequence order, for its core attention
(NOTE [Gathered rows in sequence order])."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from memo.errors import MemoError

if TYPE_CHECKING:
    from memo.adapters.base import LayerAdapter

__all__ = ["SequenceOrder"]


# NOTE [Gathered rows in sequence order]
# A rank of a tensor + sequence parallel group holds s/t tokens of the layer's input, and its pre
# gathers each token slice over the group (g = t attention-side rows per token). memo runs pre on
# slices ([0:a], then the recompute chunks), so the gathered rows come slice by slice. Where the
# gather lays out a slice rank-major (megatron's all-gather: the t ranks' slices one after the
# other), the rows of several slices are not in sequence order: rank 1's [0:a] rows come before
# rank 0's [a:s] rows. Attention needs sequence order (its causal mask is over positions), post
# needs the rows' (each slice's rows go back through the reduce-scatter that undoes the gather).
# So the core attention sees q, k, v, o and their gradients permuted into sequence order and its
# outputs are permuted back: transient copies of the attention-side tensors, made only when there
# are two or more slices (one slice in rank-major order is the sequence order).
class SequenceOrder:
    """The permutation between the rows memo's slices produce and sequence order (none: identity).

    Only the slices are kept; the index vectors (``s·g`` rows each) are made on the device for each
    use and dropped with it, so that no layer holds them from its forward to its backward.
    """

    def __init__(self, slices: list[tuple[int, int]] | None = None, g: int = 1, s: int = 0,
                 device: torch.device | None = None) -> None:
        self.slices, self.g, self.s, self.device = slices, g, s, device

    @classmethod
    def of(cls, adapter: LayerAdapter, head: list[tuple[int, int]], chunks: list[tuple[int, int]], a: int,
           s: int, g: int, device: torch.device) -> SequenceOrder:
        """The order of a layer pass's rows: its ``[0:a]`` tiles ``head``, then its ``[a:s]`` ``chunks``
        (relative to ``a``), each of ``g`` rows per token."""
        layout = adapter.gather_layout
        if layout not in ("token-major", "rank-major"):
            raise MemoError(f"memo.runtime: {type(adapter).__name__}.gather_layout is {layout!r}; expected "
                            "'token-major' or 'rank-major'")
        slices = list(head) + [(a + c0, a + c1) for c0, c1 in chunks]
        if g == 1 or layout == "token-major" or len(slices) <= 1:
            return cls()
        return cls(slices, g, s, device)

    def _index(self, to_sequence: bool) -> torch.Tensor:
        """Rows slice by slice hold ranks 0..g-1 of the slice's tokens one after the other:
        row ``b·g + r·n + i`` (slice ``[b:b+n]``) is sequence position ``r·s + b + i``."""
        g, s, dev = self.g, self.s, self.device
        ranks = torch.arange(g, device=dev)[:, None]
        if not to_sequence:  # the sequence position of each row
            return torch.cat([(ranks * s + torch.arange(b, e, device=dev)).reshape(-1)
                              for b, e in self.slices])
        index = torch.empty(g, s, dtype=torch.long, device=dev)  # the row of each sequence position
        for b, e in self.slices:
            index[:, b:e] = b * g + ranks * (e - b) + torch.arange(e - b, device=dev)
        return index.reshape(-1)

    def to_sequence(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.slices is None:
            return ts
        index = self._index(True)
        return tuple(t.index_select(0, index) for t in ts)

    def to_rows(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.slices is None:
            return ts
        index = self._index(False)
        return tuple(t.index_select(0, index) for t in ts)
