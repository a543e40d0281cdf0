#!/usr/bin/env python
"""Every activation-memory strategy on one model and one sequence length, side by side.

One invocation trains the same model (same seed, same data) with

- ``none``: plain autograd,
- ``full-recompute``: ``torch.utils.checkpoint`` per layer,
- ``full-offload``: memo's wrapper with alpha = 1,
- ``memo``: memo with the solved alpha ("auto") and the planned allocator,
- ``offloaded-checkpoint``: ALST's recipe with PyTorch's APIs (every layer checkpointed, its input
  offloaded to pinned host memory, its MLP tiled),
- ``torchtune-offload``: torchtune's activation offloading with its activation checkpointing (an
  equivalent written from its documented behaviour: NOTE [torchtune's activation offloading] in
  memo/train/strategies.py),
- ``save-on-cpu``: PyTorch's ``torch.autograd.graph.save_on_cpu(pin_memory=<cuda>)`` around
  forward + backward of the plain model (the baseline a PyTorch user would otherwise pick),

and on CUDA also ``none`` and ``full-recompute`` under PyTorch's own caching allocator, plain and
with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (each in a fresh interpreter, since the
allocator is fixed at CUDA initialisation). It prints one table: alpha, mean step time (steps
after the first), tokens per GPU per second, MFU, device peak, host bytes, planned/fallback
allocations, and ratios to full recompute and to the best peer.

NOTE [Best peer]
The peers are what a user would pick instead of memo: ``offloaded-checkpoint``, ``torchtune-offload``,
``save-on-cpu`` and ``full-offload`` (``_common.PEERS``). The best peer of a table is the one that
does best at what the table measures: here the lowest device peak (then the shorter step), in
benchmarks/max_seq_len.py the longest sequence. Its name is printed in the table's header.

NOTE [Same meter for every row]
The in-process rows all run under one memo.allocator context per row (see NOTE [Measuring
device memory] in memo/train/meter.py): the peak is memo's allocator's peak of bytes in use
plus the parameters. Every row, ``save-on-cpu`` (:class:`memo.train.SaveOnCpu`) included, is
given its own :class:`memo.train.MemoryMeter`. On CUDA memo's allocator is installed before the
first CUDA tensor (memo's row needs it), so the in-process baselines are served by memo's fallback caching
allocator; the extra subprocess rows measure PyTorch's allocators with
``torch.cuda.max_memory_allocated``, which counts the same bytes (live tensors, parameters
included).

The CPU ``save-on-cpu`` row emulates host memory: NOTE [save_on_cpu on the CPU backend] in
memo/train/strategies.py.

Usage::

    python benchmarks/strategies.py                       # CPU: gpt-mini, 4K tokens
    python benchmarks/strategies.py --model gpt-1.3b --seq-len 32K --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
from _common import PEERS, ROWS, add_device_arguments, best_peer, build_strategy, resolve_device, run_main

from memo.cli.args import positive_float, positive_int, seq_len
from memo.errors import MemoError
from memo.estimate import align
from memo.train.strategies import MemoryMeter
from memo.units import format_mib

__all__ = ["format_table", "main", "peer_row", "run_row"]

#: Rows that also run under PyTorch's own CUDA allocators (subprocesses, CUDA only).
TORCH_ALLOCATOR_ROWS = ("none", "full-recompute")
TORCH_ALLOCATORS = {"caching": None, "expandable": "expandable_segments:True"}
BENCH_KIND = "memo.benchmark.strategies"
BENCH_VERSION = 1
_ROW_PREFIX = "ROW-JSON "


# ---------------------------------------------------------------- one row


def run_row(name: str, args: argparse.Namespace, allocator: str = "memo") -> dict[str, Any]:
    """Train one row for ``args.steps`` steps and return its measurements.

    ``allocator``: ``"memo"`` (in-process rows) or the PyTorch CUDA allocator of a subprocess row.
    """
    from memo.train import TrainConfig, summarize, train

    config = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch,
                         steps=args.steps, device=args.device, dtype=args.dtype, seed=args.seed,
                         peak_tflops=args.peak_tflops)
    strategy = build_strategy(name, MemoryMeter(), time_limit=args.time_limit)
    lines: list[str] = []
    start = time.perf_counter()
    result = train(config, progress=False, log=lines.append, strategy=strategy)  # closes the strategy
    wall = time.perf_counter() - start
    summary = summarize(result)
    last = result.steps[-1].extras
    label = name if allocator == "memo" else f"{name} [torch {allocator}]"
    return {
        "row": label,
        "strategy": name,
        "allocator": allocator,
        "alpha": strategy.alpha,
        "alpha_binding": strategy.alpha_binding,
        "first_loss": summary["first_loss"],
        "last_loss": summary["last_loss"],
        "mean_step_time_s": summary["mean_step_time_s"],
        "mean_tgs": summary["mean_tgs"],
        "mean_mfu": summary["mean_mfu"],
        "peak_device_bytes": summary["peak_memory_bytes"],
        "peak_device_kind": result.peak_memory_kind,
        "host_bytes": int(last.get("host_pinned_bytes", 0)),
        "planned": int(last.get("allocator", {}).get("planned", 0)),
        "fallback": int(last.get("allocator", {}).get("fallback", 0)),
        "unplanned": int(last.get("allocator", {}).get("unplanned", 0)),
        "steps": [{"loss": s.loss, "step_time_s": s.step_time_s} for s in result.steps],
        "wall_s": wall,
    }


def _torch_allocator_row(name: str, allocator: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row in a fresh interpreter whose CUDA allocator is PyTorch's (``allocator`` setting)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if TORCH_ALLOCATORS[allocator] is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = TORCH_ALLOCATORS[allocator]
    cmd = [sys.executable, os.path.abspath(__file__), "--child-row", name, "--child-allocator", allocator,
           "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
           "--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype,
           "--seed", str(args.seed), "--time-limit", str(args.time_limit), "--threads", str(args.threads)]
    if args.peak_tflops is not None:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = [line[len(_ROW_PREFIX):] for line in done.stdout.splitlines() if line.startswith(_ROW_PREFIX)]
    if done.returncode != 0 or not rows:
        raise MemoError(
            f"benchmarks/strategies: row {name!r} under PyTorch's {allocator} allocator failed "
            f"(exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(rows[-1])


# ---------------------------------------------------------------- table




def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "n/a"
    return f"{value / base:.2f}x"


def peer_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best peer (NOTE [Best peer]): the peer row with the lowest device peak, then the fastest."""
    return best_peer(rows, lambda r: (r["peak_device_bytes"] if r["peak_device_bytes"] is not None
                                      else float("inf"), r["mean_step_time_s"]))


def format_table(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table; ratios are row / full-recompute (memo's allocator row), and row / the
    best peer (NOTE [Best peer])."""
    base = next((r for r in rows if r["row"] == "full-recompute"), None)
    peer = peer_row(rows)
    header = ("strategy", "alpha", "step time", "TGS", "MFU", "device peak", "host bytes",
              "planned/fallback", "time/FR", "MFU/FR", "peak/FR", "time/BP", "peak/BP")
    table = [header]
    for r in rows:
        table.append((
            r["row"],
            "-" if r["alpha"] is None else f"{r['alpha']:.3f}",
            f"{r['mean_step_time_s'] * 1e3:,.0f} ms",
            f"{r['mean_tgs']:,.0f}",
            "n/a" if r["mean_mfu"] is None else f"{100 * r['mean_mfu']:.1f}%",
            format_mib(r["peak_device_bytes"]),
            format_mib(r["host_bytes"]),
            f"{r['planned']}/{r['fallback']}" if r["allocator"] == "memo" else "-",
            _ratio(r["mean_step_time_s"], base and base["mean_step_time_s"]),
            _ratio(r["mean_mfu"], base and base["mean_mfu"]),
            _ratio(r["peak_device_bytes"], base and base["peak_device_bytes"]),
            _ratio(r["mean_step_time_s"], peer and peer["mean_step_time_s"]),
            _ratio(r["peak_device_bytes"], peer and peer["peak_device_bytes"]),
        ))
    return align(table)


# ---------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arguments(p)
    p.add_argument("--seq-len", type=seq_len, default=None,
                   help="tokens per sequence: 2048, 32K, 1M (default: 4K on CPU, 32K on CUDA)")
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per step (1)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps per strategy; step 1 is warm-up, not timed (default: 3 on CPU, 6 on CUDA)")
    p.add_argument("--seed", type=int, default=0, help="seed for initialisation and data (0)")
    p.add_argument("--peak-tflops", type=positive_float,
                   help="device peak TFLOPS for MFU (default: known GPUs)")
    p.add_argument("--time-limit", type=positive_float, default=None,
                   help="seconds per MIP solve of memo's planner (default: 5 on CPU, 20 on CUDA)")
    p.add_argument("--only", nargs="+", choices=ROWS, help="run only these rows (default: all)")
    p.add_argument("--no-torch-allocators", action="store_true",
                   help="CUDA: skip the rows under PyTorch's caching/expandable allocators")
    p.add_argument("--json", metavar="OUT.json", help="write every row's measurements as JSON")
    # One row in a fresh interpreter (PyTorch's CUDA allocator rows); not for direct use.
    p.add_argument("--child-row", choices=TORCH_ALLOCATOR_ROWS, help=argparse.SUPPRESS)
    p.add_argument("--child-allocator", choices=sorted(TORCH_ALLOCATORS), help=argparse.SUPPRESS)
    return p


def _defaults(args: argparse.Namespace) -> None:
    cuda = resolve_device(args, "benchmarks/strategies")
    args.seq_len = args.seq_len or (32768 if cuda else 4096)
    args.steps = args.steps or (6 if cuda else 3)
    args.time_limit = args.time_limit or (20.0 if cuda else 5.0)
    if args.steps < 2:
        raise MemoError("benchmarks/strategies: --steps must be >= 2 (step 1 is warm-up and is not timed)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _defaults(args)
    cuda = torch.device(args.device).type == "cuda"
    if args.child_row is not None:
        print(_ROW_PREFIX + json.dumps(run_row(args.child_row, args, args.child_allocator)), flush=True)
        return 0
    names = [n for n in ROWS if args.only is None or n in args.only]
    if cuda:
        from memo import allocator

        # memo's row needs memo's CUDA allocator, which must be installed before the first
        # CUDA tensor; every in-process row is then measured by it (NOTE [Same meter for every row]).
        if not allocator.cuda_installed():
            allocator.install_cuda()
    print(f"benchmarks/strategies: {args.model}, seq {args.seq_len:,} x {args.micro_batch}, {args.dtype} on "
          f"{args.device}, {args.steps} steps per strategy (step 1 not timed), torch threads "
          f"{torch.get_num_threads()}", flush=True)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name in names:
        row = run_row(name, args)
        rows.append(row)
        print(f"  {row['row']}: {row['mean_step_time_s'] * 1e3:,.0f} ms/step, "
              f"peak {format_mib(row['peak_device_bytes'])}, loss {row['first_loss']:.4f} -> "
              f"{row['last_loss']:.4f} ({row['wall_s']:.0f} s)", flush=True)
        gc.collect()
        from memo import allocator as memo_allocator

        memo_allocator.empty_cache(torch.device(args.device))
    torch_rows = [n for n in names if n in TORCH_ALLOCATOR_ROWS]
    if not cuda:
        skipped.append("PyTorch caching / expandable_segments allocator rows: CUDA only (no CUDA device in "
                       "this run)")
    elif args.no_torch_allocators:
        skipped.append("PyTorch caching / expandable_segments allocator rows: --no-torch-allocators")
    else:
        for allocator_name in TORCH_ALLOCATORS:
            for name in torch_rows:
                row = _torch_allocator_row(name, allocator_name, args)
                rows.append(row)
                print(f"  {row['row']}: {row['mean_step_time_s'] * 1e3:,.0f} ms/step, "
                      f"peak {format_mib(row['peak_device_bytes'])}", flush=True)
    peer = peer_row(rows)
    print(f"\n{args.model}, seq {args.seq_len:,}: mean over steps 2..{args.steps}; ratios to full-recompute "
          f"(FR) and to the best peer (BP: {peer['row'] if peer else 'none run'}, the lowest device peak of "
          f"{', '.join(PEERS)})\n")
    print(format_table(rows))
    kinds = sorted({f"{r['row']}: {r['peak_device_kind']}" for r in rows})
    print("\ndevice peak measured as: " + "; ".join(kinds))
    if not cuda:
        print("host bytes: memo's host arena; for save-on-cpu, offloaded-checkpoint and torchtune-offload "
              "the peak of host copies held, emulated on CPU (NOTE [save_on_cpu on the CPU backend]); MFU "
              "n/a: no peak FLOPS for a CPU")
    for line in skipped:
        print(f"skipped: {line}")
    if args.json:
        out = {"version": BENCH_VERSION, "kind": BENCH_KIND, "model": args.model, "seq_len": args.seq_len,
               "micro_batch": args.micro_batch, "device": args.device, "dtype": args.dtype,
               "steps": args.steps, "rows": rows, "best_peer": peer and peer["row"], "skipped": skipped}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        print(f"json written to {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main)
