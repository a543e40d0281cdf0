"""``memo plan``: plan a trace (bi-level: greedy, exact search, DSA MIP) and write the plan.

    memo plan trace.json -o plan.json [--time-limit S] [--solver cbc|highs] [--no-mip]
    memo plan trace.json -o plan.json --device-mem-gb 80
    memo plan trace.json --expand -o addresses.json
    memo plan trace.json -o plan.json --capacity 1MiB --time-limit 10

``--capacity`` turns the search from minimising into a decision: the first placement within
that many bytes is kept (often far sooner than the minimum is proven), and the command exits 1
when none was found in time, with the numbers. ``--time-limit`` counts from the command's
start, so the whole command, start-up and reading the trace included, keeps to it.

``--expand`` writes ``{"peak", "lower_bound", "addresses": {"<id>": offset}}`` for
every allocation instead of the plan (an id reused after a free gets the keys
``"<id>.1"``, ``"<id>.2"``, ... for its later allocations).

``--device-mem-gb G`` checks that the plan fits one GPU of G GB (10^9 bytes) and records the
budget in the plan as ``memo profile --device-mem-gb`` does (``memo show`` prints it). The need
is the iteration's peak (the plan's arena, or the most bytes live at once in the whole trace when
that is more) plus the parameters and optimizer states when the trace's meta records the model
states (``model_states``, NOTE [Model states]); a trace that records none is checked on its
iteration alone, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

from memo.cli.args import byte_count, positive_float
from memo.cli.show import device_lines, warning_lines
from memo.errors import MemoError
from memo.jsonio import atomic_write, check_writable
from memo.paths import check_distinct
from memo.planner import Plan, Trace, load_trace, lower_bound, make_plan, save_plan, without_unphased
from memo.units import GB, format_bytes

__all__ = ["add_parser", "device_need", "format_summary", "run"]



def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plan", help="plan a trace: offsets for every activation allocation",
                                   description=__doc__)
    parser.add_argument("trace", help="trace JSON (memo.trace, version 1; see docs/formats.md)")
    parser.add_argument("-o", "--output", required=True, help="where to write the plan (or the addresses)")
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="seconds the whole command may take, counted from its start (reading the "
                        "trace, exact search and MIP share them); default 60")
    parser.add_argument("--capacity", type=byte_count, default=None, metavar="BYTES",
                        help="bytes the arena may take (1048576, 1MiB, 80GB): the search stops at the first "
                        "placement within them instead of minimising further, and memo plan exits 1, after "
                        "writing the best plan it found, when none fits within --time-limit. Default: "
                        "minimise the peak")
    parser.add_argument("--solver", choices=("cbc", "highs"), default="cbc",
                        help="MIP solver: cbc (bundled with PuLP, default) or highs (needs highspy)")
    parser.add_argument("--no-mip", action="store_true",
                        help="greedy heuristic only (fast: no search, no MIP)")
    parser.add_argument("--flat", action="store_true",
                        help="plan every allocation individually (no layer blocks)")
    parser.add_argument("--for-allocator", action="store_true",
                        help="leave allocations made outside phases to memo's fallback allocator (they are "
                        "never served from the arena); default: every allocation gets an address")
    parser.add_argument("--gradients", choices=("arena", "fallback"), default="arena",
                        help="with --for-allocator, where the parameter gradients go: arena (default), "
                        "sharing its bytes with the activations freed before them, for training that sets "
                        "the gradients to None after each optimizer step; fallback for gradient accumulation")
    parser.add_argument("--expand", action="store_true",
                        help="write {peak, lower_bound, addresses: {id: offset}} instead of the plan")
    parser.add_argument("--device-mem-gb", type=positive_float, default=None, metavar="GB",
                        help="memory of one GPU in GB (10^9 bytes): refuse a plan whose iteration peak, plus "
                        "the parameters and optimizer states when the trace records them, does not fit it, "
                        "and record the budget in the plan (`memo show` prints it). Default: no check")
    parser.set_defaults(func=run)
    return parser


def format_summary(plan: Plan) -> str:
    """A few lines: peak, lower bound, ratio, no-reuse size, solver."""
    s = plan.solver
    lines = [
        f"allocations   {len(plan.allocations)}",
        f"peak          {format_bytes(plan.peak)}",
        f"lower bound   {format_bytes(plan.lower_bound)}",
        f"ratio         {plan.ratio:.4f}",
        f"no reuse      {format_bytes(plan.no_reuse_bytes)}",
        f"solver        {s.get('kind')} {s.get('solver') or 'heuristic only'}, {s.get('seconds', 0):.2f} s"
        + (", heuristic fallback" if s.get("heuristic_fallback") else ""),
    ]
    total = s.get("total") if isinstance(s.get("total"), dict) else s
    if "optimal" in total:
        gap = 100 * total.get("optimality_gap", 0)
        proven = "yes (proven)" if total["optimal"] else f"not proven; at most {gap:.2f}% above"
        lines.append(f"optimal       {proven}")
    if "unphased_left_to_fallback" in s:
        left = s["unphased_left_to_fallback"]
        lines.append(f"not planned   {left['allocations']} allocations outside phases "
                     f"({format_bytes(left['bytes'])}), served by the fallback allocator")
    if "gradients_in_arena" in s:
        grads = s["gradients_in_arena"]
        lines.append(f"gradients     {grads['allocations']} in the arena ({format_bytes(grads['bytes'])}), "
                     "sharing it with the activations freed before them")
    lines += device_lines(plan.device)
    lines += warning_lines(plan.warnings)
    return "\n".join(lines)


def _trace_model_states(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The model states a trace's meta records (NOTE [Model states]), or None when it records none."""
    states = meta.get("model_states")
    if states is None:
        return None
    try:
        for part in ("parameters", "gradients", "optimizer"):
            value = states[part]["bytes"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(part)
    except (KeyError, TypeError, ValueError):
        raise MemoError("memo plan: the trace's meta.model_states must give parameters, gradients and "
                        "optimizer bytes (ints >= 0), as `memo profile` records them; fix or drop the "
                        "key") from None
    return dict(states)


def device_need(trace: Trace, plan: Plan, budget_bytes: int | None = None) -> dict[str, Any]:
    """One rank's device memory for ``plan`` (NOTE [Device total] in memo/pipeline/device.py), as
    ``Plan.device`` records it.

    The iteration needs the plan's arena, or the most bytes live at once in the whole trace when
    that is more (a plan for the allocator leaves unphased requests and gradients to its fallback,
    which needs device memory too). Parameters and optimizer states live across iterations and are
    not in the trace: they are added when the trace's meta records them (gradients are in the
    trace). ``model_states`` is None when it records none: the total is the iteration's alone.
    """
    states = _trace_model_states(trace.meta)
    iteration = max(int(plan.peak), int(lower_bound(trace)))
    static = 0 if states is None else int(states["parameters"]["bytes"]) + int(states["optimizer"]["bytes"])
    return {"budget_bytes": budget_bytes, "model_states": states, "activations_bytes": int(plan.peak),
            "iteration_peak_bytes": iteration, "total_bytes": iteration + static}


def _check_budget(device: dict[str, Any], gb: float) -> None:
    """Refuse a plan that does not fit ``--device-mem-gb``: the need, its parts, the budget, what to do."""
    need, budget = device["total_bytes"], device["budget_bytes"]
    if need <= budget:
        return
    iteration = device["iteration_peak_bytes"]
    if device["model_states"] is None:
        parts = ("the iteration's peak alone: the trace records no model states, so parameters, gradients "
                 "and optimizer states are not counted")
    else:
        parts = (f"iteration peak {format_bytes(iteration)} + parameters and optimizer states "
                 f"{format_bytes(need - iteration)}")
    raise MemoError(
        f"memo plan: the plan needs {format_bytes(need)} ({need:,} bytes) of device memory per rank "
        f"({parts}), more than --device-mem-gb {gb:g} ({format_bytes(budget)}, {budget:,} bytes). "
        f"Give a larger --device-mem-gb, or profile again with `memo profile --device-mem-gb {gb:g}` "
        "(it chooses a layer policy, keep / memo / full recompute per layer, that fits), a shorter "
        "--seq-len, a smaller --micro-batch or more --tensor-parallel"
    )


def run(args: argparse.Namespace) -> int:
    # NOTE [Outputs are not inputs] in memo/paths.py
    check_distinct("memo plan", [("TRACE", args.trace)], [("-o", args.output)])
    check_writable(args.output, "memo plan -o")
    trace = load_trace(args.trace)
    with warnings.catch_warnings():
        # The planner's warnings are in plan.warnings, which the summary prints once.
        warnings.filterwarnings("ignore", message=r"memo\.planner: ", category=UserWarning)
        plan = make_plan(trace, time_limit=_time_left(args), solver=args.solver, use_mip=not args.no_mip,
                         method="flat" if args.flat else "auto",
                         unphased="fallback" if args.for_allocator else "plan", capacity=args.capacity,
                         gradients=args.gradients)
    if args.device_mem_gb is not None:
        # The same record as `memo profile --device-mem-gb` (Plan.device), checked before writing.
        plan.device = device_need(trace, plan, int(args.device_mem_gb * GB))
        _check_budget(plan.device, args.device_mem_gb)
    if args.expand:
        out = {"peak": plan.peak, "lower_bound": plan.lower_bound, "addresses": plan.expanded()}
        with atomic_write(args.output, "memo plan") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    else:
        save_plan(plan, args.output)
    print(format_summary(plan))
    if not args.for_allocator:
        _, count, nbytes = without_unphased(trace)
        if count:
            print(f"note          {count} allocations made outside phases ({format_bytes(nbytes)}) got "
                  "addresses too; `memo profile` plans for memo's allocator, which serves those from its "
                  "fallback: add --for-allocator for the same plan")
    print(f"wrote {args.output}")
    if args.capacity is not None and plan.peak > args.capacity:
        print(f"memo plan: the plan needs {format_bytes(plan.peak)} ({plan.peak:,} bytes), over the capacity "
              f"of {format_bytes(args.capacity)} ({args.capacity:,} bytes); the lower bound is "
              f"{format_bytes(plan.lower_bound)}. Give more --time-limit, or more capacity", file=sys.stderr)
        return 1
    return 0


#: Seconds kept back from --time-limit for writing the plan and printing the summary.
_WRITE_RESERVE = 0.2


def _time_left(args: argparse.Namespace) -> float:
    """--time-limit less what the command has already spent (start-up, reading the trace)."""
    started = getattr(args, "started", None)
    spent = 0.0 if started is None else time.monotonic() - started
    left = args.time_limit - spent - _WRITE_RESERVE
    if left <= 0:
        raise MemoError(f"memo plan: --time-limit {args.time_limit:g} s was spent before planning began "
                        f"({spent:.1f} s reading the trace); give more")
    return left
