"""The machine numbers of the alpha LP: T_layer, B and M_CPU, measured or assumed.

On a CUDA device the profiler measures the forward time of one layer
(:func:`time_layer_forward`, synchronised) and the pinned host<->device
bandwidth (:func:`measure_bandwidth`). On meta and CPU neither means anything
for the GPU job being planned, so the caller states them; T_layer may instead
be estimated from FLOPs (:func:`estimate_layer_ms`). Every value carries where
it came from (:class:`Quantity`) so ``memo profile`` can say which numbers were
measured and which assumed.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memo.errors import MemoError

__all__ = [
    "GPU_PEAK_TFLOPS",
    "Quantity",
    "estimate_layer_ms",
    "layer_flops",
    "machine_memory_bytes",
    "measure_bandwidth",
    "time_layer_forward",
]

#: Dense peak tensor-core TFLOP/s for 16-bit inputs (bf16/fp16), from the vendors' data sheets
#: (SXM parts, no sparsity). fp32 runs use TF32 peaks: half of these on A100/H100-class parts.
GPU_PEAK_TFLOPS: dict[str, float] = {
    "v100": 125.0,
    "a100": 312.0,
    "a800": 312.0,
    "l40s": 362.0,
    "h100": 989.0,
    "h800": 989.0,
    "h200": 989.0,
    "b200": 2250.0,
}


@dataclass(frozen=True)
class Quantity:
    """A number the LP uses and where it came from (``"measured"``, ``"given"``, ``"estimated"``)."""

    value: float
    source: str
    how: str = ""

    def describe(self, unit: str) -> str:
        how = f" ({self.how})" if self.how else ""
        return f"{self.value:,.4g} {unit} [{self.source}{how}]"


def layer_flops(n_params_layer: int, hidden: int, seq_len: int, micro_batch: int) -> float:
    """Training FLOPs of one layer for one micro-batch: the per-layer share of the paper's
    ``6·s·P + 6·n·h·s²``, i.e. ``6·b·s·P_layer + 6·b·h·s²`` (forward is a third of it)."""
    return 6.0 * micro_batch * seq_len * n_params_layer + 6.0 * micro_batch * hidden * seq_len**2


def estimate_layer_ms(
    n_params_layer: int, hidden: int, seq_len: int, micro_batch: int, gpu: str, efficiency: float
) -> Quantity:
    """Forward time of one layer from FLOPs: ``layer_flops / 3 / (peak · efficiency)``."""
    key = gpu.lower()
    if key not in GPU_PEAK_TFLOPS:
        raise MemoError(
            f"memo.profiler: unknown GPU {gpu!r} for the FLOP estimate; known: {', '.join(GPU_PEAK_TFLOPS)}. "
            "Pass --layer-ms to give T_layer directly."
        )
    if not 0 < efficiency <= 1:
        raise MemoError(f"memo.profiler: efficiency must be in (0, 1], got {efficiency}")
    peak = GPU_PEAK_TFLOPS[key] * 1e12
    fwd = layer_flops(n_params_layer, hidden, seq_len, micro_batch) / 3.0
    ms = fwd / (peak * efficiency) * 1e3
    how = f"{fwd:.3g} forward FLOPs on {key} at {GPU_PEAK_TFLOPS[key]:g} TFLOP/s x {efficiency:g}"
    return Quantity(ms, "estimated", how)


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_layer_forward(layer: nn.Module, x: torch.Tensor, *, repeats: int = 3, warmup: int = 1) -> Quantity:
    """Median forward time of ``layer(x)`` in ms, with autograd recording as in training.

    ``x: [s, b, h]`` on the device to time. The device is synchronised around
    each run, so the time is the layer's, not the launch's.
    """
    if x.device.type == "meta":
        raise MemoError("memo.profiler: a layer's forward time cannot be measured on the meta device")
    sync = _sync(x.device)
    x = x.detach().requires_grad_(True)
    times = []
    for k in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        y = layer(x)
        sync()
        if k >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        del y
    return Quantity(statistics.median(times), "measured", f"median of {repeats} synchronised forwards")


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 3) -> Quantity:
    """Pinned host<->device copy bandwidth in GB/s: the slower of H2D and D2H (median of ``repeats``)."""
    if device.type != "cuda":
        raise MemoError(f"memo.profiler: copy bandwidth is measured on CUDA only, not on {device.type}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, dst, src in (("H2D", dev, host), ("D2H", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        runs = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            stop.record()
            stop.synchronize()
            runs.append(nbytes / (start.elapsed_time(stop) * 1e-3) / 1e9)
        rates[name] = statistics.median(runs)
    slow = min(rates, key=rates.get)
    how = (
        f"pinned {nbytes >> 20} MiB copies: H2D {rates['H2D']:.1f}, D2H {rates['D2H']:.1f} GB/s; using {slow}"
    )
    return Quantity(rates[slow], "measured", how)


def machine_memory_bytes() -> int:
    """Physical memory of this machine (``MemTotal``), for when no host memory size is given."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise MemoError("memo.profiler: cannot read this machine's memory size; pass --host-mem-gb") from None
