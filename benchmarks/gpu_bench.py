#!/usr/bin/env python
"""memo against the methods a user would pick instead, on one GPU, in one command within a time budget.

``make gpu-bench`` (issue 27) runs this on a lent GPU (an H100 80GB or an H200) for a 1B-class
Llama (``llama-3.2-1b``, memo/models/config.py) in bf16, and writes one markdown file to paste into
benchmarks/RESULTS.md (``--out``) and a JSON file with every raw number beside it:

1. the longest sequence each strategy trains (two steps of forward, backward and AdamW), searched
   by benchmarks/max_seq_len.py's :func:`search` (doubling, then bisection to ``--granularity``);
2. the step time and MFU of each strategy at 32K, 64K and 128K tokens (``--seq-lens``);
3. memo's device peak against its plan's ``device["total_bytes"]`` (the bar: within 3%) and
   against full recompute's peak at the same length.

Strategies: none, full-recompute, offloaded-checkpoint, torchtune-offload and memo; one that
:data:`memo.train.STRATEGIES` does not list is skipped with a line saying so.

NOTE [One interpreter per strategy]
On CUDA memo's allocator must be installed before the first CUDA tensor and the baselines must
not have it (benchmarks/max_seq_len.py: NOTE [Emulated device memory on CPU]), so each strategy
runs in an interpreter of its own (``--child``), set up by max_seq_len's own ``_setup_cuda``, one
for its timed rows and one for its search. A timed row is a :func:`memo.train.train` of
``--steps`` steps (step 1 is warm-up and not timed; memo profiles and plans the very model, as
``memo train`` does) measured by max_seq_len's :class:`CappedMeter`, so that a row and a try of the
search are held to the same device budget. The search is max_seq_len's :func:`search` with its
``try_length`` replaced in the child's module: a length a row trained fits and one a row ran out of
memory at does not, without asking the device again; any other length is max_seq_len's own try
(two steps), unless the time budget says no. Children print one JSON record per row and per try
as they go (``GPU-BENCH-JSON``), so one stopped at its time limit keeps what it measured.
benchmarks/strategies.py's ``run_row`` is not used for the rows: it builds its own unbudgeted
:class:`MemoryMeter` and does not return the strategy, whose plan (``device["total_bytes"]``) the
third table needs. On the CPU, ``--jobs`` children run at once and share their interpreter among
several strategies (each emulates its own device, as benchmarks/strategies.py's CPU rows do).

NOTE [Time budget]
The budget (``--time-budget-s``, default 1100 s) counts from ``--started-at`` (the Makefile passes
the moment ``make gpu-bench`` began, so the build is inside it) or from this script's start. The
timed rows of every strategy run first, within ROWS_FRACTION (75%) of what is left; then the
searches, within all that is left. In each phase a strategy's child gets a share of what is left
when its turn comes (WEIGHTS: memo's rows 2.5, since it profiles and plans at each length; none
0.5; the others 1; time a child leaves unused goes to those after it); a child still running
GRACE_S (20 s) after its share is stopped, and never after the budget. Inside a child every row
and every try is predicted before it starts, from the same strategy's measurement at the longest
length not above it (else the shortest above): its set-up (what is not a step: model build,
memo's profile) scaled by the length, its steps by model FLOPs
(:func:`memo.utils.flops.flops_per_sample`). What is predicted not to end EXIT_S (10 s) before
the share does is not run and is printed as skipped, with the seconds it needed and had; a search
cut short that way reports its longest length as a lower bound ("time budget"). Strategies run
in the order none, full-recompute, memo, offloaded-checkpoint, torchtune-offload.

``--dry-run`` runs the very same code (children, rows, searches, budget, both output files) on
the CPU with a 4-layer Llama (benchmarks/configs/llama-dry-run.json), 128 to 512 tokens and
memo's CPU allocator emulating a 10 MiB device, in float32 (a CPU's bf16 is many times slower),
two children at once, in about half a minute to a minute; a GPU session then measures instead of
debugging.

Usage::

    make gpu-bench WHEELS=/path/to/wheels            # installs, builds with MEMO_BUILD_CUDA=1, runs this
    python benchmarks/gpu_bench.py --dry-run         # CPU: the same code path, tiny
    python benchmarks/gpu_bench.py --time-budget-s 600 --seq-lens 32K 64K --max-seq 256K
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
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
#: The fraction of the time left that the timed rows of all strategies may use; the searches get the
#: rest, and what the rows leave unused.
ROWS_FRACTION = 0.75
_RECORD = "GPU-BENCH-JSON "
DRY_RUN_MODEL = str(ROOT / "benchmarks" / "configs" / "llama-dry-run.json")
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

    def __init__(self, deadline: float, model: str) -> None:
        self.deadline = deadline
        self.model = model
        self.points: list[Point] = []

    def left(self) -> float:
        return self.deadline - time.time()

    def refuse(self, length: int, steps: int) -> str | None:
        """Why a run of ``steps`` steps at ``length`` tokens must not start, or None."""
        left = self.left()
        need = predict_seconds(self.points, length, steps, self.model)
        if left <= 0:
            return "this strategy's share of the time budget is spent"
        if need is not None and need > left:
            return (f"needs ~{need:.0f} s (predicted), {left:.0f} s of this strategy's share of the time "
                    "budget left")
        return None


# ---------------------------------------------------------------- child: one strategy


def _emit(record: dict[str, Any]) -> None:
    print(_RECORD + json.dumps(record), flush=True)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _row(name: str, length: int, msl: argparse.Namespace, steps: int,
         peak_tflops: float | None) -> dict[str, Any]:
    """Train ``steps`` steps of ``name`` at ``length`` tokens under max_seq_len's budget and meter;
    MFU = :func:`memo.utils.flops.flops_per_sample` / mean step time / ``peak_tflops``."""
    import max_seq_len
    import torch
    from _common import build_strategy

    from memo import allocator
    from memo.train import TrainConfig, summarize, train
    from memo.utils.flops import flops_per_sample, mfu

    meter = max_seq_len.CappedMeter(None if msl.device_mem_mb is None else int(msl.device_mem_mb * 2**20))
    # memo profiles this very model, as `memo train` does (alpha "auto", the layer policy for the budget).
    strategy = build_strategy(name, meter, time_limit=msl.time_limit,
                              device_mem_gb=max_seq_len._budget_gb(msl))
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


def _child(args: argparse.Namespace) -> int:
    """The strategies of ``--child`` one after the other (on CUDA exactly one: NOTE [One interpreter per
    strategy]; a CPU run with --jobs shares an interpreter between strategies, as
    benchmarks/strategies.py does on the CPU)."""
    import max_seq_len
    import torch

    argv = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--granularity",
            str(args.granularity), "--start", str(args.start), "--max-seq", str(args.max_seq), "--time-limit",
            str(args.time_limit), "--threads", str(args.threads)]
    if args.device_mem_mb is not None:
        argv += ["--device-mem-mb", str(args.device_mem_mb)]
    msl = max_seq_len._parser().parse_args(argv)
    max_seq_len._defaults(msl)  # max_seq_len's own defaults: memo profiled by name on CUDA, ...
    if torch.device(msl.device).type == "cuda":
        if len(args.child) != 1:
            sys.exit("error: gpu_bench: on CUDA a child measures one strategy (NOTE [One interpreter per "
                     "strategy])")
        max_seq_len._setup_cuda(args.child[0], msl)
    info = _info(args.model, args.peak_tflops)
    _emit({**info, "strategy": None, "t": time.time()})
    status = 0
    for name in args.child:
        start = time.time()
        status = _strategy(name, args, msl, info["peak_tflops"]) or status
        _emit({"type": "done", "strategy": name, "seconds": time.time() - start})
    return status


def _strategy(name: str, args: argparse.Namespace, msl: argparse.Namespace, peak_tflops: float | None) -> int:
    """One strategy's phase: the timed rows, or the longest-sequence search (NOTE [One interpreter per
    strategy])."""
    budget = _Budget(args.deadline - EXIT_S, args.model)
    rows: list[dict[str, Any]] = []
    if args.phase in ("rows", "both"):
        status = _rows(name, args, msl, peak_tflops, budget, rows)
        if args.phase == "rows" or status:
            return status
    # What the rows found: from the parent (--known), or from this child's own rows ("both", the CPU
    # with --jobs), through the same JSON.
    found = json.loads(args.known or "{}").get(name, {}) if args.phase == "search" else \
        json.loads(json.dumps(_known(rows)))
    budget.points.clear()
    known: dict[int, tuple[bool, str]] = {}
    for key, row in found.items():
        known[int(key)] = (row["fits"], row["detail"])
        if row["fits"]:
            budget.points.append(Point(int(key), row["setup_s"], row["step_s"], row["steps"]))
    return _search(name, msl, budget, known)


def _rows(name: str, args: argparse.Namespace, msl: argparse.Namespace, peak_tflops: float | None,
          budget: _Budget, rows: list[dict[str, Any]]) -> int:
    """The timed rows, shortest first; a length longer than one that ran out of memory is not run."""
    oom: int | None = None
    for length in args.seq_lens:
        why = f"{oom:,} tokens ran out of memory" if oom is not None else budget.refuse(length, args.steps)
        if why is not None:
            _emit({"type": "skip", "strategy": name, "what": f"timed row at {length:,}", "seq_len": length,
                   "why": why})
            _say(f"  {name} @ {length:,}: skipped: {why}")
            continue
        row = _row(name, length, msl, args.steps, peak_tflops)
        if row["status"] == "ok":
            step = row["mean_step_time_s"]
            row["setup_s"] = row["wall_s"] - args.steps * step
            budget.points.append(Point(length, row["setup_s"], step, args.steps))
            _say(f"  {name} @ {length:,}: {step * 1e3:,.0f} ms/step, peak "
                 f"{row['peak_device_bytes'] / 2**20:,.1f} MiB [{row['wall_s']:.1f} s]")
        elif row["status"] == "out of memory":
            oom = length
            _say(f"  {name} @ {length:,}: out of memory [{row['wall_s']:.1f} s]")
        else:
            _say(f"  {name} @ {length:,}: error: {row['detail']}")
        _emit(row)
        rows.append(row)
        if row["status"] == "error":
            return 1
    return 0


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
    # rows and the budget (NOTE [One interpreter per strategy]).
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


def _run_child(cmd: list[str], timeout: float) -> tuple[list[dict[str, Any]], str]:
    """Run a child (its stderr passes through, live); its records, and how it ended."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1.0))
        ended = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        # The child and what it started (a MIP solver) are one process group.
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        ended = f"stopped after {timeout:.0f} s (its share of the time budget)"
    return _records(out or ""), ended


def _child_cmd(names: list[str], args: argparse.Namespace, deadline: float, phase: str,
               known: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *names, "--phase", phase,
           "--known", json.dumps(known), "--model", args.model,
           "--device", args.device, "--dtype", args.dtype, "--seq-lens", *map(str, args.seq_lens),
           "--steps", str(args.steps), "--granularity", str(args.granularity), "--start", str(args.start),
           "--max-seq", str(args.max_seq), "--time-limit", str(args.time_limit),
           "--threads", str(args.threads), "--deadline", repr(deadline)]
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
    skips = [r for r in records if r["type"] == "skip"]
    ended = next((p["ended"] for p in phases.values() if p["ended"] != "ok"), "ok")
    return {"strategy": name, "ended": ended, "phases": phases,
            "seconds": sum(p["seconds"] for p in phases.values()),
            "rows": [r for r in records if r["type"] == "row"],
            "search": _search_summary(records, name, (phases.get("search") or phases.get("both") or {}).get(
                "ended", "not run")),
            "row_skips": {str(r["seq_len"]): r["why"] for r in skips if "seq_len" in r},
            "skipped": [f"{r['strategy']}: {r['what']}: {r['why']}" for r in skips]}


def _known(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the timed rows found, for the search: a length that trained fits, one that ran out of
    memory does not; the rows that trained also time the search's tries (NOTE [Time budget])."""
    known = {}
    for r in records:
        if r["type"] == "row" and r["status"] == "ok":
            peak = r["peak_device_bytes"] / 2**20
            known[str(r["seq_len"])] = {
                "fits": True, "setup_s": r["setup_s"], "step_s": r["mean_step_time_s"], "steps": r["steps"],
                "detail": f"fits (the timed row: {r['steps']} steps, peak {peak:,.1f} MiB)"}
        elif r["type"] == "row" and r["status"] == "out of memory":
            known[str(r["seq_len"])] = {"fits": False,
                                        "detail": "out of memory (the timed row): " + r["detail"]}
    return known


def _groups(todo: list[str], jobs: int) -> list[list[str]]:
    """The strategies of each child: one each with --jobs 1 (always on a GPU); on the CPU, --jobs
    children, the strategies dealt out by weight (memo's profiles make it the heaviest)."""
    if jobs == 1:
        return [[n] for n in todo]
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
        args.seq_lens = args.seq_lens or [128, 256, 512]
        args.device_mem_mb = args.device_mem_mb if args.device_mem_mb is not None else 10.0
        args.granularity = args.granularity or 128
        args.max_seq = args.max_seq or 1024
        args.time_limit = args.time_limit or 0.5
        args.steps = args.steps or 2
        args.peak_tflops = args.peak_tflops or DRY_RUN_PEAK_TFLOPS
        args.time_budget_s = args.time_budget_s or 240.0
        args.jobs = args.jobs or 2
    args.device = args.device or "cuda"
    args.dtype = args.dtype or "bfloat16"
    args.model = args.model or "llama-3.2-1b"
    if args.model.endswith(".json"):  # the children run in the repository's root
        args.model = os.path.abspath(args.model)
    args.seq_lens = sorted(set(args.seq_lens or [32768, 65536, 131072]))
    args.granularity = args.granularity or 8192
    args.start = args.start or args.seq_lens[0]
    args.max_seq = args.max_seq or (1 << 20)
    args.time_limit = args.time_limit or 5.0
    args.steps = args.steps or 3
    args.time_budget_s = args.time_budget_s or 1100.0
    args.jobs = args.jobs or 1
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
                   help="lengths of the timed rows (default: 32K 64K 128K)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps per timed row; step 1 is warm-up (default 3: two timed steps)")
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
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads per child (1)")
    p.add_argument("--jobs", type=int, default=None,
                   help="CPU only: children at once, the strategies dealt out among them (default 1; dry run "
                   "2); each emulates its own device, so what fits does not change, only the timings")
    p.add_argument("--out", default=None,
                   help="markdown results (default benchmarks/results/gpu_bench.md; dry run "
                   "build/gpu_bench-dry-run.md); the JSON is written beside it (.json)")
    p.add_argument("--child", nargs="+", choices=WANTED, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("rows", "search", "both"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--known", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    if "--preflight" in (sys.argv[1:] if argv is None else argv):
        return preflight()  # before memo is importable: make gpu-bench runs it before the build
    args = _parser().parse_args(argv)
    started = args.started_at if args.started_at is not None else time.time()
    _defaults(args)
    if args.child is not None:
        return _child(args)
    if args.device.startswith("cuda") and (status := preflight()):
        return status

    from memo.train import STRATEGIES  # imports no torch: the parent never touches the device

    end = started + args.time_budget_s
    out_md = Path(args.out) if args.out else (ROOT / "build" / "gpu_bench-dry-run.md" if args.dry_run
                                               else ROOT / "benchmarks" / "results" / "gpu_bench.md")
    out_json = out_md.with_suffix(".json")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    print(f"gpu_bench: {args.model}, {args.dtype} on {args.device}{' (dry run)' if args.dry_run else ''}; "
          f"timed rows at {', '.join(f'{n:,}' for n in args.seq_lens)} tokens; time budget "
          f"{args.time_budget_s:.0f} s, {end - time.time():.0f} s left", flush=True)

    wanted = [n for n in RUN_ORDER if args.only is None or n in args.only]
    results: dict[str, dict[str, Any]] = {}
    info: dict[str, Any] = {}
    skipped: list[str] = []
    for name in wanted:
        if name not in STRATEGIES:
            skipped.append(f"{name}: not measured: memo.train.STRATEGIES does not list it "
                           f"({', '.join(STRATEGIES)})")
            print(f"gpu_bench: skipped {skipped[-1]}", flush=True)
    todo = [n for n in wanted if n in STRATEGIES]

    def save() -> dict[str, Any]:
        now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        report = {
            "version": BENCH_VERSION, "kind": BENCH_KIND, "date": now, "dry_run": args.dry_run,
            "hardware": {k: v for k, v in info.items() if k not in ("type", "strategy", "t")},
            "model": args.model, "num_parameters": info.get("num_parameters"), "dtype": args.dtype,
            "device": args.device, "device_mem_mb": args.device_mem_mb, "seq_lens": args.seq_lens,
            "steps": args.steps, "granularity": args.granularity, "max_seq": args.max_seq,
            "peak_tflops": info.get("peak_tflops"), "peak_source": _peak_source(info, args),
            "time_budget_s": args.time_budget_s, "used_s": time.time() - started, "plan_bar": PLAN_BAR,
            "strategies": [results[n] for n in WANTED if n in results],
            "memo_vs_plan": _memo_vs_plan(results, args.seq_lens),
            "skipped": skipped + [line for n in WANTED if n in results for line in results[n]["skipped"]],
        }
        out_json.write_text(json.dumps(report, indent=2) + "\n")
        out_md.write_text(format_markdown(report))
        return report

    lock = threading.Lock()
    startup = [STARTUP_S]
    records: dict[str, list[dict[str, Any]]] = {n: [] for n in todo}
    phases: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in todo}

    def measure(phase: str, phase_end: float, group: list[str], waiting: list[str]) -> None:
        with lock:
            left = phase_end - time.time()
            # One child at a time: its strategy's weighted share of what is left (NOTE [Time budget]);
            # several children at once (CPU only): each may use what is left.
            # Each child's share starts with the seconds a child takes to start (imports, CUDA), the
            # longest seen so far.
            unstarted = [n for n in waiting if not phases[n].get(phase)]
            weight = WEIGHTS.get(phase, WEIGHTS["rows"])
            work = left - startup[0] * len(unstarted)
            mine = weight.get(group[0], 1.0) / sum(weight.get(n, 1.0) for n in unstarted)
            share = startup[0] + work * mine if args.jobs == 1 else left
            for name in group:
                phases[name][phase] = {"share_s": share, "ended": "not run", "seconds": 0.0}
            if share < startup[0] + 5:
                for name in group:
                    what = "timed rows" if phase == "rows" else "longest-sequence search"
                    skipped.append(f"{name}: {what} not run: {max(left, 0):.0f} s of the time budget left")
                    print(f"gpu_bench: skipped {skipped[-1]}", flush=True)
                return
            print(f"\n== {', '.join(group)}: {phase}, share {share:.0f} s of the {left:.0f} s left",
                  flush=True)
            known = {n: _known(records[n]) for n in group}
        start = time.time()
        got, ended = _run_child(_child_cmd(group, args, start + share, phase, known),
                                min(share + GRACE_S, end - start))
        with lock:
            found = next((r for r in got if r["type"] == "info"), None)
            if found:
                startup[0] = max(startup[0], found["t"] - start)
            if not info and found:
                info.update(found)
                print(f"gpu_bench: {info.get('gpu', 'no GPU')}, torch {info['torch']}, CUDA {info['cuda']}; "
                      f"peak {info['peak_tflops']} TFLOPS ({_peak_source(info, args)})", flush=True)
            for name in group:
                mine = [r for r in got if r.get("strategy") == name]
                done = next((r for r in mine if r["type"] == "done"), None)
                phases[name][phase].update(ended="ok" if done and ended == "ok" else ended,
                                           seconds=done["seconds"] if done else time.time() - start)
                records[name] += [r for r in mine if r["type"] != "done"]
                results[name] = _strategy_result(name, records[name], phases[name])
                if phase != "rows":
                    s = results[name]["search"]
                    print(f"== {name}: longest {s['longest']:,} (limited by {s['limited_by']}); "
                          f"{results[name]['seconds']:.0f} s in all", flush=True)
            save()

    # The timed rows of every strategy first, then the searches (NOTE [Time budget]): one child at a
    # time on a GPU, each strategy alone on the device. On the CPU with --jobs, children at once, each
    # the rows and then the search of its strategies (the same functions, in one interpreter).
    rows_end = time.time() + ROWS_FRACTION * (end - time.time())
    plan = [("rows", rows_end), ("search", end)] if args.jobs == 1 else [("both", end)]
    for phase, phase_end in plan:
        groups = _groups(todo, args.jobs)
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(lambda g, p=phase, e=phase_end: measure(p, e, g, todo), groups))
    report = save()
    print("\n" + out_md.read_text())
    print(f"results written to {out_md} and {out_json}")
    # A child stopped at the end of its share is the budget at work; one that failed is an error.
    return 1 if any(r["ended"].startswith("exit") for r in report["strategies"]) else 0


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


def _step_table(report: dict[str, Any], by_name: dict[str, Any]) -> list[str]:
    rows = []
    for n in report["seq_lens"]:
        fr = next((r for r in by_name.get("full-recompute", {}).get("rows", [])
                   if r["seq_len"] == n and r["status"] == "ok"), None)
        for name in (m for m in WANTED if m in by_name):
            row = next((r for r in by_name[name]["rows"] if r["seq_len"] == n), None)
            if row is None or row["status"] != "ok":
                why = by_name[name]["row_skips"].get(str(n))
                rows_ended = by_name[name].get("phases", {}).get("rows", {}).get("ended")
                what = (row["status"] if row is not None
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


def _plan_table(report: dict[str, Any]) -> list[str]:
    rows = [[_k(m["seq_len"]), _mib(m["peak_bytes"]), _mib(m["plan_total_bytes"]),
             "n/a" if m["peak_over_plan"] is None else f"{m['peak_over_plan']:.3f}",
             {True: "yes", False: "**no**", None: "n/a"}[m["within_bar"]],
             _mib(m["full_recompute_peak_bytes"]),
             "n/a" if m["peak_over_full_recompute"] is None else f"{m['peak_over_full_recompute']:.2f}x"]
            for m in report["memo_vs_plan"]]
    return [f"memo's device peak against its plan (`plan.device[\"total_bytes\"]`; the bar: within "
            f"{100 * report['plan_bar']:.0f}%) and against full recompute's peak at the same length:", "",
            *_table(["seq", "memo peak", "plan total", "peak/plan", "within bar", "full-recompute peak",
                     "memo/FR"], rows)]


def format_markdown(report: dict[str, Any]) -> str:
    """The results as markdown to paste into benchmarks/RESULTS.md."""
    by_name = {s["strategy"]: s for s in report["strategies"]}
    lines = [*_header(report), *_longest_table(report, by_name), *_step_table(report, by_name),
             *_plan_table(report)]
    if report["skipped"]:
        lines += ["", "Skipped:", "", *[f"- {line}" for line in report["skipped"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
