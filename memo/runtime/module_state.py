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
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["as_in_forward", "module_tensors"]


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
