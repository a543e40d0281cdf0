#!/usr/bin/env python
"""Per-stage device peak and host bytes of a pipelined ``memo train`` (issue 29), PP = 2 against PP = 1,
memo against full recompute, measured on this machine.

Each row is one ``memo train --engine megatron --micro-batches M`` run (the same model, sequence and
micro-batches), launched with ``torchrun`` for PP = 2; the numbers are the runs' own reports: each rank's
device peak (on the CPU: memo's allocator serving the steps, its peak in use plus the rank's parameters,
NOTE [Measuring device memory]), its pinned host bytes (memo's arenas) and the forwards its chunks held
in flight (NOTE [Pipeline stages]), beside what the stage's plan of its step expected of them (memo's
rows: NOTE [A stage's address plan]). The losses of every row are printed too: every layout trains the
same model (NOTE [Pipeline initialisation]).

Usage::

    python benchmarks/pipeline_stages.py                          # gpt-mini, 2K tokens, 4 micro-batches
    python benchmarks/pipeline_stages.py --model tiny --seq-len 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: (strategy, flags) of the rows: memo at a fixed alpha with the default policy for each chunk's place,
#: memo with the policy and alpha each stage's planner chooses (NOTE [A stage's profile]), and full
#: recompute.
STRATEGIES = (("memo alpha 0.25", ["--strategy", "memo", "--alpha", "0.25"]),
              ("memo planned", ["--strategy", "memo"]),
              ("full-recompute", ["--strategy", "full-recompute"]))
#: (name, processes, flags) of the layouts.
LAYOUTS = (("PP 1", 1, []), ("PP 2 (1F1B)", 2, ["--pp", "2"]),
           ("PP 2 x VPP 2", 2, ["--pp", "2", "--vpp", "2"]))


def run(layout: tuple[str, int, list[str]], strategy: tuple[str, list[str]], args: argparse.Namespace,
        out: Path) -> dict[str, Any]:
    """One ``memo train`` run; its report."""
    name, procs, flags = layout
    report = out / f"{name.replace(' ', '_')}-{strategy[0].replace(' ', '_')}.json"
    train = ["train", "--engine", "megatron", "--model", args.model, "--seq-len", str(args.seq_len),
             "--micro-batches", str(args.micro_batches), "--steps", str(args.steps), "--no-progress",
             "--report", str(report), *strategy[1], *flags]
    if procs == 1:
        cmd = [sys.executable, "-m", "memo", *train]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
               "-m", "memo", *train]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    print("pipeline_stages: " + " ".join(cmd[1:] if procs == 1 else ["torchrun", *cmd[3:]]), file=sys.stderr)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"pipeline_stages: {name} {strategy[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(report.read_text())


def rows(report: dict[str, Any], layout: str, strategy: str) -> list[dict[str, Any]]:
    """One row per stage (its first rank) of a run's report."""
    losses = [s["loss"] for s in report["steps"]]
    par = report.get("parallel")
    if par is None:
        plan = report.get("plan") or {}
        return [{"layout": layout, "strategy": strategy, "stage": 0, "peak": report["peak_device_bytes"],
                 "host": report["host_pinned_bytes"], "in_flight": None, "losses": losses,
                 "plan_total": plan.get("device_total_bytes"), "plan_host": report.get("host_pinned_bytes")
                 if plan else None, "policy": None}]
    stages: dict[int, dict[str, Any]] = {}
    for r in par["ranks"]:
        stages.setdefault(r["pp_rank"], r)
    return [{"layout": layout, "strategy": strategy, "stage": s, "peak": r["peak_device_bytes"],
             "host": r["host_pinned_bytes"], "in_flight": r.get("forwards_in_flight"), "losses": losses,
             "plan_total": r.get("plan_device_total_bytes"), "plan_host": r.get("plan_host_bytes"),
             "policy": r.get("policy"), "alpha": r.get("alpha")}
            for s, r in sorted(stages.items())]


def _policy(r: dict[str, Any]) -> str:
    """``"6 memo"`` per chunk, ``/`` between chunks, with alpha."""
    if not r.get("policy"):
        return "-"
    kinds = ("memo", "input-only", "recompute", "keep")
    chunks = [", ".join(f"{c.count(k)} {k}" for k in kinds if c.count(k)) for c in r["policy"]]
    return " / ".join(chunks) + (f" (alpha {r['alpha']:.3f})" if r.get("alpha") is not None else "")


def table(all_rows: list[dict[str, Any]]) -> str:
    mib = 2**20
    lines = ["| layout | strategy | stage | layer policy | device peak MiB | plan's device total MiB | host "
             "pinned MiB | plan's host MiB | forwards in flight per chunk | losses (first -> last) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in all_rows:
        flights = "-" if not r["in_flight"] else ", ".join(map(str, r["in_flight"]))
        total = "-" if r.get("plan_total") is None else f"{r['plan_total'] / mib:.2f}"
        host = "-" if r.get("plan_host") is None else f"{r['plan_host'] / mib:.2f}"
        lines.append(f"| {r['layout']} | {r['strategy']} | {r['stage']} | {_policy(r)} | "
                     f"{r['peak'] / mib:.2f} | {total} | {r['host'] / mib:.2f} | {host} | {flights} | "
                     f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini", help="registered model (its layers divisible by 4)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", metavar="OUT.json", help="write the rows as JSON here")
    args = p.parse_args(argv)
    all_rows = []
    with tempfile.TemporaryDirectory(prefix="memo-pp-") as tmp:
        for strategy in STRATEGIES:
            for layout in LAYOUTS:
                all_rows += rows(run(layout, strategy, args, Path(tmp)), layout[0], strategy[0])
    print(f"\n{args.model}, seq {args.seq_len}, {args.micro_batches} micro-batches, {args.steps} steps "
          "(CPU)\n")
    print(table(all_rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"version": 1, "args": vars(args), "rows": all_rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
