#!/usr/bin/env python
"""The longest sequence of Llama-3.1-8B per strategy, each at its own best layout, from meta plans.

Two machines, as DeepSpeed's ALST (arXiv 2506.13996) measured them:

- **eight GPUs**: 8 x 80 GB in one node with 2 TB of host memory and 32 GB/s links (ALST: 3.7M
  tokens on 8 H100s);
- **one GPU**: 1 x 80 GB with ALST's 1.9 TB of host memory, full fine-tuning (ALST: 500K).

Each is ``memo estimate --model llama-3.1-8b --max-seq --search`` with that machine (this script
runs exactly that command in-process and reads its JSON, so the table is the command's answer):
every layout of the GPUs (TP x CP x PP, all-gather or Ulysses context parallelism, the states
sharded by megatron's distributed optimizer or by FSDP2, on the device or in host memory), every
strategy at its best one, each length confirmed by a meta profile at that length (NOTE [Fast
longest-sequence search] in memo/estimate/search.py). memo's rows fit its plan's budget, the others
the 80% rule (NOTE [Fit limits]).

ALST's lengths are its paper's published measurements, printed beside ours for reference: this
script measures memo's plans, not ALST.

Usage::

    python benchmarks/longest_at_scale.py                       # both machines, ~minutes
    python benchmarks/longest_at_scale.py --only eight --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import _common

from memo.cli.main import main as memo_main

__all__ = ["MACHINES", "main", "run_machine"]

#: name -> (memo estimate flags, ALST's published longest length on that machine).
MACHINES: dict[str, tuple[list[str], int]] = {
    "eight": (["--gpus", "8", "--gpus-per-node", "8", "--device-mem-gb", "80", "--host-mem-gb", "2048",
               "--bandwidth-gbps", "32"], 3_700_000),
    "one": (["--gpus", "1", "--gpus-per-node", "1", "--device-mem-gb", "80", "--host-mem-gb", "1900",
             "--bandwidth-gbps", "32"], 500_000),
}


def run_machine(name: str, model: str, granularity: str, log: Any) -> dict[str, Any]:
    """``memo estimate --max-seq --search --json`` on one machine of :data:`MACHINES`."""
    flags, alst = MACHINES[name]
    argv = ["estimate", "--model", model, *flags, "--max-seq", "--search", "--granularity", granularity,
            "--json"]
    log(f"longest_at_scale: memo {' '.join(argv)}")
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = memo_main(argv)
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"longest_at_scale: memo estimate exited {code} on machine {name!r}")
    return {"machine": name, "command": "memo " + " ".join(argv), "seconds": round(seconds, 1),
            "alst_published_tokens": alst, "answer": json.loads(out.getvalue())}


def _layout(lay: dict[str, Any] | None) -> str:
    if lay is None:
        return "-"
    cp = f"CP {lay['cp']}" + (" (Ulysses)" if lay["cp"] > 1 and lay["cp_comm"] == "a2a" else "")
    return f"TP {lay['tp']} x {cp} x PP {lay['pp']}, states {lay['sharding']}"


def table(run: dict[str, Any]) -> str:
    """A markdown table of one machine's answer, with ratios to full recompute and to ALST."""
    rows = {r["strategy"]: r for r in run["answer"]["strategies"]}
    fr = rows.get("full-recompute", {}).get("longest") or 0
    alst = run["alst_published_tokens"]
    lines = ["| strategy | longest tokens | vs full recompute | vs ALST (published) | layout | GiB per GPU "
             "(limit) | host GiB per node | memo policy |", "|" + "---|" * 8]
    for name, r in rows.items():
        e = r["estimate"] or {}
        n = r["longest"]
        limit = "-" if not e else (f"{e['total_gib']:.1f} ({e['limit_gib']:.1f}, "
                                   + ("plan budget" if e["limit_rule"] == "plan" else
                                      f"{e['fit_fraction']:.0%} rule") + ")")
        vs_fr = f"{n / fr:.2f}x" if fr else "-"
        lines.append(f"| {name} | {n:,} | {vs_fr} | {n / alst:.2f}x | {_layout(r['layout'])} | {limit} | "
                     f"{e.get('host_gib_per_node') or 0:,.0f} | {e.get('policy') or '-'} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=tuple(MACHINES), nargs="+", default=list(MACHINES),
                   help="machines to run (default: both)")
    p.add_argument("--model", default="llama-3.1-8b", help="registered model or a CONFIG.json")
    p.add_argument("--granularity", default="32K", help="step of the longest-sequence search")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write the runs as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    runs = [run_machine(name, args.model, args.granularity, log) for name in args.only]
    for run in runs:
        print(f"\n### {run['machine']} ({run['command']}, {run['seconds']:.0f} s)\n")
        print(table(run))
    if args.json:
        args.json.write_text(json.dumps({"version": 1, "kind": "memo.benchmark.longest_at_scale",
                                         "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    _common.run_main(main)
