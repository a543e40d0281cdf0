#!/usr/bin/env python
"""memo and full recompute on cores another job shares: step time alone and beside a fixed CPU load.

Each row runs ``memo train`` (the demo's job: gpt-mini at 4K on the CPU, memo planned within 0.08 GB,
so its layers run in the demo's 256-token tiles) for memo and for full recompute, once on the machine
as it is and once beside one busy-loop process per core that this script starts and stops. The table
gives each strategy's median step time (steps after the first) and how much slower it got under the
load; memo should degrade no worse than full recompute (the last column at or below 1).

Two OpenMP wait settings are compared (NOTE [OpenMP threads that sleep] in memo/cli/main.py):
``passive``, what ``memo`` sets, and ``spin``, libgomp's default of spinning ~3 ms at each barrier
(``GOMP_SPINCOUNT=300000``), what every ``memo`` command ran with before.

    python benchmarks/contention.py --json benchmarks/results/contention-DATE.json

The table in benchmarks/RESULTS.md is ``python benchmarks/contention.py --from-json FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: OpenMP wait settings: the environment each adds to the ``memo`` commands.
WAITS = {"passive": {}, "spin": {"GOMP_SPINCOUNT": "300000"}}
STRATEGIES = ("memo", "full-recompute")
BUSY_LOOP = "while True:\n    pass\n"


def memo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "memo", *args]


def run(cmd: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"contention: {' '.join(cmd[2:5])} ... failed ({done.returncode}):\n{done.stderr[-2000:]}")


def step_time(report: Path) -> float:
    """Median step time in seconds over the steps after the first (warm-up)."""
    times = [s["step_time_s"] for s in json.loads(report.read_text())["steps"]]
    return statistics.median(times[1:] or times)


def start_load(n: int) -> list[subprocess.Popen]:
    """``n`` busy-loop processes (one per core): a fixed CPU load beside the measured job."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def measure(args: argparse.Namespace, folder: Path) -> list[dict]:
    job = ["--model", args.model, "--seq-len", args.seq_len, "--device", "cpu", "--dtype", "float32"]
    plan = folder / "plan.json"
    print(f"contention: planning memo for {args.model} at {args.seq_len} within {args.device_mem_gb} GB",
          flush=True)
    run(memo_cmd("profile", *job, "--device-mem-gb", str(args.device_mem_gb), "-o", str(plan), "--quiet"), {})
    rows = []
    for wait, env in WAITS.items():
        for load in (0, args.load):
            procs = start_load(load)
            try:
                rows.append({"waits": wait, "load_processes": load,
                             **{name: train_step(args, job, folder, plan, name, env) for name in STRATEGIES}})
            finally:
                stop_load(procs)
            print(f"  {wait} waits, {load} busy loops: memo {rows[-1]['memo']:.2f} s/step, full recompute "
                  f"{rows[-1]['full-recompute']:.2f} s/step", flush=True)
    return rows


def train_step(args: argparse.Namespace, job: list[str], folder: Path, plan: Path, name: str,
               env: dict[str, str]) -> float:
    """One ``memo train`` of ``name``; its median step time."""
    report = folder / f"{name}.json"
    extra = ["--plan", str(plan), "--device-mem-gb", str(args.device_mem_gb)] if name == "memo" else []
    run(memo_cmd("train", *job, "--steps", str(args.steps), "--strategy", name, "--no-progress",
                 "--report", str(report), *extra), env)
    return step_time(report)


def table(rows: list[dict], meta: dict) -> str:
    quiet = {r["waits"]: r for r in rows if r["load_processes"] == 0}
    lines = [f"{meta['model']} at {meta['seq_len']}, {meta['steps']} steps (median of steps 2..), "
             f"{meta['cores']} cores, {meta['date']}; busy loops: processes beside the job; the machine's "
             f"load average before: {meta['load_average_before']:.1f}",
             "",
             "| OpenMP waits | busy loops | memo s/step | full recompute s/step | memo / FR | memo slowdown "
             "| FR slowdown | memo slowdown / FR slowdown |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = quiet[r["waits"]]
        memo_slow, fr_slow = r["memo"] / base["memo"], r["full-recompute"] / base["full-recompute"]
        memo, fr = r["memo"], r["full-recompute"]
        lines.append(f"| {r['waits']} | {r['load_processes']} | {memo:.2f} | {fr:.2f} | {memo / fr:.2f} | "
                     f"{memo_slow:.2f}x | {fr_slow:.2f}x | {memo_slow / fr_slow:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--seq-len", default="4K")
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is not timed (3)")
    p.add_argument("--device-mem-gb", type=float, default=0.08, help="memo's device budget (the demo's 0.08)")
    p.add_argument("--load", type=int, default=os.cpu_count() or 1,
                   help="busy-loop processes beside the job (default: one per core)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--from-json", default=None, help="print the table of a saved run; run nothing")
    args = p.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(table(saved["rows"], saved["meta"]))
        return 0
    if args.steps < 2:
        sys.exit("contention: --steps must be at least 2 (the first step is not timed)")
    # the machine's own load (other jobs), which the table cannot remove
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args, Path(tmp))
    meta = {"model": args.model, "seq_len": args.seq_len, "steps": args.steps, "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "load_average_before": before}
    if args.json:
        Path(args.json).write_text(json.dumps({"version": 1, "meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
