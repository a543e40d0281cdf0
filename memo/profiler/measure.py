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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from memo.errors import MemoError
from memo.units import GB

if TYPE_CHECKING:
    from memo.machine import Machine
    from memo.models.config import ModelConfig

__all__ = [
    "Quantity",
    "estimate_layer_ms",
    "gpu_names",
    "gpu_peak_flops",
    "layer_forward_flops",
    "check_machine",
    "machine_memory_bytes",
    "measure_bandwidth",
    "measure_machine",
    "time_layer_forward",
]



@dataclass(frozen=True)
class Quantity:
    """A number the LP uses and where it came from (``"measured"``, ``"given"``, ``"estimated"``)."""

    value: float
    source: str
    how: str = ""

    def describe(self, unit: str) -> str:
        how = f" ({self.how})" if self.how else ""
        if unit == "ms":
            from memo.units import format_ms

            return f"{format_ms(self.value)} [{self.source}{how}]"
        return f"{self.value:,.4g} {unit} [{self.source}{how}]"


def gpu_names() -> list[str]:
    """Names ``--gpu`` accepts: memo.utils.flops.GPU_PEAK_TFLOPS keys, lower-case, dashes for spaces."""
    from memo.utils.flops import GPU_PEAK_TFLOPS

    return [key.lower().replace(" ", "-") for key in GPU_PEAK_TFLOPS]


def gpu_peak_flops(gpu: str, dtype: torch.dtype) -> float:
    """Dense peak FLOP/s of ``gpu`` (e.g. ``"h100"``) for matmuls in ``dtype``."""
    from memo.utils.flops import GPU_PEAK_TFLOPS

    for key, table in GPU_PEAK_TFLOPS.items():
        if key.lower().replace(" ", "-") == gpu.lower().replace(" ", "-") and dtype in table:
            return table[dtype] * 1e12
    raise MemoError(
        f"memo.profiler: no peak for GPU {gpu!r} in {dtype}; known GPUs: {', '.join(gpu_names())}. "
        "Pass --layer-ms to give T_layer directly."
    )


def layer_forward_flops(config: ModelConfig, seq_len: int, micro_batch: int) -> float:
    """Forward FLOPs of one layer for one micro-batch.

    The per-layer share of the paper's training FLOPs ``6·s·P + 6·n·h·s²``
    (memo.utils.flops.flops_per_sample): divided by the n layers, times the
    micro-batch, and a third of it for the forward (backward is twice the forward).
    """
    from memo.utils.flops import flops_per_sample

    return flops_per_sample(config, seq_len) * micro_batch / config.n_layers / 3.0


def estimate_layer_ms(
    config: ModelConfig, seq_len: int, micro_batch: int, gpu: str, dtype: torch.dtype, efficiency: float
) -> Quantity:
    """T_layer from FLOPs: ``layer_forward_flops / (peak · efficiency)``, in ms."""
    if not 0 < efficiency <= 1:
        raise MemoError(f"memo.profiler: efficiency must be in (0, 1], got {efficiency}")
    peak = gpu_peak_flops(gpu, dtype)
    fwd = layer_forward_flops(config, seq_len, micro_batch)
    ms = fwd / (peak * efficiency) * 1e3
    how = f"{fwd:.3g} forward FLOPs per layer on {gpu} at {peak / 1e12:g} TFLOP/s x {efficiency:g}"
    return Quantity(ms, "estimated", how)


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_layer_forward(layer: nn.Module, *args: object, repeats: int = 3, warmup: int = 1,
                       layer_kwargs: Mapping[str, object] | None = None) -> Quantity:
    """Median forward time of ``layer(*args, **layer_kwargs)`` in ms.

    ``args`` and ``layer_kwargs``: what the model passes the layer (the hidden states ``[s, b, h]``
    positionally, or by keyword as megatron-core passes ``hidden_states``), on the device to time:
    the first tensor among them says which. The device is synchronised around each run, so the
    time is the layer's, not the launch's. The forward runs without autograd: keeping tensors for
    backward costs no compute, and at a million tokens one layer's saved tensors alone would not
    fit on the GPU.
    """
    tensors = [t for t in (*args, *(layer_kwargs or {}).values()) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise MemoError("memo.profiler: time_layer_forward needs the layer's inputs (no tensor was given)")
    device = tensors[0].device
    if device.type == "meta":
        raise MemoError("memo.profiler: a layer's forward time cannot be measured on the meta device")
    sync = _sync(device)
    times = []
    with torch.no_grad():
        for k in range(warmup + repeats):
            sync()
            t0 = time.perf_counter()
            y = layer(*args, **(layer_kwargs or {}))
            sync()
            if k >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            del y
    return Quantity(statistics.median(times), "measured", f"median of {repeats} synchronised forwards")


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 3) -> Quantity:
    """Copy bandwidth B of the alpha LP in GB/s (median of ``repeats``).

    CUDA: pinned host<->device copies, the slower of H2D and D2H. CPU: memo's CPU backend
    moves activations with memcpy on its copy worker, so B is the memcpy rate.
    """
    if device.type == "cpu":
        return _memcpy_bandwidth(min(nbytes, 64 << 20), repeats)
    if device.type != "cuda":
        raise MemoError(f"memo.profiler: copy bandwidth cannot be measured on {device.type}; pass it")
    from memo.allocator.host import PinnedHostBuffer

    pinned = PinnedHostBuffer(nbytes, device)  # what the runtime copies through (exactly sized)
    host, dev = pinned.tensor, torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    # Events and copies on the target device's stream: with cuda:N the current device may be another.
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        for name, dst, src in (("H2D", dev, host), ("D2H", host, dev)):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            runs = []
            for _ in range(repeats):
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                stop.record(stream)
                stop.synchronize()
                runs.append(nbytes / (start.elapsed_time(stop) * 1e-3) / 1e9)
            rates[name] = statistics.median(runs)
    del dev
    pinned.release()
    slow = min(rates, key=rates.get)
    how = (
        f"pinned {nbytes >> 20} MiB copies: H2D {rates['H2D']:.1f}, D2H {rates['D2H']:.1f} GB/s; using {slow}"
    )
    return Quantity(rates[slow], "measured", how)


def _memcpy_bandwidth(nbytes: int, repeats: int) -> Quantity:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        runs.append(nbytes / (time.perf_counter() - start) / 1e9)
    return Quantity(statistics.median(runs), "measured", f"CPU backend: memcpy of {nbytes >> 20} MiB")


def machine_memory_bytes() -> int:
    """Physical memory of this machine (``MemTotal``), for when no host memory size is given."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise MemoError("memo.profiler: cannot read this machine's memory size; pass --host-mem-gb") from None


def check_machine(machine: Machine, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse missing machine numbers (a :class:`memo.machine.Machine`) before a (possibly long)
    recording, not after it: the meta device measures nothing."""
    if machine.gpu is not None:
        gpu_peak_flops(machine.gpu, dtype)
    if device.type != "meta":
        return  # cuda and cpu measure what is not given
    missing = []  # every missing number at once, not one per try
    if machine.bandwidth_gbps is None:
        missing.append(
            "the host<->device bandwidth: pass --bandwidth-gbps (e.g. 25 for PCIe 4.0 x16, 50 for PCIe 5.0 "
            "x16; `memo env` measures it on a GPU)"
        )
    if machine.layer_ms is None and machine.gpu is None:
        missing.append(
            "a layer's forward time: pass --layer-ms, or --gpu (h100, a100, ...) with --efficiency to "
            "estimate it from FLOPs"
        )
    if missing:
        raise MemoError("memo.profiler: the meta device cannot measure " + "; and ".join(missing))


def measure_machine(machine: Machine, device: torch.device, dtype: torch.dtype, *,
                    time_layer: Callable[[], Quantity], config: ModelConfig | None = None, seq_len: int = 0,
                    micro_batch: int = 1) -> dict[str, Quantity]:
    """B, T_layer and the node's host memory of ``machine`` (a :class:`memo.machine.Machine`): given,
    measured on ``device`` (cpu/cuda; ``time_layer()`` times one layer there), or T_layer estimated
    from FLOPs of the model ``config`` at ``seq_len`` x ``micro_batch`` on ``machine.gpu``."""
    q: dict[str, Quantity] = {}
    if machine.bandwidth_gbps is not None:
        q["bandwidth_gbps"] = Quantity(float(machine.bandwidth_gbps), "given")
    elif device.type in ("cuda", "cpu"):
        q["bandwidth_gbps"] = measure_bandwidth(device)
    else:
        raise MemoError(
            f"memo.profiler: the host<->device bandwidth cannot be measured on {device.type}; pass "
            "--bandwidth-gbps (e.g. 25 for PCIe 4.0 x16, 50 for PCIe 5.0 x16; `memo env` measures it "
            "on a GPU)"
        )
    if machine.layer_ms is not None:
        q["layer_ms"] = Quantity(float(machine.layer_ms), "given")
    elif machine.gpu is not None:
        q["layer_ms"] = estimate_layer_ms(config, seq_len, micro_batch, machine.gpu, dtype,
                                          machine.efficiency)
    elif device.type in ("cuda", "cpu"):
        q["layer_ms"] = time_layer()
    else:
        raise MemoError(
            f"memo.profiler: a layer's forward time cannot be measured on {device.type}; pass --layer-ms, "
            "or --gpu (h100, a100, ...) with --efficiency to estimate it from FLOPs"
        )
    if machine.host_mem_gb is not None:
        q["host_memory_bytes"] = Quantity(float(machine.host_mem_gb) * GB, "given")
    else:
        q["host_memory_bytes"] = Quantity(float(machine_memory_bytes()), "measured", "this machine's RAM")
    return q
