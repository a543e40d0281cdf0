"""An RMSNorm that saves its input and one float32 value per token for backward, nothing more.

NOTE [Lean RMSNorm]
``torch.nn.RMSNorm`` is a composite of pointwise ops wherever torch has no fused kernel for it
(CPU and meta in torch 2.13: ``aten::_fused_rms_norm`` is CompositeImplicitAutograd there, and
the composite is also what runs when the input and weight dtypes differ). It computes in float32,
so on a bf16 input autograd keeps two float32 tensors of the input's shape for backward, the
upcast input and the normalised input: 8 bytes per element against the input's 2, and backward
holds several more float32 temporaries at once. At long sequences those are the largest
activations of a Llama layer, and they are what memo's profiler measures and its planner
offloads or recomputes.

:class:`RMSNorm` computes the same function in float32 but saves only what backward cannot do
without: the input ``x`` in its own dtype and the reciprocal
root mean square ``rstd`` in float32, one value per token. Backward rebuilds the normalised input
from those two. Forward rounds once, at the end, as ``nn.RMSNorm`` does, so in float32 the two
agree to rounding, and in bf16 they produce the same values up to the order of float32 operations.

The module has ``nn.RMSNorm``'s constructor, parameter (``weight``) and state dict, so checkpoints
move between the two unchanged. Under autocast it returns what ``nn.RMSNorm`` returns: devices
whose autocast lists ``rms_norm`` among the float32 ops (CUDA, XPU, ...) get a float32 output, the
others (CPU) the input's dtype; either way the saved input stays in its own dtype.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from memo.errors import MemoError

__all__ = ["RMSNorm", "rms_norm"]


def _autocast_fp32_devices() -> frozenset[str]:
    """Device types whose autocast runs ``rms_norm`` in float32 (a kernel registered for it in
    autocast_mode.cpp's float32 list); asked of the dispatcher once, at import."""
    found = set()
    for device in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla"):
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", f"Autocast{device.upper()}"):
                found.add(device)
        except RuntimeError:  # a dispatch key this torch does not know
            continue
    return frozenset(found)


_AUTOCAST_FP32_DEVICES = _autocast_fp32_devices()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs, the input's own dtype for float32 and float64 (torch's opmath)."""
    return torch.promote_types(dtype, torch.float32)


class _RMSNormFunction(torch.autograd.Function):
    """``y = x · rstd · w`` with ``rstd = 1/sqrt(mean(x²) + eps)`` over the last ``dims`` dims;
    saves ``x`` and ``rstd`` (NOTE [Lean RMSNorm])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: int, eps: float,
                out_dtype: torch.dtype) -> torch.Tensor:
        reduce = tuple(range(-dims, 0))
        xc = x.to(_compute_dtype(x.dtype))
        rstd = torch.rsqrt(xc.square().mean(reduce) + eps)
        y = xc * rstd.view(*rstd.shape, *([1] * dims))
        del xc
        if weight is not None:
            y.mul_(weight)
        ctx.dims = dims
        ctx.save_for_backward(x, rstd, weight)
        return y.to(out_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, rstd, weight = ctx.saved_tensors
        dims = ctx.dims
        reduce = tuple(range(-dims, 0))
        need_x, need_w = ctx.needs_input_grad[:2]
        compute = _compute_dtype(x.dtype)
        r = rstd.view(*rstd.shape, *([1] * dims))
        x_hat = x.to(compute, copy=True).mul_(r)
        g = grad.to(compute)
        grad_w = None
        if weight is not None and need_w:
            tokens = tuple(range(x.dim() - dims))
            grad_w = (g * x_hat).sum(tokens).to(weight.dtype)
        grad_x = None
        if need_x:
            # d/dx of x·rstd: rstd · (ĝ - x̂ · mean(ĝ · x̂)), with ĝ the gradient of x̂.
            g_hat = g * weight.to(compute) if weight is not None else g
            del g  # a float32 copy of the gradient for 16-bit inputs: at most three such at once
            along = (g_hat * x_hat).mean(reduce, keepdim=True)
            grad_x = x_hat.mul_(along).neg_().add_(g_hat).mul_(r).to(x.dtype)
        return grad_x, grad_w, None, None, None


def rms_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """RMS norm of ``x: [..., *normalized_shape]`` over its last ``len(normalized_shape)`` dims, as
    ``torch.nn.functional.rms_norm``, saving only ``x`` and a float32 ``rstd: [...]`` for backward.

    ``eps=None`` is the float32 epsilon (float64's for float64 inputs), as torch's. The output has
    ``x``'s dtype, or float32 under an autocast that runs ``rms_norm`` in float32 (NOTE [Lean RMSNorm]).
    """
    shape = tuple(normalized_shape)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise MemoError(f"memo.models.rms_norm: input of shape {tuple(x.shape)} does not end in the "
                        f"normalized shape {shape}")
    if weight is not None and tuple(weight.shape) != shape:
        raise MemoError(f"memo.models.rms_norm: weight of shape {tuple(weight.shape)}, expected {shape}")
    out_dtype = x.dtype
    device = x.device.type
    if device in _AUTOCAST_FP32_DEVICES and torch.is_autocast_enabled(device):
        out_dtype = torch.float32
    if eps is None:  # torch's default: the epsilon of the dtype it computes in, not of x's
        eps = torch.finfo(_compute_dtype(x.dtype)).eps
    return _RMSNormFunction.apply(x, weight, len(shape), float(eps), out_dtype)


class RMSNorm(nn.Module):
    """``torch.nn.RMSNorm`` with the same constructor, ``weight`` and state dict, whose autograd
    node keeps only the input and a float32 rstd per token (NOTE [Lean RMSNorm]).

    ``x: [..., *normalized_shape]`` -> the same shape, in ``x``'s dtype (float32 under a CUDA
    autocast, as ``nn.RMSNorm``).
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: tuple[int, ...]
    eps: float | None
    elementwise_affine: bool

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (int(normalized_shape),)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Ones, as ``nn.RMSNorm``."""
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
