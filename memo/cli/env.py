"""``memo env``: what a user needs to file a bug or plan a run.

Versions (python, torch, CUDA, megatron-core, flash-attn), the extension's
backends, GPUs with memory, host memory, and the measured copy bandwidth, the ``B`` of
memo's alpha LP: pinned host<->device copies on CUDA, the CPU backend's memcpy without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import time
from typing import Any

import torch

from memo.units import GiB

__all__ = ["add_parser", "collect_env", "format_env", "measure_pinned_bandwidth"]



def _package_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _host_memory() -> dict[str, int | None]:
    """Total and available host memory in bytes, from /proc/meminfo where it exists."""
    total = available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        total = int(fields["MemTotal"].split()[0]) * 1024
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            pass
    return {"total_bytes": total, "available_bytes": available}


def measure_pinned_bandwidth(
    device: int = 0, nbytes: int = 256 * 2**20, repeats: int = 5
) -> dict[str, float]:
    """Best-of-``repeats`` pinned host<->device copy bandwidth in GB/s (10^9 bytes/s).

    This is the ``B`` of the alpha LP: offloads run pinned D2H and prefetches
    pinned H2D, each on its own stream.
    """
    from memo.allocator.host import PinnedHostBuffer

    pinned = PinnedHostBuffer(nbytes, torch.device("cuda", device))  # what memo's arena uses
    host, dev = pinned.tensor, torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    result = {}
    for name, dst, src in (("h2d_gbps", dev, host), ("d2h_gbps", host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        result[name] = nbytes / best / 1e9
    del dev
    pinned.release()
    return result


def collect_env(measure_bandwidth: bool = True) -> dict[str, Any]:
    """Everything ``memo env`` prints, as a JSON-able dict."""
    try:
        from memo import _C

        build = dict(_C.build_info())
    except ImportError as err:
        build = {"error": f"memo._C failed to import: {err}"}
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpu: dict[str, Any] = {
                "index": i,
                "name": props.name,
                "memory_bytes": props.total_memory,
                "capability": f"{props.major}.{props.minor}",
            }
            if measure_bandwidth:
                gpu["pinned_bandwidth"] = measure_pinned_bandwidth(i)
            gpus.append(gpu)
    cpu_copy = None
    if not gpus and measure_bandwidth:
        from memo.profiler.measure import measure_bandwidth as measure_copy

        cpu_copy = measure_copy(torch.device("cpu")).value
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        "memo": _package_version("memo"),
        "memo_extension": build,
        "megatron_core": _package_version("megatron-core"),
        "flash_attn": _package_version("flash-attn"),
        "pulp": _package_version("pulp"),
        "cpu_count": os.cpu_count(),
        "host_memory": _host_memory(),
        "gpus": gpus,
        # memo's CPU backend moves activations with memcpy on a copy worker: its B on CPU.
        "cpu_copy_gbps": cpu_copy,
    }


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / GiB:.1f} GiB"


def format_env(env: dict[str, Any]) -> str:
    build = env["memo_extension"]
    if "error" in build:
        ext = build["error"]
    else:
        ext = (
            f"backends {', '.join(build['backends'])}; CUDA {build['cuda_version']}; "
            f"{build['compiler']}; built against torch {build['torch_version']}"
        )
    lines = [
        "memo environment",
        f"  python          {env['python']} ({env['platform']})",
        f"  torch           {env['torch']} (CUDA: {env['torch_cuda']})",
        f"  memo            {env['memo']}",
        f"  memo._C         {ext}",
        f"  megatron-core   {env['megatron_core']}",
        f"  flash-attn      {env['flash_attn']}",
        f"  pulp            {env['pulp']}",
        f"  host            {env['cpu_count']} CPUs, {_gib(env['host_memory']['total_bytes'])} memory "
        f"({_gib(env['host_memory']['available_bytes'])} available)",
    ]
    if not env["gpus"]:
        lines.append("  GPUs            none visible (memo runs its CPU backend)")
        if env.get("cpu_copy_gbps") is not None:
            lines.append(f"  copy engine     {env['cpu_copy_gbps']:.1f} GB/s: the CPU backend's memcpy, "
                         "memo's B on this machine (not a PCIe figure)")
    for gpu in env["gpus"]:
        line = (
            f"  GPU {gpu['index']}           {gpu['name']} (sm {gpu['capability']}), "
            f"{_gib(gpu['memory_bytes'])}"
        )
        if "pinned_bandwidth" in gpu:
            bw = gpu["pinned_bandwidth"]
            line += f", pinned H2D {bw['h2d_gbps']:.1f} GB/s, D2H {bw['d2h_gbps']:.1f} GB/s"
        lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    env = collect_env(measure_bandwidth=not args.no_bandwidth)
    print(json.dumps(env, indent=2) if args.json else format_env(env))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "env",
        help="print versions, backends, GPUs, host memory and pinned bandwidth (for bug reports)",
        description="Print what a bug report or a run plan needs: versions of python, torch, CUDA, "
        "megatron-core and flash-attn, memo's extension backends, GPUs with memory, host memory and, "
        "on CUDA, the measured pinned host<->device bandwidth in GB/s.",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    parser.add_argument(
        "--no-bandwidth", action="store_true",
        help="skip the copy bandwidth measurement (pinned copies on CUDA, memcpy on CPU)",
    )
    parser.set_defaults(func=run)
    return parser
