"""What benchmarks/strategies.py and benchmarks/max_seq_len.py share: the strategy rows, the device
flags and their defaults.

Imported as a sibling module (``import _common``): ``python benchmarks/x.py`` puts benchmarks/ first
on ``sys.path``, so no path is added by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from memo.errors import MemoError
from memo.train import STRATEGIES, SaveOnCpu, Strategy, StrategyOptions, make_strategy
from memo.train.strategies import MemoryMeter

__all__ = ["PEERS", "ROWS", "add_device_arguments", "best_peer", "build_strategy", "resolve_device",
           "run_main"]

#: The strategy rows, in table order: memo train's strategies and PyTorch's save_on_cpu.
ROWS = (*STRATEGIES, SaveOnCpu.name)
#: The peers: what a user would pick instead of memo (the "best peer" of the tables is one of them).
PEERS = ("offloaded-checkpoint", "torchtune-offload", SaveOnCpu.name, "full-offload")


def best_peer(rows: list[dict], key: Callable[[dict], Any]) -> dict | None:
    """The peer row (:data:`PEERS`) that ``key`` ranks first (smallest), or None without one."""
    peers = [r for r in rows if r.get("strategy") in PEERS and r.get("allocator", "memo") == "memo"]
    return min(peers, key=key) if peers else None


def build_strategy(name: str, meter: MemoryMeter, **memo_options: object) -> Strategy:
    """The strategy of one row, measured by ``meter``; ``memo_options``: :class:`StrategyOptions`
    fields for the ``memo`` row (time_limit, plan, device_mem_gb)."""
    if name == SaveOnCpu.name:
        return SaveOnCpu(meter)
    if name != "memo":
        memo_options = {}
    return make_strategy(StrategyOptions(strategy=name, **memo_options), meter)


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype and --threads, which :func:`resolve_device` fills in."""
    from memo.models import list_configs
    from memo.train import DTYPES

    p.add_argument("--model", default=None,
                   help=f"model (default: gpt-mini on CPU, gpt-1.3b on CUDA): {', '.join(list_configs())}")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when present)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU: torch intra-op threads (1; 0 keeps torch's default). On a shared machine more "
                   "OpenMP threads than free cores spin at every barrier and steps get many times slower")


def resolve_device(args: argparse.Namespace, prog: str) -> bool:
    """Device, CPU threads, model and dtype defaults the benchmarks share; returns whether on CUDA."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(args.device).type == "cuda"
    if args.threads < 0:
        raise MemoError(f"{prog}: --threads must be >= 0, got {args.threads}")
    if not cuda and args.threads > 0:
        torch.set_num_threads(args.threads)
    if cuda and not torch.cuda.is_available():
        raise MemoError(f"{prog}: --device {args.device} but torch sees no CUDA device")
    if not cuda and args.device != "cpu":
        raise MemoError(f"{prog}: --device must be cpu or cuda[:i], got {args.device!r}")
    args.model = args.model or ("gpt-1.3b" if cuda else "gpt-mini")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    return cuda


def run_main(main: Callable[[], int]) -> None:
    """A benchmark script's exit: ``main()``'s status, or a MemoError (a bad flag, a job that cannot
    run) as one line on stderr instead of a traceback."""
    try:
        sys.exit(main())
    except MemoError as err:
        sys.exit(f"error: {err}")
