"""What one forward of a wrapped layer leaves for its backward (:class:`LayerRecord`), and what the
layer's backward uses of the core attention that forward ran (:class:`CoreAttention`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.autograd.graph import GradientEdge

from memo.runtime.autocast import AutocastState
from memo.runtime.dropout import LayerDropout
from memo.runtime.packing import Packer
from memo.runtime.rows import Rows
from memo.runtime.sequence_order import SequenceOrder
from memo.runtime.subgraphs import SubGraphs
from memo.runtime.taps import TapGrads

__all__ = ["CoreAttention", "Grads", "LayerRecord"]

#: dq, dk, dv in the rows' layout.
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class CoreAttention(Protocol):
    """A layer's core attention, with its own backward: :class:`~memo.runtime.core_attention.MemoCore`
    or :class:`~memo.runtime.core_attention.BlackBoxCore` (NOTE [Black-box core attention] in
    memo/runtime/core_attention.py)."""

    black_box: bool
    #: Its backward needs q, k, v again (the saved ``[0:a]`` rows and ``[a:s]`` recomputed).
    needs_qkv: bool

    def output(self, rec: LayerRecord, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor | None]:
        """Attention without autograd -> o in the rows' layout and its log-sum-exp (None: unknown)."""

    def forward(self, rec: LayerRecord, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention once in the layer's forward, what its backward needs sent to the rounding buffer
        -> o in the rows' layout."""

    def backward(self, rec: LayerRecord, run: SubGraphs, grad_o: torch.Tensor, o_dev: torch.Tensor,
                 qkv: list[Rows] | None) -> Grads:
        """Attention's backward (``qkv``: the rows of q, k, v where :attr:`needs_qkv`) -> dq, dk, dv."""

    def recompute(self, rec: LayerRecord, qkv: list[Rows], device: torch.device) -> tuple[
            tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor | None]:
        """An input-only layer's attention again in backward -> (what its backward needs, o in the
        rows' layout, its graph or None)."""

    def recomputed_backward(self, rec: LayerRecord, run: SubGraphs, grad_o: torch.Tensor,
                            recomputed: tuple[torch.Tensor, ...], graph: torch.Tensor | None,
                            own: bool = False) -> Grads:
        """The backward of what :meth:`recompute` made -> dq, dk, dv in the rows' layout (``own``: q, k,
        v are the backward's alone, to be written over)."""


@dataclass
class LayerRecord:
    """What one forward of a wrapped layer leaves for its backward."""

    a: int
    s: int
    #: What the layer's adapter split off its arguments besides x (``split_args``), passed back to it.
    ctx: object
    #: Attention-side tokens per layer-input token (a tensor-parallel rank gathers its sequence:
    #: NOTE [Tensor-parallel rank] in memo/models/parallel.py); o, q, k, v rows split at ``a * g``.
    g: int
    taps: TapGrads
    packer: Packer
    x_slot: int = -1
    o_slot: int = -1
    lse_slot: int = -1
    qkv_slots: tuple[int, ...] = ()
    #: The ``[0:a]`` tiles (NOTE [Tiles bounded by memory]) and, per tile, its pre sub-graph's roots
    #: (``(j, edge)``: q, k, v that require grad) and its post sub-graph's root.
    head: list[tuple[int, int]] = field(default_factory=list)
    pre_edges: list[list[tuple[int, GradientEdge]]] = field(default_factory=list)
    post_edges: list[GradientEdge] = field(default_factory=list)
    #: The ``[a:s]`` token chunks (relative to ``a``) and the RNG state before each one's pre
    #: and post forward (NOTE [Chunked recompute]).
    chunks: list[tuple[int, int]] = field(default_factory=list)
    rng_pre: list[Any] = field(default_factory=list)
    rng_post: list[Any] = field(default_factory=list)
    autocast: AutocastState | None = None
    qkv_dtypes: tuple[torch.dtype, ...] = ()
    #: The forward in flight this record belongs to (NOTE [Forwards in flight] in buffers.py), and its
    #: layer's slot epoch there (NOTE [Failed iteration] in memo/runtime/runtime.py).
    flight: int = 0
    epoch: int = 0
    #: The layer's parameters and buffers as forward ran with them (NOTE [Recompute with the
    #: forward's tensors] in memo/runtime/module_state.py).
    module_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Full-sequence dropout masks (NOTE [Dropout as unwrapped]); None for a layer in eval mode.
    dropout: LayerDropout | None = None
    #: The attention-side rows in sequence order (NOTE [Gathered rows in sequence order] in
    #: memo/runtime/sequence_order.py).
    order: SequenceOrder | None = None
    #: q, k, v's shapes past their first dimension (zero gradients for inputs a black box ignores).
    qkv_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: The core attention this forward ran, with its own backward (NOTE [Black-box core attention] in
    #: memo/runtime/core_attention.py).
    core: CoreAttention | None = None
    #: The input-only policy (NOTE [Input-only layers]): attention is recomputed in backward too,
    #: from the RNG state it ran at (``rng_core``).
    input_only: bool = False
    rng_core: Any = None
    #: A segment layer (NOTE [Segments of two layers] in memo/runtime/segments.py): its input is not kept;
    #: its backward recomputes it, of this shape and dtype, from the layer before it.
    segment: bool = False
    x_like: tuple[tuple[int, ...], torch.dtype] | None = None

    def scope(self, phase: str, t0: int, t1: int) -> contextlib.AbstractContextManager[None]:
        """Where ``pre``/``post`` runs on tokens ``[t0:t1]``: dropout draws full-sequence masks."""
        return contextlib.nullcontext() if self.dropout is None else self.dropout.scope(phase, t0, t1)
