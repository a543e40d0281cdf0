"""The tensors a layer's forward ran with, put back for its recompute in backward.

NOTE [Recompute with the forward's tensors]
memo runs a layer's ``pre``/``post`` again in backward, reading the layer's parameters and buffers
from the module as it is then. Usually those are the tensors forward read. Not under
``torch.func.functional_call`` (or ``torch.nn.utils.stateless``), which puts other tensors in the
module for the call only: by backward the module's own are back, and the recomputed tokens would
use them, giving silently wrong gradients (the loss, computed in forward, is right). So forward
keeps which tensor each name held (:func:`module_tensors`, references only), and backward runs with
those (:func:`as_in_forward`), swapping only the names whose tensor changed: nothing to do in
ordinary training. torch.utils.checkpoint gets this right the same way, by recomputing inside the
original call's closure.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["as_in_forward", "buffer_snapshot", "gathered", "module_tensors", "restore_changed"]


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name (shared ones under each of their names)."""
    tensors: dict[str, torch.Tensor] = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        prefix = f"{owner_name}." if owner_name else ""
        for store in (owner._parameters, owner._buffers):
            for name, t in store.items():
                if t is not None:
                    tensors[prefix + name] = t
    return tensors


@contextlib.contextmanager
def as_in_forward(module: nn.Module, saved: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run with the tensors ``saved`` by :func:`module_tensors` in forward where the module now
    holds others (NOTE [Recompute with the forward's tensors]); the module's own come back after."""
    now = module_tensors(module)
    changed = {name: t for name, t in saved.items() if now.get(name) is not t}
    if not changed:
        yield
        return
    undo: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor | None]] = []
    try:
        for name, t in changed.items():
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            store = owner._parameters if attr in owner._parameters else owner._buffers
            undo.append((store, attr, store.get(attr)))
            store[attr] = t
        yield
    finally:
        for store, attr, old in reversed(undo):
            store[attr] = old


# NOTE [Dry runs under FSDP2]
# FSDP2 (fully_shard) keeps a layer's parameters sharded between its calls and gathers them in its
# forward hooks (NOTE [memo under FSDP2] in memo/distributed/fsdp2.py). memo's sizing pass runs a
# layer's pre/post outside the layer's call (LayerCall.measure, from the Session before step 1):
# there the module holds its shards, DTensors that cannot meet the plain input. So the dry run
# gathers them first with FSDP2's own unshard() and reshards after, where they are sharded; inside
# the layer's forward (the first iteration sizes the buffers there) they are gathered already and
# nothing is done. unshard() is a collective: every rank sizes the same layers.
@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """Run with ``module``'s parameters gathered where FSDP2 holds them sharded (NOTE [Dry runs under
    FSDP2]); a module no one shards runs as it is."""
    fsdp, dtensor = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    if fsdp is None or dtensor is None:  # not imported: nothing is sharded
        yield
        return
    sharded = [m for m in module.modules() if isinstance(m, fsdp.FSDPModule)]
    if not sharded or not any(isinstance(p, dtensor.DTensor) for p in module.parameters()):
        yield
        return
    for m in sharded:
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.reshard()


# NOTE [Layers with state]
# Some layers change their own buffers in forward: spectral_norm's power iteration, quantization
# observers, counters. memo's sizing pass is a dry forward of each offloaded layer, and it runs a
# layer's pre/post again on token ranges (one call per tile, and the recompute in backward): each
# call would advance that state once more than the unwrapped model does, and at alpha = 1 the
# sizing pass alone would change the first step's loss. So the sizing pass snapshots the layer's
# buffers and puts back those whose values it changed (a cache filled or resized for a new length,
# a new or reshaped buffer, is not state and is kept). A layer that changes its buffers is then
# wrapped only where it runs once per forward and never in backward: alpha = 1 and one tile.
# Anywhere else it is refused with the names of the buffers, rather than trained on state advanced
# a few extra times per step.
def buffer_snapshot(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every buffer of ``module``: the tensor and a copy of its values (NOTE [Layers with state])."""
    return {name: (b, b.detach().clone()) for name, b in module.named_buffers() if b is not None}


def restore_changed(module: nn.Module, snapshot: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """Put back the buffers whose values changed since ``snapshot`` (same shape and dtype; a cache
    rebuilt at another size is kept); returns their names."""
    changed = []
    now = dict(module.named_buffers())
    for name, (tensor, values) in snapshot.items():
        current = now.get(name)
        if current is None or current.shape != values.shape or current.dtype != values.dtype:
            continue
        if current.device.type == "meta" or torch.equal(current, values):
            continue
        changed.append(name)
        with torch.no_grad():
            current.copy_(values)
        if current is not tensor:  # forward assigned a new tensor: put the old one back, restored
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            with torch.no_grad():
                tensor.copy_(values)
            owner._buffers[attr] = tensor
    return changed
