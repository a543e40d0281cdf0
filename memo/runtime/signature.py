"""What, besides its input, decides the bytes a wrapped layer offloads (NOTE [Sizing the host arena] in
memo/runtime/runtime.py): :func:`layer_signature`."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = ["LayerSignature", "layer_signature", "signature_change"]


class LayerSignature(NamedTuple):
    """A layer's signature: layers with equal signatures offload equal bytes for equal inputs."""

    kind: type
    #: Attention-side rows per input token (NOTE [Tensor-parallel rank] in memo/models/parallel.py).
    gather: int
    #: (name, shape, dtype, requires_grad) of each parameter.
    params: tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]
    #: (name, shape, dtype) of each buffer.
    buffers: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    #: (name, training) of each submodule, the layer itself first.
    modes: tuple[tuple[str, bool], ...]
    #: The class of each submodule.
    classes: tuple[type, ...]


def layer_signature(layer: nn.Module) -> LayerSignature:
    """What, besides its input, decides the bytes a layer offloads (NOTE [Sizing the host arena]):
    its class and sequence gather, each parameter's name, shape, dtype and ``requires_grad``,
    each buffer's, each submodule's train/eval mode, and each submodule's class (a layer whose core
    attention memo runs as a black box offloads what that attention saves: NOTE [Black-box core
    attention]). Layers with equal signatures offload equal bytes for equal inputs."""
    from memo.adapters import find_adapter

    adapter = find_adapter(layer)
    return LayerSignature(
        type(layer),
        adapter.sequence_gather(layer) if adapter is not None else int(getattr(layer, "sequence_gather", 1)),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()),
        tuple((n, m.training) for n, m in layer.named_modules()),
        tuple(type(m) for _, m in layer.named_modules()),
    )


def signature_change(old: LayerSignature, new: LayerSignature) -> str:
    """The first difference between two :func:`layer_signature` values, in words."""
    old_params = {n: rg for n, _, _, rg in old.params}
    for n, _, _, rg in new.params:
        if n in old_params and old_params[n] != rg:
            return f"parameter {n!r} was {'un' if rg else ''}frozen (requires_grad {old_params[n]} -> {rg})"
    old_modes = dict(old.modes)
    for n, training in new.modes:
        if n in old_modes and old_modes[n] != training:
            what = f"submodule {n!r}" if n else "the layer"
            return f"{what} was switched to {'train' if training else 'eval'} mode (e.g. dropout)"
    if old != new:
        return "its parameters, buffers or class changed"
    return ""
