#!/usr/bin/env python
"""memo against the methods a user would pick instead, on one GPU, in one command within a time budget.

``make gpu-bench`` (issues 27 and 45) runs this on a lent GPU (an H100 80GB or an H200) for a
1B-class Llama (``llama-3.2-1b``, memo/models/config.py) in bf16, and writes one markdown file to
paste into benchmarks/RESULTS.md (``--out``), a JSON file with every raw number beside it, and the
records file a later loan resumes from (NOTE [Resuming a run]), in stages (NOTE [Stages of a loan]):

1. every attention kernel the device offers, timed and checked (NOTE [Attention kernels in the bench]);
2. the step time and MFU of each strategy at 64K and 128K tokens (``--seq-lens``) where it can fit
   (NOTE [Rows that cannot fit] in benchmarks/gpu_bench_prep.py), and memo's device peak against its
   plan's ``device["total_bytes"]`` (the bar: within 3%) and full recompute's peak;
3. the longest sequence each strategy trains (two steps of forward, backward and AdamW), searched
   by benchmarks/max_seq_len.py's :func:`search` (doubling, then bisection to ``--granularity``);
4. the same rows for a Llama-3.1-8B-shaped model with 4 layers at 128K and 256K tokens.

Strategies: none, full-recompute, offloaded-checkpoint, torchtune-offload and memo; one that
:data:`memo.train.STRATEGIES` does not list is skipped with a line saying so.

NOTE [One interpreter for memo, one for the rest]
On CUDA memo's allocator must be installed before the first CUDA tensor and the baselines must
not have it (benchmarks/max_seq_len.py: NOTE [Emulated device memory on CPU]), so memo runs in an
interpreter of its own (``--child``) and every other strategy of a stage in one interpreter beside
it, set up by max_seq_len's own ``_setup_cuda`` (PyTorch's allocator, capped where ``--device-mem-mb``
says): a child's start (imports, CUDA) is ~10 s of a loan, and the baselines share nothing a row leaves
behind (each row's peak is reset by memo.train.train, and its memory given back before the next).
A timed row is a :func:`memo.train.train` of ``--steps`` steps (step 1 is warm-up and not timed; memo
profiles and plans the very model, as ``memo train`` does, unless its plan is cached: NOTE [Plan
cache]) measured by max_seq_len's :class:`CappedMeter`, so that a row and a try of the search are
held to the same device budget. A row whose device memory is predicted above the device's is
reported, not run (NOTE [Rows that cannot fit] in benchmarks/gpu_bench_prep.py). The search is
max_seq_len's :func:`search` with its ``try_length`` replaced in the child's module: a length a row
trained fits and one a row ran out of memory at (or was predicted not to fit) does not, without
asking the device again; any other length is max_seq_len's own try (two steps), unless the time
budget says no. Children print one JSON record per row and per try as they go (``GPU-BENCH-JSON``),
so one stopped at its time limit keeps what it measured. benchmarks/strategies.py's ``run_row`` is
not used for the rows: it builds its own unbudgeted :class:`MemoryMeter` and does not return the
strategy, whose plan (``device["total_bytes"]``) the third table needs. On the CPU, ``--jobs``
children run at once, the strategies dealt out among them (each emulates its own device, as
benchmarks/strategies.py's CPU rows do).

NOTE [Time budget]
The budget (``--time-budget-s``, default 720 s) counts from ``--started-at`` (the Makefile passes
the moment ``make gpu-bench`` began, so the build is inside it) or from this script's start. The
stages run in order (NOTE [Stages of a loan]), each child given all the time left; a child still
running GRACE_S (20 s) after the budget's end is stopped. Inside a child every row and every try is
predicted before it starts: from the same strategy's measurement at the longest length not above it
(else the shortest above), its set-up (what is not a step: model build, memo's profile) scaled by
the length and its steps by model FLOPs (:func:`memo.utils.flops.flops_per_sample`); before any
measurement, from the prior of NOTE [Predicted device time]. What is predicted not to end EXIT_S
(10 s) before the budget does is not run and is printed as skipped, with the seconds it needed and
had; it is what ``--resume`` runs on the next loan (NOTE [Resuming a run]). A search cut short that
way reports its longest length as a lower bound ("time budget").

``--dry-run`` runs the very same code (children, stages, records, budget, both output files) on
the CPU with a 4-layer Llama (benchmarks/configs/llama-dry-run.json; the wide stage a 2-layer wider
one), 128 and 256 tokens and memo's CPU allocator emulating a 10 MiB device, in float32 (a CPU's
bf16 is many times slower), two children at once; a GPU session then measures instead of debugging.

Usage::

    make gpu-bench-plans                             # on the CPU, before the loan: memo's plans, rows' needs
    make gpu-bench WHEELS=/path/to/wheels            # installs, builds with MEMO_BUILD_CUDA=1, runs this
    make gpu-bench GPU_BENCH_ARGS="--resume benchmarks/results/gpu_bench.records.jsonl"   # the next loan
    python benchmarks/gpu_bench.py --dry-run         # CPU: the same code path, tiny
    python benchmarks/gpu_bench.py --dry-run --predict   # the GPU run's predicted device time, per stage
    python benchmarks/gpu_bench.py --stages 64K kernels --time-budget-s 400
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime as dt
import functools
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gpu_bench_prep as prep

ROOT = Path(__file__).resolve().parent.parent
BENCH_KIND = "memo.benchmark.gpu_bench"
BENCH_VERSION = 1
#: The strategies measured, in table order (issue 27).
WANTED = ("none", "full-recompute", "offloaded-checkpoint", "torchtune-offload", "memo")
#: The order the children run in, and each one's weight in the time budget (NOTE [Time budget]).
RUN_ORDER = ("none", "full-recompute", "memo", "offloaded-checkpoint", "torchtune-offload")
#: memo's timed rows profile and plan at each length (about 40 s at 32K on an H200, 2026-11-26), so
#: they weigh most; plain autograd runs out of memory early and weighs least.
WEIGHTS = {"rows": {"none": 0.5, "memo": 2.5}, "search": {"none": 0.5, "memo": 1.5}}
#: memo's device peak within this fraction of its plan's ``device["total_bytes"]`` (issue 27's bar).
PLAN_BAR = 0.03
#: Seconds a child may run past its share before it is stopped, and the seconds of its share it
#: keeps for exiting (predictions stop that much earlier).
GRACE_S = 20.0
EXIT_S = 10.0
#: Seconds a child takes to start (imports, CUDA) until one has been measured: 9 s on an H200.
STARTUP_S = 10.0
_RECORD = "GPU-BENCH-JSON "
DRY_RUN_MODEL = str(ROOT / "benchmarks" / "configs" / "llama-dry-run.json")
DRY_RUN_WIDE_MODEL = str(ROOT / "benchmarks" / "configs" / "llama-dry-run-wide.json")
#: The wide stage's model: Llama-3.1-8B's layer (hidden 4096, GQA 32/8, ffn 14336), 4 of its 32 layers.
WIDE_MODEL = str(ROOT / "benchmarks" / "configs" / "llama-3.1-8b-4l.json")
#: The headline rows' strategies, in the order they run (issue 45); torchtune-offload has a stage after.
HEADLINE = ("none", "full-recompute", "memo", "offloaded-checkpoint")
#: The strategies of the wide stage: plain autograd runs out of memory there long before.
WIDE = ("full-recompute", "memo", "offloaded-checkpoint")
RECORDS_KIND = "memo.benchmark.gpu_bench.records"
#: The peak a dry run divides by: a CPU has no entry in memo.utils.flops.GPU_PEAK_TFLOPS.
DRY_RUN_PEAK_TFLOPS = 1.0

__all__ = ["WANTED", "format_markdown", "main", "predict_seconds"]


def preflight() -> int:
    """gpu_check's preflight, worded for make gpu-bench."""
    from gpu_check import preflight as cuda_preflight

    return cuda_preflight("make gpu-bench", "Run it on a machine with an NVIDIA GPU, or "
                          "`python benchmarks/gpu_bench.py --dry-run` for the CPU rehearsal.")


# ---------------------------------------------------------------- time


class Point(tuple):
    """A run of one strategy that trained: (length, set-up seconds, seconds per step, steps)."""

    def __new__(cls, length: int, setup_s: float, step_s: float, steps: int) -> Point:
        return super().__new__(cls, (length, max(setup_s, 0.0), step_s, steps))


def predict_seconds(points: list[Point], length: int, steps: int, model: str) -> float | None:
    """Seconds a run of ``steps`` steps at ``length`` tokens should take (NOTE [Time budget]).

    ``points``: runs of the same strategy that trained. From the one at the longest length not above
    ``length`` (else the shortest above it): its set-up (model build, memo's profile and plan: what
    is not a step) scaled by the length, its steps by model FLOPs
    (:func:`memo.utils.flops.flops_per_sample`). None when nothing was measured yet.
    """
    from memo.utils.flops import flops_per_sample

    if not points:
        return None
    below = [p for p in points if p[0] <= length]
    ref_len, setup_s, step_s, _ = max(below) if below else min(points)
    flops = flops_per_sample(model, length) / flops_per_sample(model, ref_len)
    return setup_s * length / ref_len + steps * step_s * flops


class _Budget:
    """A child's share of the time budget: the wall-clock moment it ends, and what it let run."""

    def __init__(self, deadline: float, model: str, name: str = "", peak_tflops: float | None = None) -> None:
        self.deadline = deadline
        self.model = model
        self.name = name
        self.peak_tflops = peak_tflops  # for the prior, before a row of this strategy was measured
        self.points: list[Point] = []

    def left(self) -> float:
        return self.deadline - time.time()

    def refuse(self, length: int, steps: int) -> str | None:
        """Why a run of ``steps`` steps at ``length`` tokens must not start, or None."""
        left = self.left()
        need = predict_seconds(self.points, length, steps, self.model)
        if need is None and self.peak_tflops is not None:
            need = prior_seconds(self.name, self.model, length, steps, self.peak_tflops)
        if left <= 0:
            return "this strategy's share of the time budget is spent"
        if need is not None and need > left:
            return (f"needs ~{need:.0f} s (predicted), {left:.0f} s of this strategy's share of the time "
                    "budget left")
        return None


# NOTE [Predicted device time]
# What a loan costs before anything was measured on it (``--predict``, printed at the start of every
# run, and what a child predicts for a row of a strategy it has not measured yet):
#   build + per child (STARTUP_S + per row that can fit (setup + steps x step time))
# - build: BUILD_S, the ~3 minutes `make gpu-check` took to install and build on an H200 (2026-11-26,
#   tenth session, both architectures); `make gpu-bench` now builds for the device's architecture
#   only, with parallel nvcc threads, and skips an unchanged CUDA library, so this is an upper bound.
# - children: per stage one for memo and one for every other strategy (NOTE [One interpreter for memo,
#   one for the rest]), each STARTUP_S to start.
# - rows: one predicted not to fit the GPU's memory (GPU_MEMORY_GIB in gpu_bench_prep.py; NOTE [Rows that
#   cannot fit] there) is not run and costs nothing.
# - step time: model FLOPs (memo.utils.flops.flops_per_sample) / (the GPU's dense bf16 peak from
#   memo.utils.flops.GPU_PEAK_TFLOPS x the strategy's MFU). PRIOR_MFU is each strategy's MFU measured
#   at 32K on an H200 (RESULTS.md, "make gpu-bench trial on an H200", the fused-AdamW rows where
#   measured); full recompute measured 22.1% at 64K, so MFU holds within a few points up to 64K. An
#   H100 has the H200's bf16 peak (989 TFLOPS) and less memory bandwidth: the prediction assumes the
#   same MFU, which long sequences (attention-bound, compute-bound) make close. Two steps a row: one
#   warm-up, one timed (the 32K rows' timed steps agreed within 0.2%).
# - setup: memo's profile and plan, 42 s at 32K on the H200, scaled by length (PRIOR_SETUP_S); a plan
#   from the cache (NOTE [Plan cache]: one made ahead by `make gpu-bench-plans`, or profiled by an
#   earlier loan) costs PLAN_LOAD_S instead; every other strategy builds its model in a few seconds
#   (OTHER_SETUP_S).
# - A row that runs out of memory ends at its first step: the prediction, which runs every row it does
#   not predict to misfit to the end, is an upper bound there.
BUILD_S = 180.0
PRIOR_MFU = {"none": 0.276, "full-recompute": 0.231, "offloaded-checkpoint": 0.211,
             "torchtune-offload": 0.224, "memo": 0.254}
PRIOR_SETUP_S = {"memo": (42.0, 32768)}
OTHER_SETUP_S = 5.0
PLAN_LOAD_S = 5.0
#: Issue 45: the headline rows within this many minutes of the machine's start, build included.
HEADLINE_MINUTES = 8
#: Seconds the attention-kernel timings take (a child, its start included).
KERNELS_S = 30.0


def prior_seconds(name: str, model: str, length: int, steps: int, peak_tflops: float,
                  cached_plan: bool = False) -> float:
    """One row's seconds before anything was measured (NOTE [Predicted device time])."""
    from memo.utils.flops import flops_per_sample

    step = flops_per_sample(_config(model), length) / (peak_tflops * 1e12 * PRIOR_MFU.get(name, 0.2))
    if name in PRIOR_SETUP_S and not cached_plan:
        seconds, at = PRIOR_SETUP_S[name]
        setup = seconds * length / at
    else:
        setup = PLAN_LOAD_S if name in PRIOR_SETUP_S else OTHER_SETUP_S
    return setup + steps * step


def _config(model: str) -> Any:
    from memo.models import get_config, load_config

    return load_config(model) if model.endswith(".json") else get_config(model)


# ---------------------------------------------------------------- child: one strategy


def _emit(record: dict[str, Any]) -> None:
    print(_RECORD + json.dumps(record), flush=True)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _row(name: str, length: int, msl: argparse.Namespace, steps: int,
         peak_tflops: float | None, plan_dir: str | None = None) -> dict[str, Any]:
    """Train ``steps`` steps of ``name`` at ``length`` tokens under max_seq_len's budget and meter;
    MFU = :func:`memo.utils.flops.flops_per_sample` / mean step time / ``peak_tflops``."""
    import max_seq_len
    import torch
    from _common import build_strategy

    from memo import allocator
    from memo.train import TrainConfig, summarize, train
    from memo.utils.flops import flops_per_sample, mfu

    meter = max_seq_len.CappedMeter(None if msl.device_mem_mb is None else int(msl.device_mem_mb * 2**20))
    # memo profiles this very model, as `memo train` does (alpha "auto", the layer policy for the budget),
    # unless its plan is in the cache (NOTE [Plan cache]).
    cached, source = _cached_plan(plan_dir, msl, length) if name == "memo" and plan_dir else (None, None)
    plan = str(cached) if source is not None else None
    strategy = build_strategy(name, meter, time_limit=msl.time_limit,
                              device_mem_gb=max_seq_len._budget_gb(msl), plan=plan)
    config = TrainConfig(model=msl.model, seq_len=length, micro_batch=1, steps=steps, device=msl.device,
                         dtype=msl.dtype, seed=0, peak_tflops=peak_tflops)
    flops = flops_per_sample(msl.model, length)  # one sequence per step
    row: dict[str, Any] = {"type": "row", "strategy": name, "seq_len": length, "steps": steps,
                           "flops_per_step": flops, "mfu": None}
    start = time.perf_counter()
    try:
        result = train(config, progress=False, log=lambda _line: None, strategy=strategy)  # closes it
    except Exception as err:  # only out-of-memory is a measurement; anything else is this row's error
        row.update(status="out of memory" if max_seq_len._is_oom(err) else "error",
                   detail=str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__)
    else:
        summary = summarize(result)
        last = result.steps[-1].extras
        peak = None if peak_tflops is None else peak_tflops * 1e12
        row.update(status="ok", mean_step_time_s=summary["mean_step_time_s"],
                   mfu=mfu(flops, 1, summary["mean_step_time_s"], peak), train_mfu=summary["mean_mfu"],
                   first_loss=summary["first_loss"], last_loss=summary["last_loss"],
                   step_times_s=[s.step_time_s for s in result.steps],
                   peak_device_bytes=summary["peak_memory_bytes"], peak_device_kind=result.peak_memory_kind,
                   host_bytes=int(last.get("host_pinned_bytes", 0)), alpha=strategy.alpha,
                   alpha_binding=strategy.alpha_binding,
                   allocator=dict(last.get("allocator", {})))
        if name == "memo":
            row["plan_source"] = source or "profiled"
            if plan is None and cached is not None and strategy.plan is not None:
                from memo.planner import save_plan

                cached.parent.mkdir(parents=True, exist_ok=True)
                save_plan(strategy.plan, cached)
        plan = strategy.plan
        device = getattr(plan, "device", None) if plan is not None else None
        if device:
            row["plan"] = {"total_bytes": device.get("total_bytes"),
                           "budget_bytes": device.get("budget_bytes"),
                           "activations_bytes": device.get("activations_bytes"),
                           "iteration_peak_bytes": device.get("iteration_peak_bytes"),
                           "estimate_bytes": (device.get("estimate") or {}).get("bytes"),
                           "binding": device.get("binding"),
                           "policy": list(getattr(plan, "policy", None) or [])}
    row["wall_s"] = time.perf_counter() - start
    del strategy
    gc.collect()
    if torch.device(msl.device).type == "cuda" and not allocator.cuda_installed():
        torch.cuda.empty_cache()
    else:
        allocator.empty_cache(torch.device(msl.device).type)
    return row


# NOTE [Attention kernels in the bench]
# memo's causal attention runs the kernel memo.models.attention_kernels chooses for the device (NOTE
# [Choosing the attention kernel] there); the choice is a claim about speed that only the device can
# check. The "kernels" stage times every kernel the device offers at the model's attention shape
# (its heads, key/value heads and head dim; micro-batch 1) at KERNEL_LENGTHS tokens, forward and
# backward apart (the median of KERNEL_REPS after a warm-up), and checks each kernel's output,
# log-sum-exp and gradients against the fp32 reference at KERNEL_CHECK_LEN tokens (the memory-efficient
# kernel in fp32; float64 on a CPU), within twice what torch's flash kernel errs plus 4 ulp (the rule of
# tests/models/test_attention_kernels.py). TFLOPS count causal attention as benchmarks/flops.py does.
KERNEL_LENGTHS = {"cuda": (16384, 65536), "cpu": (256,)}
KERNEL_CHECK_LEN = {"cuda": 2048, "cpu": 128}
KERNEL_REPS = {"cuda": 5, "cpu": 2}


def _time(fn: Any, reps: int, cuda: bool) -> float:
    import torch

    fn()  # warm-up
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _kernel_errors(kernel: str, q: Any, k: Any, v: Any, g: Any, ref: tuple[Any, ...]) -> list[float]:
    from memo.models import causal_attention as ca

    o, lse = ca._forward_kernels(kernel, q, k, v)
    grads = ca._backward_kernels(kernel, g, q, k, v, o, lse)
    s = q.shape[0]
    mine = (o, lse[..., :s], *grads)
    theirs = (ref[0], ref[1][..., :s], *ref[2:])
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(mine, theirs, strict=True)]


def _kernel_timings(model: str, device: str, dtype_name: str) -> dict[str, Any]:
    """The "kernels" record (NOTE [Attention kernels in the bench])."""
    import torch

    from memo.models import attention_kernels as ak
    from memo.models import causal_attention as ca

    config = _config(model)
    kind = torch.device(device).type
    cuda = kind == "cuda"
    dtype = getattr(torch, dtype_name)
    n, n_kv = config.n_heads, config.n_kv_heads or config.n_heads
    d = config.head_dim or config.hidden // n
    choice = ak.describe_kernel(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def inputs(s: int, dt: Any) -> tuple[Any, ...]:
        shapes = ((s, 1, n, d), (s, 1, n_kv, d), (s, 1, n_kv, d), (s, 1, n, d))
        return tuple(torch.randn(shape, generator=gen, device=device, dtype=dt) for shape in shapes)

    check = inputs(KERNEL_CHECK_LEN[kind], dtype)
    ref_dtype = torch.float32 if cuda else torch.float64
    ref_kernel = "aten_cuda" if cuda else "aten_cpu"
    ref_in = tuple(t.to(ref_dtype) for t in check)
    ref_o, ref_lse = ca._forward_kernels(ref_kernel, *ref_in[:3])
    ref = (ref_o, ref_lse, *ca._backward_kernels(ref_kernel, ref_in[3], *ref_in[:3], ref_o, ref_lse))
    errors = {kernel: _kernel_errors(kernel, *check, ref) for kernel in choice.available}
    base = errors[ref_kernel]
    eps = torch.finfo(dtype).eps
    rows = []
    for kernel in choice.available:
        matches = all(e <= 2 * b + 4 * eps for e, b in zip(errors[kernel], base, strict=True))
        for s in KERNEL_LENGTHS[kind]:
            q, k, v, g = inputs(s, dtype)
            o, lse = ca._forward_kernels(kernel, q, k, v)
            fwd = _time(functools.partial(ca._forward_kernels, kernel, q, k, v), KERNEL_REPS[kind], cuda)
            backward = functools.partial(ca._backward_kernels, kernel, g, q, k, v, o, lse)
            bwd = _time(backward, KERNEL_REPS[kind], cuda)
            flops = 2.0 * s * s * n * d  # causal forward: QKᵀ and PV, half the score matrix
            rows.append({"kernel": kernel, "seq_len": s, "forward_s": fwd, "backward_s": bwd,
                         "forward_tflops": flops / fwd / 1e12, "backward_tflops": 2.5 * flops / bwd / 1e12,
                         "errors": dict(zip(("o", "lse", "dq", "dk", "dv"), errors[kernel], strict=True)),
                         "matches_reference": matches})
            del q, k, v, g, o, lse
            _say(f"  kernel {kernel} @ {s:,}: forward {fwd * 1e3:,.1f} ms, backward {bwd * 1e3:,.1f} ms"
                 f"{'' if matches else ' (DOES NOT MATCH the reference)'}")
    return {"type": "kernels", "strategy": "kernels", "chosen": choice.as_dict(), "dtype": dtype_name,
            "heads": [n, n_kv, d], "rows": rows}


# NOTE [Plan cache]
# memo's timed row profiles and plans the very model on the device, as `memo train` does: ~42 s of a
# 32K row on an H200, more than its steps. What the plan depends on is known before the row runs (the
# model's fingerprint, the length, dtype, device budget and planner time limit, the GPU, and memo's own
# code), so a plan is kept under a key of all of them (``--plan-dir``, default build/gpu_bench_plans,
# benchmarks/gpu_bench_prep.py's plan_path) and a run with the same key loads it instead of profiling.
# Two kinds are found there, in this order: one a row profiled on this device and saved ("cache" in
# the row's ``plan_source``), and one ``make gpu-bench-plans`` made ahead on the CPU, on meta, for this
# GPU ("meta cache"; what that costs in accuracy: NOTE [Plans made ahead on meta] in gpu_bench_prep.py);
# else the row profiles ("profiled") and saves its plan. The folder travels with the loan (the device
# tool's carry); a change to any part of the key (another GPU, a new memo) is another key.
def _plan_target(msl: argparse.Namespace) -> str:
    """What this child's profile would be made for: the device type and, on CUDA, the GPU's name."""
    import torch

    if not msl.device.startswith("cuda"):
        return torch.device(msl.device).type
    return f"cuda {torch.cuda.get_device_name(torch.device(msl.device))}"


def _cached_plan(plan_dir: str, msl: argparse.Namespace, length: int) -> tuple[Path, str | None]:
    """Where this child's profiled plan for ``length`` tokens goes, and the plan to load instead with where
    it came from: one profiled on this device ("cache"), else one made ahead on meta for this GPU ("meta
    cache", NOTE [Plans made ahead on meta] in benchmarks/gpu_bench_prep.py), else none."""
    args = (msl.model, length, msl.dtype, msl.device_mem_mb, msl.time_limit)
    target = _plan_target(msl)
    mine = prep.plan_path(plan_dir, *args, target)
    if mine.exists():
        return mine, "cache"
    key = prep.gpu_key(target) if target.startswith("cuda ") else None
    ahead = prep.plan_path(plan_dir, *args, f"meta {key}") if key else None
    if ahead is not None and ahead.exists():
        return ahead, "meta cache"
    return mine, None


def _child(args: argparse.Namespace) -> int:
    """The strategies of ``--child`` one after the other (on CUDA memo alone, or the others: NOTE [One
    interpreter for memo, one for the rest])."""
    import max_seq_len
    import torch

    argv = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--granularity",
            str(args.granularity), "--start", str(args.start), "--max-seq", str(args.max_seq), "--time-limit",
            str(args.time_limit), "--threads", str(args.threads)]
    if args.device_mem_mb is not None:
        argv += ["--device-mem-mb", str(args.device_mem_mb)]
    msl = max_seq_len._parser().parse_args(argv)
    max_seq_len._defaults(msl)  # max_seq_len's own defaults: memo profiled by name on CUDA, ...
    if args.attention_kernel:  # NOTE [Stages of a loan]: the chosen kernel failed its check
        from memo.models.attention_kernels import pin_kernel

        pin_kernel(args.attention_kernel)
    if torch.device(msl.device).type == "cuda":
        if "memo" in args.child and len(args.child) != 1:
            sys.exit("error: gpu_bench: on CUDA memo runs in a child of its own (NOTE [One interpreter for "
                     "memo, one for the rest])")
        max_seq_len._setup_cuda(args.child[0], msl)
    info = _info(args.model, args.peak_tflops)
    _emit({**info, "strategy": None, "t": time.time()})
    if args.phase == "kernels":
        start = time.time()
        _emit(_kernel_timings(args.model, msl.device, msl.dtype))
        _emit({"type": "done", "strategy": "kernels", "seconds": time.time() - start})
        return 0
    status = 0
    for name in args.child:
        start = time.time()
        status = _strategy(name, args, msl, info["peak_tflops"]) or status
        _emit({"type": "done", "strategy": name, "seconds": time.time() - start})
    return status


def _strategy(name: str, args: argparse.Namespace, msl: argparse.Namespace, peak_tflops: float | None) -> int:
    """One strategy's stage: its timed rows, or its longest-sequence search (NOTE [One interpreter per
    strategy]), told by the parent what earlier stages and runs measured (``--known``: NOTE [Resuming a
    run])."""
    # Before a length of this strategy was measured, the budget asks the GPU prior (NOTE [Predicted device
    # time]); a dry run's CPU is no GPU, so it runs its first row unpredicted.
    budget = _Budget(args.deadline - EXIT_S, args.model, name, None if args.dry_run else peak_tflops)
    known = json.loads(args.known or "{}").get(name) or {"rows": {}, "tries": {}}
    found = {**known["tries"], **known["rows"]}
    for key, row in found.items():
        if row["fits"] and "step_s" in row:
            budget.points.append(Point(int(key), row["setup_s"], row["step_s"], row["steps"]))
    if args.phase == "rows":
        return _rows(name, args, msl, peak_tflops, budget, known["rows"])
    return _search(name, msl, budget, {int(k): (r["fits"], r["detail"]) for k, r in found.items()})


def _rows(name: str, args: argparse.Namespace, msl: argparse.Namespace, peak_tflops: float | None,
          budget: _Budget, done: dict[str, dict[str, Any]]) -> int:
    """The timed rows not in ``done`` (measured before), shortest first; a length longer than one that ran
    out of memory is not run."""
    oom = min((int(k) for k, r in done.items() if not r["fits"]), default=None)
    for length in args.seq_lens:
        if str(length) in done:
            continue
        why = f"{oom:,} tokens did not fit (out of memory)" if oom is not None and oom < length else \
            budget.refuse(length, args.steps)
        if why is not None:
            _emit({"type": "skip", "strategy": name, "what": f"timed row at {length:,}", "seq_len": length,
                   "why": why, "oom": oom is not None and oom < length})
            _say(f"  {name} @ {length:,}: skipped: {why}")
            continue
        unfit = _unfit(name, length, msl, args.plan_dir)
        if unfit is not None:  # NOTE [Rows that cannot fit] in benchmarks/gpu_bench_prep.py
            oom = length if oom is None else min(oom, length)
            _say(f"  {name} @ {length:,}: {unfit['detail']}")
            _emit({"type": "row", "strategy": name, "seq_len": length, "steps": args.steps, "mfu": None,
                   "flops_per_step": None, "wall_s": 0.0, **unfit})
            continue
        row = _row(name, length, msl, args.steps, peak_tflops, args.plan_dir)
        if row["status"] == "ok":
            step = row["mean_step_time_s"]
            row["setup_s"] = row["wall_s"] - args.steps * step
            budget.points.append(Point(length, row["setup_s"], step, args.steps))
            _say(f"  {name} @ {length:,}: {step * 1e3:,.0f} ms/step, peak "
                 f"{row['peak_device_bytes'] / 2**20:,.1f} MiB [{row['wall_s']:.1f} s]")
        elif row["status"] == "out of memory":
            oom = length if oom is None else min(oom, length)
            _say(f"  {name} @ {length:,}: out of memory [{row['wall_s']:.1f} s]")
        else:
            _say(f"  {name} @ {length:,}: error: {row['detail']}")
        _emit(row)
        if row["status"] == "error":
            return 1
    return 0


def _device_bytes(msl: argparse.Namespace) -> int | None:
    """The device memory a row may use: the budget (``--device-mem-mb``), else the whole GPU's."""
    import torch

    if msl.device_mem_mb is not None:
        return int(msl.device_mem_mb * 2**20)
    if msl.device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(msl.device)).total_memory)
    return None


def _unfit(name: str, length: int, msl: argparse.Namespace, plan_dir: str) -> dict[str, Any] | None:
    """A "does not fit" row where ``name`` at ``length`` tokens needs more than the device has, predicted
    before it runs (NOTE [Rows that cannot fit] in benchmarks/gpu_bench_prep.py), else None."""
    if name == "memo":
        from memo.planner import load_plan

        path, source = _cached_plan(plan_dir, msl, length)
        need = None if source is None else (getattr(load_plan(path), "device", None) or {}).get("total_bytes")
        how = f"its plan's device total ({source})"
    else:
        from memo.errors import MemoError

        try:
            found = prep.need(msl.model, length, msl.dtype, name, plan_dir)
        except MemoError as err:  # no estimate is no reason not to measure
            _say(f"  {name} @ {length:,}: no memory estimate ({err}); the row runs")
            found = None
        need, how = (None, "") if found is None else (found["bytes"], found["how"])
    device = _device_bytes(msl)
    detail = prep.refuse_unfit(need, device)
    if detail is None:
        return None
    return {"status": "does not fit", "detail": detail, "need_bytes": need, "device_bytes": device,
            "need_from": how}


def _search(name: str, msl: argparse.Namespace, budget: _Budget, known: dict[int, tuple[bool, str]]) -> int:
    """max_seq_len's search, its tries answered by the rows where they ran and held to the budget."""
    import max_seq_len

    tried = max_seq_len.try_length

    def budgeted_try(strategy: str, length: int, search_args: argparse.Namespace,
                     workdir: str) -> tuple[bool, str]:
        record: dict[str, Any] = {"type": "try", "strategy": strategy, "seq_len": length,
                                  "budget_stop": False}
        if length in known:
            record["fits"], record["detail"] = known[length]
            record["from_row"] = True
        elif (why := budget.refuse(length, 2)) is not None:
            record.update(fits=False, detail=f"not tried: {why}", budget_stop=True)
        else:
            start = time.perf_counter()
            outcome = tried(strategy, length, search_args, workdir)
            record["fits"], record["detail"] = outcome
            record["seconds"] = time.perf_counter() - start
            record.update(getattr(outcome, "measured", {}))  # max_seq_len's Outcome: peak, step time
            if record["fits"]:
                # Two steps; without the second step's time (a plain pair) all of it counts as steps.
                step = record.get("step_time_s") or record["seconds"] / 2
                budget.points.append(Point(length, record["seconds"] - 2 * step, step, 2))
            _emit(record)
            return outcome
        _emit(record)
        return record["fits"], record["detail"]

    # max_seq_len's search looks its module's try_length up at each try: this one answers from the
    # rows and the budget (NOTE [One interpreter for memo, one for the rest]).
    max_seq_len.try_length = budgeted_try
    try:
        result = max_seq_len.search(name, msl)
    finally:
        max_seq_len.try_length = tried
    _emit({"type": "search", **result})
    return 0


# ---------------------------------------------------------------- parent


def _info(model: str, peak_tflops: float | None) -> dict[str, Any]:
    """The hardware, the model's size, and the peak FLOPS the MFU divides by (``peak_tflops`` when
    given, else memo.utils.flops.GPU_PEAK_TFLOPS by GPU name)."""
    import torch

    from memo.models import get_config
    from memo.models.model import num_parameters
    from memo.utils.flops import GPU_PEAK_TFLOPS

    info: dict[str, Any] = {"type": "info", "torch": torch.__version__, "cuda": torch.version.cuda,
                            "python": sys.version.split()[0], "cpus": os.cpu_count(),
                            "num_parameters": num_parameters(get_config(model), max_seq_len=0),
                            "peak_tflops": peak_tflops, "peak_source": "--peak-tflops"}
    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info["host_memory_gib"] = round(pages / 2**30, 1)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")
        key = next((k for k in GPU_PEAK_TFLOPS if k in props.name), None)
        if peak_tflops is None and key is not None:
            info["peak_tflops"] = GPU_PEAK_TFLOPS[key][torch.bfloat16]
            info["peak_source"] = (f"memo.utils.flops.GPU_PEAK_TFLOPS[{key!r}]: the dense bf16 tensor-core "
                                   "peak of NVIDIA's datasheet")
        elif peak_tflops is None:
            info["peak_source"] = f"none: {props.name!r} is not in memo.utils.flops.GPU_PEAK_TFLOPS (MFU n/a)"
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    return info


def _records(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len(_RECORD):]) for line in text.splitlines() if line.startswith(_RECORD)]


def _run_child(cmd: list[str], timeout: float, on_record: Any) -> str:
    """Run a child (its stderr passes through, live), handing each record to ``on_record`` as it comes
    (NOTE [Resuming a run]); how it ended."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    timer = threading.Timer(max(timeout, 1.0), lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()  # the child and what it started (a MIP solver) are one process group
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(_RECORD):
                on_record(json.loads(line[len(_RECORD):]))
        proc.wait()
    finally:
        stopped = not timer.is_alive() and proc.returncode == -signal.SIGKILL
        timer.cancel()
    if stopped:
        return f"stopped after {timeout:.0f} s (its share of the time budget)"
    return "ok" if proc.returncode == 0 else f"exit {proc.returncode}"


def _child_cmd(stage: Stage, names: list[str], args: argparse.Namespace, deadline: float,
               known: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *names, "--phase", stage.phase,
           "--known", json.dumps(known), "--model", stage.model,
           "--device", args.device, "--dtype", args.dtype, "--seq-lens", *map(str, stage.seq_lens or
                                                                                args.seq_lens),
           "--steps", str(args.steps), "--granularity", str(args.granularity), "--start", str(args.start),
           "--max-seq", str(args.max_seq), "--time-limit", str(args.time_limit),
           "--threads", str(args.threads), "--deadline", repr(deadline), "--plan-dir", args.plan_dir]
    if args.dry_run:
        cmd.append("--dry-run")
    if args.attention_kernel and stage.phase != "kernels":
        cmd += ["--attention-kernel", args.attention_kernel]
    if args.device_mem_mb is not None:
        cmd += ["--device-mem-mb", str(args.device_mem_mb)]
    if args.peak_tflops is not None:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    return cmd


def _search_summary(records: list[dict[str, Any]], name: str, ended: str) -> dict[str, Any]:
    """One strategy's search: its own result, or one rebuilt from its tries when the child was stopped."""
    tries = [r for r in records if r["type"] == "try"]
    done = next((r for r in records if r["type"] == "search"), None)
    trained = [r["seq_len"] for r in records if (r["type"] == "try" and r["fits"])
               or (r["type"] == "row" and r["status"] == "ok")]
    longest = done["longest"] if done else max(trained, default=0)
    above = [t for t in tries if not t["fits"] and t["seq_len"] > longest]
    failed = sorted(t["seq_len"] for t in above if not t["budget_stop"])
    budget_stops = sorted(t["seq_len"] for t in above if t["budget_stop"])
    if done is None:
        limited = f"stopped ({ended})"
    elif failed and (not budget_stops or failed[0] <= budget_stops[0]):
        limited = "device memory"
    elif budget_stops:
        limited = "time budget"
    else:
        limited = "--max-seq"
    return {"strategy": name, "longest": longest, "first_failure": failed[0] if failed else None,
            "limited_by": limited, "complete": done is not None, "tries": tries}


def _strategy_result(name: str, records: list[dict[str, Any]],
                     phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    # What a later run measured replaces what an earlier one skipped (NOTE [Resuming a run]).
    measured = {r["seq_len"] for r in records if r["type"] == "row"}
    tried = {r["seq_len"] for r in records if r["type"] == "try" and not r["budget_stop"]}
    skips = [r for r in records if r["type"] == "skip" and r.get("seq_len") not in measured]
    records = [r for r in records if not (r["type"] == "try" and r["budget_stop"] and r["seq_len"] in tried)]
    ended = next((p["ended"] for p in phases.values() if p["ended"] != "ok"), "ok")
    search_ended = next((p["ended"] for p in phases.values() if p.get("phase") == "search"), "not run")
    return {"strategy": name, "ended": ended, "phases": phases,
            "seconds": sum(p["seconds"] for p in phases.values()),
            "rows": sorted((r for r in records if r["type"] == "row"), key=lambda r: r["seq_len"]),
            "search": _search_summary(records, name, search_ended),
            "row_skips": {str(r["seq_len"]): r["why"] for r in skips if "seq_len" in r},
            "skipped": [f"{r['strategy']}: {r['what']}: {r['why']}" for r in skips]}


def _known(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """What earlier stages and runs found for one strategy, for its child (NOTE [Resuming a run]): the
    timed rows that trained or ran out of memory ("rows"; a child does not run them again), and the
    search's tries that trained or did not ("tries"); a length that trained also times later ones."""
    known: dict[str, dict[str, dict[str, Any]]] = {"rows": {}, "tries": {}}
    for r in records:
        if r["type"] == "row" and r["status"] == "ok":
            peak = r["peak_device_bytes"] / 2**20
            known["rows"][str(r["seq_len"])] = {
                "fits": True, "setup_s": r["setup_s"], "step_s": r["mean_step_time_s"], "steps": r["steps"],
                "detail": f"fits (the timed row: {r['steps']} steps, peak {peak:,.1f} MiB)"}
        elif r["type"] == "row" and r["status"] == "out of memory":
            known["rows"][str(r["seq_len"])] = {"fits": False,
                                                "detail": "out of memory (the timed row): " + r["detail"]}
        elif r["type"] == "row" and r["status"] == "does not fit":
            known["rows"][str(r["seq_len"])] = {"fits": False, "detail": r["detail"]}
        elif r["type"] == "try" and not r["budget_stop"]:
            entry = {"fits": r["fits"], "detail": r["detail"]}
            if r["fits"] and r.get("seconds") is not None:
                step = r.get("step_time_s") or r["seconds"] / 2
                entry.update(setup_s=max(r["seconds"] - 2 * step, 0.0), step_s=step, steps=2)
            known["tries"][str(r["seq_len"])] = entry
    return known


def _groups(todo: list[str], jobs: int) -> list[list[str]]:
    """The strategies of each child: with --jobs 1 (always on a GPU) every strategy but memo in one, then
    memo in its own (NOTE [One interpreter for memo, one for the rest]); on the CPU, --jobs children, the
    strategies dealt out by weight (memo's profiles make it the heaviest)."""
    if jobs == 1:
        return [g for g in ([n for n in todo if n != "memo"], [n for n in todo if n == "memo"]) if g]
    groups: list[list[str]] = [[] for _ in range(min(jobs, len(todo)))]
    weight = WEIGHTS["rows"]
    for name in sorted(todo, key=lambda n: -weight.get(n, 1.0)):
        min(groups, key=lambda g: sum(weight.get(n, 1.0) for n in g)).append(name)
    return [g for g in groups if g]


def _defaults(args: argparse.Namespace) -> None:
    if args.dry_run:
        args.device = args.device or "cpu"
        args.model = args.model or DRY_RUN_MODEL
        args.dtype = args.dtype or "float32"  # bf16 matmuls are many times slower on a CPU
        args.seq_lens = args.seq_lens or [128, 256]
        args.wide_model = args.wide_model or DRY_RUN_WIDE_MODEL
        args.wide_seq_lens = args.wide_seq_lens or [128, 256]
        args.device_mem_mb = args.device_mem_mb if args.device_mem_mb is not None else 10.0
        args.granularity = args.granularity or 128
        args.max_seq = args.max_seq or 1024
        args.time_limit = args.time_limit or 0.5
        args.steps = args.steps or 2
        args.peak_tflops = args.peak_tflops or DRY_RUN_PEAK_TFLOPS
        args.time_budget_s = args.time_budget_s or 240.0
        args.jobs = args.jobs or 2
        args.plan_dir = args.plan_dir or str(ROOT / "build" / "gpu_bench_plans-dry-run")
    args.device = args.device or "cuda"
    args.dtype = args.dtype or "bfloat16"
    args.model = args.model or "llama-3.2-1b"
    if args.model.endswith(".json"):  # the children run in the repository's root
        args.model = os.path.abspath(args.model)
    if args.wide_model and args.wide_model.endswith(".json"):
        args.wide_model = os.path.abspath(args.wide_model)
    args.seq_lens = sorted(set(args.seq_lens or [65536, 131072]))
    args.wide_model = args.wide_model or WIDE_MODEL
    args.wide_seq_lens = sorted(set(args.wide_seq_lens or [131072, 262144]))
    args.plan_dir = args.plan_dir or str(ROOT / "build" / "gpu_bench_plans")
    args.granularity = args.granularity or 8192
    args.start = args.start or args.seq_lens[0]
    args.max_seq = args.max_seq or (1 << 20)
    args.time_limit = args.time_limit or 5.0
    args.steps = args.steps or 2  # NOTE [Predicted device time]: one warm-up step, one timed
    args.time_budget_s = args.time_budget_s or 720.0
    args.jobs = args.jobs or 1
    args.attention_kernel = getattr(args, "attention_kernel", None)
    if args.jobs < 1 or (args.jobs > 1 and not args.device.startswith("cpu")):
        sys.exit(f"error: gpu_bench: --jobs must be 1 on a GPU (one device) and at least 1 on the CPU, "
                 f"got {args.jobs}")
    if args.steps < 2:
        sys.exit("error: gpu_bench: --steps must be >= 2 (step 1 is warm-up and is not timed)")
    if args.start > args.max_seq:
        sys.exit(f"error: gpu_bench: --start {args.start:,} is longer than --max-seq {args.max_seq:,}")


def _parser() -> argparse.ArgumentParser:
    from memo.cli.args import positive_float, positive_int, seq_len

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preflight", action="store_true", help="only check that a CUDA device is present")
    p.add_argument("--dry-run", action="store_true",
                   help="the same code path on the CPU: a 4-layer Llama, 128 to 512 tokens, a 10 MiB "
                   "emulated device")
    p.add_argument("--model", default=None, help="model name or CONFIG.json (default: llama-3.2-1b)")
    p.add_argument("--device", default=None, help="cuda[:i] (default), or cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="default bfloat16 (dry run: float32, which a CPU runs many times faster)")
    p.add_argument("--seq-lens", nargs="+", type=seq_len, default=None,
                   help="lengths of the headline rows, one stage each (default: 64K 128K)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps per timed row; step 1 is warm-up (default 2: one timed step, a loan is short)")
    p.add_argument("--granularity", type=seq_len, default=None,
                   help="the search's bisection stops at this many tokens (default 8K)")
    p.add_argument("--start", type=seq_len, default=None,
                   help="first length the search tries (default: the shortest --seq-lens, so that its "
                   "doubling meets the timed rows)")
    p.add_argument("--max-seq", type=seq_len, default=None,
                   help="longest length the search tries (default 1M)")
    p.add_argument("--device-mem-mb", type=positive_float, default=None,
                   help="device memory budget in MiB (default: the whole GPU; dry run 10)")
    p.add_argument("--time-limit", type=positive_float, default=None,
                   help="seconds memo's planner may spend in its MIP stages (default 5, memo train's; dry "
                   "run 0.5)")
    p.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="peak TFLOPS for MFU (default: memo.utils.flops.GPU_PEAK_TFLOPS by GPU name)")
    p.add_argument("--time-budget-s", type=positive_float, default=None,
                   help="seconds for the whole run, counted from --started-at (default 1100; dry run 240)")
    p.add_argument("--started-at", type=float, default=None,
                   help="Unix time the budget counts from (default: now; make gpu-bench passes the moment it "
                   "began, so the build is inside the budget)")
    p.add_argument("--only", nargs="+", choices=WANTED, help="measure only these strategies")
    p.add_argument("--stages", nargs="+", default=None,
                   help="run only these stages (NOTE [Stages of a loan]): kernels, a headline length (64K, "
                   "128K), torchtune, longest, wide (default: all, in that order)")
    p.add_argument("--wide-model", default=None,
                   help="the wide stage's model (default benchmarks/configs/llama-3.1-8b-4l.json: "
                   "Llama-3.1-8B's layer, 4 of them)")
    p.add_argument("--wide-seq-lens", nargs="+", type=seq_len, default=None,
                   help="the wide stage's lengths (default 128K 256K)")
    p.add_argument("--resume", default=None, metavar="RECORDS",
                   help="go on where the run that wrote RECORDS (its .records.jsonl) stopped: only what it "
                   "did not measure runs, and its new records go to the same file (NOTE [Resuming a run])")
    p.add_argument("--predict", action="store_true",
                   help="print the predicted device time of each stage on --predict-gpu and exit "
                   "(NOTE [Predicted device time]); with --dry-run, of the GPU run's defaults")
    p.add_argument("--predict-gpu", default=prep.PLAN_GPU,
                   help="the GPU --predict predicts for and --make-plans plans for (a key of "
                   f"memo.utils.flops.GPU_PEAK_TFLOPS; default {prep.PLAN_GPU}, the kind lent); a run's "
                   "opening line predicts for its own GPU (nvidia-smi), else this one")
    p.add_argument("--make-plans", action="store_true",
                   help="make memo's plans for its rows (of --stages) on meta for --predict-gpu, and every "
                   "row's predicted device memory, into --plan-dir, on this machine's CPU (make "
                   "gpu-bench-plans; NOTE [Plans made ahead on meta] in benchmarks/gpu_bench_prep.py); exit")
    p.add_argument("--plan-dir", default=None,
                   help="memo's plan cache (NOTE [Plan cache]; default build/gpu_bench_plans)")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads per child (1)")
    p.add_argument("--jobs", type=int, default=None,
                   help="CPU only: children at once, the strategies dealt out among them (default 1; dry run "
                   "2); each emulates its own device, so what fits does not change, only the timings")
    p.add_argument("--out", default=None,
                   help="markdown results (default benchmarks/results/gpu_bench.md; dry run "
                   "build/gpu_bench-dry-run.md); the JSON is written beside it (.json)")
    p.add_argument("--child", nargs="+", choices=(*WANTED, "kernels"), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("rows", "search", "kernels"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--known", default=None, help=argparse.SUPPRESS)
    p.add_argument("--attention-kernel", default=None, help=argparse.SUPPRESS)
    return p


# NOTE [Stages of a loan]
# A loan is short (15 minutes of device time, the machine's start included), so what matters most runs
# first and the rest waits for the next loan (NOTE [Resuming a run]): the attention kernels' timings and
# checks first (~30 s: every row after runs the chosen kernel, and one that fails or does not match the
# fp32 reference is replaced by torch's flash kernel in every later child, ``--attention-kernel``,
# rather than spoil the loan), the headline rows, one stage per length (64K, then 128K: none, full
# recompute, memo, offloaded-checkpoint), torchtune-offload's rows, the longest sequence of every
# strategy, and last the wide stage, a Llama-3.1-8B-shaped model with 4 layers at 128K and 256K. A
# stage's children run one after the other, each given all the time left (what it predicts will not
# fit it skips, to be run on resume).
@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a run (NOTE [Stages of a loan])."""

    name: str
    model: str
    phase: str  # "rows", "kernels" or "search"
    seq_lens: tuple[int, ...]
    strategies: tuple[str, ...]


def stages(args: argparse.Namespace, available: tuple[str, ...]) -> list[Stage]:
    """The stages of a run, in order, with the strategies ``available`` and ``--only`` keep."""
    def keep(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for n in names if n in available and (args.only is None or n in args.only))

    out = [Stage("kernels", args.model, "kernels", (), ("kernels",))]
    out += [Stage(_k(n), args.model, "rows", (n,), keep(HEADLINE)) for n in args.seq_lens]
    out += [Stage("torchtune", args.model, "rows", tuple(args.seq_lens), keep(("torchtune-offload",))),
            Stage("longest", args.model, "search", (), keep(RUN_ORDER)),
            Stage("wide", args.wide_model, "rows", tuple(args.wide_seq_lens), keep(WIDE))]
    wanted = args.stages
    return [st for st in out if st.strategies and (wanted is None or st.name in wanted)]


def _settled(stage: Stage, name: str, mine: list[dict[str, Any]]) -> bool:
    """Whether earlier records hold what ``stage`` measures of strategy ``name`` (NOTE [Resuming a run])."""
    if stage.phase == "kernels":
        return any(r["type"] == "kernels" for r in mine)
    if stage.phase == "search":
        return any(r["type"] == "search" for r in mine)
    rows = {r["seq_len"]: r["status"] for r in mine if r["type"] == "row"}
    oom = min((n for n, status in rows.items() if status in ("out of memory", "does not fit")), default=None)
    return all(n in rows or (oom is not None and oom < n) for n in stage.seq_lens)


def predict(args: argparse.Namespace, plan: list[Stage], gpu: str, cached: set[tuple[str, int]] | None = None
            ) -> list[dict[str, Any]]:
    """Each stage's predicted seconds on ``gpu`` (NOTE [Predicted device time]), the rows it will not run
    because they cannot fit (NOTE [Rows that cannot fit] in benchmarks/gpu_bench_prep.py), and the running
    total with the build. ``cached``: the (model, length) whose memo plan is in the cache; None: those
    ``--plan-dir`` holds for ``gpu`` (:func:`cached_plans`)."""
    import torch

    from memo.utils.flops import GPU_PEAK_TFLOPS

    key = prep.gpu_table_key(gpu)
    peak = GPU_PEAK_TFLOPS[key][torch.bfloat16]
    gib = prep.device_gib(key) if args.device_mem_mb is None else args.device_mem_mb / 1024
    device = None if gib is None else int(gib * 2**30)
    cached = cached_plans(args, plan, key) if cached is None else cached
    total, out = BUILD_S, []
    for stage in plan:
        unfit: list[str] = []
        if stage.phase == "kernels":
            seconds: float | None = KERNELS_S
        elif stage.phase == "search":
            seconds = None  # how far a search goes is what it measures
        else:
            seconds = 0.0
            for group in _groups(list(stage.strategies), 1):  # one child each (NOTE [One interpreter ...])
                rows = []
                for n in group:
                    for length in stage.seq_lens:
                        found = None if n == "memo" else prep.need(stage.model, length, args.dtype, n,
                                                                   args.plan_dir)
                        if prep.refuse_unfit(found and found["bytes"], device) is not None:
                            unfit.append(f"{n} @ {_k(length)}")
                            continue
                        rows.append(prior_seconds(n, stage.model, length, args.steps, peak,
                                                  n == "memo" and (stage.model, length) in cached))
                seconds += STARTUP_S + sum(rows)  # a child starts even where no row of it can fit
        total += seconds or 0.0
        out.append({"stage": stage.name, "strategies": list(stage.strategies), "seconds": seconds,
                    "total_with_build_s": total, "does_not_fit": unfit})
    return out


def cached_plans(args: argparse.Namespace, plan: list[Stage], gpu: str) -> set[tuple[str, int]]:
    """The (model, length) of memo's rows whose plan ``make gpu-bench-plans`` left in ``--plan-dir`` for
    ``gpu`` (NOTE [Plans made ahead on meta] in benchmarks/gpu_bench_prep.py)."""
    return {(model, n) for model, n in plans_ahead(plan) if prep.plan_path(
        args.plan_dir, model, n, args.dtype, args.device_mem_mb, args.time_limit, f"meta {gpu}").exists()}


def plans_ahead(plan: list[Stage]) -> list[tuple[str, int]]:
    """The (model, length) of memo's plans ``make gpu-bench-plans`` makes: every memo row of ``plan``'s
    stages (the headline rows, then the wide stage's)."""
    return [(st.model, n) for st in plan if st.phase == "rows" and "memo" in st.strategies
            for n in st.seq_lens]


def _predict(argv: list[str], available: tuple[str, ...]) -> int:
    """``--predict``: the GPU run's device time per stage as ``--plan-dir`` holds memo's plans now, and with
    every plan ``make gpu-bench-plans`` makes (with ``--dry-run``: of the GPU run's defaults)."""
    gpu_args = _parser().parse_args([a for a in argv if a != "--dry-run"])
    _defaults(gpu_args)
    gpu = gpu_args.predict_gpu
    plan = stages(gpu_args, available)
    rows = predict(gpu_args, plan, gpu)
    _print_prediction(rows, gpu)
    ahead, found = _print_plans_ahead(gpu_args, plan, gpu)
    if not ahead <= found:
        headline = [r for r in predict(gpu_args, plan, gpu, found | ahead) if r["stage"][:-1].isdigit()]
        if headline:
            print(f"gpu_bench: with them (make gpu-bench-plans first) the headline rows end "
                  f"{headline[-1]['total_with_build_s'] / 60:.1f} min after the build starts", flush=True)
    return 0


def _print_plans_ahead(args: argparse.Namespace, plan: list[Stage], gpu: str
                       ) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """Say how many of the plans ``make gpu-bench-plans`` makes ``--plan-dir`` holds; (wanted, found)."""
    ahead = set(plans_ahead(plan))
    found = cached_plans(args, plan, prep.gpu_table_key(gpu))
    print(f"gpu_bench: memo's plans made ahead for the {gpu} in {args.plan_dir}: {len(found & ahead)} of "
          f"{len(ahead)} (make gpu-bench-plans; NOTE [Plans made ahead on meta])", flush=True)
    return ahead, found


def _gpu_key() -> str | None:
    """This machine's GPU as a key of memo.utils.flops.GPU_PEAK_TFLOPS, from nvidia-smi (the parent never
    touches the device: NOTE [One interpreter for memo, one for the rest])."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    name = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip().splitlines()
    return prep.gpu_key(name[0]) if name else None


def _print_prediction(rows: list[dict[str, Any]], gpu: str) -> None:
    print(f"gpu_bench: predicted device time on an {gpu} (NOTE [Predicted device time]; build "
          f"{BUILD_S:.0f} s):", flush=True)
    for r in rows:
        seconds = "as far as the time left" if r["seconds"] is None else f"{r['seconds']:.0f} s"
        unfit = f"; predicted not to fit, not run: {', '.join(r['does_not_fit'])}" * bool(r["does_not_fit"])
        print(f"  {r['stage']:>9}: {seconds:>24}, {r['total_with_build_s'] / 60:5.1f} min with the build and "
              f"the stages before ({', '.join(r['strategies'])}{unfit})", flush=True)
    headline = [r for r in rows if r["stage"][:-1].isdigit()]
    if headline:
        minutes = headline[-1]["total_with_build_s"] / 60
        within = "within" if minutes <= HEADLINE_MINUTES else "over"
        print(f"gpu_bench: the headline rows end {minutes:.1f} min after the build starts ({within} issue "
              f"45's {HEADLINE_MINUTES} minutes)", flush=True)


# NOTE [Resuming a run]
# Every record a child prints (a timed row, a try of the search, a skip, the kernels' timings) is
# appended, as it arrives, to the run's records file (``<out>.records.jsonl``, a header line first:
# kind, version and the job the records belong to), so a loan that ends in the middle of a row keeps
# every row before it. ``--resume FILE`` reads the file back, checks that it is this job's (model,
# dtype, device budget, steps), and runs only what it does not hold: a stage whose rows (or search, or
# timings) are all there is skipped, a child is told the rows it must not run again and what its
# search found so far (``--known``), and the new records go to the same file. The results (markdown
# and JSON) are made from all the records, old and new.
def _job(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "wide_model": args.wide_model, "dtype": args.dtype, "device": args.device,
            "device_mem_mb": args.device_mem_mb, "steps": args.steps, "dry_run": args.dry_run}


def _portable(job: dict[str, Any]) -> dict[str, Any]:
    """A job with models named relative to the repository, so a records file resumes in another clone."""
    def rel(model: str) -> str:
        return os.path.relpath(model, ROOT) if os.path.isabs(model) else model

    return {**job, "model": rel(job["model"]), "wide_model": rel(job["wide_model"])}


def read_records(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The records of the run that wrote ``path``, checked against this job (NOTE [Resuming a run])."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        head = json.loads(lines[0]) if lines else {}
        records = [json.loads(line) for line in lines[1:]]
    except json.JSONDecodeError as err:
        # A loan may end in the middle of a line: the last one alone may be cut short.
        good = [json.loads(line) for line in lines[1:-1]]
        if len(good) != len(lines) - 2:
            sys.exit(f"error: gpu_bench: --resume {path}: not a records file ({err})")
        records = good
    if head.get("kind") != RECORDS_KIND or head.get("version") != BENCH_VERSION:
        sys.exit(f"error: gpu_bench: --resume {path}: not a gpu_bench records file (kind "
                 f"{head.get('kind')!r}, version {head.get('version')!r}; want {RECORDS_KIND!r}, "
                 f"{BENCH_VERSION})")
    mine = _portable(_job(args))
    if head.get("job") != mine:
        theirs = head.get("job", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        sys.exit(f"error: gpu_bench: --resume {path} was written for another job: {diff} (theirs, this "
                 "run's); give the same --model, --dtype, --device-mem-mb and --steps, or start a new run")
    return records


def main(argv: list[str] | None = None) -> int:
    if "--preflight" in (sys.argv[1:] if argv is None else argv):
        return preflight()  # before memo is importable: make gpu-bench runs it before the build
    args = _parser().parse_args(argv)
    started = args.started_at if args.started_at is not None else time.time()
    _defaults(args)
    if args.child is not None:
        return _child(args)
    from memo.train import STRATEGIES  # imports no torch: the parent never touches the device

    plan = stages(args, (*STRATEGIES, "kernels"))
    if args.make_plans:
        rows = [(st.model, n, name) for st in plan if st.phase == "rows" for n in st.seq_lens
                for name in st.strategies]
        return prep.make_plans(args, plans_ahead(plan), rows)
    if args.predict:
        return _predict(sys.argv[1:] if argv is None else argv, (*STRATEGIES, "kernels"))
    if args.device.startswith("cuda") and (status := preflight()):
        return status

    end = started + args.time_budget_s
    out_md = Path(args.out) if args.out else (ROOT / "build" / "gpu_bench-dry-run.md" if args.dry_run
                                               else ROOT / "benchmarks" / "results" / "gpu_bench.md")
    out_json = out_md.with_suffix(".json")
    records_path = Path(args.resume) if args.resume else out_md.with_suffix(".records.jsonl")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    all_records: list[dict[str, Any]] = read_records(records_path, args) if args.resume else []
    if not args.resume:
        records_path.write_text(json.dumps({"kind": RECORDS_KIND, "version": BENCH_VERSION,
                                            "job": _portable(_job(args))}) + "\n")
    print(f"gpu_bench: {args.model}, {args.dtype} on {args.device}{' (dry run)' if args.dry_run else ''}; "
          f"headline rows at {', '.join(f'{n:,}' for n in args.seq_lens)} tokens; time budget "
          f"{args.time_budget_s:.0f} s, {end - time.time():.0f} s left; records: {records_path}"
          + (f" (resumed: {len(all_records)} records)" if args.resume else ""), flush=True)
    if not args.dry_run:
        gpu = _gpu_key() or args.predict_gpu
        _print_prediction(predict(args, plan, gpu), gpu)
        _print_plans_ahead(args, plan, gpu)
    skipped = [f"{n}: not measured: memo.train.STRATEGIES does not list it ({', '.join(STRATEGIES)})"
               for n in RUN_ORDER if n not in STRATEGIES and (args.only is None or n in args.only)]
    for line in skipped:
        print(f"gpu_bench: skipped {line}", flush=True)
    run = _Run(args, started, end, out_md, records_path, all_records, skipped)
    for stage in plan:
        run.stage(stage)
        if stage.phase == "kernels":
            _pin_after_kernels(args, run.records)
    report = run.save()
    print("\n" + out_md.read_text())
    print(f"results written to {out_md} and {out_json}; records in {records_path}")
    # A child stopped at the end of its share is the budget at work; one that failed is an error.
    return 1 if any(r["ended"].startswith("exit") for r in report["strategies"]) else 0


def _pin_after_kernels(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    """Torch's flash kernel for every later child where the chosen kernel failed its check on a GPU
    (NOTE [Stages of a loan]); the report says so."""
    if not args.device.startswith("cuda"):
        return
    record = next((r for r in reversed(records) if r["type"] == "kernels"), None)
    chosen = None if record is None else record["chosen"]["kernel"]
    ok = record is not None and all(r["matches_reference"] for r in record["rows"] if r["kernel"] == chosen) \
        and any(r["kernel"] == chosen for r in record["rows"])
    if not ok and chosen != "aten_cuda":
        args.attention_kernel = "aten_cuda"
        what = chosen or "unknown: the kernels stage did not finish"
        print(f"gpu_bench: the chosen attention kernel ({what}) failed its check; every later child runs "
              "aten_cuda", flush=True)


class _Run:
    """The parent's state: every record so far, each strategy's stages, and the output files."""

    def __init__(self, args: argparse.Namespace, started: float, end: float, out_md: Path, records_path: Path,
                 records: list[dict[str, Any]], skipped: list[str]) -> None:
        self.args, self.started, self.end = args, started, end
        self.out_md, self.records_path = out_md, records_path
        self.records = records
        self.skipped = skipped
        self.info: dict[str, Any] = next((r for r in records if r["type"] == "info"), {})
        self.startup = STARTUP_S
        self.phases: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        self.lock = threading.Lock()

    def mine(self, model: str, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("model") == model and r.get("strategy") == name]

    def add(self, record: dict[str, Any], stage: Stage) -> None:
        record = {**record, "stage": stage.name, "model": _portable({"model": stage.model,
                                                                     "wide_model": stage.model})["model"]}
        with self.lock:
            self.records.append(record)
            with self.records_path.open("a") as f:  # NOTE [Resuming a run]: on disk as it arrives
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def stage(self, stage: Stage) -> None:
        model = _portable({"model": stage.model, "wide_model": stage.model})["model"]
        todo = [n for n in stage.strategies if not _settled(stage, n, self.mine(model, n))]
        for name in set(stage.strategies) - set(todo):
            print(f"== {stage.name}: {name}: already measured (records)", flush=True)
        groups = _groups(todo, self.args.jobs)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, self.args.jobs)) as pool:
            list(pool.map(lambda g: self.measure(stage, model, g), groups))

    def measure(self, stage: Stage, model: str, group: list[str]) -> None:
        left = self.end - time.time()
        for name in group:
            self.phases.setdefault((model, name), {})[stage.name] = {"phase": stage.phase, "share_s": left,
                                                                     "ended": "not run", "seconds": 0.0}
        if left < self.startup + 5:
            for name in group:
                self.skipped.append(f"{name}: stage {stage.name} not run: {max(left, 0):.0f} s of the time "
                                    "budget left (resume the run on the next loan)")
                print(f"gpu_bench: skipped {self.skipped[-1]}", flush=True)
            return
        print(f"\n== {stage.name} ({stage.phase}): {', '.join(group)}; {left:.0f} s left", flush=True)
        known = {n: _known(self.mine(model, n)) for n in group}
        start = time.time()
        got: list[dict[str, Any]] = []

        def on_record(record: dict[str, Any]) -> None:
            got.append(record)
            self.add(record, stage)

        ended = _run_child(_child_cmd(stage, group, self.args, self.end, known), self.end - start + GRACE_S,
                           on_record)
        with self.lock:
            found = next((r for r in got if r["type"] == "info"), None)
            if found:
                self.startup = max(self.startup, found["t"] - start)
                if not self.info:
                    self.info.update(found)
                    print(f"gpu_bench: {found.get('gpu', 'no GPU')}, torch {found['torch']}, CUDA "
                          f"{found['cuda']}; peak {found['peak_tflops']} TFLOPS "
                          f"({_peak_source(found, self.args)})", flush=True)
            for name in group:
                done = next((r for r in got if r["type"] == "done" and r["strategy"] == name), None)
                self.phases[(model, name)][stage.name].update(
                    ended="ok" if done and ended == "ok" else ended,
                    seconds=done["seconds"] if done else time.time() - start)
            self.save()

    def results(self, model: str) -> dict[str, dict[str, Any]]:
        out = {}
        for name in WANTED:
            mine = [r for r in self.mine(model, name) if r["type"] not in ("done", "info")]
            phases = self.phases.get((model, name), {})
            if mine or phases:
                out[name] = _strategy_result(name, mine, phases)
        return out

    def save(self) -> dict[str, Any]:
        args = self.args
        now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        model = _portable(_job(args))["model"]
        wide = _portable(_job(args))["wide_model"]
        results, wide_results = self.results(model), self.results(wide)
        info = self.info
        kernels = next((r for r in reversed(self.records) if r["type"] == "kernels"), None)
        report = {
            "version": BENCH_VERSION, "kind": BENCH_KIND, "date": now, "dry_run": args.dry_run,
            "hardware": {k: v for k, v in info.items()
                         if k not in ("type", "strategy", "t", "stage", "model")},
            "model": args.model, "num_parameters": info.get("num_parameters"), "dtype": args.dtype,
            "device": args.device, "device_mem_mb": args.device_mem_mb, "seq_lens": args.seq_lens,
            "steps": args.steps, "granularity": args.granularity, "max_seq": args.max_seq,
            "peak_tflops": info.get("peak_tflops"), "peak_source": _peak_source(info, args),
            "time_budget_s": args.time_budget_s, "used_s": time.time() - self.started, "plan_bar": PLAN_BAR,
            "records": str(self.records_path),
            "strategies": [results[n] for n in WANTED if n in results],
            "memo_vs_plan": _memo_vs_plan(results, args.seq_lens),
            "wide": {"model": args.wide_model, "seq_lens": args.wide_seq_lens,
                     "strategies": [wide_results[n] for n in WANTED if n in wide_results],
                     "memo_vs_plan": _memo_vs_plan(wide_results, args.wide_seq_lens)},
            "kernels": kernels, "attention_kernel_pinned": args.attention_kernel,
            "skipped": self.skipped + [line for res in (results, wide_results) for n in WANTED if n in res
                                       for line in res[n]["skipped"]],
        }
        self.out_md.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        self.out_md.write_text(format_markdown(report))
        return report


def _peak_source(info: dict[str, Any], args: argparse.Namespace) -> str | None:
    if args.dry_run and args.peak_tflops == DRY_RUN_PEAK_TFLOPS:
        return ("dry run: a nominal 1 TFLOPS, not a measured rate (a CPU has no entry in "
                "memo.utils.flops.GPU_PEAK_TFLOPS)")
    return info.get("peak_source")


# ---------------------------------------------------------------- tables


def _memo_vs_plan(results: dict[str, dict[str, Any]], lengths: list[int]) -> list[dict[str, Any]]:
    """memo's measured device peak against its plan's device["total_bytes"] and full recompute's peak."""
    out = []
    memo = {r["seq_len"]: r for r in results.get("memo", {}).get("rows", []) if r["status"] == "ok"}
    fr = {r["seq_len"]: r for r in results.get("full-recompute", {}).get("rows", []) if r["status"] == "ok"}
    for n in lengths:
        if n not in memo:
            continue
        row = memo[n]
        planned = (row.get("plan") or {}).get("total_bytes")
        peak = row["peak_device_bytes"]
        ratio = None if not planned or peak is None else peak / planned
        fr_peak = fr[n]["peak_device_bytes"] if n in fr else None
        out.append({"seq_len": n, "peak_bytes": peak, "plan_total_bytes": planned, "peak_over_plan": ratio,
                    "within_bar": None if ratio is None else abs(ratio - 1) <= PLAN_BAR,
                    "full_recompute_peak_bytes": fr_peak,
                    "peak_over_full_recompute": None if not fr_peak or peak is None else peak / fr_peak,
                    "alpha": row.get("alpha"), "host_bytes": row.get("host_bytes")})
    return out


def _k(n: int) -> str:
    if n % 2**20 == 0:
        return f"{n // 2**20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _mib(n: float | None) -> str:
    from memo.units import format_mib

    return "-" if n is None else format_mib(n)


def _table(header: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    rule = ["---" if i < right_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(r) + " |" for r in (header, rule, *rows)]


def _ratio(value: float | None, base: float | None, digits: int = 2) -> str:
    return "n/a" if value is None or not base else f"{value / base:.{digits}f}x"


def _header(report: dict[str, Any]) -> list[str]:
    hw = report["hardware"]
    gpu = hw.get("gpu") or f"no GPU ({report['device']})"
    title = f"### `make gpu-bench`{' --dry-run' if report['dry_run'] else ''} ({report['date'][:10]}, {gpu})"
    if hw.get("gpu"):
        gpu += f" ({hw['gpu_memory_gib']} GiB, capability {hw['capability']}, driver {hw.get('driver')})"
    params = report["num_parameters"]
    size = "?" if params is None else f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
    model = report["model"]
    if os.path.isabs(model) and model.startswith(str(ROOT) + os.sep):
        model = os.path.relpath(model, ROOT)
    budget = "the whole device" if report["device_mem_mb"] is None else f"{report['device_mem_mb']:g} MiB"
    return [title, "", f"Written by `benchmarks/gpu_bench.py` at {report['date']}. Hardware: {gpu}; torch "
            f"{hw.get('torch')}, CUDA {hw.get('cuda')}, Python {hw.get('python')}; host "
            f"{hw.get('host_memory_gib')} GiB, {hw.get('cpus')} CPUs. Model `{model}` ("
            f"{size} parameters), {report['dtype']}, "
            f"micro-batch 1, AdamW; device budget {budget}. Time budget {report['time_budget_s']:.0f} s, "
            f"used {report['used_s']:.0f} s.", ""]


def _longest_table(report: dict[str, Any], by_name: dict[str, Any]) -> list[str]:
    base = by_name.get("full-recompute", {}).get("search", {}).get("longest")
    rows = []
    for name in (n for n in WANTED if n in by_name):
        s = by_name[name]["search"]
        longest = f"{s['longest']:,}" + ("" if s["limited_by"] == "device memory" else " or more")
        rows.append([name, longest, "-" if s["first_failure"] is None else f"{s['first_failure']:,}",
                     s["limited_by"], _ratio(s["longest"], base),
                     str(sum(1 for t in s["tries"] if not t["budget_stop"])),
                     f"{by_name[name]['seconds']:.0f}"])
    return [f"Longest sequence that trains two steps (doubling from the first timed length, then bisection "
            f"to {_k(report['granularity'])} tokens, at most {_k(report['max_seq'])}; a length a timed row "
            "trained counts as fitting, one it ran out of memory at as not):", "",
            *_table(["strategy", "longest", "first OOM", "limited by", "vs full-recompute", "tries",
                     "seconds"], rows), ""]


def _step_table(report: dict[str, Any], by_name: dict[str, Any], lengths: list[int]) -> list[str]:
    rows = []
    for n in lengths:
        fr = next((r for r in by_name.get("full-recompute", {}).get("rows", [])
                   if r["seq_len"] == n and r["status"] == "ok"), None)
        for name in (m for m in WANTED if m in by_name):
            row = next((r for r in by_name[name]["rows"] if r["seq_len"] == n), None)
            if row is None or row["status"] != "ok":
                why = by_name[name]["row_skips"].get(str(n))
                rows_ended = next((p["ended"] for p in by_name[name].get("phases", {}).values()
                                   if p.get("phase") == "rows"), None)
                what = (_not_run(row) if row is not None
                        else "not run: " + why.split(" (")[0] if why and "out of memory" in why
                        else "not run (time budget)" if why or rows_ended == "not run"
                        else "not run (stopped)")
                rows.append([_k(n), name, what, *["-"] * 6])
                continue
            t, peak = row["mean_step_time_s"], row["peak_device_bytes"]
            rows.append([_k(n), name, f"{t * 1e3:,.0f} ms",
                         "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%", _mib(peak),
                         _mib(row["host_bytes"]), "-" if row.get("alpha") is None else f"{row['alpha']:.3f}",
                         _ratio(t, fr and fr["mean_step_time_s"]),
                         _ratio(peak, fr and fr["peak_device_bytes"])])
    return [f"Step time (mean of steps 2..{report['steps']}) and MFU = model FLOPs per step / step time / "
            "peak. FLOPs: `memo.utils.flops.flops_per_sample` (6·s·P + 6·n·h·s², the Memo paper's count; "
            f"recomputation not counted); peak {report['peak_tflops']} TFLOPS ({report['peak_source']}). "
            "Device peak: bytes of live tensors at the peak, parameters included (memo's allocator for memo, "
            "PyTorch's for the others); FR = full-recompute.", "",
            *_table(["seq", "strategy", "step time", "MFU", "device peak", "host bytes", "alpha", "time/FR",
                     "peak/FR"], rows, right_from=2), ""]


def _not_run(row: dict[str, Any]) -> str:
    """A row's table cell where it did not train: its status, and a predicted misfit's numbers."""
    if row["status"] != "does not fit":
        return row["status"]
    return (f"does not fit: needs {_mib(row['need_bytes'])} of {_mib(row['device_bytes'])} "
            "(estimated, not run)")


def _plan_table(report: dict[str, Any], memo_vs_plan: list[dict[str, Any]]) -> list[str]:
    rows = [[_k(m["seq_len"]), _mib(m["peak_bytes"]), _mib(m["plan_total_bytes"]),
             "n/a" if m["peak_over_plan"] is None else f"{m['peak_over_plan']:.3f}",
             {True: "yes", False: "**no**", None: "n/a"}[m["within_bar"]],
             _mib(m["full_recompute_peak_bytes"]),
             "n/a" if m["peak_over_full_recompute"] is None else f"{m['peak_over_full_recompute']:.2f}x"]
            for m in memo_vs_plan]
    return [f"memo's device peak against its plan (`plan.device[\"total_bytes\"]`; the bar: within "
            f"{100 * report['plan_bar']:.0f}%) and against full recompute's peak at the same length:", "",
            *_table(["seq", "memo peak", "plan total", "peak/plan", "within bar", "full-recompute peak",
                     "memo/FR"], rows)]


def _kernel_table(kernels: dict[str, Any] | None) -> list[str]:
    if not kernels:
        return []
    chosen = kernels["chosen"]
    n, n_kv, d = kernels["heads"]
    rows = [[r["kernel"] + (" (chosen)" if r["kernel"] == chosen["kernel"] else ""), _k(r["seq_len"]),
             f"{r['forward_s'] * 1e3:,.2f} ms", f"{r['forward_tflops']:,.1f}",
             f"{r['backward_s'] * 1e3:,.2f} ms", f"{r['backward_tflops']:,.1f}",
             "yes" if r["matches_reference"] else "**no**",
             f"{max(r['errors'].values()):.2e}"] for r in kernels["rows"]]
    return [f"Attention kernels ({kernels['dtype']}, {n} query heads, {n_kv} key/value heads, head dim {d}, "
            f"micro-batch 1; NOTE [Attention kernels in the bench]). Chosen: {chosen['kernel']} "
            f"({chosen['reason']}).", "",
            *_table(["kernel", "seq", "forward", "fwd TFLOPS", "backward", "bwd TFLOPS",
                     "matches fp32 reference", "max abs error"], rows), ""]


def format_markdown(report: dict[str, Any]) -> str:
    """The results as markdown to paste into benchmarks/RESULTS.md."""
    by_name = {s["strategy"]: s for s in report["strategies"]}
    lines = [*_header(report), *_step_table(report, by_name, report["seq_lens"]),
             *_plan_table(report, report["memo_vs_plan"]), "", *_longest_table(report, by_name)]
    wide = report["wide"]
    if wide["strategies"]:
        model = wide["model"]
        if os.path.isabs(model) and model.startswith(str(ROOT) + os.sep):
            model = os.path.relpath(model, ROOT)
        wide_by_name = {s["strategy"]: s for s in wide["strategies"]}
        lines += [f"The wide stage: `{model}`.", "", *_step_table(report, wide_by_name, wide["seq_lens"]),
                  *_plan_table(report, wide["memo_vs_plan"]), ""]
    lines += _kernel_table(report["kernels"])
    if report["skipped"]:
        lines += ["", "Skipped:", "", *[f"- {line}" for line in report["skipped"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
