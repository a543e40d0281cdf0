"""Figures of training reports: loss curves (the paper's Figure 12d)."""

from __future__ import annotations

from typing import Any

__all__ = ["plot_losses"]


def plot_losses(reports: list[dict[str, Any]], path: str) -> None:
    """Loss curves of several reports (``memo.report`` dicts) on one figure, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":", "-."]
    for i, rep in enumerate(reports):
        label = rep["strategy"] if rep["alpha"] is None else f"{rep['strategy']} (alpha={rep['alpha']:.3g})"
        xs = [s["step"] for s in rep["steps"]]
        ys = [s["loss"] for s in rep["steps"]]
        ax.plot(xs, ys, styles[i % len(styles)], linewidth=2.2 - 0.3 * (i % 4), label=label)
    first = reports[0]
    ax.set_title(f"{first['model']}, seq {first['seq_len']:,} x {first['micro_batch']}, {first['dtype']}")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("training loss")
    curves = [[s["loss"] for s in rep["steps"]] for rep in reports]
    if len(curves) > 1 and all(c == curves[0] for c in curves[1:]):
        # Identical losses draw one line; say so, or a reader looks for the missing curves.
        ax.text(0.02, 0.03, "all curves coincide (identical losses)", transform=ax.transAxes,
                fontsize="small", color="dimgray")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
