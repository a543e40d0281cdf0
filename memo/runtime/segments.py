"""Segments of two layers: one offloaded input for two layers (the "segment" policy).

NOTE [Segments of two layers]
Where host memory binds, a checkpoint every two layers halves the host bytes of input-only layers: layer
j runs "segment" after an input-only layer j - 1. Its forward is an input-only layer's that offloads
nothing (its slot in the rounding buffers has no host bytes). Its backward first makes its input again:
it waits for layer j - 1's prefetch (started, as for any layer, when the gradient of layer j's output is
ready), runs layer j - 1's forward without autograd from that input (its tiles, attention and the RNG and
autocast state its forward ran under, with its forward's tensors), and writes the output into layer j's
own device buffer, which is free then: its slot moved no bytes, and the layer before it (j - 1) holds
the other buffer. From there the backward is an input-only layer's. Layer j - 1's backward then finds
its buffer ready. So the device holds what an input-only layer's backward holds (two buffers, one
layer's backward at a time, and a tile of layer j - 1's forward while the input is made), and the price
is one more forward of layer j - 1 per segment, and one prefetch that does not hide under a backward.
A segment of three would need a third layer input on the device at once; memo stops at two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from memo.errors import MemoError, internal_assert
from memo.repeated_tiles import tile_indices
from memo.runtime.dropout import replay_rng
from memo.runtime.module_state import as_in_forward, gathered
from memo.runtime.rows import Rows

if TYPE_CHECKING:
    from memo.runtime.layer_context import WrappedLayer
    from memo.runtime.layer_record import LayerRecord

__all__ = ["replay_output", "segment_input"]


def segment_input(call: WrappedLayer, rec: LayerRecord) -> torch.Tensor:
    """The input of segment layer ``call``, made again in its own device buffer from the offloaded input of
    the layer before it (NOTE [Segments of two layers]); ``rec`` is the segment layer's record."""
    rt, i, f = call.runtime, call.index, rec.flight
    ref = rt.pending.get((f, i - 1))
    head_rec = None if ref is None else ref()
    if head_rec is None or head_rec.segment or not head_rec.input_only:
        raise MemoError(f"memo.runtime: segment layer {i}'s backward found no forward of input-only layer "
                        f"{i - 1} awaiting its backward; a segment layer's backward must run before the "
                        "backward of the layer it follows (NOTE [Segments of two layers])")
    buffers = rt.buffers
    internal_assert(buffers is not None and rec.x_like is not None, "a segment layer ran a forward")
    assert buffers is not None and rec.x_like is not None  # for the type checker: asserted above
    buffers.ready(i - 1, f)
    x_head = buffers.view(i - 1, head_rec.x_slot, f)
    shape, dtype = rec.x_like
    out = buffers.scratch(i, shape, dtype, f)
    replay_output(rt.calls[i - 1], head_rec, x_head, out)
    return out


def replay_output(call: WrappedLayer, rec: LayerRecord, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:] = layer(x)`` without autograd, as input-only layer ``call``'s forward computed it (``rec``):
    its tiles, attention, RNG, autocast and module tensors (NOTE [Segments of two layers])."""
    layer, adapter, ctx, g, s = call.layer, call.adapter, rec.ctx, rec.g, rec.s
    device = x.device
    with gathered(layer), as_in_forward(layer, rec.module_tensors), torch.no_grad(), rec.autocast.replay():
        qkv = [Rows(s * g) for _ in range(3)]
        for n in tile_indices(len(rec.chunks)):
            c0, c1 = rec.chunks[n]
            with replay_rng(rec.rng_pre[n], device), rec.scope("pre", c0, c1):
                parts = adapter.pre(layer, x[c0:c1], c0, ctx)
            for rows, t in zip(qkv, parts, strict=True):
                rows.put(c0 * g, t)
            del parts
        if rec.dropout is not None:
            rec.dropout.end_phase()
        q, k, v = (rows.take() for rows in qkv)
        del qkv
        with replay_rng(rec.rng_core, device):
            o = rec.core.output(rec, q, k, v)[0]
        del q, k, v
        for n in tile_indices(len(rec.chunks)):
            c0, c1 = rec.chunks[n]
            with replay_rng(rec.rng_post[n], device), rec.scope("post", c0, c1):
                out[c0:c1] = adapter.post(layer, o[c0 * g:c1 * g], x[c0:c1], ctx)
        if rec.dropout is not None:
            rec.dropout.end_phase()
