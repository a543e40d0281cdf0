#!/usr/bin/env python
"""The main job, end to end: environment -> profile -> plan -> train with memo and baselines.

``make demo`` runs this. Every step is a `memo` command a user could type; each is printed
before it runs. At the end a side-by-side table compares memo with full recompute and with
plain autograd, and the loss curves are drawn on one figure.

On a CUDA machine the same script uses the GPU (bf16); elsewhere the CPU backend (fp32).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
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




def table(reports: dict[str, dict]) -> str:
    base = reports["full-recompute"]
    base_time = base["summary"]["mean_step_time_s"]
    rows = [
        ("strategy", "alpha", "loss first->last", "step time", "vs recompute", "device peak", "host pinned",
         "alloc planned/fallback"),
    ]
    for name in STRATEGIES:
        r = reports[name]
        s = r["summary"]
        rows.append((
            name,
            "-" if r["alpha"] is None else f"{r['alpha']:.3f}",
            f"{s['first_loss']:.4f}->{s['last_loss']:.4f}",
            f"{s['mean_step_time_s'] * 1e3:,.0f} ms",
            f"{base_time / s['mean_step_time_s']:.2f}x",
            format_mib(r["peak_device_bytes"]),
            format_mib(r["host_pinned_bytes"]),
            f"{r['allocator']['planned']}/{r['allocator']['fallback']}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out", help="folder for the plan, picture, reports (demo_out)")
    parser.add_argument("--model", default="gpt-mini", help="model to train (gpt-mini: 12 layers, h 128)")
    parser.add_argument("--seq-len", default="4K", help="tokens per sequence (4K)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per strategy (6)")
    args = parser.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = ["--model", args.model, "--seq-len", args.seq_len]

    print(f"memo demo: {args.model} at {args.seq_len} tokens on {device} ({dtype}); files in {out}/")
    sh("env", "--no-bandwidth") if not cuda else sh("env")
    sh("profile", *run, "--device", device, "--dtype", dtype, "-o", str(out / "plan.json"),
       "--trace-out", str(out / "trace.json"), "--quiet")
    sh("show", str(out / "plan.json"))
    sh("plot", str(out / "plan.json"), "-o", str(out / "plan.png"))
    common = [*run, "--steps", str(args.steps), "--device", device, "--dtype", dtype, "--no-progress"]
    sh("train", *common, "--strategy", "memo", "--plan", str(out / "plan.json"), "--report",
       str(out / "memo.json"))
    sh("train", *common, "--strategy", "full-recompute", "--report", str(out / "full-recompute.json"))
    sh("train", *common, "--strategy", "none", "--report", str(out / "none.json"), "--plot",
       str(out / "loss.png"), "--compare", str(out / "memo.json"), str(out / "full-recompute.json"))

    reports = {name: json.loads((out / f"{name}.json").read_text()) for name in STRATEGIES}
    print("\nmemo demo: side by side (step time is the mean over steps after the first)\n")
    print(table(reports))
    print(f"\nplan picture: {out / 'plan.png'}   loss curves: {out / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
