#!/usr/bin/env python
"""The longest sequence each activation-memory strategy trains without running out of device memory.

For every strategy (none, full-recompute, full-offload, memo, the peers offloaded-checkpoint and
torchtune-offload, and PyTorch's save_on_cpu) one training step (forward, backward, AdamW step) is
tried at growing sequence lengths: doubling from ``--start`` until a step fails, then bisection
down to ``--granularity`` tokens. A length "fits" when the step finishes; it does not fit when an
allocation fails. The table gives each strategy's longest sequence, its device peak, host bytes
and step time there, and ratios to full recompute and to the best peer (NOTE [Best peer] in
benchmarks/strategies.py: here the peer with the longest sequence).

NOTE [Emulated device memory on CPU]
On CPU the device is memo's CPU allocator (NOTE [Measuring device memory] in
memo/train/meter.py), capped at ``--device-mem-mb``: the parameters are allocated before the
allocator context, memo's plan arena is reserved when it opens, and the fallback allocator
may reserve what is left (``memo.allocator.planned(..., fallback_limit=...)``). Every other
allocation of the step (activations, gradients, AdamW state, memo's rounding buffers) comes
from that remainder, and an allocation beyond it raises the allocator's out-of-memory error:
a failed allocation, not a formula. memo's host arena and save_on_cpu's host copies live
outside the device allocator, as they would in host memory next to a GPU.

On CUDA the device is the real one (or capped with ``--device-mem-mb``: PyTorch's allocator via
``torch.cuda.set_per_process_memory_fraction``, memo's via the same fallback limit). memo's
CUDA allocator must be installed before the first CUDA tensor and PyTorch's rows must not have
it, so every strategy's search runs in its own interpreter (on CPU too: one code path, and a
failed step cannot leave state behind for the next strategy).

NOTE [Profiling memo before each try]
memo's plan is made before each try, outside the capped context (profiling is one-time set-up
that a real job does once, and may do on another device). ``--memo-profile model`` (CPU
default) profiles the very model the step trains, as ``memo train`` does; its pass 1 runs the
plain model on the device. On a real GPU that pass needs as much memory as ``none`` and would
cap memo at none's length, so ``--memo-profile name`` (CUDA default) profiles by model name:
pass 1 on the meta device (NOTE [Sizes from meta] in memo/pipeline/__init__.py), pass 2 wrapped on
the device, and the step loads the plan file. Below DEFAULT_MAX_SEQ_LEN (4096) tokens the
by-name profile builds a smaller GPT position table than training does, so ``embed.bwd``
deviates from the plan (served by the fallback, counted, warned about once).

Usage::

    python benchmarks/max_seq_len.py                                 # CPU: gpt-mini, 96 MiB device
    python benchmarks/max_seq_len.py --device cuda --model gpt-1.3b --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import PEERS, ROWS, add_device_arguments, best_peer, build_strategy, resolve_device, run_main

from memo.cli.args import positive_float, seq_len
from memo.errors import DeviceBudgetError, MemoError
from memo.estimate import align
from memo.session import Session
from memo.train.strategies import MemoryMeter, Wrapping
from memo.units import format_mib

__all__ = ["CappedMeter", "Outcome", "main", "peer_result", "search", "try_length"]

BENCH_KIND = "memo.benchmark.max_seq_len"
BENCH_VERSION = 1
_RESULT_PREFIX = "SEARCH-JSON "


class DeviceMemoryFull(MemoError):
    """The device budget is used up before the step starts (parameters and plan arena)."""


class _CappedSession(Session):
    """A Session whose fallback pool is capped by the whole device budget (parameters included)."""

    def fallback_limit(self, table: Any) -> int | None:
        if self.device_budget_bytes is None:
            return None
        param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        arena = int(table.peak if hasattr(table, "peak") else table.get("peak", 0))
        limit = self.device_budget_bytes - param_bytes - arena
        if limit <= 0:
            raise DeviceMemoryFull(
                f"max_seq_len: the device budget {self.device_budget_bytes / 2**20:.1f} MiB is used up "
                f"before the step: parameters {param_bytes / 2**20:.1f} MiB + plan arena "
                f"{arena / 2**20:.1f} MiB"
            )
        # The fallback pool is process-wide and keeps the segments it cached before this context
        # (memo's profiling passes run through it); the limit is only checked when a new segment is
        # reserved, so cached segments would serve allocations beyond it. Hand them back first.
        # Gradients left by memo's profiling passes are live fallback blocks that pin whole segments;
        # the step starts with zero_grad(set_to_none=True) anyway, so dropping them changes nothing.
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        return limit


class CappedMeter(MemoryMeter):
    """A meter whose Session caps the fallback pool by the whole device budget, parameters included
    (NOTE [Emulated device memory on CPU]); ``device_budget_bytes`` None leaves it uncapped."""

    def make_session(self, model: torch.nn.Module, wrapping: Wrapping, device: torch.device,
                     example: tuple[torch.Tensor, torch.Tensor]) -> Session:
        from memo import allocator

        if self.device_budget_bytes is None or (device.type == "cuda" and not allocator.cuda_installed()):
            # Uncapped, or PyTorch's CUDA allocator (capped by the memory fraction in _setup_cuda).
            return super().make_session(model, wrapping, device, example)
        return _CappedSession(model, wrapping.plan, alpha=wrapping.alpha, policy=wrapping.policy,
                              planned_allocator=wrapping.planned_allocator, device=device,
                              device_budget_bytes=self.device_budget_bytes, example=example,
                              debug_copy_delay_us=wrapping.debug_copy_delay_us)

    def open(self, model: torch.nn.Module, wrapping: Wrapping, device: torch.device,
             example: tuple[torch.Tensor, torch.Tensor]) -> Session:
        from memo import allocator

        session = super().open(model, wrapping, device, example)
        if not isinstance(session, _CappedSession):
            return session
        use_plan = wrapping.plan is not None and wrapping.planned_allocator
        limit = session.fallback_limit({"peak": int(wrapping.plan.peak) if use_plan else 0})
        held = int(allocator.stats(device)["fallback"]["reserved_bytes"])
        if limit is not None and held > limit:
            raise MemoError(
                f"max_seq_len: memo's fallback pool still holds {held / 2**20:.1f} MiB of segments with live "
                f"blocks from before the step, more than its limit {limit / 2**20:.1f} MiB; the cap cannot "
                "be enforced"
            )
        return session


def _is_oom(err: BaseException | None) -> bool:
    """Whether a failed step ran out of device memory (anything else is a real error)."""
    # memo wraps some failed allocations in its own error (e.g. "could not allocate the rounding
    # buffers"), with the allocator's error as the cause: look down the chain.
    while err is not None:
        # DeviceBudgetError: memo's planner found no layer policy within the budget (before the step).
        if isinstance(err, (torch.OutOfMemoryError, DeviceMemoryFull, DeviceBudgetError)):
            return True
        text = str(err)
        # memo's CUDA backend throws from the pluggable allocator; torch re-raises it as RuntimeError.
        if isinstance(err, RuntimeError) and ("out of memory" in text.lower() or "memo allocator" in text):
            return True
        err = err.__cause__
    return False


def _memo_plan(args: argparse.Namespace, length: int, workdir: str) -> str:
    """Profile and plan memo for ``length`` tokens; returns the plan file (alpha solved, "auto")."""
    from memo.planner import save_plan

    from memo.pipeline import profile
    from memo.train import DTYPES

    result = profile(args.model, length, 1, DTYPES[args.dtype], torch.device(args.device).type,
                     recorder="allocator", time_limit=args.time_limit, device_mem_gb=_budget_gb(args))
    path = os.path.join(workdir, f"plan-{length}.json")
    save_plan(result.plan, path)
    return path


def _budget_gb(args: argparse.Namespace) -> float | None:
    """The budget in GB (10^9 bytes), as memo's planner takes it, or None."""
    return None if args.device_mem_mb is None else args.device_mem_mb * 2**20 / 1e9


class Outcome(tuple):
    """What :func:`try_length` returns: ``(fits, what happened)``, a plain pair to unpack, with the
    try's measurements as ``measured`` (``peak_device_bytes``, ``host_bytes``, ``step_time_s`` of the
    second step; empty when the step did not fit). A wrapper that answers with a plain pair
    (benchmarks/gpu_bench.py) leaves them unknown."""

    measured: dict[str, Any]

    def __new__(cls, fits: bool, detail: str, measured: dict[str, Any] | None = None) -> Outcome:
        outcome = super().__new__(cls, (fits, detail))
        outcome.measured = dict(measured or {})
        return outcome


def try_length(name: str, length: int, args: argparse.Namespace, workdir: str) -> Outcome:
    """Train two steps of ``name`` at ``length`` tokens under the budget; (fits, what happened), with
    the measurements of the second step (:class:`Outcome`)."""
    from memo import allocator
    from memo.train import TrainConfig, train

    meter = CappedMeter(None if args.device_mem_mb is None else int(args.device_mem_mb * 2**20))
    plan_s = 0.0
    if name == "memo" and args.memo_profile == "name":
        start = time.perf_counter()
        plan = _memo_plan(args, length, workdir)
        plan_s = time.perf_counter() - start
        strategy = build_strategy(name, meter, plan=plan, time_limit=args.time_limit)
    else:
        # The memo row's prepare() profiles and plans this model (alpha "auto", the layer policy for
        # the budget) before the capped meter opens.
        strategy = build_strategy(name, meter, time_limit=args.time_limit, device_mem_gb=_budget_gb(args))
    # Two steps: a length fits when training goes on, i.e. when the second step's activations fit
    # beside the optimizer states the first step created (memo plans for exactly that); with one
    # step a baseline would "fit" with the states never beside its activations.
    config = TrainConfig(model=args.model, seq_len=length, micro_batch=1, steps=2, device=args.device,
                         dtype=args.dtype, seed=0)
    start = time.perf_counter()
    measured: dict[str, Any] = {}
    try:
        result = train(config, progress=False, log=lambda _line: None, strategy=strategy)  # closes it
        last = result.steps[-1]
        peak = last.peak_memory_bytes
        measured = {"peak_device_bytes": peak, "host_bytes": int(last.extras.get("host_pinned_bytes", 0)),
                    "step_time_s": last.step_time_s}
        outcome = (True, f"fits, peak {peak / 2**20:.1f} MiB" if peak is not None else "fits")
    except Exception as err:  # classified just below: only out-of-memory means "does not fit"
        if not _is_oom(err):
            raise
        outcome = (False, "out of memory: " + str(err).strip().splitlines()[0][:300])
    gc.collect()
    device_type = torch.device(args.device).type
    if device_type == "cuda" and not allocator.cuda_installed():
        torch.cuda.empty_cache()
    else:
        allocator.empty_cache(device_type)
    seconds = time.perf_counter() - start
    extra = f" (plan {plan_s:.1f} s)" if plan_s else ""
    return Outcome(outcome[0], f"{outcome[1]} [{seconds:.1f} s{extra}]", measured)


def search(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Doubling from ``args.start`` then bisection to ``args.granularity`` tokens, up to ``args.max_seq``."""
    tries: list[dict[str, Any]] = []
    g = args.granularity

    def fits(length: int) -> bool:
        outcome = try_length(name, length, args, workdir)  # looked up here: gpu_bench.py replaces it
        ok, what = outcome
        tries.append({"seq_len": length, "fits": ok, "detail": what, **getattr(outcome, "measured", {})})
        print(f"  {name} @ {length:,}: {what}", file=sys.stderr, flush=True)
        return ok

    with tempfile.TemporaryDirectory(prefix="memo-maxseq-") as workdir:
        lo, hi = 0, None  # lo: longest length that fit; hi: shortest that failed
        length = args.start
        while length <= args.max_seq:
            if not fits(length):
                hi = length
                break
            lo = length
            length *= 2
        if hi is None and lo < args.max_seq and fits(args.max_seq):
            lo = args.max_seq
        elif hi is None and lo < args.max_seq:
            hi = args.max_seq
        while hi is not None and hi - lo > g:
            mid = (lo + hi) // 2 // g * g
            if mid <= lo:
                break
            if fits(mid):
                lo = mid
            else:
                hi = mid
    at_longest = next((t for t in tries if t["seq_len"] == lo and t["fits"]), {})
    return {"strategy": name, "longest": lo, "first_failure": hi, "capped_by_max_seq": hi is None,
            "at_longest": {k: at_longest.get(k) for k in ("peak_device_bytes", "host_bytes", "step_time_s")},
            "tries": tries}


# ---------------------------------------------------------------- parent


def _child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one strategy's search in a fresh interpreter (see the module docstring for why)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--model", args.model,
           "--device", args.device, "--dtype", args.dtype, "--start", str(args.start),
           "--granularity", str(args.granularity), "--max-seq", str(args.max_seq),
           "--time-limit", str(args.time_limit), "--memo-profile", args.memo_profile,
           "--threads", str(args.threads)]
    if args.device_mem_mb is not None:
        cmd += ["--device-mem-mb", str(args.device_mem_mb)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr: tries, live
    found = [line[len(_RESULT_PREFIX):] for line in done.stdout.splitlines()
             if line.startswith(_RESULT_PREFIX)]
    if done.returncode != 0 or not found:
        raise MemoError(f"max_seq_len: the search for {name!r} failed (exit {done.returncode}); "
                        "its error is printed above")
    return json.loads(found[-1])


def peer_result(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best peer (NOTE [Best peer] in benchmarks/strategies.py): the peer that trains the longest
    sequence (then the smaller device peak there)."""
    def rank(r: dict[str, Any]) -> tuple[int, float]:
        peak = (r.get("at_longest") or {}).get("peak_device_bytes")
        return -r["longest"], float("inf") if peak is None else peak
    return best_peer(results, rank)


def _ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}x"


def format_table(results: list[dict[str, Any]], max_seq: int) -> str:
    """Longest sequence, and the device peak, host bytes and step time (the second step) at it; ratios
    of the longest sequence to full recompute (FR) and to the best peer (BP)."""
    base = next((r for r in results if r["strategy"] == "full-recompute"), None)
    peer = peer_result(results)
    header = ("strategy", "longest seq", "first failure", "vs FR", "vs BP", "device peak", "host bytes",
              "step time", "tries")
    rows = [header]
    for r in results:
        longest = f"{r['longest']:,}" + (" (= --max-seq)" if r["capped_by_max_seq"] else "")
        failure = "-" if r["first_failure"] is None else f"{r['first_failure']:,}"
        at = r.get("at_longest") or {}
        peak, host, step = at.get("peak_device_bytes"), at.get("host_bytes"), at.get("step_time_s")
        rows.append((r["strategy"], longest, failure, _ratio(r["longest"], base and base["longest"]),
                     _ratio(r["longest"], peer and peer["longest"]),
                     "-" if peak is None else format_mib(peak), "-" if host is None else format_mib(host),
                     "-" if step is None else f"{step * 1e3:,.0f} ms", str(len(r["tries"]))))
    return align(rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arguments(p)
    p.add_argument("--device-mem-mb", type=positive_float, default=None,
                   help="device memory budget in MiB (CPU: the emulated device, default 96; CUDA: default "
                   "the whole device)")
    p.add_argument("--start", type=seq_len, default=None,
                   help="first length tried (default: --granularity)")
    p.add_argument("--granularity", type=seq_len, default=None,
                   help="bisection stops when the bracket is this many tokens (default: 256 CPU, 4K CUDA)")
    p.add_argument("--max-seq", type=seq_len, default=None,
                   help="longest length tried (default: 8K on CPU, 1M on CUDA)")
    p.add_argument("--time-limit", type=positive_float, default=None,
                   help="seconds per MIP solve of memo's planner (default: 2 on CPU, 20 on CUDA)")
    p.add_argument("--memo-profile", choices=("model", "name"), default=None,
                   help="how memo is profiled before each try (NOTE [Profiling memo before each try]; "
                   "default: model on CPU, name on CUDA)")
    p.add_argument("--only", nargs="+", choices=ROWS, help="search only these strategies (default: all)")
    p.add_argument("--jobs", type=int, default=1,
                   help="CPU: strategies searched at once, each in its own interpreter with --threads "
                   "threads (default 1); each emulates its own device, so what fits does not change")
    p.add_argument("--json", metavar="OUT.json", help="write every search (all tries) as JSON")
    p.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)  # one search, in a fresh interpreter
    return p


def _defaults(args: argparse.Namespace) -> None:
    cuda = resolve_device(args, "max_seq_len")
    if not cuda and args.device_mem_mb is None:
        args.device_mem_mb = 96.0
    args.granularity = args.granularity or (4096 if cuda else 256)
    args.start = args.start or args.granularity
    args.max_seq = args.max_seq or ((1 << 20) if cuda else 8192)
    args.time_limit = args.time_limit or (20.0 if cuda else 2.0)
    args.memo_profile = args.memo_profile or ("name" if cuda else "model")
    if args.jobs < 1 or (cuda and args.jobs != 1):
        raise MemoError(f"max_seq_len: --jobs must be 1 on CUDA (one device) and at least 1 on CPU, got "
                        f"{args.jobs}")
    if args.start > args.max_seq:
        raise MemoError(f"max_seq_len: --start {args.start:,} is longer than --max-seq {args.max_seq:,}")


def _setup_cuda(name: str, args: argparse.Namespace) -> None:
    """Choose the CUDA allocator of this interpreter before its first CUDA tensor."""
    from memo import allocator

    if name == "memo":
        allocator.install_cuda()
    elif args.device_mem_mb is not None:
        device = torch.device(args.device)
        if device.index is None:  # "cuda" is the current device; the memory fraction wants an index
            device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = args.device_mem_mb * 2**20 / total
        if fraction > 1:
            raise MemoError(f"max_seq_len: --device-mem-mb {args.device_mem_mb:g} is more than the device's "
                            f"{total / 2**20:,.0f} MiB")
        torch.cuda.set_per_process_memory_fraction(fraction, device)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _defaults(args)
    if args.child is not None:
        if torch.device(args.device).type == "cuda":
            _setup_cuda(args.child, args)
        print(_RESULT_PREFIX + json.dumps(search(args.child, args)), flush=True)
        return 0
    budget = "the whole device" if args.device_mem_mb is None else f"{args.device_mem_mb:g} MiB"
    print(f"max_seq_len: {args.model}, {args.dtype} on {args.device}, device memory {budget}; two steps "
          f"(fwd+bwd+AdamW) per try; doubling from {args.start:,}, bisection to {args.granularity:,} tokens, "
          f"at most {args.max_seq:,}", flush=True)
    def run(name: str) -> dict[str, Any]:
        start = time.perf_counter()
        result = _child(name, args)
        result["wall_s"] = time.perf_counter() - start
        print(f"  {name}: longest {result['longest']:,} ({len(result['tries'])} tries, "
              f"{result['wall_s']:.0f} s)", flush=True)
        return result

    names = [name for name in ROWS if args.only is None or name in args.only]
    # --jobs: searches in parallel interpreters (CPU only, see _defaults); the table keeps ROWS' order.
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run, names))
    peer = peer_result(results)
    print(f"\n{args.model}, device memory {budget}: longest sequence that trains two steps; device peak, "
          "host bytes and step time (step 2) at that length; ratios to full-recompute (FR) and to the best "
          f"peer (BP: {peer['strategy'] if peer else 'none run'}, the longest of {', '.join(PEERS)})\n")
    print(format_table(results, args.max_seq))
    if args.json:
        out = {"version": BENCH_VERSION, "kind": BENCH_KIND, "model": args.model, "device": args.device,
               "dtype": args.dtype, "device_mem_mb": args.device_mem_mb, "granularity": args.granularity,
               "max_seq": args.max_seq, "best_peer": peer and peer["strategy"], "results": results}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"json written to {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main)
