"""What a wrapped layer and its core attention use of the runtime and of the layer they serve
(NOTE [Layer context]): protocols, so that neither imports the module that implements them."""

from __future__ import annotations

from collections.abc import Sequence  # at run time: tests resolve LayerContext's hints
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

    from memo.adapters.base import LayerAdapter
    from memo.runtime.buffers import RoundingBuffers, RuntimeStats

__all__ = ["LayerContext", "WrappedLayer"]


class LayerContext(Protocol):
    """What a :class:`LayerCall` uses of the runtime that serves it, and nothing more.

    NOTE [Layer context]
    A wrapped layer's forward and backward need a few things shared by all the layers of one model:
    alpha, the rounding buffers, the counters, the forwards awaiting their backward, the anchor,
    the flight being recorded, and the warnings already given. They are state the runtime
    changes as it goes (``flight`` at every forward, ``pending`` and ``anchor`` replaced, the
    buffers reallocated), so a LayerCall reads them from the runtime when it needs them (a copy
    taken once would go stale), through this protocol: :class:`memo.runtime.MemoRuntime` is the
    one implementation, and layer.py never imports runtime.py (tests/runtime/test_runtime.py checks both).
    """

    alpha: float
    """Fraction of each layer's tokens whose skeletal tensors are offloaded (NOTE [Token-wise recompute])."""
    recompute_chunk_tokens: int | None
    """Tokens per recompute chunk, or None for the default (NOTE [Chunked recompute])."""
    buffers: RoundingBuffers | None
    """The rounding buffers; allocated by the runtime before any layer's forward runs."""
    stats: RuntimeStats
    """The runtime's counters (layer forwards and backwards, offloaded and recomputed tokens)."""
    pending: dict[tuple[int, int], Any]
    """``(flight, layer index)`` -> weak reference to the record of a forward awaiting its backward."""
    anchor: torch.Tensor
    """The empty tensor every wrapped layer's node takes as input, so that backward reaches it."""
    flight: int
    """The flight the current forward records into (NOTE [Forwards in flight])."""
    said: set[str]
    """Topics already warned about, once per runtime."""
    policy: list[str]
    """Each layer's policy (NOTE [Layer policy] in memo/runtime/runtime.py)."""
    calls: Sequence[WrappedLayer]
    """The wrapped layers, in forward order (a segment layer reruns the one before it: NOTE [Segments of
    two layers] in memo/runtime/segments.py)."""

    def begin_forward(self) -> None:
        """Called by the first layer's forward: choose the flight this forward records into."""

    def drop_failed(self, flight: int, index: int, epoch: int, where: str) -> None:
        """An exception left layer ``index``'s ``where`` ("forward"/"backward") of the forward
        whose slot epoch is ``epoch``: drop that forward (NOTE [Failed iteration])."""

    def reset(self) -> None:
        """Drop an abandoned iteration: wait for copies, set every layer idle, forget what is pending."""


class WrappedLayer(Protocol):
    """What a core attention (memo/runtime/core_attention.py) uses of the wrapped layer it serves:
    :class:`memo.runtime.layer.LayerCall` is the one implementation."""

    runtime: LayerContext
    """The runtime the layer runs in (NOTE [Layer context])."""
    layer: nn.Module
    """The layer's module."""
    adapter: LayerAdapter
    """The layer's adapter: its pre, core attention and post (NOTE [Layer adapters])."""
    index: int
    """The layer's index among the model's wrapped layers."""
