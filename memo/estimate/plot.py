"""Per-GPU memory against sequence length, one line per strategy, with the GPU's memory."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from memo.token_split import token_multiple
from memo.units import GiB

if TYPE_CHECKING:
    from memo.estimate.layout import ParallelLayout

__all__ = ["plot_memory"]



def plot_memory(series: list[dict[str, Any]], device_bytes: int, limit_bytes: int, title: str,
                path: str) -> None:
    """``series``: ``{"label": str, "points": [(seq_len, total_bytes), ...]}`` per strategy. The GPU's
    memory is a solid line, the share an estimate may fill (the 80% rule) a dashed one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memo.estimate.search import tokens

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = ["o-", "s--", "^-.", "d:"]
    lengths: set[int] = set()
    for i, s in enumerate(series):
        pts = sorted(s["points"])
        if not pts:
            continue
        lengths.update(p[0] for p in pts)
        ax.plot([p[0] for p in pts], [p[1] / GiB for p in pts], styles[i % len(styles)], label=s["label"])
    ax.axhline(device_bytes / GiB, color="black", linewidth=1.2,
               label=f"GPU memory ({device_bytes / GiB:,.1f} GiB)")
    ax.axhline(limit_bytes / GiB, color="gray", linestyle="--", linewidth=1.0,
               label=f"fit limit ({limit_bytes / device_bytes:.0%})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ticks = sorted(lengths)
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([tokens(t) for t in ticks], rotation=45, fontsize="small")
        ax.minorticks_off()
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("per-GPU memory (GiB)")
    ax.set_title(title, fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def lengths_to_plot(top: int, granularity: int | None, layouts: list[ParallelLayout]) -> list[int]:
    """Eight lengths, doubling up to ``top`` (rounded up), each valid for every layout drawn."""
    step = math.lcm(*(token_multiple(lay.tp, lay.cp) for lay in layouts)) if layouts else 1
    if granularity:
        step = math.lcm(step, granularity)
    lengths, n = [], max(step, (top >> 7) // step * step)
    while n < 2 * top and len(lengths) < 9:
        lengths.append(n)
        n = -(-2 * n // step) * step
    return lengths or [step]
