"""``memo profile``: record one iteration, solve alpha, write the memory plan.

Example (no GPU, no memory: the meta device)::

    memo profile --model gpt-7b --seq-len 1M --device meta --bandwidth-gbps 32 \\
        --layer-ms 9000 --host-mem-gb 2048 --gpus-per-node 8 -o plan.json

On CUDA the bandwidth and the layer time are measured unless given. The
output says which numbers were measured, given or estimated. See
docs/profiling.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

import torch

from memo.cli.args import add_machine_arguments, positive_float, positive_int, seq_len
from memo.errors import MemoError
from memo.machine import Machine
from memo.planner.vocab import RECORDERS, Recorder

if TYPE_CHECKING:
    from memo.pipeline import ProfileResult

__all__ = ["add_parser", "run"]



def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile",
        help="record one iteration's allocation trace, solve alpha and write the memory plan",
        description="Record one training iteration (forward, loss, backward), measure S_input, S_attn, "
        "S_others per layer, solve alpha, trace the wrapped model and write the memory plan. "
        "--device meta profiles any length in seconds without allocating memory.",
    )
    _add_run_arguments(p)
    _add_rank_arguments(p)
    _add_planning_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """What is profiled and where: model, sizes, dtype, device, outputs and recorder."""
    p.add_argument("--model", required=True,
                   help="registered config name (gpt-7b, llama-3.1-8b, tiny, ...) or a CONFIG.json with "
                   "memo.models.ModelConfig's fields (arch, n_layers, hidden, n_heads, ...)")
    p.add_argument(
        "--seq-len", required=True, type=seq_len, help="tokens per sequence: 4096, 128K, 1M (K=1024)"
    )
    p.add_argument(
        "--micro-batch", type=positive_int, default=1, help="sequences per micro-batch (default 1)"
    )
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    p.add_argument(
        "--device",
        choices=("meta", "cpu", "cuda"),
        default=None,
        help="default: cuda when present, else meta",
    )
    p.add_argument("-o", "--output", required=True, help="where to write the plan (JSON)")
    p.add_argument("--trace-out", help="also write the trace the plan was made from (JSON)")
    p.add_argument(
        "--recorder",
        choices=RECORDERS,
        default=None,
        help="trace to plan from. dispatch: every storage torch creates (any device, the default on "
        "meta); allocator: the real requests through memo.allocator.logging (cpu/cuda, their default)",
    )


def _add_rank_arguments(p: argparse.ArgumentParser) -> None:
    """The machine, the parallelism that makes the profiled rank, its device budget and how its
    model states are counted."""
    add_machine_arguments(
        p, "processes sharing the host memory (default: the CUDA devices here; 1 on cpu/meta)"
    )
    p.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=None,
        help="GPUs one layer is split over (Megatron tensor + sequence parallel; the paper's 1M-token runs "
        "use the node's 8): the profile, alpha, the layer policy and the plan are one rank's, with "
        "shapes sharded as megatron-core shards them. Default: 1",
    )
    p.add_argument(
        "--context-parallel",
        type=positive_int,
        default=None,
        help="GPUs the sequence is split over (megatron-core context parallelism): the profiled rank runs "
        "seq-len/c tokens, so seq-len must be a multiple of 2c (and of c x tensor-parallel). Ring "
        "attention's communication buffers are not counted. Default: 1",
    )
    p.add_argument(
        "--device-mem-gb", type=positive_float, default=None,
        help="memory of one GPU in GB (10^9 bytes): the layer policy (keep / memo / full recompute per "
        "layer) and alpha must fit it per rank, model states included. Default: no budget beyond full "
        "recompute's own need (memo never needs more)",
    )
    p.add_argument(
        "--optimizer-states", choices=("same", "mixed"), default="same",
        help="how model states are counted: same (AdamW in the model dtype, as memo train runs; default) "
        "or mixed (Megatron mixed precision: fp32 main grads, master weights and Adam moments)",
    )


def _add_planning_arguments(p: argparse.ArgumentParser) -> None:
    """The "planning" group: the planner's time and solver, and whether pass 2 runs."""
    s = p.add_argument_group("planning")
    s.add_argument(
        "--time-limit", type=positive_float, default=30.0,
        help="seconds the plan may take (exact search and MIP share them)",
    )
    s.add_argument(
        "--solver", choices=("cbc", "highs"), default=None, help="MIP solver for the planner (default: cbc)"
    )
    s.add_argument(
        "--gradients", choices=("arena", "fallback"), default="arena",
        help="where the plan puts the parameter gradients: arena (default) shares the arena's bytes "
        "with the activations freed before them, for training that sets the gradients to None after "
        "each optimizer step; fallback for gradient accumulation (several backward passes per step)",
    )
    wrap = s.add_mutually_exclusive_group()
    wrap.add_argument(
        "--wrap-pass",
        dest="wrap_pass",
        action="store_true",
        default=None,
        help="require pass 2 (wrapped model)",
    )
    wrap.add_argument(
        "--no-wrap-pass", dest="wrap_pass", action="store_false", help="plan from the plain model's trace"
    )


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "meta"


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.3f} {unit}"
    return f"{int(n)} B"


def _report(result: ProfileResult, seq_len: int, micro_batch: int, hidden: int, dtype: torch.dtype,
            ranks: int = 1) -> list[str]:
    """What a user reads: sizes per layer, machine numbers and their sources, alpha, plan.

    ``seq_len`` is the tokens of one rank's layer input: the job's over ``ranks`` = TP x CP ranks.
    """
    stats = result.layer_stats[0]
    bsh = micro_batch * seq_len * hidden * torch.empty((), dtype=dtype).element_size()
    s = "s" if ranks == 1 else f"s/{ranks}"
    lines = [
        f"per layer: S_input {_bytes(stats.s_input)}, S_attn {_bytes(stats.s_attn)}, "
        f"S_others {_bytes(stats.s_others)}; {stats.n_skeletal} skeletal and {stats.n_transient} transient "
        "allocations",
        f"  S_input + S_attn + S_others = {stats.total / bsh:.4f} x b*{s}*h elements "
        "(the paper counts 16 for its GPT; docs/profiling.md)",
    ]
    q = result.quantities
    if q:
        lines.append(f"B        {q['bandwidth_gbps'].describe('GB/s')}")
        lines.append(f"T_layer  {q['layer_ms'].describe('ms')}")
        host = q["host_memory_bytes"]
        in_gb = type(host)(host.value / 1e9, host.source, host.how)
        lines.append(f"host     {in_gb.describe('GB per node')}")
    if result.alpha is not None:
        a = result.alpha
        lines.append(
            f"alpha    {a.alpha:.4f} (binding: {a.binding}); {_bytes(a.bytes_per_layer)} copied per layer in "
            f"{a.copy_seconds * 1e3:,.1f} ms; pinned host {_bytes(a.host_bytes)} of {_bytes(a.host_memory)}"
        )
    if result.policy is not None:
        from memo.planner import describe_policy

        pol = result.policy
        letters = " ".join(x[0] for x in pol.policy)
        lines.append(f"policy   {describe_policy(pol.policy)} (per layer: {letters}; "
                     "m = memo, r = full recompute, k = keep)")
    if result.plan is not None:
        p = result.plan
        lines.append(
            f"plan     peak {_bytes(p.peak)}, lower bound {_bytes(p.lower_bound)} "
            f"({p.peak / max(p.lower_bound, 1):.3f}x), trace from the "
            f"{'wrapped' if result.wrapped else 'plain'} model"
        )
        if p.device:
            d = p.device
            budget = d["budget_bytes"]
            lines.append(f"device   {_bytes(d['total_bytes'])} per rank (iteration peak "
                         f"{_bytes(d['iteration_peak_bytes'])} + parameters and optimizer states)"
                         + (f" of {_bytes(budget)} budget" if budget else "")
                         + f"; full recompute needs {_bytes(d['estimate']['full_recompute_bytes'])}")
    return lines


def _fill_defaults(args: argparse.Namespace) -> tuple[dict[str, str], int]:
    """Fill in the defaults of ``args`` in place, refusing a --device not here or a length the ranks
    cannot share. Returns where the tensor-parallel, context-parallel and GPUs-per-node numbers
    came from, and the tokens the profiled rank runs."""
    from memo.profiler import rank_tokens

    if args.device is None:
        args.device = _default_device()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MemoError("memo profile: --device cuda given but torch sees no CUDA device; use --device meta")
    if args.recorder is None:
        # Plans are replayed by (phase, request index), so on a real device the trace should be the
        # allocator's own requests (docs/profiling.md, "Which recorder"); meta has only dispatch.
        args.recorder = Recorder.DISPATCH.value if args.device == "meta" else Recorder.ALLOCATOR.value
    sources = {"tp": "given", "cp": "given", "gpus": "given"}
    if args.tensor_parallel is None:
        # The profile is of one rank as given: no sharding unless asked for (the paper's 1M-token
        # runs split each layer over the node's 8 GPUs: --tensor-parallel 8).
        args.tensor_parallel, sources["tp"] = 1, "default"
    if args.context_parallel is None:
        args.context_parallel, sources["cp"] = 1, "default"
    group = args.tensor_parallel * args.context_parallel
    # A length the ranks cannot share is refused before anything is built.
    rank_seq = rank_tokens(args.seq_len, args.tensor_parallel, args.context_parallel)
    if args.gpus_per_node is None:
        # Every GPU of the node is one process sharing its host memory. Without CUDA here, assume
        # the profiled rank's TP x CP group fills the node (fewer host bytes per process than
        # one process alone would claim: the safe side); --gpus-per-node says otherwise.
        if args.device == "cuda":
            args.gpus_per_node, sources["gpus"] = torch.cuda.device_count(), "the CUDA devices here"
        else:
            args.gpus_per_node = group
            sources["gpus"] = ("default: one process" if group == 1 else
                               f"assumed: the TP x CP group of {group} ranks on one node; "
                               "pass --gpus-per-node")
    return sources, rank_seq


def _print_rank(args: argparse.Namespace, sources: dict[str, str], rank_seq: int) -> None:
    """The host share, tensor and context parallelism of the profiled rank, and where each came from."""
    print(f"M_CPU    host memory x {args.host_safety:g} / {args.gpus_per_node} GPU(s) per node "
          f"[{sources['gpus']}]")
    print(f"TP       {args.tensor_parallel}-way tensor+sequence parallel per layer [{sources['tp']}]")
    print(f"CP       {args.context_parallel}-way context parallel [{sources['cp']}]: the rank runs "
          f"{rank_seq:,} of {args.seq_len:,} tokens, its layer input holds "
          f"{rank_seq // args.tensor_parallel:,}")


def run(args: argparse.Namespace) -> int:
    from memo.jsonio import check_writable
    from memo.paths import check_distinct
    from memo.pipeline import DTYPES, profile

    # NOTE [Outputs are not inputs] in memo/paths.py; --model may be a CONFIG.json
    check_distinct("memo profile", [("--model", args.model if os.path.isfile(args.model) else None)],
                   [("-o", args.output), ("--trace-out", args.trace_out)])
    check_writable(args.output, "memo profile -o")
    if args.trace_out:
        check_writable(args.trace_out, "memo profile --trace-out")

    if args.dtype not in DTYPES:
        raise MemoError(f"memo profile: unknown --dtype {args.dtype!r}; use one of {', '.join(DTYPES)}")
    from memo.models import get_config

    config = get_config(args.model)  # unknown names fail here with the list of valid ones
    sources, rank_seq = _fill_defaults(args)
    group = args.tensor_parallel * args.context_parallel
    from memo.planner import Trace, save_plan, save_trace

    dtype = DTYPES[args.dtype]
    start = time.perf_counter()
    print(
        f"memo profile: {args.model}, seq_len {args.seq_len:,}, micro-batch {args.micro_batch}, "
        f"{args.dtype} on {args.device}, {args.recorder} recorder"
        + (f", one rank of TP {args.tensor_parallel} x CP {args.context_parallel}" if group > 1 else ""),
        file=sys.stderr,
    )
    result = profile(
        args.model,
        args.seq_len,
        args.micro_batch,
        dtype,
        args.device,
        machine=Machine.from_args(args),
        tensor_parallel=args.tensor_parallel,
        context_parallel=args.context_parallel,
        optimizer_states=args.optimizer_states,
        gradients=args.gradients,
        recorder=args.recorder,
        wrap_pass=args.wrap_pass,
        time_limit=args.time_limit,
        solver=args.solver,
        progress=not args.quiet and sys.stderr.isatty(),
        log=lambda line: print(f"  {line}", file=sys.stderr),
    )
    for line in _report(result, rank_seq // args.tensor_parallel, args.micro_batch, config.hidden, dtype,
                        group):
        print(line)
    _print_rank(args, sources, rank_seq)
    for note in result.notes:
        print(f"note: {note}")
    if args.trace_out:
        save_trace(Trace.from_dict(result.trace), args.trace_out)
        print(f"trace: {args.trace_out} ({len(result.trace['events']):,} events)")
    save_plan(result.plan, args.output)
    print(f"plan: {args.output} (alpha {result.alpha.alpha:.4f}); total {time.perf_counter() - start:.1f} s")
    return 0
