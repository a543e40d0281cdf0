"""A memo layer's core attention, one small class per kind, each with its forward and backward.

:class:`MemoCore` is the attention the layer's adapter computes itself; :class:`BlackBoxCore` is any
other, which memo runs as it is (NOTE [Black-box core attention]). A
:class:`~memo.runtime.layer.LayerCall` makes one of them per forward and keeps it in the forward's
record (:class:`~memo.runtime.layer_record.CoreAttention` is what the layer's backward uses of
them). Both also recompute their forward in an input-only layer's backward (NOTE [Input-only
layers] in memo/runtime/layer.py).

NOTE [Black-box core attention]
memo never replaces a layer's attention by its own. Where the adapter computes the layer's core
attention itself (``core_forward`` / ``core_backward``: memo's models, megatron layers built with
memo's spec) attention runs once without autograd and its backward is memo's, from the saved o
and lse. Any other core attention (``adapter.core_function`` returns it: a sliding window, a
custom mask, TransformerEngine's attention, a context-parallel implementation memo does not know)
is a black box: it runs once, on all tokens, with autograd, on q, k, v fed through taps; every
tensor it saves goes through the layer's pack hook into the rounding buffer, like the ``[0:a]``
sub-graphs' (packed after the call, so that a saved output refers to the copy of o already in the
buffer instead of being copied twice). In backward its own graph runs once from the gradient of o
and the taps hand back dq, dk, dv; nothing of it is recomputed. The price: it offloads what it
saves (typically q, k, v of all tokens, not only ``[0:a]``'s), and q, k, v of ``[a:s]`` are not
recomputed for attention, only for pre's own backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from memo.errors import MemoError, internal_assert
from memo.models.causal_attention import gradients_into_inputs
from memo.runtime.dropout import replay_rng
from memo.runtime.layer_context import WrappedLayer
from memo.runtime.layer_record import Grads, LayerRecord
from memo.runtime.rows import Rows
from memo.runtime.subgraphs import SubGraphs
from memo.runtime.taps import Tap

__all__ = ["BlackBoxCore", "CoreFunction", "MemoCore"]

#: A core attention memo runs as it is: q, k, v in sequence order -> its output (checked to be one
#: tensor ``[s, b, heads * head_dim]``, megatron's core attention contract).
CoreFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


class MemoCore:
    """The core attention the adapter computes (``core_forward`` / ``core_backward``: memo's models,
    megatron layers built with memo's spec): once without autograd, its backward memo's, from the
    saved o and its log-sum-exp."""

    black_box = False
    #: Its backward needs q, k, v again (the saved ``[0:a]`` rows and ``[a:s]`` recomputed).
    needs_qkv = True

    def __init__(self, call: WrappedLayer) -> None:
        self.call = call

    def output(self, rec: LayerRecord, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor | None]:
        """Attention without autograd on the rows' q, k, v -> o in the rows' layout and the
        log-sum-exp."""
        seq = rec.order.to_sequence(q, k, v)
        with torch.no_grad():
            o, lse = self.call.adapter.core_forward(self.call.layer, *seq, rec.ctx)
        del seq
        (o,) = rec.order.to_rows(o.contiguous())
        return o, lse

    def forward(self, rec: LayerRecord, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention once, without autograd; q, k, v of ``[0:a]``, o and its log-sum-exp go to the
        rounding buffer -> o in the rows' layout."""
        packer, ag = rec.packer, rec.a * rec.g
        if rec.a > 0:
            rec.qkv_slots = tuple(packer.sink.pack(t[:ag], f"{name}[:{ag}]")
                                  for name, t in zip("qkv", (q, k, v), strict=True))
        o, lse = self.output(rec, q, k, v)
        del q, k, v
        rec.o_slot = packer.sink.pack(o, "attention output o")
        rec.lse_slot = packer.sink.pack(lse, "attention log-sum-exp")
        packer.add_base(o, rec.o_slot)
        del lse
        return o

    def backward(self, rec: LayerRecord, run: SubGraphs, grad_o: torch.Tensor, o_dev: torch.Tensor,
                 qkv: list[Rows] | None) -> Grads:
        """Attention's backward from the saved o and lse, ``qkv`` the rows of q, k, v
        (:meth:`~memo.runtime.layer.LayerCall._recompute_qkv`) -> ``(dq, dk, dv)`` in the rows' layout."""
        internal_assert(qkv is not None, "memo's core attention's backward needs q, k, v (needs_qkv)")
        call, order = self.call, rec.order
        q, k, v = order.to_sequence(*(rows.take() for rows in qkv))  # the rows' copies are dropped here
        del qkv
        lse = call.runtime.buffers.view(call.index, rec.lse_slot, rec.flight)
        (grad_seq,), (o_seq,) = order.to_sequence(grad_o), order.to_sequence(o_dev)
        grads = call.adapter.core_backward(call.layer, grad_seq, q, k, v, o_seq, lse, rec.ctx)
        del q, k, v, grad_seq, o_seq
        return order.to_rows(*grads)

    def recompute(self, rec: LayerRecord, qkv: list[Rows], device: torch.device) -> tuple[
            tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor | None]:
        """Step 0 of an input-only layer's backward: attention's forward again on the recomputed q,
        k, v -> (the sequence-order tensors its backward needs, o in the rows' layout, None)."""
        order = rec.order
        q, k, v = order.to_sequence(*(rows.take() for rows in qkv))
        del qkv
        with rec.autocast.replay(), replay_rng(rec.rng_core, device):
            with torch.no_grad():
                o, lse = self.call.adapter.core_forward(self.call.layer, q, k, v, rec.ctx)
            (o_rows,) = order.to_rows(o.contiguous())
        return (q, k, v, o, lse), o_rows, None

    def recomputed_backward(self, rec: LayerRecord, run: SubGraphs, grad_o: torch.Tensor,
                            recomputed: tuple[torch.Tensor, ...], graph: torch.Tensor | None,
                            own: bool = False) -> Grads:
        """Step 2 of an input-only layer's backward, from what :meth:`recompute` made -> dq, dk, dv
        in the rows' layout; ``own``: q, k, v are this backward's alone, and dq, dk, dv may be written
        over them (NOTE [Gradients written over q, k, v] in memo/models/causal_attention.py)."""
        order = rec.order
        (grad_seq,) = order.to_sequence(grad_o)
        q, k, v, o, lse = recomputed
        with gradients_into_inputs() if own else contextlib.nullcontext():
            grads = self.call.adapter.core_backward(self.call.layer, grad_seq, q, k, v, o, lse, rec.ctx)
        return order.to_rows(*grads)


class BlackBoxCore:
    """A core attention memo does not compute (``adapter.core_function`` returns it), run as it is
    (NOTE [Black-box core attention])."""

    black_box = True
    needs_qkv = False

    def __init__(self, call: WrappedLayer, core: CoreFunction) -> None:
        self.call = call
        self.core = core
        #: Its graph (the edge of its output) from forward to backward; None: no gradient reaches it.
        self.edge: GradientEdge | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The core attention's output, checked (megatron's core attention contract)."""
        out = self.core(q, k, v)
        if not isinstance(out, torch.Tensor) or out.dim() != 3:
            raise MemoError(
                f"memo.runtime: layer {self.call.index}'s core attention returned "
                f"{type(out).__name__}{list(out.shape) if isinstance(out, torch.Tensor) else ''}; memo "
                "needs one tensor [s, b, heads * head_dim] (megatron's core attention contract)")
        return out

    def output(self, rec: LayerRecord, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[
            torch.Tensor, None]:
        """The core attention without autograd (an input-only layer's forward) -> o in the rows'
        layout and None (a black box gives no log-sum-exp)."""
        seq = rec.order.to_sequence(q, k, v)
        with torch.no_grad():
            o = self(*seq)
        del seq
        (o,) = rec.order.to_rows(o.contiguous())
        return o, None

    def forward(self, rec: LayerRecord, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Runs the layer's own core attention once, with autograd, every tensor it saves sent to the
        rounding buffer (NOTE [Black-box core attention]); -> o in the rows' layout."""
        packer = rec.packer
        q, k, v = rec.order.to_sequence(q, k, v)
        with torch.enable_grad():
            ins = [Tap.apply(rec.taps, name, self.call.runtime.anchor, t)
                   for name, t in zip("qkv", (q, k, v), strict=True)]
            with packer.deferred() as later:
                out = self(*ins)
            del ins, q, k, v
            self.edge = get_gradient_edge(out) if out.requires_grad else None  # None: no gradient
        (o,) = rec.order.to_rows(out.detach().contiguous())
        rec.o_slot = packer.sink.pack(o, "attention output o")
        packer.add_base(o, rec.o_slot)
        later.resolve()  # after o is a base: a core that saves its output refers to that copy
        del out
        return o

    def backward(self, rec: LayerRecord, run: SubGraphs, grad_o: torch.Tensor, o_dev: torch.Tensor,
                 qkv: list[Rows] | None) -> Grads:
        """The black box's own backward (NOTE [Black-box core attention]) -> dq, dk, dv in the rows'
        layout (zeros for an input the core does not use)."""
        (grad_seq,) = rec.order.to_sequence(grad_o)
        if self.edge is not None:
            run([self.edge], [grad_seq])
        self.edge = None
        s, dtypes = rec.s * rec.g, rec.qkv_dtypes
        grads = []
        for name, dtype in zip("qkv", dtypes, strict=True):
            d = rec.taps.pop(name)
            grads.append(d if d is not None else torch.zeros((s, *rec.qkv_shapes[name]), dtype=dtype,
                                                            device=grad_o.device))
        return rec.order.to_rows(*grads)

    def recompute(self, rec: LayerRecord, qkv: list[Rows], device: torch.device) -> tuple[
            tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor | None]:
        """Step 0 of an input-only layer's backward: the core attention again, with autograd, on the
        recomputed q, k, v -> (its leaves q, k, v, o in the rows' layout, its graph or None)."""
        order = rec.order
        q, k, v = order.to_sequence(*(rows.take() for rows in qkv))
        del qkv
        with rec.autocast.replay(), replay_rng(rec.rng_core, device):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            del q, k, v
            with torch.enable_grad():
                out = self(*leaves)
        (o_rows,) = order.to_rows(out.detach().contiguous())
        return tuple(leaves), o_rows, out if out.requires_grad else None

    def recomputed_backward(self, rec: LayerRecord, run: SubGraphs, grad_o: torch.Tensor,
                            recomputed: tuple[torch.Tensor, ...], graph: torch.Tensor | None,
                            own: bool = False) -> Grads:
        """Step 2 of an input-only layer's backward: the recomputed graph's backward -> dq, dk, dv
        in the rows' layout (zeros for an input the core does not use; ``own`` is not used: the black
        box's backward makes its own)."""
        (grad_seq,) = rec.order.to_sequence(grad_o)
        leaves = recomputed
        found = run([get_gradient_edge(graph)], [grad_seq], leaves) if graph is not None else (None,) * 3
        grads = [d if d is not None else torch.zeros_like(t) for d, t in zip(found, leaves, strict=True)]
        return rec.order.to_rows(*grads)
