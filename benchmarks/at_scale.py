#!/usr/bin/env python
"""Per-rank device memory of none, full recompute and memo at scale, and the longest sequence each fits.

For every sequence length, one rank (tensor parallel t, context parallel c) is profiled on the meta
device (``memo.pipeline.profile(..., device="meta")``: no GPU and no memory; NOTE [Sizes from meta]
in memo/pipeline/__init__.py) three times:

- **none**: every layer keeps its activations (the fixed layer policy all ``"keep"``);
- **full recompute**: every layer recomputes in backward (all ``"recompute"``);
- **memo**: the planner's own choice of memo / recompute / keep per layer and alpha, within the
  device budget (``--device-mem-gb``), the host memory and the link (NOTE [Layer policy]).

Each row is the plan's per-rank device total (``plan.device["total_bytes"]``: the recorded
iteration's peak plus parameters, gradients and optimizer states, NOTE [Device total]), which is
what ``memo show`` prints as ``device/rank``. Then, for each strategy, the longest sequence whose
total fits the budget: doubling from ``--search-start`` (halving when it does not fit), then
bisection to ``--granularity`` tokens. A fixed policy fits when its recorded total is within the
budget less the share every plan leaves free for allocator fragmentation (NOTE [Fallback
headroom] in memo/pipeline/device.py); memo fits when the planner finds a policy (it raises
DeviceBudgetError otherwise) and the recorded total is within the same.

NOTE [At-scale layer time]
The layer time matters to memo only (alpha's bandwidth constraint and the policy's speed).
``--layer-ms`` is one rank's forward time at ``--layer-ms-at`` tokens, as ``memo profile
--layer-ms`` takes it (the default, 19100 ms at 1M tokens, is issue 10's command); other lengths
scale it by one layer's forward FLOPs (``memo.profiler.layer_forward_flops``: 6·s·P + 6·n·h·s²),
so the s² attention share shrinks as it does on a GPU. The numbers are predictions from the
profiler's recorded sizes, not measurements on a GPU; they change when memo's runtime does, so
re-run this script rather than copy its numbers.

Usage::

    python benchmarks/at_scale.py                                  # gpt-7b, TP 8, 128K..1M, 80 GB
    python benchmarks/at_scale.py --json at_scale.json
    python benchmarks/at_scale.py --model llama-3.1-8b --seq-lens 256K 1M --no-search
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memo.cli.args import positive_float, positive_int, seq_len
from memo.errors import DeviceBudgetError, MemoError
from memo.units import GB, GiB

__all__ = ["BENCH_KIND", "BENCH_VERSION", "STRATEGIES", "main", "measure", "search"]

BENCH_KIND = "memo.benchmark.at_scale"
BENCH_VERSION = 1

#: Table name -> the fixed layer policy of every layer (None: the planner chooses).
STRATEGIES: dict[str, str | None] = {"none": "keep", "full recompute": "recompute", "memo": None}


class Bench:
    """The job (model, parallelism, machine) and every profile made so far, cached by (strategy, length)."""

    def __init__(self, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        from memo.models import get_config

        self.args = args
        self.config = get_config(args.model)
        self.budget = int(args.device_mem_gb * GB)
        # NOTE [Fallback headroom] (memo/pipeline/device.py): memo plans within the budget less a
        # share kept free for allocator fragmentation; every strategy is judged against the same.
        from memo.pipeline import usable_device_bytes

        self.usable = usable_device_bytes(self.budget)
        self.log = log
        self.cache: dict[tuple[str, int], dict[str, Any]] = {}
        self.profiles = 0

    def layer_ms(self, length: int) -> float:
        """NOTE [At-scale layer time]: ``--layer-ms`` at ``--layer-ms-at`` tokens, scaled by FLOPs."""
        from memo.profiler import layer_forward_flops

        a = self.args
        scale = (layer_forward_flops(self.config, length, a.micro_batch)
                 / layer_forward_flops(self.config, a.layer_ms_at, a.micro_batch))
        return a.layer_ms * scale

    def run(self, strategy: str, length: int, budgeted: bool = True) -> dict[str, Any]:
        """Profile ``strategy`` at ``length`` tokens (cached); the row's per-rank numbers."""
        key = (strategy if budgeted else f"{strategy} (no budget)", length)
        if key in self.cache:
            return self.cache[key]
        from memo.pipeline import profile

        a = self.args
        fixed = STRATEGIES[strategy]
        policy = None if fixed is None else [fixed] * self.config.n_layers
        layer_ms = self.layer_ms(length)
        start = time.perf_counter()
        row: dict[str, Any] = {"strategy": strategy, "seq_len": length, "layer_ms": layer_ms,
                               "budgeted": budgeted}
        try:
            result = profile(
                a.model, length, a.micro_batch, a.dtype, "meta", bandwidth_gbps=a.bandwidth_gbps,
                layer_ms=layer_ms, host_mem_gb=a.host_mem_gb, gpus_per_node=a.gpus_per_node,
                host_safety=a.host_safety, tensor_parallel=a.tensor_parallel,
                context_parallel=a.context_parallel, device_mem_gb=a.device_mem_gb if budgeted else None,
                optimizer_states=a.optimizer_states, policy=policy, time_limit=a.time_limit,
            )
        except DeviceBudgetError as err:  # memo: no layer policy fits the budget (an estimate)
            row.update(total_bytes=None, fits=False, error=str(err))
        else:
            device = result.plan.device
            states = device["model_states"]
            row.update(
                total_bytes=int(device["total_bytes"]),
                iteration_peak_bytes=int(device["iteration_peak_bytes"]),
                states_bytes=sum(int(states[k]["bytes"]) for k in ("parameters", "gradients", "optimizer")),
                fits=int(device["total_bytes"]) <= self.usable,
                policy=list(result.policy.policy),
                alpha=float(result.alpha.alpha),
                binding=str(device.get("binding")),
                full_recompute_estimate_bytes=int(device["estimate"]["full_recompute_bytes"]),
            )
        row["seconds"] = time.perf_counter() - start
        self.profiles += 1
        self.cache[key] = row
        self.log(_progress_line(row, self.usable))
        return row


def _progress_line(row: dict[str, Any], budget: int) -> str:
    what = "no budget" if not row["budgeted"] else ("fits" if row["fits"] else "does not fit")
    total = ("no policy fits" if row["total_bytes"] is None else f"{row['total_bytes'] / GiB:,.2f} GiB")
    extra = ""
    if row.get("policy") is not None and row["strategy"] == "memo":
        from memo.planner import describe_policy

        extra = f", {describe_policy(row['policy'])}, alpha {row['alpha']:.3f}"
    return (f"  {row['strategy']:<14} @ {row['seq_len']:>10,} tokens: {total} per rank ({what} "
            f"{budget / GiB:.2f} GiB){extra} [{row['seconds']:.1f} s]")


def measure(bench: Bench, lengths: list[int]) -> list[dict[str, Any]]:
    """One table row per length: every strategy's per-rank total. memo, when no policy fits the
    budget, is profiled once more without one, so the row still shows what it would need."""
    rows = []
    for length in lengths:
        row: dict[str, Any] = {"seq_len": length, "layer_ms": bench.layer_ms(length), "strategies": {}}
        for name in STRATEGIES:
            got = bench.run(name, length)
            if name == "memo" and got["total_bytes"] is None:
                got = {**bench.run(name, length, budgeted=False), "budget_error": got["error"]}
            row["strategies"][name] = got
        rows.append(row)
    return rows


def search(bench: Bench, strategy: str) -> dict[str, Any]:
    """The longest multiple of ``--granularity`` tokens (up to ``--max-seq``) whose profile fits.

    Doubling from ``--search-start`` while it fits (halving while it does not), then bisection.
    Totals grow with the length for every strategy, which the bisection assumes.
    """
    from memo.estimate import longest

    a = bench.args
    found = longest(lambda length: bool(bench.run(strategy, length)["fits"]), a.search_start, a.granularity,
                    a.max_seq)
    return {"strategy": strategy, **found}


# ---------------------------------------------------------------- output


def _gib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:,.2f}" if n >= GiB else f"{n / GiB:.4f}"  # small models keep their digits


def _tokens(n: int) -> str:
    from memo.estimate import tokens  # shared with `memo estimate`

    return tokens(n)


def _align(table: list[tuple[str, ...]]) -> str:
    from memo.estimate import align  # shared with `memo estimate`

    return align(table)


def format_rows(rows: list[dict[str, Any]], budget: int, usable: int) -> str:
    """Per-rank device GiB per strategy (lower is better); ``*``: over the budget."""
    from memo.planner import describe_policy

    header = ("seq len", "T_layer ms", "states GiB", "none GiB (lower=better)", "full recompute GiB",
              "memo GiB", "memo/FR (<1 better)", "memo/none (<1 better)", "memo policy")
    table = [header]
    for row in rows:
        s = row["strategies"]

        def cell(name: str, s: dict = s) -> str:
            r = s[name]
            return _gib(r["total_bytes"]) + ("" if r["total_bytes"] is None or r["fits"] else " *")

        memo, fr, none = (s[k]["total_bytes"] for k in ("memo", "full recompute", "none"))
        m = s["memo"]
        policy = "-" if m.get("policy") is None else (
            f"{describe_policy(m['policy'])}, alpha {m['alpha']:.3f}"
            + ("" if m["budgeted"] else " (no policy fits; shown without a budget)"))
        table.append((
            _tokens(row["seq_len"]), f"{row['layer_ms']:,.0f}", _gib(s["none"].get("states_bytes")),
            cell("none"), cell("full recompute"), cell("memo"),
            "-" if not (memo and fr) else f"{memo / fr:.2f}x",
            "-" if not (memo and none) else f"{memo / none:.2f}x",
            policy,
        ))
    return _align(table) + (
        f"\n* over {usable / GiB:.2f} GiB per rank: the budget of {budget / GB:g} GB "
        f"({budget / GiB:.2f} GiB) less the share left free for allocator fragmentation "
        "(NOTE [Fallback headroom]). memo is the planner's "
        "choice: the fastest layer policy within the budget, so where the budget is loose it may keep more "
        "than full recompute; the longest sequence below is what its saving buys.")


def format_longest(results: list[dict[str, Any]], budget: int, granularity: int) -> str:
    base = next((r for r in results if r["strategy"] == "full recompute"), None)
    header = (f"strategy (on {budget / GB:g} GB)", "longest seq (higher=better)", "tokens",
              "vs full recompute (>1 better)", "first failure", "profiles")
    table = [header]
    for r in results:
        longest = (f"< {_tokens(granularity)}" if not r["longest"] else _tokens(r["longest"])) \
            + (" (= --max-seq)" if r["capped_by_max_seq"] else "")
        ratio = "-" if not base or not base["longest"] else f"{r['longest'] / base['longest']:.2f}x"
        failure = "-" if r["first_failure"] is None else _tokens(r["first_failure"])
        table.append((r["strategy"], longest, f"{r['longest']:,}", ratio, failure, str(len(r["tries"]))))
    return _align(table) + f"\n(bisection to {_tokens(granularity)} tokens)"


# ---------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-7b", help="registered model or CONFIG.json (default gpt-7b)")
    p.add_argument("--tensor-parallel", type=positive_int, default=8, help="TP size of the rank (default 8)")
    p.add_argument("--context-parallel", type=positive_int, default=1, help="CP size of the rank (default 1)")
    p.add_argument("--seq-lens", type=seq_len, nargs="+", default=[128 << 10, 256 << 10, 512 << 10, 1 << 20],
                   help="lengths of the table (default 128K 256K 512K 1M)")
    p.add_argument("--device-mem-gb", type=positive_float, default=80.0,
                   help="memory of one GPU in GB, 10^9 bytes, as memo profile takes it (default 80)")
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-batch (1)")
    p.add_argument("--dtype", default="bfloat16", help="default bfloat16")
    p.add_argument("--optimizer-states", choices=("same", "mixed"), default="same",
                   help="how model states are counted, as memo profile takes it (default same)")
    m = p.add_argument_group("machine (issue 10's command)")
    m.add_argument("--gpus-per-node", type=positive_int, default=8, help="default 8")
    m.add_argument("--host-mem-gb", type=positive_float, default=2048.0, help="host memory per node (2048)")
    m.add_argument("--host-safety", type=positive_float, default=0.8, help="share memo may pin (0.8)")
    m.add_argument("--bandwidth-gbps", type=positive_float, default=32.0, help="host<->device GB/s (32)")
    m.add_argument("--layer-ms", type=positive_float, default=19100.0,
                   help="one rank's layer forward ms at --layer-ms-at tokens (default 19100; NOTE [At-scale "
                   "layer time])")
    m.add_argument("--layer-ms-at", type=seq_len, default=1 << 20, help="tokens --layer-ms is for (1M)")
    s = p.add_argument_group("longest-sequence search")
    s.add_argument("--no-search", action="store_true", help="the table only")
    s.add_argument("--search-start", type=seq_len, default=None,
                   help="first length tried (default: the shortest of --seq-lens)")
    s.add_argument("--granularity", type=seq_len, default=32 << 10, help="bisection step (default 32K)")
    s.add_argument("--max-seq", type=seq_len, default=8 << 20, help="longest length tried (default 8M)")
    p.add_argument("--time-limit", type=positive_float, default=10.0,
                   help="seconds per plan for the planner's MIP (default 10)")
    p.add_argument("--json", metavar="OUT.json", help="also write the rows and searches as JSON")
    return p


def _check(args: argparse.Namespace) -> None:
    from memo.profiler import token_multiple

    if args.host_safety > 1:
        raise MemoError(f"at_scale: --host-safety must be in (0, 1], got {args.host_safety}")
    m = token_multiple(args.tensor_parallel, args.context_parallel)
    args.search_start = args.search_start or min(args.seq_lens)
    for name, value in (("--granularity", args.granularity), ("--search-start", args.search_start),
                        *(("--seq-lens", v) for v in args.seq_lens)):
        if value % m:
            raise MemoError(f"at_scale: {name} {value:,} is not a multiple of {m}, which TP "
                            f"{args.tensor_parallel} x CP {args.context_parallel} needs")
    if not args.no_search and args.max_seq % args.granularity:
        raise MemoError(f"at_scale: --max-seq {args.max_seq:,} is not a multiple of --granularity "
                        f"{args.granularity:,}")
    if not args.no_search and args.search_start % args.granularity:
        raise MemoError(f"at_scale: --search-start {args.search_start:,} is not a multiple of --granularity "
                        f"{args.granularity:,}")
    if not args.no_search and args.search_start > args.max_seq:
        raise MemoError(f"at_scale: --search-start {args.search_start:,} is longer than --max-seq "
                        f"{args.max_seq:,}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check(args)
    bench = Bench(args, lambda line: print(line, file=sys.stderr, flush=True))
    start = time.perf_counter()
    job = (f"{args.model}, one rank of TP {args.tensor_parallel} x CP {args.context_parallel}, "
           f"{args.dtype}, micro-batch {args.micro_batch}; {args.gpus_per_node} GPUs per node, host "
           f"{args.host_mem_gb:g} GB, {args.bandwidth_gbps:g} GB/s, T_layer {args.layer_ms:g} ms at "
           f"{_tokens(args.layer_ms_at)} (scaled by FLOPs); budget {args.device_mem_gb:g} GB "
           f"({bench.budget / GiB:.2f} GiB) per GPU")
    print(f"at_scale: {job}; meta-device profiles", flush=True)
    rows = measure(bench, sorted(args.seq_lens))
    searches = [] if args.no_search else [search(bench, name) for name in STRATEGIES]
    wall = time.perf_counter() - start
    print(f"\nPer-rank device memory (iteration peak + parameters, gradients, optimizer states), GiB; "
          f"{job}\n")
    print(format_rows(rows, bench.budget, bench.usable))
    if searches:
        print(f"\nPredicted longest sequence per rank's GPU of {args.device_mem_gb:g} GB\n")
        print(format_longest(searches, bench.budget, args.granularity))
    print(f"\n{bench.profiles} meta profiles in {wall:.0f} s")
    if args.json:
        out = {"version": BENCH_VERSION, "kind": BENCH_KIND,
               "job": {k: getattr(args, k) for k in (
                   "model", "tensor_parallel", "context_parallel", "micro_batch", "dtype",
                   "optimizer_states", "device_mem_gb", "gpus_per_node", "host_mem_gb", "host_safety",
                   "bandwidth_gbps", "layer_ms", "layer_ms_at", "granularity", "max_seq", "search_start")},
               "budget_bytes": bench.budget,
               "usable_bytes": bench.usable, "rows": rows, "longest": searches, "profiles": bench.profiles,
               "wall_s": wall}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"json written to {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MemoError as err:
        sys.exit(f"error: {err}")
