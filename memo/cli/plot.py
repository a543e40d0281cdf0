"""``memo plot plan.json -o plan.png``: the plan as a picture.

Time (trace event index) on x, arena address on y, one rectangle per planned
allocation, coloured by phase kind. Plans carry their allocations' lifetimes
(see docs/formats.md), so no trace is needed.
"""

from __future__ import annotations

import argparse

from memo.cli.args import figure_path
from memo.cli.show import safe_text
from memo.paths import check_distinct
from memo.phase_names import phase_kind
from memo.planner import Plan, load_plan
from memo.units import format_bytes

__all__ = ["add_parser", "plot_plan", "run"]

_COLOURS = {"embed.fwd": "#1f77b4", "layer.fwd": "#2ca02c", "head.fwd": "#ff7f0e", "head.bwd": "#d62728",
            "layer.bwd": "#9467bd", "embed.bwd": "#8c564b", "optimizer": "#e377c2", None: "#7f7f7f"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plot", help="draw a plan: time x address", description=__doc__)
    parser.add_argument("plan", help="plan JSON")
    parser.add_argument("-o", "--output", required=True, type=figure_path, help="image file (png, svg, pdf)")
    parser.set_defaults(func=run)
    return parser


def _unit(nbytes: int) -> tuple[str, int]:
    """The largest binary unit in which ``nbytes`` is at least 1, for axis labels."""
    for name, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return name, scale
    return "B", 1


#: The most rectangles drawn one by one. A figure 1,440 pixels wide cannot show more apart; past
#: this the largest (by bytes x time) are drawn and the title says how many of how many.
MAX_DRAWN = 20_000


def plot_plan(plan: Plan, path: str) -> int:
    """Draw ``plan`` into ``path``; returns the number of rectangles drawn (at most MAX_DRAWN, the
    largest by area where the plan has more)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    unit, scale = _unit(max(plan.peak, 1))
    kinds = list(_COLOURS)
    rows = [(a.start, a.end, off, a.size, kinds.index(phase_kind(a.phase) if a.phase is not None else None))
            for a, off in zip(plan.allocations, plan.offsets, strict=True) if off is not None]
    placed = len(rows)
    table = np.array(rows, dtype=np.float64).reshape(-1, 5)
    if placed > MAX_DRAWN:  # the largest by area: the ones a picture can show
        area = (table[:, 1] - table[:, 0]) * table[:, 3]
        table = table[np.argsort(-area, kind="stable")[:MAX_DRAWN]]
    x0, x1, y0 = table[:, 0], table[:, 1], table[:, 2] / scale
    y1 = y0 + table[:, 3] / scale
    # One polygon per allocation, built as one array: matplotlib draws a collection at once.
    verts = np.stack([np.stack([x0, y0], 1), np.stack([x0, y1], 1), np.stack([x1, y1], 1),
                      np.stack([x1, y0], 1)], axis=1)
    colours = [_COLOURS[kinds[int(k)]] for k in table[:, 4]]
    fig, ax = plt.subplots(figsize=(12, 6))
    edges = {"edgecolors": "black", "linewidths": 0.2} if len(table) <= 5_000 else {"edgecolors": "face"}
    ax.add_collection(PolyCollection(verts, facecolors=colours, **edges))
    ax.set_xlim(0, max(plan.end_time, max((a.end for a in plan.allocations), default=1)))
    ax.set_ylim(0, max(plan.peak, 1) / scale * 1.02)
    ax.axhline(plan.lower_bound / scale, color="red", linestyle="--", linewidth=0.8)
    ax.set_xlabel("time (trace event)")
    ax.set_ylabel(f"address ({unit})")
    shown = "" if placed <= MAX_DRAWN else f"; the largest {MAX_DRAWN:,} of {placed:,} allocations drawn"
    ax.set_title(f"{safe_text(plan.meta.get('model', 'plan'))}: peak {format_bytes(plan.peak)}, "
                 f"lower bound {format_bytes(plan.lower_bound)} (dashed){shown}")
    used = set(colours)
    # Beside the axes, never over the rectangles.
    ax.legend(handles=[Patch(color=c, label=k or "unphased") for k, c in _COLOURS.items() if c in used],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return len(table)


def run(args: argparse.Namespace) -> int:
    # NOTE [Outputs are not inputs] in memo/paths.py
    check_distinct("memo plot", [("PLAN", args.plan)], [("-o", args.output)])
    plan = load_plan(args.plan)
    n = plot_plan(plan, args.output)
    placed = sum(off is not None for off in plan.offsets)
    print(f"wrote {args.output} ({n:,} allocations" + (f" drawn of {placed:,})" if n < placed else ")"))
    return 0
