"""Which exact attention kernel memo's causal attention runs on a device, chosen once per device.

memo.models.causal_attention asks :func:`attention_kernel` for the kernel of a device and runs it:

- ``"cudnn"``: ``aten._scaled_dot_product_cudnn_attention`` and its backward (cuDNN's fused attention,
  with the log-sum-exp memo keeps), on Hopper and newer where this torch has it;
- ``"flash_attn"``: the flash-attn package (>= 2.7) where it is installed;
- ``"aten_cuda"``: ``aten._scaled_dot_product_flash_attention`` (the flash kernel built into torch);
- ``"aten_cpu"``: the CPU flash kernel, on the CPU and the meta device.

All of them are exact attention (no approximation, no dropout): they differ in speed and in rounding
within their dtype, never in what they compute. fp32 inputs on CUDA run the memory-efficient kernel
whatever the choice (NOTE [fp32 attention on CUDA] in causal_attention.py), and a call the chosen kernel
does not take (:func:`cudnn_takes`) runs torch's flash kernel instead.

NOTE [Choosing the attention kernel]
The rule: on a GPU of compute capability 9.0 or above (Hopper, Blackwell), cuDNN's attention where this
torch exposes it and cuDNN 9 is present; else flash-attn where installed; else torch's flash kernel.
cuDNN's fused attention is the kernel NVIDIA tunes for Hopper's tensor-memory accelerator and
asynchronous warpgroup matmuls, which torch's flash kernel (FlashAttention-2) does not use; below 9.0
flash-attn or torch's flash kernel is the tuned one. The rule is a claim about speed and is measured,
not assumed: ``make gpu-bench`` times every kernel this module reports available at llama-3.2-1b's
attention shape and checks each one's output and gradients against the fp32 reference
(benchmarks/gpu_bench.py, NOTE [Attention kernels in the bench]); where the rows say otherwise the
rule changes here. The choice is made once per device (cached; the availability probes import
packages and ask cuDNN its version) and recorded in the training report (``attention_kernel``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from memo.errors import MemoError

__all__ = ["KERNELS", "KernelChoice", "attention_kernel", "choose_kernel", "cudnn_takes", "describe_kernel",
           "flash_attn_module", "kernels_available", "pin_kernel"]

#: Every kernel name, fastest first where more than one is available (NOTE [Choosing the attention kernel]).
KERNELS = ("cudnn", "flash_attn", "aten_cuda", "aten_cpu")
#: The compute capability from which cuDNN's attention is preferred (Hopper).
CUDNN_FROM_CAPABILITY = (9, 0)
#: cuDNN's fused attention with a causal mask and a log-sum-exp output needs cuDNN 9 (torch's own check).
CUDNN_MIN_VERSION = 90000
_HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernel of one device, what else was available, and why this one."""

    kernel: str
    """One of :data:`KERNELS`."""
    available: tuple[str, ...]
    """The kernels this device could run, in :data:`KERNELS` order."""
    reason: str
    """One line: the rule that picked ``kernel``."""

    def as_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "available": list(self.available), "reason": self.reason}


@functools.cache
def flash_attn_module() -> Any | None:
    """flash-attn's interface module if a version with the 2.7 kernel signatures is installed."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    major_minor = tuple(int(p) for p in flash_attn.__version__.split(".")[:2] if p.isdigit())
    # The private _flash_attn_forward/_backward signatures changed in 2.7 (split window sizes,
    # softcap); older releases use the aten kernels instead of guessing their signatures.
    if major_minor < (2, 7):
        return None
    return flash_attn_interface


def _cudnn_attention_present() -> bool:
    """Whether this torch has cuDNN's attention ops and cuDNN 9 (not whether the GPU suits it)."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    if not torch.backends.cudnn.is_available():
        return False
    version = torch.backends.cudnn.version()
    return version is not None and version >= CUDNN_MIN_VERSION


def kernels_available(capability: tuple[int, int], cudnn: bool, flash_attn: bool) -> tuple[str, ...]:
    """The CUDA kernels a device of ``capability`` can run, given what is installed."""
    found = []
    if cudnn and capability >= (8, 0):  # cuDNN's fused attention needs Ampere or newer
        found.append("cudnn")
    if flash_attn:
        found.append("flash_attn")
    found.append("aten_cuda")
    return tuple(found)


def choose_kernel(capability: tuple[int, int], cudnn: bool, flash_attn: bool) -> KernelChoice:
    """NOTE [Choosing the attention kernel], for a CUDA device of ``capability`` (major, minor)."""
    available = kernels_available(capability, cudnn, flash_attn)
    cc = f"{capability[0]}.{capability[1]}"
    if "cudnn" in available and capability >= CUDNN_FROM_CAPABILITY:
        return KernelChoice("cudnn", available, f"compute capability {cc} >= 9.0 and cuDNN 9 present: "
                            "cuDNN's fused attention")
    if "flash_attn" in available:
        why = "below 9.0" if capability < CUDNN_FROM_CAPABILITY else "no cuDNN 9 attention in this torch"
        return KernelChoice("flash_attn", available, f"compute capability {cc} ({why}), flash-attn installed")
    return KernelChoice("aten_cuda", available, f"compute capability {cc}: torch's flash kernel (flash-attn "
                        "not installed" + ("" if capability < CUDNN_FROM_CAPABILITY or "cudnn" in available
                                           else ", no cuDNN 9 attention in this torch") + ")")


@functools.cache
def _cuda_choice(index: int) -> KernelChoice:
    capability = torch.cuda.get_device_capability(index)
    choice = choose_kernel(tuple(capability), _cudnn_attention_present(), flash_attn_module() is not None)
    if _pinned is not None:
        if _pinned not in choice.available:
            raise MemoError(f"memo.models.attention: kernel {_pinned!r} was pinned, but cuda:{index} offers "
                            f"only {', '.join(choice.available)}")
        return KernelChoice(_pinned, choice.available, f"pinned by pin_kernel (the rule: {choice.kernel})")
    return choice


_pinned: str | None = None


def pin_kernel(kernel: str | None) -> None:
    """Run ``kernel`` on every CUDA device instead of the rule's choice (None: the rule again). For a
    process that found the rule's kernel wrong on its device (benchmarks/gpu_bench.py's
    ``--attention-kernel``); call it before the first attention. A device without ``kernel`` refuses at
    its first attention."""
    global _pinned
    if kernel is not None and kernel not in KERNELS[:3]:
        raise MemoError(f"memo.models.attention: cannot pin kernel {kernel!r}; choose one of "
                        f"{', '.join(KERNELS[:3])}")
    _pinned = kernel
    _cuda_choice.cache_clear()


def describe_kernel(device: torch.device | str) -> KernelChoice:
    """The kernel of ``device`` with what else was available and why (the training report's record)."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return KernelChoice("aten_cpu", ("aten_cpu",), f"{device.type}: torch's CPU flash kernel")
    if device.type != "cuda":
        raise MemoError(f"memo.models.attention: no attention kernel for device type {device.type!r}; use "
                        "cpu, cuda or meta")
    return _cuda_choice(torch.cuda.current_device() if device.index is None else device.index)


def attention_kernel(device: torch.device | str) -> str:
    """The kernel memo's causal attention runs on ``device``: one of :data:`KERNELS`."""
    return describe_kernel(device).kernel


def cudnn_takes(q: torch.Tensor) -> bool:
    """Whether the cuDNN kernel takes ``q: [s, b, n, d]``: fp16/bf16 and a head dim it tiles (a multiple of
    8, at most 128, torch's own condition); other calls run torch's flash kernel."""
    d = q.shape[-1]
    return q.dtype in _HALF and d % 8 == 0 and d <= 128
