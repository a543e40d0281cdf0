#!/usr/bin/env python
"""memo's setup before the first step (profile, policy probes, plan) against one training step.

Each job runs in a fresh process, as ``memo train`` would: :func:`memo.pipeline.profile` on the CPU
(the machine measured, the policy calibrated and probed, the plan made), then three steps of
:class:`memo.Session` with that plan and SGD; the step time is the median of steps 2 and 3. Wall
and CPU seconds are both given: on a shared machine the wall time depends on the other jobs, the CPU
time much less. ``--with-1m`` adds ``memo profile --model gpt-7b --seq-len 1M --device meta`` (no
step: nothing runs on a device), minutes on a 2-core machine.

    python benchmarks/setup_time.py --json benchmarks/results/setup-time-DATE.json

The table in benchmarks/RESULTS.md is ``python benchmarks/setup_time.py --from-json FILE``. Run it
with ``PYTHONPATH=`` another checkout to measure that checkout's setup with this script.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: name -> (model, tokens, device budget in GB or None): memo train's default job at 2K, the demo's.
JOBS = {"gpt-mini 2K": ("gpt-mini", 2048, None), "gpt-mini 4K (demo, 0.08 GB)": ("gpt-mini", 4096, 0.08)}
ONE_M = "gpt-7b 1M meta profile"
STAGES = ("build", "pass1", "measure", "alpha", "pass2", "plan")


def child(name: str) -> dict:
    """One job in this process: setup and steps, wall and CPU seconds."""
    import torch

    from memo import Session
    from memo.models import build_model
    from memo.pipeline import profile

    model_name, seq, budget = JOBS[name]
    machine = {} if budget is None else {"device_mem_gb": budget}
    counts = _count_iterations()
    wall, cpu = time.perf_counter(), time.process_time()
    result = profile(model_name, seq, dtype="float32", device="cpu", **machine)
    setup = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
             "stages_s": {k: result.timings.get(k, 0.0) for k in STAGES}, **counts}
    counts.clear()  # the steps below are not the setup's
    torch.manual_seed(0)
    model = build_model(model_name, device="cpu", dtype=torch.float32)
    vocab = model.config.vocab_size
    ids, labels = torch.randint(0, vocab, (1, seq)), torch.randint(0, vocab, (1, seq))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = []
    with Session(model, result.plan) as session:
        for _ in range(3):
            wall, cpu = time.perf_counter(), time.process_time()
            session.step(ids, labels)
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append((time.perf_counter() - wall, time.process_time() - cpu))
    step = {"wall_s": statistics.median(w for w, _ in steps[1:]),
            "cpu_s": statistics.median(c for _, c in steps[1:])}
    return {"job": name, "setup": setup, "step": step, "alpha": result.alpha.alpha,
            "policy": list(result.policy.policy)}


def _count_iterations() -> dict:
    """Counts, from now on, the setup's recorded iterations (``recordings``: memo.pipeline.step.record_step,
    the policy's calibration and probes and pass 2) and the iterations run on the device
    (``iterations``: ModelStep.run, a recording's and any warm-up's), as the returned dict's values."""
    from memo.pipeline import step

    counts = {"recordings": 0, "iterations": 0}
    record_step, run = step.record_step, step.ModelStep.run

    def counted_record(*args, **kwargs):
        if counts:
            counts["recordings"] += 1
        return record_step(*args, **kwargs)

    def counted_run(self):
        if counts:
            counts["iterations"] += 1
        return run(self)

    step.record_step, step.ModelStep.run = counted_record, counted_run
    return counts


def one_m_profile() -> dict:
    """``memo profile`` of gpt-7b at 1M tokens on meta, as a user types it: wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["profile", "--model", "gpt-7b", "--seq-len", "1M", "--device", "meta",
               "-o", f"{tmp}/plan.json"]
        done = subprocess.run([sys.executable, "-m", "memo", *cmd], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"setup_time: memo profile at 1M failed ({done.returncode}):\n{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in done.stdout.splitlines() if "events" in ln or "plan made" in ln]
    return {"job": ONE_M, "setup": {"wall_s": time.perf_counter() - wall, "cpu_s": cpu, "log": lines},
            "step": None}


def run_child(name: str) -> dict:
    # NOTE [OpenMP threads that sleep] (memo/cli/main.py): what a `memo` command sets, set here too.
    env = {**os.environ}
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    done = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        sys.exit(f"setup_time: {name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"{meta['date']}, {meta['cores']} cores, load average before {meta['load_average_before']:.1f}; "
             "seconds wall (CPU)", "",
             "| job | setup | pass 1 | measure | probes | plan | recordings (iterations) | one step "
             "| setup / step (wall, CPU) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, st = r["setup"], r["step"]
        stages = s.get("stages_s") or {}
        cells = [f"{stages[k]:.1f}" if k in stages else "-" for k in ("pass1", "measure", "alpha", "plan")]
        step = "-" if st is None else f"{st['wall_s']:.2f} ({st['cpu_s']:.2f})"
        ratio = "-" if st is None else f"{s['wall_s'] / st['wall_s']:.1f}, {s['cpu_s'] / st['cpu_s']:.1f}"
        setup = f"{s['wall_s']:.1f} ({s['cpu_s']:.1f})"
        recorded = f"{s['recordings']} ({s['iterations']})" if "recordings" in s else "-"
        lines.append(f"| {r['job']} | {setup} | {' | '.join(cells)} | {recorded} | {step} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", choices=sorted(JOBS), default=None, help="run one job")
    p.add_argument("--with-1m", action="store_true",
                   help="also the 1M-token meta profile of gpt-7b (minutes)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--from-json", default=None, help="print the table of a saved run; run nothing")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(table(saved["rows"], saved["meta"]))
        return 0
    meta = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
            "load_average_before": os.getloadavg()[0],
            "memo": str(Path(__import__("memo").__file__).parents[1])}
    rows = []
    for name in [args.only] if args.only else list(JOBS):
        rows.append(run_child(name))
        print(table(rows[-1:], meta).splitlines()[-1], flush=True)
    if args.with_1m:
        rows.append(one_m_profile())
    if args.json:
        Path(args.json).write_text(json.dumps({"version": 1, "meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
