"""``memo estimate``: per-GPU memory of a long-context job, and the best parallel layout, before any GPU.

Examples::

    memo estimate --model llama-3.1-8b --seq-len 8192 --gpus 8 --tp 4 --cp 1 --pp 2 \\
        --micro-batch 1 --strategy none --method formula --json
    memo estimate --model gpt-7b --seq-len 512K --gpus 8 --tp 8 --strategy memo
    memo estimate --model gpt-7b --gpus 8 --device-mem-gb 80 --host-mem-gb 2048 --max-seq --search

The estimate is of one GPU of the first pipeline stage: model states (the seed's closed form:
bf16 weights, fp32 gradients and Adam states split by ZeRO-1 over d·c) plus activations, from the
closed form (--method formula) or memo's meta-device profile of that rank (--method plan, the
default). "fits" is the 80% rule: the total within 80% of --device-mem-gb (memo: its plan's budget;
--fit-limit-gib: one limit for every strategy). Only layouts `memo train` launches are estimated,
and every answer prints the command that launches it. See docs/estimate.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memo import repeated_tiles
from memo.cli.args import figure_path, fraction, positive_float, positive_int, seq_len
from memo.errors import MemoError
from memo.estimate.core import MEMO_POLICIES
from memo.estimate.layout import CP_COMMS, SHARDINGS
from memo.estimate.plan_method import PLAN_STRATEGIES
from memo.planner.vocab import CPComm, EstimateMethod, Sharding, StrategyName
from memo.units import GiB

if TYPE_CHECKING:
    from memo.estimate import Estimate, Estimator, ParallelLayout

#: Where progress lines go (stderr, or nowhere with --json).
Log = Callable[[str], None]

__all__ = ["add_parser", "run"]

STRATEGY_CHOICES = PLAN_STRATEGIES  # the strategies memo estimate counts


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "estimate",
        help="per-GPU memory of a job on a TP x CP x PP x DP layout; the best layout; the longest sequence",
        description=__doc__,
    )
    p.add_argument("--model", required=True,
                   help="registered config name (gpt-7b, llama-3.1-8b, ...) or a CONFIG.json")
    p.add_argument("--seq-len", type=seq_len, default=None,
                   help="tokens per sequence: 8192, 512K, 1M (K=1024); not needed with --max-seq")
    job = p.add_argument_group("layout (the data-parallel size is N / (T·C·P))")
    job.add_argument("--gpus", type=positive_int, default=1, help="N, all GPUs of the job")
    job.add_argument("--tp", type=positive_int, default=1, help="tensor (+ sequence) parallel size T")
    job.add_argument("--cp", type=positive_int, default=1, help="context parallel size C")
    job.add_argument("--pp", type=positive_int, default=1, help="pipeline stages P (1F1B; first stage shown)")
    job.add_argument("--micro-batch", type=positive_int, default=1,
                     help="sequences per micro-batch B (--search also tries the powers of two below it)")
    job.add_argument("--cp-comm", choices=CP_COMMS, default=None, help=_CP_COMM_HELP)
    job.add_argument("--sharding", choices=SHARDINGS, default=None, help=_SHARDING_HELP)
    job.add_argument("--ulysses-head-chunks", type=positive_int, default=None, metavar="N",
                     help="Ulysses (a2a) over N chunks of heads, as memo train --ulysses-head-chunks runs "
                     "it: 1/N of the head shards during attention for more key/value traffic (default: memo "
                     "train's, one chunk per key/value head a rank receives; a search of memo's plans also "
                     "tries the finest count)")
    p.add_argument("--strategy", choices=STRATEGY_CHOICES, default=None, nargs="+", metavar="STRATEGY",
                   help=f"activation memory strategy, one of {', '.join(STRATEGY_CHOICES)} (default: memo); "
                   "--max-seq takes several (default: all of them)")
    p.add_argument("--alpha", type=_alpha, default=None,
                   help="memo's offloaded share in [0, 1] (default: solved by the LP, lowered until it fits)")
    p.add_argument("--method", choices=("plan", "formula"), default="plan",
                   help="plan: activations from memo's meta profile of the rank; formula: the seed's closed "
                   "form (none and full-recompute only)")
    p.add_argument("--model-states", choices=("formula", "mixed", "same"), default="formula",
                   help="formula: the seed's closed form; mixed: the same bytes per parameter, parameters "
                   "counted on memo's rank model; same: AdamW in --dtype as `memo train` runs")
    p.add_argument("--dtype", default="bfloat16", help="model dtype of the profiled rank (plan method)")
    m = p.add_argument_group("machine")
    m.add_argument("--device-mem-gb", type=positive_float, default=80.0,
                   help="memory of one GPU in GB (10^9 bytes, as memo profile takes it)")
    m.add_argument("--fit-fraction", type=fraction, default=None,
                   help="share of the GPU an estimate may fill and fit (the seed's 80%% rule; memo's rows "
                   "fit its plan's budget instead). Default: 0.8")
    m.add_argument("--fit-limit-gib", type=positive_float, default=None, metavar="GIB",
                   help="hold every strategy, memo's included, to this many GiB per GPU instead of each "
                   "strategy's own limit (the 80%% rule, memo's plan budget)")
    m.add_argument("--host-mem-gb", type=positive_float, default=2048.0, help="host memory of one node in GB")
    m.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs sharing a node's host memory")
    m.add_argument("--host-safety", type=fraction, default=0.8, help="share of host memory memo may pin")
    m.add_argument("--bandwidth-gbps", type=positive_float, default=32.0, help="host<->device GB/s per GPU")
    m.add_argument("--layer-ms", type=positive_float, default=None,
                   help="one rank's forward time of one layer in ms at --seq-len (or --layer-ms-at) on the "
                   "given --tp x --cp; other lengths and layouts are scaled by FLOPs. Default: estimated "
                   "from FLOPs on --gpu at --efficiency")
    m.add_argument("--layer-ms-at", type=seq_len, default=None, help="tokens --layer-ms is for")
    m.add_argument("--gpu", default="a800", help="GPU for the FLOP estimate of the layer time (the paper's)")
    m.add_argument("--efficiency", type=fraction, default=0.5, help="share of --gpu's peak a layer reaches")
    p.add_argument("--memo-policy", choices=MEMO_POLICIES, default="auto",
                   help="memo's layers: memo (input and attention output to the host, alpha of the rest), "
                   "input-only (the input alone to the host, everything else recomputed), or auto: memo "
                   "while the host holds it, else input-only")
    p.add_argument("--memo-keep-last", type=int, choices=(0, 2), default=0,
                   help="layers at the end of a stage memo keeps whole: 0 (every layer offloads, memo's "
                   "leanest policy) or 2 (the paper's fixed rule)")
    s = p.add_argument_group("search")
    s.add_argument("--search", action="store_true",
                   help="every valid TP/CP/PP/DP/micro-batch layout of --gpus, ranked by fit, then fewest "
                   "communicating ranks")
    s.add_argument("--max-seq", action="store_true",
                   help="the longest sequence that fits, per strategy (bisection on the estimate)")
    s.add_argument("--granularity", type=seq_len, default=32 << 10,
                   help="step of the longest-sequence search")
    s.add_argument("--seq-cap", type=seq_len, default=16 << 20, help="longest sequence the search tries")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", type=figure_path, metavar="PATH",
                   help="draw per-GPU memory vs sequence length per strategy, with the GPU's memory")
    p.set_defaults(func=run)
    return p


_CP_COMM_HELP = ("context-parallel attention: all_gather (K and V gathered) or a2a (Ulysses: all tokens of "
                 "a share of the heads). Default: all_gather where the sharding's engine runs it, else a2a; "
                 "--search tries both")
_SHARDING_HELP = ("model states over the D·C ranks that share weights: optimizer (megatron's distributed "
                  "optimizer, ZeRO-1), full (FSDP2, ZeRO-3) or full-offload (FSDP2 with the states in "
                  "host memory). Default: optimizer; --search tries all three where memo train runs them")


#: The seed's 80% rule, where --fit-fraction is not given.
FIT_FRACTION = 0.8


def _limit_rule(e: dict[str, Any]) -> str:
    """How a row's fit limit was set (NOTE [Fit limits] in memo/estimate/core.py)."""
    return {"plan": "memo's plan budget", "given": "--fit-limit-gib"}.get(e["limit_rule"],
                                                                           f"{e['fit_fraction']:.0%} rule")


def _limit_line(est: Estimator, strategy: str) -> str:
    """``strategy``'s fit limit and how it was set, for a table's heading or a row."""
    from memo.estimate.core import limit_words

    m = est.machine
    return (f"{_gib(est.limit_bytes(strategy))} GiB per GPU "
            f"({limit_words(est.limit_rule(strategy), m.fit_fraction, m.device_mem_gb)})")


def _alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"alpha must be in [0, 1], got {text!r}")
    return value


def _gib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:,.2f}" if n >= GiB / 100 else f"{n / GiB:.4f}"


def _check(args: argparse.Namespace) -> None:
    """Everything refusable before any profile, one line each."""
    if args.seq_len is None and not args.max_seq:
        raise MemoError("memo estimate: give --seq-len, or --max-seq for the longest sequence that fits")
    if args.max_seq and args.seq_cap % args.granularity:
        raise MemoError(f"memo estimate: --seq-cap {args.seq_cap:,} is not a multiple of --granularity "
                        f"{args.granularity:,}")
    if args.strategy is not None and len(args.strategy) > 1 and not args.max_seq:
        raise MemoError(f"memo estimate: --strategy {' '.join(args.strategy)}: one strategy per estimate or "
                        "search; several only with --max-seq")
    if args.method == EstimateMethod.FORMULA and StrategyName.MEMO in (args.strategy or ()):
        raise MemoError("memo estimate: the formula has no closed form for memo (its device share depends on "
                        "alpha, host memory and the link); use --method plan")
    if args.ulysses_head_chunks is not None and args.search:
        raise MemoError(f"memo estimate: --ulysses-head-chunks {args.ulysses_head_chunks} names one "
                        "layout's chunks of heads; --search tries memo's Ulysses layouts at the default and "
                        "the finest count itself")
    if args.alpha is not None and args.max_seq:
        raise MemoError("memo estimate: --alpha is fixed, but --max-seq lowers memo's alpha wherever a "
                        "length needs it; leave --alpha out")
    if args.alpha is not None and args.strategy not in (None, [StrategyName.MEMO]):
        raise MemoError(f"memo estimate: --alpha is memo's; --strategy {' '.join(args.strategy)} has none")
    if args.layer_ms_at is not None and args.layer_ms is None:
        raise MemoError("memo estimate: --layer-ms-at says where --layer-ms was taken; give --layer-ms too")
    if args.fit_limit_gib is not None and args.fit_fraction is not None:
        raise MemoError(f"memo estimate: --fit-limit-gib {args.fit_limit_gib:g} holds every strategy to one "
                        f"limit, which --fit-fraction {args.fit_fraction:g} would set another way; give one "
                        "of them")


def _estimator(args: argparse.Namespace) -> Estimator:
    from memo.estimate import Estimator, Machine

    at = args.layer_ms_at or args.seq_len or (1 << 20)
    fit_fraction = FIT_FRACTION if args.fit_fraction is None else args.fit_fraction
    machine = Machine(device_mem_gb=args.device_mem_gb, fit_fraction=fit_fraction,
                      host_mem_gb=args.host_mem_gb, gpus_per_node=args.gpus_per_node,
                      host_safety=args.host_safety, bandwidth_gbps=args.bandwidth_gbps,
                      layer_ms=args.layer_ms,
                      layer_ms_at=(at, args.tp * args.cp) if args.layer_ms is not None else None,
                      gpu=args.gpu, efficiency=args.efficiency, memo_keep_last=args.memo_keep_last)
    if args.layer_ms is None:
        from memo.pipeline import DTYPES
        from memo.profiler import gpu_peak_flops

        gpu_peak_flops(args.gpu, DTYPES.get(args.dtype, DTYPES["bfloat16"]))  # an unknown --gpu fails here
    given = None if args.fit_limit_gib is None else int(args.fit_limit_gib * GiB)
    return Estimator(args.model, method=args.method, dtype=args.dtype, model_states=args.model_states,
                     machine=machine, log=None, memo_policy=args.memo_policy, fit_limit_bytes=given)


def _layout(args: argparse.Namespace) -> ParallelLayout:
    """The layout the flags name, refused before any profile where ``memo train`` launches none like
    it (NOTE [Layouts memo train launches] in memo/estimate/layout.py). Without --cp-comm, the CP
    communication is all_gather where the sharding's engine runs it, else the one it runs."""
    from memo.estimate import Layout

    def layout(comm: str) -> ParallelLayout:
        return Layout(args.gpus, args.tp, args.cp, args.pp, args.micro_batch, cp_comm=comm,
                      sharding=args.sharding or Sharding.OPTIMIZER, head_chunks=args.ulysses_head_chunks)

    chosen = layout(args.cp_comm or (CPComm.A2A if args.ulysses_head_chunks else CPComm.ALL_GATHER))
    if args.cp_comm is None and chosen.engine is None:
        chosen = next((lay for lay in map(layout, CP_COMMS) if lay.engine is not None), chosen)
    problem = chosen.launch_problem()
    if problem is not None:
        raise MemoError(f"memo estimate: {problem}")
    return chosen


def _layout_cell(lay: dict[str, Any]) -> str:
    """``TP CP PP DP sharding`` of a layout's dict, ``a2a`` after CP where it is Ulysses."""
    a2a = (" a2a" if lay["cp"] > 1 and lay["cp_comm"] == CPComm.A2A else "") + (
        f"/{lay['head_chunks']}" if lay.get("head_chunks") else "")
    return f"{lay['tp']} {lay['cp']}{a2a} {lay['pp']} {lay['dp']} {lay['sharding']}"


def _cp_comm_cell(lay: ParallelLayout) -> str:
    """The CP communication, and Ulysses' chunks of heads where not memo train's default."""
    if lay.cp == 1:
        return "-"
    return str(lay.cp_comm) + (f" /{lay.head_chunks} chunks" if lay.head_chunks is not None else "")


def _shardings(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The shardings and context-parallel communications a search tries: the ones given, else all."""
    return {"shardings": (args.sharding,) if args.sharding else SHARDINGS,
            "cp_comms": (args.cp_comm,) if args.cp_comm else CP_COMMS}


def _strategies(args: argparse.Namespace, estimator: Estimator) -> tuple[str, ...]:
    if args.strategy is not None:
        return tuple(dict.fromkeys(args.strategy))
    default = (StrategyName.MEMO,) if args.method == EstimateMethod.PLAN else (StrategyName.NONE,)
    return estimator.strategies() if args.max_seq else default


def run(args: argparse.Namespace) -> int:
    from memo.jsonio import check_writable

    _check(args)
    if args.plot:
        check_writable(args.plot, "memo estimate --plot")
    est = _estimator(args)
    start = time.perf_counter()
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda _line: None)
    skipped_before = repeated_tiles.skipped
    if args.max_seq:
        out = _run_max_seq(args, est, log)
    elif args.search:
        out = _run_search(args, est, log)
    else:
        out = _run_one(args, est)
    if args.plot:
        _plot(args, est, out)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        if args.method == EstimateMethod.PLAN:
            print(f"\n{est.profiler.profiles} meta profiles in {time.perf_counter() - start:.1f} s "
                  f"({repeated_tiles.skipped - skipped_before:,} repeated tiles skipped: NOTE [Repeated "
                  "tiles in a meta estimate])")
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


# ---------------------------------------------------------------- one layout


def _run_one(args: argparse.Namespace, est: Estimator) -> dict[str, Any]:
    from memo.estimate import launch_command

    layout = _layout(args)
    (strategy,) = _strategies(args, est)
    e = est.estimate(args.seq_len, layout, strategy, args.alpha)
    command = launch_command(est, layout, args.seq_len, strategy)
    if not args.json:
        print(_describe_one(e))
        print(f"launch ({layout.engine}{'' if e.fits else '; it does not fit'}): {command}")
    return {**e.to_dict(), "engine": layout.engine, "command": command}


def _describe_one(e: Estimate) -> str:
    from memo.estimate.core import limit_words

    if e.model_states != "formula":
        how = f"counted on memo's rank model, {e.model_states} precision"
    elif e.layout.sharding == Sharding.OPTIMIZER:
        how = "(6 + 12/(d·c)) B per parameter"
    else:  # NOTE [Sharded model states]
        how = "16/(d·c) B per parameter sharded, and the layers FSDP2 gathers"
    lines = [
        f"memo estimate: {e.model}, {e.seq_len:,} tokens, {e.layout.gpus} GPUs as {e.layout.describe()}, "
        f"strategy {e.strategy}, method {e.method}",
        "",
        "per GPU of the first pipeline stage      GiB",
        f"  model states                   {_gib(e.model_states_bytes):>10}   weights, gradients, optimizer: "
        f"{e.parameters:,} parameters, {how}",
        f"  activations                    {_gib(e.activations_bytes):>10}",
        f"  total                          {_gib(e.total_bytes):>10}",
        f"fits: {'yes' if e.fits else 'NO'} (limit "
        f"{limit_words(e.limit_rule, e.fit_fraction, e.device_mem_gb)} = {_gib(e.limit_bytes)} GiB)",
    ]
    if e.alpha is not None:
        lines.append(f"memo: alpha {e.alpha:.4f} (binding: {e.alpha_binding}); pinned host memory "
                     f"{_gib(e.host_bytes_per_process)} GiB per GPU, "
                     f"{_gib(e.host_bytes_per_node)} GiB per node")
    elif e.policy is not None:
        lines.append(f"memo: {_policy_cell(e.to_dict())} (binding: {e.alpha_binding}); host memory "
                     f"{_gib(e.host_bytes_per_process)} GiB per GPU, {_gib(e.host_bytes_per_node)} GiB per "
                     "node")
    lines.extend(f"note: {n}" for n in e.notes)
    return "\n".join(lines)


# ---------------------------------------------------------------- --search


def _micro_batches(args: argparse.Namespace) -> tuple[int, ...]:
    out, b = [], 1
    while b <= args.micro_batch:
        out.append(b)
        b *= 2
    if args.micro_batch not in out:
        out.append(args.micro_batch)
    return tuple(out)


def _run_search(args: argparse.Namespace, est: Estimator, log: Log) -> dict[str, Any]:
    from memo.estimate import align, launch_command, search_layouts

    (strategy,) = _strategies(args, est)
    log(f"memo estimate: every layout of {args.gpus} GPUs for {args.model} at {args.seq_len:,} tokens, "
        f"strategy {strategy}, method {args.method}")
    rows = search_layouts(est, args.seq_len, args.gpus, strategy, _micro_batches(args), log,
                          **_shardings(args))
    # a row that cannot run (the strategy refuses its layout) has no command to give
    commands = [None if r["estimate"] is None else launch_command(est, r["layout"], args.seq_len, strategy)
                for r in rows]
    if not args.json:
        table = [("rank", "engine", "TP", "CP", "PP", "DP", "B", "CP comm", "sharding", "t·c·p", "states GiB",
                  "activations GiB", "total GiB", "fits", "alpha")]
        for i, r in enumerate(rows, 1):
            lay, e = r["layout"], r["estimate"]
            cells = (str(i), lay.engine, str(lay.tp), str(lay.cp), str(lay.pp), str(lay.dp),
                     str(lay.micro_batch), _cp_comm_cell(lay), str(lay.sharding),
                     str(lay.model_parallel))
            if e is None:
                table.append((*cells, "-", "-", "-", "cannot run", "-"))
            else:
                table.append((*cells, _gib(e.model_states_bytes), _gib(e.activations_bytes),
                              _gib(e.total_bytes), "yes" if e.fits else "no",
                              "-" if e.alpha is None else f"{e.alpha:.3f}"))
        print(f"\nLayouts of {args.gpus} GPUs that memo train launches, for {args.model}, {args.seq_len:,} "
              f"tokens, {strategy} ({args.method}); fit limit {_limit_line(est, strategy)}; best first "
              "(fits, then fewest communicating ranks t·c·p)\n")
        print(align(table))
        errors = [r for r in rows if r["error"]]
        for r in errors:
            print(f"cannot run {r['layout'].short()}: {r['error']}")
        print(f"\nlaunch the best ({rows[0]['layout'].short()}, {rows[0]['layout'].engine}): {commands[0]}")
    return {"version": 1, "kind": "memo.estimate.search", "model": args.model, "seq_len": args.seq_len,
            "gpus": args.gpus, "strategy": strategy, "method": args.method,
            "limit_bytes": est.limit_bytes(strategy), "limit_rule": est.limit_rule(strategy),
            "layouts": [{"rank": i, **r["layout"].to_dict(), "engine": r["layout"].engine,
                         "limit_bytes": est.limit_bytes(strategy), "limit_rule": est.limit_rule(strategy),
                         "estimate": None if r["estimate"] is None else r["estimate"].to_dict(),
                         "error": r["error"], "command": command}
                        for i, (r, command) in enumerate(zip(rows, commands, strict=True), 1)]}


# ---------------------------------------------------------------- --max-seq


def _run_max_seq(args: argparse.Namespace, est: Estimator, log: Log) -> dict[str, Any]:
    from memo.estimate import longest_sequences

    strategies = _strategies(args, est)
    layouts = _max_seq_layouts(args, est)
    limits = "; ".join(f"{s} {_limit_line(est, s)}" for s in strategies)
    log(f"memo estimate: longest sequence of {args.model} on {args.gpus} GPUs, {len(layouts)} layout(s) x "
        f"{len(strategies)} strategies, method {args.method}, fit limits: {limits}")
    results = longest_sequences(est, layouts, strategies, args.granularity, args.seq_cap, log=log)
    if all(r["best"] is None for r in results):
        smallest = _smallest_need(est, layouts, strategies, args.granularity)
        raise MemoError(
            f"memo estimate: no strategy fits even {args.granularity:,} tokens on {args.gpus} GPUs within "
            f"its fit limit ({limits}): the smallest need is {smallest}; use more GPUs or more "
            "--device-mem-gb")
    out_rows = [_max_seq_row(est, r) for r in results]
    if not args.json:
        _print_max_seq(args, est, out_rows, layouts)
    return {"version": 1, "kind": "memo.estimate.longest", "model": args.model, "gpus": args.gpus,
            "method": args.method, "model_states": args.model_states, "device_mem_gb": args.device_mem_gb,
            "fit_fraction": est.machine.fit_fraction, "fit_limit_bytes": est.fit_limit_bytes,
            "host_mem_gb": args.host_mem_gb,
            "gpus_per_node": args.gpus_per_node, "bandwidth_gbps": args.bandwidth_gbps,
            "granularity": args.granularity, "seq_cap": args.seq_cap, "strategies": out_rows}


def _max_seq_layouts(args: argparse.Namespace, est: Estimator) -> list[ParallelLayout]:
    """The layouts --max-seq searches: every valid one of DP 1 with --search, else the one given."""
    from memo.estimate import valid_layouts

    if not args.search:
        layout = _layout(args)
        layout.check(est.config, args.granularity)  # every length tried is a multiple of the granularity
        return [layout]
    layouts = valid_layouts(est.config, args.gpus, None, (args.micro_batch,), data_parallel_one=True,
                            **_shardings(args))
    layouts = [lay for lay in layouts if not lay.problems(est.config, args.granularity)]
    if not layouts:
        raise MemoError(f"memo estimate: no layout of {args.gpus} GPUs with DP 1 that memo train "
                        f"launches is valid for {est.config.name} at a multiple of --granularity "
                        f"{args.granularity:,}")
    return layouts


def _max_seq_row(est: Estimator, r: dict[str, Any]) -> dict[str, Any]:
    """One strategy's longest sequence (a result of ``longest_sequences``) as its JSON row."""
    from memo.estimate import launch_command

    b = r["best"]
    return {
        "strategy": r["strategy"],
        "longest": b["longest"] if b else 0,
        "layout": b["layout"].to_dict() if b else None,
        "engine": b["layout"].engine if b else None,
        "command": launch_command(est, b["layout"], b["longest"], r["strategy"]) if b else None,
        "limit_bytes": est.limit_bytes(r["strategy"]), "limit_rule": est.limit_rule(r["strategy"]),
        "capped_by_seq_cap": bool(b and b["capped_by_max_seq"]),
        "estimate": b["estimate"].to_dict() if b and b["estimate"] else None,
        "layouts": [{**x["layout"].to_dict(), "longest": x["longest"], "guess": x["guess"],
                     "pruned": x["pruned"], "settled": bool(x.get("settled")),
                     "first_failure": x["first_failure"],
                     "total_gib_at_longest": None if x["estimate"] is None else
                     round(x["estimate"].total_bytes / GiB, 4)} for x in r["layouts"]],
    }


def _print_max_seq(args: argparse.Namespace, est: Estimator, out_rows: list[dict[str, Any]],
                   layouts: list[ParallelLayout]) -> None:
    """The --max-seq tables: per strategy, then per layout where there are several; notes, commands."""
    from memo.estimate import align, tokens

    base = next((o["longest"] for o in out_rows if o["strategy"] == StrategyName.FULL_RECOMPUTE), 0)
    table = [("strategy", "longest seq", "tokens", "vs full recompute", "layout (TP CP PP DP sharding)",
              "GiB per GPU there", "fit limit GiB", "memo policy", "host GiB/node")]
    for o in out_rows:
        e = o["estimate"]
        lay = o["layout"]
        rule = {"limit_rule": o["limit_rule"], "fit_fraction": est.machine.fit_fraction}
        table.append((
            o["strategy"],
            (tokens(o["longest"]) if o["longest"] else f"< {tokens(args.granularity)}")
            + (" (cap)" if o["capped_by_seq_cap"] else ""),
            f"{o['longest']:,}",
            f"{o['longest'] / base:.2f}x" if base and o["longest"] else "-",
            "-" if lay is None else _layout_cell(lay),
            "-" if e is None else f"{e['total_gib']:,.2f}",
            f"{_gib(o['limit_bytes'])} ({_limit_rule(rule)})",
            "-" if e is None or e["policy"] is None else _policy_cell(e),
            "-" if e is None or e["host_gib_per_node"] is None else f"{e['host_gib_per_node']:,.0f}",
        ))
    limit = (f"fit limit {_gib(est.fit_limit_bytes)} GiB for every strategy (--fit-limit-gib)"
             if est.fit_limit_bytes is not None else
             f"fit limit {est.machine.fit_fraction:.0%}: {_gib(est.machine.limit_bytes)} GiB; memo: its "
             "plan's budget")
    print(f"\nLongest sequence per strategy, {args.model} on {args.gpus} GPUs of "
          f"{args.device_mem_gb:g} GB ({limit}), host {args.host_mem_gb:g} GB per node of "
          f"{args.gpus_per_node}, {args.bandwidth_gbps:g} GB/s; method {args.method}, model states "
          f"{args.model_states}; to {tokens(args.granularity)}; only layouts memo train launches\n")
    print(align(table))
    if len(layouts) > 1:
        _print_layout_grid(args, out_rows, layouts)
    # The notes of the longest row: the others say the same at other lengths.
    top = max((o for o in out_rows if o["estimate"]), key=lambda o: o["longest"], default=None)
    for n in top["estimate"]["notes"] if top else []:
        print(f"note ({top['strategy']} at {tokens(top['longest'])}): {n}")
    print()
    for o in out_rows:
        if o["command"]:
            print(f"launch {o['strategy']} ({o['engine']}): {o['command']}")


def _print_layout_grid(args: argparse.Namespace, out_rows: list[dict[str, Any]],
                       layouts: list[ParallelLayout]) -> None:
    """--max-seq --search: the longest sequence of every strategy on every layout."""
    from memo.estimate import align, tokens

    head = ("layout (TP CP PP DP sharding)",) + tuple(o["strategy"] for o in out_rows)
    grid = [head]
    for lay in layouts:
        cells = []
        for o in out_rows:
            x = next(y for y in o["layouts"]
                     if _layout_cell(y) == _layout_cell(lay.to_dict()))
            cells.append(f"{tokens(x['longest'])}, no longer" if x["settled"] else
                         tokens(x["longest"]) if x["longest"] else
                         "screened" if x["pruned"] and x["guess"] is None else
                         f"~{tokens(x['guess'])}*" if x["pruned"] else "-")
        grid.append((_layout_cell(lay.to_dict()), *cells))
    print("\nLongest sequence per layout (DP 1: NOTE [Longest sequence layouts])\n")
    print(align(grid))
    print("no longer: it fits that length, and not one granularity past the best layout's, so it "
          "was not searched further")
    print("* not searched: the line through two lengths ends short of a length already confirmed"
          + ("" if args.method == EstimateMethod.FORMULA
             else "; screened: the closed form's screen left it out (NOTE [Fast longest-sequence search])"))


def _policy_cell(e: dict[str, Any]) -> str:
    """memo's layer policy of an estimate's dict: its kind, alpha, the segment layers and the layers that
    keep their input on the device (NOTE [Segments where the host binds], [Inputs on the device where the
    host binds] in memo/estimate/core.py)."""
    cell = e["policy"] + ("" if e["alpha"] is None else f", alpha {e['alpha']:.3f}")
    cell += f", {e['segment_layers']} segment" if e.get("segment_layers") else ""
    return cell + (f", {e['recomputed_layers']} recompute" if e.get("recomputed_layers") else "")


def _smallest_need(est: Estimator, layouts: list[ParallelLayout], strategies: tuple[str, ...], n: int) -> str:
    best = None
    for lay, s in itertools.product(layouts, strategies):
        try:
            e = est.estimate(n, lay, s)
        except MemoError:
            continue
        if best is None or e.total_bytes < best.total_bytes:
            best = e
    if best is None:
        return "unknown (no layout can run it)"
    return (f"{_gib(best.total_bytes)} GiB per GPU ({best.strategy}, {best.layout.describe()}, "
            f"{n:,} tokens)")


# ---------------------------------------------------------------- --plot


def _plot(args: argparse.Namespace, est: Estimator, out: dict[str, Any]) -> None:
    """Per strategy, the total at lengths around what was asked, on the layout asked (or, after a
    longest-sequence search, each strategy's best layout)."""
    from memo.estimate import Layout
    from memo.estimate.plot import lengths_to_plot, plot_memory

    series = []
    if out["kind"] == "memo.estimate.longest":
        top = max((s["longest"] for s in out["strategies"]), default=0) or args.granularity
        fields = ("gpus", "tp", "cp", "pp", "micro_batch", "cp_comm", "sharding", "head_chunks")
        pairs = [(s["strategy"], Layout(**{k: s["layout"][k] for k in fields}))
                 for s in out["strategies"] if s["layout"]]
    else:
        top = 2 * args.seq_len
        pairs = [(s, _layout(args)) for s in est.strategies()]
    g = args.granularity if args.max_seq else None
    lengths = lengths_to_plot(top, g, [layout for _, layout in pairs])
    for strategy, layout in pairs:
        points = []
        for n in lengths:
            try:
                e = est.estimate(n, layout, strategy)
            except MemoError:
                continue
            points.append((n, e.total_bytes))
        label = strategy if out["kind"] != "memo.estimate.longest" else f"{strategy} ({layout.short()})"
        series.append({"label": label, "points": points})
    title = (f"{est.config.name}, {args.gpus} GPUs, {args.method} method"
             + ("" if out["kind"] == "memo.estimate.longest" else f", {_layout(args).describe()}"))
    limit = est.machine.limit_bytes if est.fit_limit_bytes is None else est.fit_limit_bytes
    plot_memory(series, int(args.device_mem_gb * 1e9), limit, title, args.plot)
