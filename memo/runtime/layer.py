"""Token-wise offload / recompute of one transformer layer, as one ``autograd.Function``.

NOTE [Token-wise recompute]
For a layer input ``x: [s, b, h]`` and ``a = floor(alpha * s)``:

forward
  1. ``x`` goes whole into the layer's rounding buffer (offloaded).
  2. ``pre`` runs on tokens ``[0:a]`` with grad enabled, under
     ``saved_tensors_hooks`` that copy every tensor it saves into the rounding
     buffer (NOTE [What the pack hook keeps] in memo/runtime/packing.py); on ``[a:s]`` it runs under
     ``no_grad`` with ``offset`` at each chunk's first token (RoPE positions), so
     nothing is saved (NOTE [Chunked recompute]).
  3. Attention runs once on all tokens without autograd (``adapter.core_forward``; a core
     attention memo does not compute runs as a black box: NOTE [Black-box core attention] in
     memo/runtime/core_attention.py);
     ``o`` and its log-sum-exp go whole into the buffer, and ``q, k, v`` of
     tokens ``[0:a]`` (the attention's own skeletal inputs) too.
  4. ``post`` runs like ``pre``: ``[0:a]`` recorded with hooks, ``[a:s]`` without grad
     in the same chunks.
  The sub-graphs of ``[0:a]`` are kept only as ``GradientEdge``s of their outputs,
  never as tensors, so their outputs' memory is freed; their inputs are fed
  through :class:`Tap`, a parameter-free node that hands the gradient reaching
  ``x[0:a]`` / ``o[0:a]`` to the layer's backward.

backward (after the prefetch of the layer's buffer)
  1. ``torch.autograd.backward`` runs the ``[0:a]`` post sub-graph; then ``post`` is
     recomputed from the restored ``x`` and ``o`` and back-propagated one chunk of
     ``[a:s]`` at a time: parameter gradients accumulate as in any backward, and
     the gradient of ``o`` comes out.
  2. q, k, v are the restored ``[0:a]`` rows and the ``[a:s]`` rows recomputed
     without grad; attention's backward runs from the saved ``o`` and ``lse``
     (attention itself is never recomputed).
  3. The ``[0:a]`` pre sub-graph runs backward, then ``pre`` is recomputed and
     back-propagated chunk by chunk; the gradient of ``x`` is the two taps' share
     (``[0:a]``) and the recomputed chunks' leaves' (``[a:s]``).
alpha = 0 and alpha = 1 go through the same code; an empty token range just
has no sub-graph. The recomputed range replays the forward's random state
(dropout) and autocast state (NOTE [Recompute replays autocast] in memo/runtime/autocast.py).

NOTE [Chunked recompute]
``pre`` and ``post`` are token-wise (NOTE [Layer adapters]), so the recomputed
range ``[a:s]`` need not exist all at once. It is split into chunks of tokens
(:func:`token_chunks`: at most RECOMPUTE_CHUNKS of them, none with less work than
MIN_CHUNK_WORK: memo/runtime/tiles.py) and each chunk is recomputed and back-propagated on its own:
``post`` chunk by chunk (recompute, then backward), then q, k, v for attention's
backward (recomputed without grad; attention needs every row at once), then
``pre`` chunk by chunk again. The backward thus holds one chunk's activations
instead of ``(1 - alpha)`` of the layer's; the price is ``pre`` run twice on
``[a:s]`` (once without grad for q, k, v, once with it for its backward), a few
matmuls per token against attention's s. Forward runs the no-grad ``[a:s]`` range
in the same chunks and records the RNG state before each chunk's ``pre`` and
``post``, so that every recompute draws the dropout masks its forward drew. The
gradients of ``o`` and ``x`` and the layer's q, k, v and output are tensors
allocated once and filled chunk by chunk (:class:`~memo.runtime.rows.Rows`).
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import GradientEdge, get_gradient_edge

from memo.errors import MemoError
from memo.planner.vocab import LayerPolicy
from memo.profiler.saved import storage_id
from memo.repeated_tiles import tile_indices
from memo.runtime.autocast import AutocastState
from memo.runtime.core_attention import BlackBoxCore, MemoCore
from memo.runtime.dropout import LayerDropout, replay_rng, rng_state, same_rng_state
from memo.runtime.layer_context import LayerContext
from memo.runtime.layer_record import Grads, LayerRecord
from memo.runtime.module_state import (
    as_in_forward,
    buffer_snapshot,
    gathered,
    module_tensors,
    restore_changed,
)
from memo.runtime.owned_grad import incoming_refs, owned_incoming
from memo.runtime.packing import BufferSink, CountingSink, Packer
from memo.runtime.rows import Rows
from memo.runtime.segments import segment_input
from memo.runtime.sequence_order import SequenceOrder
from memo.runtime.subgraphs import SubGraphs
from memo.runtime.taps import Tap, TapGrads
from memo.runtime.tiles import (
    MIN_CHUNK_WORK,
    MIN_CPU_CHUNK_TOKENS,
    RECOMPUTE_CHUNKS,
    TILE_BYTES,
    layer_token_bytes,
    min_chunk_tokens,
    tile_bound_tokens,
    token_chunks,
)

if TYPE_CHECKING:
    from memo.adapters.base import LayerAdapter
    from memo.runtime.buffers import RoundingBuffers

__all__ = [
    "LayerCall", "LayerContext", "LayerRecord", "MIN_CHUNK_WORK", "MIN_CPU_CHUNK_TOKENS", "RECOMPUTE_CHUNKS",
    "TILE_BYTES", "layer_token_bytes", "min_chunk_tokens", "offload_tokens", "tile_bound_tokens",
    "token_chunks",
]


def offload_tokens(alpha: float, s: int) -> int:
    """``floor(alpha * s)``: the tokens whose skeletal tensors are offloaded (the rest are recomputed).

    A tiny tolerance keeps e.g. ``0.29 * 100`` at 29 despite binary rounding.
    """
    return max(0, min(s, int(math.floor(alpha * s + 1e-9))))


#: The last recompute chunk's pre graph, kept from the recompute of q, k, v for step 3 of the
#: backward: its input leaf and its q, k, v (NOTE [Input-only layers]).
_KeptChunk = tuple[torch.Tensor, tuple[torch.Tensor, ...]]


def _chunks_run(rec: LayerRecord) -> Iterator[tuple[int, tuple[int, int]]]:
    """(index, range) of the ``[a:s]`` chunks to run: every one, but for a meta estimate's repeated
    ones (NOTE [Repeated tiles in a meta estimate] in memo/repeated_tiles.py)."""
    for n in tile_indices(len(rec.chunks)):
        yield n, rec.chunks[n]


def _copy_or_zero(dst: torch.Tensor, src: torch.Tensor | None) -> None:
    """``dst[:] = src``, or zeros where autograd gave no gradient (the rows did not reach the loss)."""
    if src is None:
        dst.zero_()
    else:
        dst.copy_(src)


def _edge(t: torch.Tensor) -> GradientEdge:
    return get_gradient_edge(t)


class LayerCall:
    """One wrapped layer: its adapter, its index, and the forward/backward of NOTE [Token-wise recompute].

    ``runtime`` is the :class:`LayerContext` it runs in (NOTE [Layer context] in
    memo/runtime/layer_context.py).
    """

    def __init__(self, runtime: LayerContext, layer: nn.Module, adapter: LayerAdapter, index: int) -> None:
        self.runtime = runtime
        self.layer = layer
        self.adapter = adapter
        self.index = index

    @property
    def input_only(self) -> bool:
        """Whether this layer runs the input-only policy (NOTE [Input-only layers]); a segment layer does,
        its input recomputed instead of offloaded (NOTE [Segments of two layers] in segments.py)."""
        return self.runtime.policy[self.index] in (LayerPolicy.INPUT_ONLY, LayerPolicy.SEGMENT)

    def _keep_storages(self) -> set[int]:
        keep = set()
        for t in list(self.layer.parameters()) + list(self.layer.buffers()):
            ptr = storage_id(t)
            if ptr is not None:
                keep.add(ptr)
        return keep

    def measure(self, x: torch.Tensor, ctx: object) -> tuple[int, list[tuple[str, int]]]:
        """Dry run: the bytes one forward of this layer offloads for input ``x`` (nothing is kept),
        and what they are (``(what, bytes)`` per copied tensor)."""
        self._say_hooks()
        sink = CountingSink()
        state = buffer_snapshot(self.layer)
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), \
                gathered(self.layer):  # NOTE [Dry runs under FSDP2] in module_state.py
            _, rec = self._forward(x.detach(), ctx, sink)
        changed = restore_changed(self.layer, state)  # NOTE [Layers with state] in module_state.py
        if changed and (rec.chunks or len(rec.head) > 1 or rec.input_only):
            runs = ("its attention and all its token-wise parts again in backward" if rec.input_only else
                    f"its token-wise parts {len(rec.head) + len(rec.chunks)} times per forward "
                    + ("and again in backward for the recomputed tokens" if rec.chunks else "(one per tile)"))
            raise MemoError(
                f"memo.runtime: layer {self.index} ({type(self.layer).__name__}) changes its buffers "
                f"{', '.join(changed)} in forward (state, such as spectral_norm's power iteration, a "
                f"quantization observer or a counter), and memo would run {runs}, advancing that state "
                "more often than the unwrapped model. Give this layer the policy 'keep' (memo.wrap(model, "
                "policy=[...])), or alpha=1 with a tile that holds its whole sequence "
                "(recompute_chunk_tokens), where it runs once per forward (NOTE [Layers with state])")
        return sink.used, sink.tensors

    def forward(self, x: torch.Tensor, ctx: object) -> tuple[torch.Tensor, LayerRecord]:
        """``x: [s, b, h]`` -> ``y: [s, b, h]`` and the record backward needs."""
        rt, i = self.runtime, self.index
        if i == 0:
            rt.begin_forward()
        f = rt.flight
        rt.buffers.begin_forward(i, f)
        epoch = rt.buffers.layers[f][i].epoch
        try:
            y, rec = self._forward(x, ctx, BufferSink(rt, i, f))
        except BaseException:
            rt.drop_failed(f, i, epoch, "forward")
            raise
        rec.flight, rec.epoch = f, epoch
        rec.module_tensors = module_tensors(self.layer)
        rt.buffers.end_forward(i, f)
        rt.buffers.note_flights()
        rt.pending[f, i] = weakref.ref(rec)
        rt.stats.layer_forwards += 1
        rt.stats.offloaded_tokens += rec.a
        rt.stats.recomputed_tokens += rec.s - rec.a
        return y, rec

    def _forward(self, x: torch.Tensor, ctx: object, sink: CountingSink | BufferSink) -> tuple[
            torch.Tensor, LayerRecord]:
        rt, layer, adapter = self.runtime, self.layer, self.adapter
        s = x.shape[0]
        input_only = self.input_only
        a = 0 if input_only else offload_tokens(rt.alpha, s)
        g = adapter.sequence_gather(layer)
        ag = a * g
        xc = x.detach().contiguous()
        packer = Packer(sink, self._keep_storages(), xc.device)
        rec = LayerRecord(a=a, s=s, g=g, ctx=ctx, taps=TapGrads(), packer=packer,
                      autocast=AutocastState.capture(xc.device), input_only=input_only)
        if layer.training:
            rec.dropout = LayerDropout(s, xc.device, self._say, batch_first=adapter.batch_first)
        rec.segment = self.runtime.policy[self.index] == LayerPolicy.SEGMENT
        rec.x_like = (tuple(xc.shape), xc.dtype)
        if not rec.segment:  # NOTE [Segments of two layers] in memo/runtime/segments.py
            rec.x_slot = sink.pack(xc, "layer input x")
            packer.add_base(xc, rec.x_slot)

        hidden = xc.shape[-1]
        batch = xc[0].numel() // max(1, hidden)
        tiles = functools.partial(token_chunks, chunk_tokens=rt.recompute_chunk_tokens, batch=batch,
                                  hidden=hidden, device_type=xc.device.type,
                                  token_bytes=layer_token_bytes(layer, hidden, xc.element_size()))
        rec.head, rec.chunks = tiles(a), tiles(s - a)
        qkv = [Rows(s * g) for _ in range(3)]
        # [0:a], tile by tile with grad: each tile's saved tensors go to the buffer as it runs
        # (NOTE [Tiles bounded by memory]); its graph stays as the edges of q, k, v.
        x_taps = []
        for t0, t1 in rec.head:
            with torch.enable_grad():
                x_t = Tap.apply(rec.taps, ("x", t0), rt.anchor, xc[t0:t1])
                with packer.hooks(), rec.scope("pre", t0, t1):
                    parts = adapter.pre(layer, x_t, t0, ctx)
            rec.pre_edges.append([(j, _edge(t)) for j, t in enumerate(parts) if t.requires_grad])
            for rows, t in zip(qkv, parts, strict=True):
                rows.put(t0 * g, t.detach())
            x_taps.append(x_t)
            del parts
            packer.storages.retain({rec.x_slot})  # the tile's own tensors go with it
        rec.rng_pre = [None] * len(rec.chunks)
        for n, (c0, c1) in _chunks_run(rec):
            rec.rng_pre[n] = rng_state(xc.device)
            with torch.no_grad(), rec.scope("pre", a + c0, a + c1):
                parts = adapter.pre(layer, xc[a + c0:a + c1], a + c0, ctx)
            for rows, t in zip(qkv, parts, strict=True):
                rows.put(ag + c0 * g, t)
            del parts
        q, k, v = (rows.take() for rows in qkv)
        rec.qkv_dtypes = (q.dtype, k.dtype, v.dtype)
        rec.order = SequenceOrder.of(adapter, rec.head, rec.chunks, a, s, g, xc.device)
        rec.qkv_shapes = {name: tuple(t.shape[1:]) for name, t in zip("qkv", (q, k, v), strict=True)}
        core = adapter.core_function(layer, ctx)
        rec.core = MemoCore(self) if core is None else BlackBoxCore(self, core)
        if input_only:
            # NOTE [Input-only layers]: attention runs without autograd and nothing of it is kept.
            rec.rng_core = rng_state(xc.device)
            o = rec.core.output(rec, q, k, v)[0]
        else:
            o = rec.core.forward(rec, q, k, v)
        del q, k, v

        y = Rows(s)
        for (t0, t1), x_t in zip(rec.head, x_taps, strict=True):
            with torch.enable_grad():
                o_t = Tap.apply(rec.taps, ("o", t0), rt.anchor, o[t0 * g:t1 * g])
                with packer.hooks(), rec.scope("post", t0, t1):
                    y_t = adapter.post(layer, o_t, x_t, ctx)
            rec.post_edges.append(_edge(y_t))
            y.put(t0, y_t.detach())
            del y_t, o_t
            packer.storages.retain({rec.x_slot, rec.o_slot})
        del x_taps
        rec.rng_post = [None] * len(rec.chunks)
        for n, (c0, c1) in _chunks_run(rec):
            rec.rng_post[n] = rng_state(xc.device)
            with torch.no_grad(), rec.scope("post", a + c0, a + c1):
                y.put(a + c0, adapter.post(layer, o[ag + c0 * g:ag + c1 * g], xc[a + c0:a + c1], ctx))
        if rec.chunks and same_rng_state(rec.rng_pre[0], rng_state(xc.device)):
            # Nothing from the first chunk's pre to the last chunk's post drew random numbers: the
            # recompute has no state to replay, and a generator fork per chunk costs host time.
            rec.rng_pre = rec.rng_post = [None] * len(rec.chunks)
            rec.rng_core = None
        packer.end_pass()
        if rec.dropout is not None:
            rec.dropout.end_forward()
            rec.dropout.begin_replay()
        return y.take(), rec

    def backward(self, rec: LayerRecord, grad_y: torch.Tensor, params: tuple[torch.Tensor, ...],
                 anchor: torch.Tensor, refs: int = 0) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """``grad_y: [s, b, h]`` -> ``grad_x: [s, b, h]`` and the gradients of ``params`` (NOTE
        [Gradients through the engine]), recomputing with the tensors forward ran with (NOTE
        [Recompute with the forward's tensors] in memo/runtime/module_state.py). ``refs``: grad_y's
        Python references on entry to the engine's call (NOTE [Gradient of x over the incoming one] in
        memo/runtime/owned_grad.py; 0: not memo's to write over)."""
        # A sharding wrapper frees a layer's gathered parameters after its forward and gathers them
        # again before its backward (FSDP2: NOTE [memo under FSDP2] in memo/distributed/fsdp2.py). One
        # still freed here would be read as empty memory by the recompute: refuse it by name.
        freed = [name for name, t in rec.module_tensors.items()
                 if type(t) in (torch.Tensor, nn.Parameter) and t.numel() and t.untyped_storage().size() == 0]
        if freed:
            raise MemoError(
                f"memo.runtime: layer {self.index}'s backward found {', '.join(freed[:4])}"
                f"{' ...' if len(freed) > 4 else ''} without storage: the tensors its forward ran with were "
                "freed after the forward (a sharding wrapper's reshard) and not gathered again before this "
                "backward, so memo's recompute would read freed memory. With FSDP2, let fully_shard's hooks "
                "run around the layer's call (memo.wrap before or after fully_shard, NOTE [memo under "
                "FSDP2]); do not call the layer's forward past them")
        with as_in_forward(self.layer, rec.module_tensors):
            return self._backward(rec, grad_y, params, anchor, refs)

    def _backward(self, rec: LayerRecord, grad_y: torch.Tensor, params: tuple[torch.Tensor, ...],
                  anchor: torch.Tensor, refs: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        i, f = self.index, rec.flight
        buffers = self._begin_backward(rec)
        run = SubGraphs(params, anchor)
        x_dev = segment_input(self, rec) if rec.segment else buffers.view(i, rec.x_slot, f)
        # NOTE [Gradient of x over the incoming one] in memo/runtime/owned_grad.py
        grad_x = grad_y if refs and owned_incoming(grad_y, refs, x_dev) else torch.empty_like(
            x_dev, memory_format=torch.contiguous_format)
        grad_y = grad_y.contiguous()

        # 0. an input-only layer recomputes q, k, v and attention first (NOTE [Input-only layers]).
        kept: _KeptChunk | None = None
        recomputed: tuple[torch.Tensor, ...] | None = None
        core_graph = None
        if rec.input_only:
            kept, qkv = self._recompute_qkv(rec, x_dev)
            # q, k, v are this backward's alone unless they are the kept chunk's graph's outputs (one chunk)
            own = kept is None or not {storage_id(t) for t in kept[1]} & {storage_id(r.tensor) for r in qkv}
            recomputed, o_dev, core_graph = rec.core.recompute(rec, qkv, x_dev.device)
            del qkv
        else:
            o_dev = buffers.view(i, rec.o_slot, f)

        # 1. post -> the gradient of o, and post's share of the gradient of x.
        grad_o = self._post_backward(rec, run, grad_y, grad_x, x_dev, o_dev)
        del grad_y

        # 2. attention's backward (memo/runtime/core_attention.py): the black box's own, or from the
        # saved (or, input-only, recomputed) o and lse, with q, k, v the saved [0:a] rows and [a:s]
        # recomputed without grad.
        if rec.input_only:
            dq, dk, dv = rec.core.recomputed_backward(rec, run, grad_o, recomputed, core_graph, own)
            del recomputed, core_graph
        else:
            qkv = None
            if rec.core.needs_qkv:  # memo's core: the saved [0:a] rows, [a:s] recomputed
                kept, qkv = self._recompute_qkv(rec, x_dev)
            dq, dk, dv = rec.core.backward(rec, run, grad_o, o_dev, qkv)
            del qkv
        del grad_o, o_dev

        # 3. pre, as post -> the rest of the gradient of x.
        self._pre_backward(rec, run, (dq, dk, dv), grad_x, x_dev, kept)
        del dq, dk, dv

        rec.packer.resolve_slot = None
        buffers.end_backward(i, f)
        self.runtime.stats.layer_backwards += 1
        return grad_x, run.sums

    def _begin_backward(self, rec: LayerRecord) -> RoundingBuffers:
        """The rounding buffers that hold ``rec``'s forward, begun for this layer's backward; refused
        when that forward was dropped (NOTE [Failed iteration])."""
        rt, i, f = self.runtime, self.index, rec.flight
        rt.pending.pop((f, i), None)
        buffers = rt.buffers
        if buffers is None or f >= buffers.n_flights or buffers.layers[f][i].epoch != rec.epoch:
            raise MemoError(
                f"memo.runtime: the backward of layer {i} belongs to a forward whose offloaded activations "
                "memo has dropped (an exception in that iteration's forward or backward, or the model "
                "was unwrapped since): they are gone. Run the forward again (NOTE [Failed iteration])")
        buffers.begin_backward(i, f)
        rec.packer.resolve_slot = lambda slot: buffers.view(i, slot, f)
        return buffers

    def _post_backward(self, rec: LayerRecord, run: SubGraphs, grad_y: torch.Tensor, grad_x: torch.Tensor,
                       x_dev: torch.Tensor, o_dev: torch.Tensor) -> torch.Tensor:
        """Step 1 of the backward: post's -> the gradient of o, and post's share of the gradient of x
        written into ``grad_x`` (which may be ``grad_y`` itself: each chunk is written once read)."""
        layer, adapter, a, ctx, gather = self.layer, self.adapter, rec.a, rec.ctx, rec.g
        ag, device = a * gather, x_dev.device
        # The [0:a] tiles' sub-graphs, then recompute + backward of [a:s] chunk by chunk (NOTE
        # [Chunked recompute]).
        grad_o = torch.empty_like(o_dev, memory_format=torch.contiguous_format)
        for (t0, t1), edge in zip(rec.head, rec.post_edges, strict=True):
            run([edge], [grad_y[t0:t1]])
            _copy_or_zero(grad_o[t0 * gather:t1 * gather], rec.taps.pop(("o", t0)))
        rec.post_edges = []
        for n, (c0, c1) in _chunks_run(rec):
            rng = rec.rng_post[n]
            x_c = x_dev[a + c0:a + c1].detach().requires_grad_()
            o_c = o_dev[ag + c0 * gather:ag + c1 * gather].detach().requires_grad_()
            with torch.enable_grad(), rec.autocast.replay(), replay_rng(rng, device), \
                    rec.scope("post", a + c0, a + c1):
                y_c = adapter.post(layer, o_c, x_c, ctx)
            gx, go = run([_edge(y_c)], [grad_y[a + c0:a + c1]], (x_c, o_c))
            del y_c, x_c, o_c
            _copy_or_zero(grad_o[ag + c0 * gather:ag + c1 * gather], go)
            _copy_or_zero(grad_x[a + c0:a + c1], gx)
            del gx, go
        if rec.dropout is not None:
            rec.dropout.end_phase()
        return grad_o

    def _pre_backward(self, rec: LayerRecord, run: SubGraphs, full: Grads, grad_x: torch.Tensor,
                      x_dev: torch.Tensor, kept: _KeptChunk | None) -> None:
        """Step 3 of the backward: pre's, from ``full`` (dq, dk, dv), as post's -> adds pre's share to
        ``grad_x``. ``kept``: the last chunk's pre graph, when the recompute of q, k, v kept it."""
        layer, adapter, a, ctx, gather = self.layer, self.adapter, rec.a, rec.ctx, rec.g
        ag, device = a * gather, x_dev.device
        for (t0, t1), edges in zip(rec.head, rec.pre_edges, strict=True):
            if edges:
                run([edge for _, edge in edges], [full[j][t0 * gather:t1 * gather] for j, _ in edges])
            _copy_or_zero(grad_x[t0:t1], rec.taps.pop(("x", t0)))
        rec.pre_edges = []
        last = len(rec.chunks) - 1
        for n, (c0, c1) in _chunks_run(rec):
            rng = rec.rng_pre[n]
            if n == last and kept is not None:
                (x_c, parts), kept = kept, None
            else:
                x_c = x_dev[a + c0:a + c1].detach().requires_grad_()
                with torch.enable_grad(), rec.autocast.replay(), replay_rng(rng, device), \
                        rec.scope("pre", a + c0, a + c1):
                    parts = adapter.pre(layer, x_c, a + c0, ctx)
            roots = [_edge(t) for t in parts if t.requires_grad]
            grads = [d[ag + c0 * gather:ag + c1 * gather] for t, d in zip(parts, full, strict=True)
                     if t.requires_grad]
            del parts
            if roots:
                (gx,) = run(roots, grads, (x_c,))
                if gx is not None:
                    grad_x[a + c0:a + c1] += gx
            del x_c, roots, grads
        if rec.dropout is not None:
            rec.dropout.end_phase()

    # NOTE [Input-only layers]
    # The input-only policy (ALST's offloaded checkpoint, for when host memory binds) keeps one
    # tensor per layer on the host, the layer input, where memo(alpha) keeps two (and alpha of the
    # rest): forward runs every tile without grad (as memo's [a:s] range at alpha = 0) and attention
    # without autograd, and offloads x alone. Backward recomputes q, k, v chunk by chunk, then
    # attention's forward, from the RNG and autocast state forward ran under, and goes on as a memo
    # layer at alpha = 0 with that o and log-sum-exp: post's tiles, attention's backward, pre's
    # tiles. The price is attention once more per layer; the planner weighs it against the host
    # bytes it saves (planner/policy.py). A black-box core attention (NOTE [Black-box core
    # attention] in memo/runtime/core_attention.py) runs again with autograd in backward, its graph
    # alive until its backward has run.
    def _recompute_qkv(self, rec: LayerRecord, x_dev: torch.Tensor) -> tuple[_KeptChunk | None, list[Rows]]:
        """q, k, v rows: the saved ``[0:a]`` rows and the ``[a:s]`` rows recomputed chunk by chunk;
        -> (the last chunk's pre graph, kept for step 3 of the backward, or None), the rows."""
        layer, adapter, buffers, i, f = self.layer, self.adapter, self.runtime.buffers, self.index, rec.flight
        a, s, ctx, gather = rec.a, rec.s, rec.ctx, rec.g
        ag, device = a * gather, x_dev.device
        qkv = [Rows(s * gather) for _ in range(3)]
        if a > 0:
            for rows, slot in zip(qkv, rec.qkv_slots, strict=True):
                rows.put(0, buffers.view(i, slot, f))
        # The last chunk runs with grad and its graph is kept for step 3, so that pre runs twice on
        # its tokens, not three times (one chunk: as full recompute; NOTE [Chunked recompute]).
        last = len(rec.chunks) - 1
        kept = None
        for n, (c0, c1) in _chunks_run(rec):
            rng = rec.rng_pre[n]
            x_c = x_dev[a + c0:a + c1].detach()
            grad_mode = torch.enable_grad() if n == last else torch.no_grad()
            if n == last:
                x_c.requires_grad_()
            with grad_mode, rec.autocast.replay(), replay_rng(rng, device), rec.scope("pre", a + c0, a + c1):
                parts = tuple(adapter.pre(layer, x_c, a + c0, ctx))
            self._check_recomputed_dtypes(rec, *parts)
            for rows, t in zip(qkv, parts, strict=True):
                rows.put(ag + c0 * gather, t.detach())
            if n == last:
                kept = (x_c, parts)
            del parts, x_c
        return kept, qkv

    def _say_hooks(self) -> None:
        """Say once which of the layer's submodules have forward hooks: under memo they see one token
        range per call, and run again in backward for the recomputed tokens, as under
        torch.utils.checkpoint (NOTE [HF layout] in memo/adapters/hf.py)."""
        hooked = [name for name, m in self.layer.named_modules()
                  if name and (m._forward_hooks or m._forward_pre_hooks)]
        if hooked:
            self._say("hooks", f"forward hooks on {', '.join(hooked)} see a range of the tokens per call "
                      "(memo runs the layer's token-wise parts in ranges), and run again in backward "
                      "for the recomputed tokens, as under torch.utils.checkpoint")

    def _say(self, topic: str, text: str) -> None:
        """Warn about ``topic`` once per runtime (NOTE [Dropout as unwrapped])."""
        said = self.runtime.said
        if topic not in said:
            said.add(topic)
            warnings.warn(f"memo.runtime: layer {self.index}: {text} (NOTE [Dropout as unwrapped]; said "
                          "once)", stacklevel=2)

    def _check_recomputed_dtypes(self, rec: LayerRecord, q: torch.Tensor, k: torch.Tensor,
                                 v: torch.Tensor) -> None:
        """Attention's backward needs q, k, v in the dtypes forward gave it (and o, lse were made from)."""
        got = (q.dtype, k.dtype, v.dtype)
        if got != rec.qkv_dtypes:
            raise MemoError(
                f"memo.runtime: layer {self.index}'s recompute produced q, k, v in {got}, but its forward "
                f"produced {rec.qkv_dtypes}; pre() depends on global state that differs between forward "
                "and backward and that memo does not replay (memo replays RNG and autocast, NOTE "
                "[Recompute replays autocast]). Make the adapter's pre() independent of it"
            )



# NOTE [Gradients through the engine]
# memo's node takes the layer's trainable parameters as inputs and returns their gradients,
# like any autograd node; it never writes ``.grad`` itself. Its sub-graphs (the saved [0:a]
# ones and the recomputed chunks) run with ``torch.autograd.grad`` over the parameters, the
# runtime's anchor (so that the taps of x[0:a] and o[0:a] fire) and the chunk's leaves, and the
# parameter gradients are summed over sub-graphs. So the engine decides what happens to them,
# as for an unwrapped layer: ``loss.backward()`` accumulates them into ``.grad``,
# ``torch.autograd.grad(loss, params)`` returns them and writes nothing, and
# ``backward(inputs=[w])`` keeps w's only. ``create_graph=True`` (double backward) is refused.
class MemoLayerFunction(torch.autograd.Function):
    """``y = layer(x)`` per NOTE [Token-wise recompute]; ``anchor`` ensures backward runs."""

    @staticmethod
    def forward(ctx: FunctionCtx, call: LayerCall, layer_ctx: object, anchor: torch.Tensor,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        y, rec = call.forward(x, layer_ctx)
        ctx.call, ctx.rec, ctx.anchor, ctx.saved_params = call, rec, anchor, params
        ctx.x_requires_grad = x.requires_grad
        ctx.failed = False
        return y

    @staticmethod
    def backward(ctx: FunctionCtx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refs = incoming_refs(grad_y)  # first: NOTE [Gradient of x over the incoming one] in owned_grad.py
        if ctx.rec is None and ctx.failed:
            raise MemoError(
                "memo.runtime: this wrapped layer's backward raised before, and memo dropped that "
                "forward's offloaded activations (NOTE [Failed iteration]); run the forward again")
        if ctx.rec is None:
            raise MemoError(
                "memo.runtime: a wrapped layer's backward ran twice; memo frees its saved state after one "
                "backward (retain_graph=True over wrapped layers is not supported)"
            )
        rec, ctx.rec = ctx.rec, None
        if torch.is_grad_enabled():
            ctx.call.runtime.reset()
            raise MemoError(
                "memo.runtime: backward(create_graph=True) reached a memo-wrapped layer; memo recomputes "
                "and offloads activations, so it cannot build the graph of its own backward (double "
                "backward, e.g. gradient penalties). Run that computation on memo.unwrap(model); the "
                "iteration was dropped, the model is ready for the next forward")
        try:
            grad_x, param_grads = ctx.call.backward(rec, grad_y, ctx.saved_params, ctx.anchor, refs)
        except BaseException:
            ctx.failed = True
            ctx.call.runtime.drop_failed(rec.flight, ctx.call.index, rec.epoch, "backward")
            raise
        return (None, None, None, grad_x if ctx.x_requires_grad else None, *param_grads)
