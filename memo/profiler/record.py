"""Record one training iteration's allocation trace with the dispatch recorder.

:func:`record_trace` runs ``loss = model(ids, labels); loss.backward()`` once
under a :class:`~memo.profiler.recorder.DispatchRecorder` and returns the trace
as a ``memo.trace`` version 1 dict (docs/formats.md), with per-layer
statistics in ``"layers"`` (see :mod:`memo.profiler.stats`).

The model needs a model adapter (NOTE [Model adapters] in memo/adapters/model.py): it says
which modules are the embedding, the layers (taking ``[s, b, h]`` as first argument) and the
head, and how the loss is computed. A layer's attention is the submodule its layer adapter names
(``LayerAdapter.core_module``: ``core_attention`` by default, megatron's
``self_attention.core_attention``; optional: without one S_attn is 0 and everything skeletal
counts as S_others).
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memo.adapters.base import find_adapter
from memo.adapters.model import ModelAdapter, ModelParts, model_adapter_for
from memo.errors import MemoError
from memo.phases import PhaseListener, PhaseTracker
from memo.profiler.recorder import RECORDER_NAME, DispatchRecorder
from memo.profiler.saved import LayerSavedBytes
from memo.profiler.stats import LayerStats, layer_stats, summarise_layers
from memo.trace_format import TraceBuilder

__all__ = ["Recording", "layer_inputs", "meta_copy", "model_parts", "phase_tracker",
           "record", "record_trace"]


@dataclass
class Recording:
    """Everything one recorded iteration produced.

    Attributes:
        trace: the ``memo.trace`` dict (events end with ``{"op": "end"}``).
        layer_stats: per-layer S_input / S_attn / S_others and breakdowns.
        recorder: the recorder, with its :class:`~memo.profiler.recorder.Allocation` records.
        seconds: wall time of forward + backward under the recorder.
    """

    trace: dict[str, Any]
    layer_stats: list[LayerStats]
    recorder: DispatchRecorder = field(repr=False)
    seconds: float = 0.0


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device.

    No parameter or buffer data is copied (NOTE [Sizes from meta] in memo/pipeline/__init__.py): each one is
    replaced by a meta tensor of the same shape, dtype and ``requires_grad`` before the module tree
    is deep-copied, so even a model that fills a GPU can be copied for sizing.

    Raises TypeError for a model sharded by FSDP2, which refuses deep copies: its ranks are profiled
    as they run, gathered parameters included (NOTE [memo under FSDP2] in memo/distributed/fsdp2.py).
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can be sharded
    if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        raise TypeError("its layers are sharded by FSDP2 (fully_shard), which cannot be deep-copied; each "
                        "rank is recorded as it runs, its gathered parameters included")
    replacements: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) in replacements:
            continue
        fake = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
        replacements[id(t)] = fake
    return copy.deepcopy(model, replacements)


def model_parts(model: nn.Module) -> ModelParts:
    """The embedding, layers and head modules of ``model``, from its model adapter (NOTE [Model
    adapters]); a MemoError naming the class and the adapter to write when it has none."""
    return model_adapter_for(model, "memo.profiler").parts(model)


def phase_tracker(model: nn.Module, listeners: Sequence[PhaseListener] = ()) -> PhaseTracker:
    """A :class:`PhaseTracker` on the parts the model's adapter names."""
    parts = model_parts(model)
    return PhaseTracker(parts.embedding, parts.layers, parts.head, listeners=listeners)


class _Stop(Exception):
    """Raised by :func:`layer_inputs`' hook to end a forward at the first layer."""


def layer_inputs(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What the model passes its first layer for ``ids, labels`` (``args, kwargs``), without grad.

    NOTE [First layer's inputs]
    A layer of another library takes more than the hidden states (megatron: the attention mask and
    rotary embeddings; Hugging Face: position embeddings, a cache, a mask), in its own layout. Timing
    a layer alone, or sizing memo's buffers before the first step, needs exactly those. So the
    model's own forward runs until the first layer is called, and a hook there takes its
    arguments and stops the forward: only the embedding (and whatever the model computes for its
    layers, like the rotary tables) runs.
    """
    parts = model_parts(model)
    adapter = model_adapter_for(model, "memo.profiler")
    if not parts.layers:
        raise MemoError(f"memo.profiler: {type(model).__name__} has no layers")
    taken: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def take(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        taken.append((args, kwargs))
        raise _Stop

    handle = parts.layers[0].register_forward_pre_hook(take, with_kwargs=True)
    try:
        with torch.no_grad():
            adapter.loss(model, ids, labels)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not taken:
        raise MemoError(f"memo.profiler: a forward of {type(model).__name__} never called its first layer")
    return taken[0]


def _model_meta(model: nn.Module, ids: torch.Tensor, n_layers: int) -> dict[str, Any]:
    config = getattr(model, "config", None)
    meta: dict[str, Any] = {
        "model": str(getattr(config, "name", None) or type(model).__name__),
        "seq_len": int(ids.shape[1]),
        "micro_batch": int(ids.shape[0]),
        "device": ids.device.type,
        "recorder": RECORDER_NAME,
        "n_layers": n_layers,
    }
    param = next(model.parameters(), None)
    if param is not None:
        meta["dtype"] = str(param.dtype).removeprefix("torch.")
    from memo.models import ModelConfig, fingerprint

    if isinstance(config, ModelConfig):  # other libraries' configs are not memo's to fingerprint
        meta["fingerprint"] = str(fingerprint(config))
    elif config is not None and not isinstance(getattr(config, "name", None), str):
        meta["model"] = type(model).__name__
    return meta


def record(
    model: nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    tracker: PhaseTracker | None = None,
    meta: dict[str, Any] | None = None,
) -> Recording:
    """Run one forward + backward of ``model`` under the recorder and return the :class:`Recording`.

    Args:
        ids, labels: ``[b, s]`` token ids and targets, on the model's device.
        tracker: a PhaseTracker already attached to the model (one is made and removed otherwise).
        meta: entries that override the trace's ``meta`` (e.g. the config name).

    Parameter gradients are set to ``None`` first (as ``zero_grad()`` does) so
    the gradient allocations are part of the trace; they carry
    ``"param_grad": true`` because they are not activations.
    """
    adapter: ModelAdapter = model_adapter_for(model, "memo.profiler")
    parts = adapter.parts(model)
    layers = parts.layers
    if ids.dim() != 2:
        raise MemoError(f"memo.profiler: ids must be [b, s], got shape {tuple(ids.shape)}")
    own_tracker = tracker is None
    if tracker is None:
        tracker = PhaseTracker(parts.embedding, layers, parts.head)
    rec = DispatchRecorder(lambda: tracker.current, device=ids.device)
    tracker.add_listener(rec.on_phase)
    inputs: dict[int, int] = {}
    outputs: dict[int, int] = {}
    saved = LayerSavedBytes(lambda: rec.in_attn, lambda t: _made_in_attention(rec, t))
    handles = _attach_hooks(rec, layers, inputs, outputs, saved)
    params = list(model.parameters())
    for p in params:
        p.grad = None
    try:
        with (
            tracker.iteration(), rec,
            torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack),
        ):
            loss = adapter.loss(model, ids, labels)
            loss.backward()
        # Storages that die from here on outlived the iteration: they get no free event.
        rec.close()
    finally:
        for h in handles:
            h.remove()
        tracker.remove_listener(rec.on_phase)
        if own_tracker:
            tracker.remove()
    _tag_param_grads(rec, params)
    stats = layer_stats(rec, len(layers), inputs, outputs, saved.others, saved.rows)
    builder = TraceBuilder(meta={**_model_meta(model, ids, len(layers)), **(meta or {})})
    builder.events = rec.events  # the recorder wrote them as it saw the storages come and go
    trace = builder.finish(layers=summarise_layers(stats))
    return Recording(trace=trace, layer_stats=stats, recorder=rec, seconds=rec.seconds)


def record_trace(
    model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, *, tracker: PhaseTracker | None = None
) -> dict[str, Any]:
    """One iteration's allocation trace of ``model`` as a ``memo.trace`` dict (see :func:`record`)."""
    return record(model, ids, labels, tracker=tracker).trace


def _made_in_attention(rec: DispatchRecorder, t: torch.Tensor) -> bool:
    alloc = rec.storage_record(t)
    return alloc is not None and "attn" in alloc.tags


def _attach_hooks(
    rec: DispatchRecorder, layers: list[nn.Module], inputs: dict[int, int], outputs: dict[int, int],
    saved: LayerSavedBytes,
) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that note each layer's input size, its output storage and its core-attention span.

    Forwards that run inside backward are recomputations and are ignored, like
    the PhaseTracker does (NOTE [Phase boundaries] in memo/phases.py).
    """
    handles = []
    for i, layer in enumerate(layers):

        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], i: int = i) -> None:
            x = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(x, torch.Tensor) and torch._C._current_graph_task_id() == -1:
                inputs[i] = x.numel() * x.element_size()
                saved.enter(i, _m, x, rows=x.shape[0] if x.dim() else 1)

        def post(_m: nn.Module, _args: object, out: object, i: int = i) -> None:
            y = out[0] if isinstance(out, (tuple, list)) else out
            if torch._C._current_graph_task_id() == -1:
                saved.exit(i)
            if isinstance(y, torch.Tensor) and torch._C._current_graph_task_id() == -1:
                alloc = rec.storage_record(y)
                if alloc is not None:
                    alloc.tags.add("layer_output")
                    outputs[i] = alloc.id

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post))
        adapter = find_adapter(layer)
        core = adapter.core_module(layer) if adapter is not None else getattr(layer, "core_attention", None)
        if isinstance(core, nn.Module):
            handles.append(core.register_forward_pre_hook(lambda _m, _a: rec.enter_attn()))
            handles.append(core.register_forward_hook(lambda _m, _a, _o: rec.exit_attn()))
    return handles


def _tag_param_grads(rec: DispatchRecorder, params: list[nn.Parameter]) -> None:
    """Flag the allocations that became parameter gradients: they are not activations."""
    by_id = {ev["id"]: ev for ev in rec.events if ev["op"] == "malloc"}
    for p in params:
        if p.grad is None:
            continue
        alloc = rec.storage_record(p.grad)
        if alloc is not None:
            alloc.tags.add("param_grad")
            by_id[alloc.id]["param_grad"] = True
