"""Whether the gradient a wrapped layer's backward receives is memo's alone, so that the gradient of the
layer's input may be written over it (NOTE [Gradient of x over the incoming one])."""

from __future__ import annotations

import functools
import sys

import torch
from torch.autograd.function import FunctionCtx
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["incoming_refs", "owned_incoming"]


# NOTE [Gradient of x over the incoming one]
# A layer's backward holds the incoming gradient grad_y (the engine keeps it for the call) and makes
# the gradient of x, both [s, b, h]. Post's backward reads grad_y one chunk at a time and writes post's
# share of grad x for that chunk (NOTE [Chunked recompute] in memo/runtime/layer.py); nothing reads that
# chunk of grad_y again. So where no one else can see grad_y, memo writes grad x into grad_y's storage
# and returns it: one sequence-sized tensor less from post's backward to the end of the layer's
# backward, across its attention backward (the peak of an input-only layer). No one else sees grad_y
# when all of these hold, else grad x is a tensor of its own:
# - one reference holds its tensor (``Tensor._use_count() == 1``): no ``torch.autograd.grad(...,
#   inputs=[y])`` capture of the layer output, no ``.grad`` that took it, no other pending node that
#   receives the same tensor;
# - no other tensor views its storage (the storage's use count is the probe's);
# - no Python object refers to it beyond the engine's call (a tensor hook that stashed it): its
#   reference count on entry to the backward is exactly the probe's, measured once per process on a
#   probe function called the same way (the count differs between Python versions; any other count
#   falls back);
# - it is dense, starts its storage, spans all of it and has x's shape, dtype and device; a view (memo's
#   loss hands the last layer a view of its flat gradient) counts when its base is referred to by the
#   view alone, as the probe's is.
# ``retain_grad`` keeps a clone, so it does not count. The values are unchanged: the same chunks are
# written, only where.
# The probe runs on the meta device: the counts are the device's business nowhere, and a probe that
# allocates nothing cannot land in a recorded iteration. It is first called inside a layer's backward,
# which may be the one a CPU profile records; its tensors would then be in the plan, and the run (the
# probe cached) would leave the plan at that layer's first request.


def incoming_refs(grad: torch.Tensor) -> int:
    """Python references to ``grad``, called first thing in a backward (NOTE [Gradient of x over the
    incoming one]): what :func:`owned_incoming` compares with the probe's."""
    return sys.getrefcount(grad)


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _counts(grad: torch.Tensor, refs: int) -> tuple[int, ...]:
    """What shows whether others see ``grad``: its Python and tensor references, its storage's, and for
    a view its base's tensor and Python references (NOTE [Gradient of x over the incoming one])."""
    mine = (refs, grad._use_count(), _storage_refs(grad))
    if not grad._is_view():
        return mine
    base = grad._base
    return (*mine, base._use_count(), sys.getrefcount(base), int(base._is_view()))


class _Probe(torch.autograd.Function):
    """A backward called as memo's layer's is, measuring what an unshared incoming gradient shows."""

    seen: list[tuple[int, ...]] = []

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        refs = incoming_refs(grad)  # first, as in MemoLayerFunction.backward
        _Probe.seen.append(_counts(grad, refs))
        return grad


class _Fresh(torch.autograd.Function):
    """Hands the probe a gradient it made itself (a view of one, ``view``), as the next memo layer's
    backward (memo's loss) does."""

    view = False

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return torch.ones(2, 2, device="meta").view(4) if _Fresh.view else torch.ones(4, device="meta")


@functools.cache
def _probed(view: bool) -> tuple[int, ...]:
    """:func:`_counts` of an unshared incoming gradient (a view of an unshared base, ``view``)."""
    with _disable_current_modes(), torch.enable_grad():
        x = torch.zeros(4, requires_grad=True, device="meta")
        _Probe.seen.clear()
        _Fresh.view = view
        _Fresh.apply(_Probe.apply(x)).sum().backward()
        (seen,) = _Probe.seen
        _Probe.seen.clear()
    return seen


def owned_incoming(grad: torch.Tensor, refs: int, like: torch.Tensor) -> bool:
    """Whether ``grad`` (``refs``: :func:`incoming_refs` on entry to the backward) is memo's alone and may
    hold the gradient of ``like`` (NOTE [Gradient of x over the incoming one])."""
    if (grad.shape != like.shape or grad.dtype != like.dtype or grad.device != like.device
            or grad.layout != torch.strided or grad.requires_grad or not grad.is_contiguous()
            or grad.storage_offset() != 0
            or grad.untyped_storage().nbytes() != grad.numel() * grad.element_size()):
        return False
    return _counts(grad, refs) == _probed(grad._is_view())
