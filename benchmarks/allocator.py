#!/usr/bin/env python
"""memo's planned allocator against PyTorch's allocators, in one run, as ratios.

CPU (always): cost of one ``torch.empty`` + free pair of several sizes

- under PyTorch's default CPU allocator,
- served from a plan's arena (``memo.allocator.planned``, every request planned),
- served by memo's fallback caching allocator (a plan with no tables: every request unplanned),

printed as ns per pair and as ratios to the default.

CUDA (when a device exists): one fresh interpreter per allocator (PyTorch lets the CUDA
allocator change only before the first CUDA tensor), each training a long-sequence Llama-style
model for a few steps:

- ``caching``: PyTorch's caching allocator,
- ``expandable``: the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
- ``memo``: memo's allocator replaying a plan profiled (logging allocator) on the first step.

It prints the backend segment allocations (cudaMalloc calls) during the steady-state steps,
reserved-minus-allocated bytes at the peak (fragmentation and caching overhead), and the median
step time, each as a ratio to ``caching``.

Usage: ``python benchmarks/allocator.py [--pairs 20000] [--seq 32768] [--steps 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import memo.allocator as ma

SIZES = (4 << 10, 256 << 10, 4 << 20)  # bytes per request


def _pairs(nbytes: int, n: int, on_phase: bool) -> float:
    """ns per torch.empty + free pair; the phase is reopened every 1000 requests (request index 0)."""
    numel = nbytes // 4
    block = 1000
    t0 = time.perf_counter_ns()
    for start in range(0, n, block):
        if on_phase:
            ma.set_phase("layer.fwd[0]")
        for _ in range(min(block, n - start)):
            t = torch.empty(numel)
            del t
    elapsed = time.perf_counter_ns() - t0
    if on_phase:
        ma.set_phase(None)
    return elapsed / n


def cpu_bench(n: int) -> None:
    print(f"CPU: torch.empty + free, {n} pairs per size (ns per pair; ratio to PyTorch's default)")
    print(f"{'size':>10} {'default':>10} {'planned':>10} {'fallback':>10} "
          f"{'planned/def':>12} {'fallback/def':>13}")
    for nbytes in SIZES:
        _pairs(nbytes, 2000, False)  # warm up the default allocator
        default = min(_pairs(nbytes, n, False) for _ in range(5))
        tables = {"layer.fwd[0]": [(nbytes, 0)] * 1000}  # each request freed before the next: one slot
        with ma.planned(tables, peak=nbytes):
            planned = min(_pairs(nbytes, n, True) for _ in range(5))
            s = ma.stats()
            assert s["deviations"] == 0 and s["planned_hits"] == 5 * n, s
        with ma.planned({}, peak=0):
            _pairs(nbytes, 2000, False)
            fallback = min(_pairs(nbytes, n, False) for _ in range(5))
            s = ma.stats()
            assert s["planned_hits"] == 0 and s["segment_allocs"] <= 1, s  # cached: one segment at most
        print(f"{nbytes:>10} {default:>10.0f} {planned:>10.0f} {fallback:>10.0f} "
              f"{planned / default:>12.2f} {fallback / default:>13.2f}")


# ---------------------------------------------------------------- CUDA

_CUDA_CHILD = r"""
import json, statistics, sys, time, warnings
import torch
mode, seq, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import memo.allocator as ma
from memo.models import ModelConfig, build_model
from memo.profiler import phase_tracker
if mode == "memo":
    ma.install_cuda()
torch.manual_seed(0)
config = ModelConfig(name="bench-llama", arch="llama", n_layers=4, hidden=1024, n_heads=8, vocab_size=32000)
model = build_model(config, device="cuda", dtype=torch.bfloat16)
listeners = [ma.set_phase] if mode == "memo" else []
tracker = phase_tracker(model, listeners=listeners)  # on the parts the model adapter names
ids = torch.randint(0, 32000, (1, seq), device="cuda")
def step():
    for p in model.parameters():
        p.grad = None
    with tracker.iteration():
        loss = model(ids, ids)
        loss.backward()
    del loss
    torch.cuda.synchronize()
step()  # warm-up: kernels, workspaces
plan_ctx = None
if mode == "memo":
    from memo.planner import make_plan
    with ma.logging(device="cuda") as trace:
        step()
    plan = make_plan(trace, use_mip=False, progress=False)
    plan_ctx = ma.planned(plan, device="cuda")
    plan_ctx.__enter__()
    step()
    before = ma.stats("cuda")
else:
    step()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
if mode == "memo":
    after = ma.stats("cuda")
    segs = after["segment_allocs"] - before["segment_allocs"]
    reserved = after["arena_bytes"] + after["fallback"]["peak_reserved_bytes"]
    slack = reserved - after["peak_bytes_in_use"]
    extra = {"deviations": after["deviations"], "planned_hits": after["planned_hits"]}
    plan_ctx.__exit__(None, None, None)
else:
    after = torch.cuda.memory_stats()
    segs = after["segment.all.allocated"] - before["segment.all.allocated"]
    slack = after["reserved_bytes.all.peak"] - after["allocated_bytes.all.peak"]
    extra = {"alloc_retries": after["num_alloc_retries"] - before["num_alloc_retries"]}
print(json.dumps({"mode": mode, "segment_allocs": segs, "slack": slack,
                  "step_s": statistics.median(times), **extra}))
"""


def cuda_bench(seq: int, steps: int) -> None:
    rows = {}
    for mode in ("caching", "expandable", "memo"):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if mode == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        out = subprocess.run([sys.executable, "-c", _CUDA_CHILD, mode, str(seq), str(steps)],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(f"CUDA {mode}: failed\n{out.stderr[-2000:]}")
            continue
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    if "caching" not in rows:
        return
    base = rows["caching"]
    print(f"\nCUDA: {steps} steady-state steps, seq {seq} (ratios to PyTorch's caching allocator)")
    print(f"{'allocator':>11} {'cudaMalloc':>10} {'reserved-allocated':>19} {'step ms':>9} "
          f"{'time ratio':>10}  extra")
    for mode, r in rows.items():
        print(f"{mode:>11} {r['segment_allocs']:>10} {r['slack'] / 2**20:>15.1f} MiB "
              f"{r['step_s'] * 1e3:>9.1f} "
              f"{r['step_s'] / base['step_s']:>10.3f}  "
              + ", ".join(f"{k}={v}" for k, v in r.items()
                          if k not in ("mode", "segment_allocs", "slack", "step_s")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20000,
                        help="malloc/free pairs per size and allocator (CPU)")
    parser.add_argument("--seq", type=int, default=32768, help="sequence length of the CUDA model")
    parser.add_argument("--steps", type=int, default=5, help="timed steady-state steps (CUDA)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu_bench(args.pairs)
    if torch.cuda.is_available():
        cuda_bench(args.seq, args.steps)
    else:
        print("\nCUDA: no device here; the CUDA comparison runs when torch.cuda.is_available().")


if __name__ == "__main__":
    main()
