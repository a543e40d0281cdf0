"""``memo plan``: plan a trace (bi-level: greedy, exact search, DSA MIP) and write the plan.

    memo plan trace.json -o plan.json [--time-limit S] [--solver cbc|highs] [--no-mip]
    memo plan trace.json --expand -o addresses.json

``--expand`` writes ``{"peak", "lower_bound", "addresses": {"<id>": offset}}`` for
every allocation instead of the plan (an id reused after a free gets the keys
``"<id>.1"``, ``"<id>.2"``, ... for its later allocations).
"""

from __future__ import annotations

import argparse
import json
import warnings

from memo.cli.show import warning_lines
from memo.planner import Plan, load_trace, make_plan, save_plan, without_unphased
from memo.units import format_bytes

__all__ = ["add_parser", "format_summary", "run"]



def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plan", help="plan a trace: offsets for every activation allocation",
                                   description=__doc__)
    parser.add_argument("trace", help="trace JSON (memo.trace, version 1; see docs/formats.md)")
    parser.add_argument("-o", "--output", required=True, help="where to write the plan (or the addresses)")
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="seconds the whole plan may take (exact search and MIP share them); default 60")
    parser.add_argument("--solver", choices=("cbc", "highs"), default="cbc",
                        help="MIP solver: cbc (bundled with PuLP, default) or highs (needs highspy)")
    parser.add_argument("--no-mip", action="store_true",
                        help="greedy heuristic only (fast: no search, no MIP)")
    parser.add_argument("--flat", action="store_true",
                        help="plan every allocation individually (no layer blocks)")
    parser.add_argument("--for-allocator", action="store_true",
                        help="leave allocations made outside phases to memo's fallback allocator (they are "
                        "never served from the arena); default: every allocation gets an address")
    parser.add_argument("--expand", action="store_true",
                        help="write {peak, lower_bound, addresses: {id: offset}} instead of the plan")
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
    if "unphased_left_to_fallback" in s:
        left = s["unphased_left_to_fallback"]
        lines.append(f"not planned   {left['allocations']} allocations outside phases "
                     f"({format_bytes(left['bytes'])}), served by the fallback allocator")
    lines += warning_lines(plan.warnings)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    with warnings.catch_warnings():
        # The planner's warnings are in plan.warnings, which the summary prints once.
        warnings.filterwarnings("ignore", message=r"memo\.planner: ", category=UserWarning)
        plan = make_plan(trace, time_limit=args.time_limit, solver=args.solver, use_mip=not args.no_mip,
                         method="flat" if args.flat else "auto",
                         unphased="fallback" if args.for_allocator else "plan")
    if args.expand:
        out = {"peak": plan.peak, "lower_bound": plan.lower_bound, "addresses": plan.expanded()}
        with open(args.output, "w", encoding="utf-8") as f:
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
    return 0
