#!/usr/bin/env python
"""The main job, end to end: environment -> profile -> plan -> train with memo and baselines.

``make demo`` runs this. Every step is a `memo` command a user could type; each is printed
before it runs. At the end a side-by-side table compares memo with full recompute and with
plain autograd, and the loss curves are drawn on one figure.

memo is planned and trained within a device budget (``--device-mem-gb``; on CPU the device is
memo's allocator, capped at it, so going over is a real failed allocation) that is smaller
than what full recompute needs for the same job: memo trains where full recompute would not
fit. The baselines run without the cap, so that their needs can be read off and compared.

On a CUDA machine the same script uses the GPU (bf16, no budget unless one is given);
elsewhere the CPU backend (fp32).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from memo.units import format_mib

STRATEGIES = ("memo", "full-recompute", "none")


def sh(*args: str) -> None:
    """Run one `memo` command, showing it first; stop the demo if it fails."""
    cmd = [sys.executable, "-m", "memo", *args]
    print(f"\n$ memo {shlex.join(args)}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd)
    if done.returncode != 0:
        sys.exit(f"demo: `memo {args[0]}` failed with exit code {done.returncode}")
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)




def step_times(report: dict) -> tuple[float, float, float]:
    """Median, fastest and slowest step time in seconds over the steps after the first (warm-up)."""
    times = [st["step_time_s"] for st in report["steps"]]
    timed = times[1:] or times
    return statistics.median(timed), min(timed), max(timed)


def table(reports: dict[str, dict]) -> str:
    base_time = step_times(reports["full-recompute"])[0]
    base_peak = reports["full-recompute"]["peak_device_bytes"]
    rows = [
        ("strategy", "alpha", "loss first->last", "step time (median, range)", "speed vs FR (higher=faster)",
         "device peak", "peak vs FR (lower=less)", "host pinned", "alloc planned/fallback"),
    ]
    for name in STRATEGIES:
        r = reports[name]
        s = r["summary"]
        median, fastest, slowest = step_times(r)
        rows.append((
            name,
            "-" if r["alpha"] is None else f"{r['alpha']:.3f}",
            f"{s['first_loss']:.4f}->{s['last_loss']:.4f}",
            f"{median * 1e3:,.0f} ms ({fastest * 1e3:,.0f}-{slowest * 1e3:,.0f})",
            f"{base_time / median:.2f}x",
            format_mib(r["peak_device_bytes"]),
            f"{r['peak_device_bytes'] / base_peak:.2f}x",
            format_mib(r["host_pinned_bytes"]),
            f"{r['allocator']['planned']}/{r['allocator']['fallback']}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(reports: dict[str, dict], plan: dict) -> str:
    """What this run shows, in words and numbers: what memo saved and what it cost, and why."""
    memo, full, plain = reports["memo"], reports["full-recompute"], reports["none"]
    m_time, m_fast, m_slow = step_times(memo)
    f_time, f_fast, f_slow = step_times(full)
    speed = f_time / m_time
    saved = full["peak_device_bytes"] - memo["peak_device_bytes"]
    peak = memo["peak_device_bytes"] / full["peak_device_bytes"]
    same = memo["summary"]["last_loss"] == full["summary"]["last_loss"] == plain["summary"]["last_loss"]
    alpha = memo["alpha"]
    policy = plan.get("policy") or []
    counts = {k: policy.count(k) for k in ("memo", "recompute", "keep") if policy.count(k)}
    layers = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no layer policy"
    binding = str(plan.get("alpha_binding") or "-").replace("_", " ")
    budget = (plan.get("device") or {}).get("budget_bytes")
    fits = "" if budget is None else (
        f"memo was planned and trained within a device budget of {format_mib(budget)} per GPU; full "
        f"recompute {'would not fit in it' if full['peak_device_bytes'] > budget else 'fits in it too'}"
        f" ({format_mib(full['peak_device_bytes'])}), plain autograd "
        f"{'would not either' if plain['peak_device_bytes'] > budget else 'fits too'}"
        f" ({format_mib(plain['peak_device_bytes'])}).")
    parts = [fits,
        f"The plan: {layers} (of {len(policy)} layers), alpha {alpha:.3f}, bound by {binding}.",
        f"Device memory: memo peaked at {format_mib(memo['peak_device_bytes'])}, full recompute at "
        f"{format_mib(full['peak_device_bytes'])} and plain autograd at "
        f"{format_mib(plain['peak_device_bytes'])}; "
        + (f"memo saved {format_mib(saved)} against full recompute ({100 * (1 - peak):.0f}% less, "
           f"{peak:.2f}x; lower is better)" if saved > 0 else
           f"memo needed {format_mib(-saved)} more than full recompute ({peak:.2f}x; lower is better)")
        + f", {memo['peak_device_bytes'] / plain['peak_device_bytes']:.2f}x plain autograd's.",
        f"What it cost: {format_mib(memo['host_pinned_bytes'])} of pinned host memory for the offloaded "
        f"activations, and a median {m_time * 1e3:,.0f} ms per step (range {m_fast * 1e3:,.0f}-"
        f"{m_slow * 1e3:,.0f}) against full recompute's {f_time * 1e3:,.0f} ms ({f_fast * 1e3:,.0f}-"
        f"{f_slow * 1e3:,.0f}): {speed:.2f}x full recompute's speed (higher is faster), "
        + (f"{100 * (1 - m_time / f_time):.0f}% less time per step." if speed >= 1
           else f"{100 * (m_time / f_time - 1):.0f}% more time per step."),
        ("All three reached the same loss." if same else "The losses differ: see the loss curves."),
        "Why: full recompute keeps every layer's input on the device until its backward; an offloading "
        "layer keeps nothing there (a memo layer sends its input, its attention output and alpha of its "
        "other activations to host memory, an input-only layer its input alone), and its backward "
        "recomputes the rest one tile of tokens at a time. The longer the sequence and the deeper the "
        "model, the more this saves: benchmarks/max_seq_len.py trains longer sequences than full "
        "recompute in the same device memory (benchmarks/RESULTS.md).",
    ]
    return "\n".join(textwrap.wrap(" ".join(p for p in parts if p), 100))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out", help="folder for the plan, picture, reports (demo_out)")
    parser.add_argument("--model", default="gpt-mini", help="model to train (gpt-mini: 12 layers, h 128)")
    parser.add_argument("--seq-len", default="4K", help="tokens per sequence (4K)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per strategy (6)")
    parser.add_argument("--device-mem-gb", type=float, default=None,
                        help="device budget memo is planned and trained within (default on CPU: 0.08 GB, "
                        "less than full recompute needs for gpt-mini at 4K; on CUDA: none)")
    args = parser.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = ["--model", args.model, "--seq-len", args.seq_len]

    budget = args.device_mem_gb if args.device_mem_gb is not None or cuda else 0.08
    capped = [] if budget is None else ["--device-mem-gb", f"{budget:g}"]

    print(f"memo demo: {args.model} at {args.seq_len} tokens on {device} ({dtype}); files in {out}/")
    sh("env", "--no-bandwidth") if not cuda else sh("env")
    sh("profile", *run, "--device", device, "--dtype", dtype, *capped, "-o", str(out / "plan.json"),
       "--trace-out", str(out / "trace.json"), "--quiet")
    sh("show", str(out / "plan.json"))
    sh("plot", str(out / "plan.json"), "-o", str(out / "plan.png"))
    common = [*run, "--steps", str(args.steps), "--device", device, "--dtype", dtype, "--no-progress"]
    sh("train", *common, "--strategy", "memo", "--plan", str(out / "plan.json"), *capped, "--report",
       str(out / "memo.json"))
    sh("train", *common, "--strategy", "full-recompute", "--report", str(out / "full-recompute.json"))
    sh("train", *common, "--strategy", "none", "--report", str(out / "none.json"), "--plot",
       str(out / "loss.png"), "--compare", str(out / "memo.json"), str(out / "full-recompute.json"))

    reports = {name: json.loads((out / f"{name}.json").read_text()) for name in STRATEGIES}
    print("\nmemo demo: side by side (steps after the first; FR = full recompute)\n")
    print(table(reports))
    print(f"\nplan picture: {out / 'plan.png'}   loss curves: {out / 'loss.png'}\n")
    print(summary(reports, json.loads((out / "plan.json").read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
