#!/usr/bin/env python
"""The longest sequence per strategy at ALST's scale, each strategy at its best runnable layout, under
one device limit for every strategy, from meta plans; ALST's published lengths beside them.

Rows (DeepSpeed ALST, arXiv 2506.13996, and its ArcticTraining recipes; 80 GB GPUs, 8 per node, ALST's
1.9 TB of host memory per node, 32 GB/s links):

- Llama-3.1-8B on 1, 8 and 32 GPUs (ALST: 500K, 3.7M, 15M),
- a Qwen3-32B shape on 8 GPUs (ALST: 1.55M; memo's ``qwen3-32b``: head size 128, QK-norm),
- Llama-3.1-70B on 8 and 32 GPUs (ALST: 200K, 4M).

Each row is ``memo estimate --max-seq --search`` run in-process (its JSON is the table), twice:

1. memo, the offloaded-checkpoint peer (ALST's recipe as ``memo train`` runs it) and full recompute,
   every strategy held to ONE device limit (``--fit-limit-gib``): the peers' own rule, the seed's 80%
   of the GPU, so that the peers' rows are also their rows under their own limit;
2. memo alone at its own limit (its plan's budget, NOTE [Fit limits] in memo/estimate/core.py).

memo's search tries its Ulysses layouts at the finest count of head chunks too (UPipe's head-chunked
Ulysses, ``memo train --ulysses-head-chunks``; NOTE [Head chunks in the search] in
memo/estimate/search.py); its layout cell says the count where it chose one.

Every layout is one ``memo train`` launches, and memo's row prints the command that launches it. The
search returns the longest multiple of the granularity that fits (NOTE [Fast longest-sequence
search]). ALST's lengths are its published measurements, printed for reference: this script measures
memo's plans, not ALST. ALST's 70B x 8 recipe turns checkpoint offload off, so its peer there is full
recompute; its 8B x 1 figure stopped at a kernel error at 555K, not at memory.

Usage::

    python benchmarks/longest_at_scale.py                               # every row, ~minutes each
    python benchmarks/longest_at_scale.py --only 8b-x8 --json out.json
    python benchmarks/longest_at_scale.py --from-json a.json b.json     # the table of saved runs
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common

from memo.cli.main import main as memo_main
from memo.units import GB, GiB

__all__ = ["ROWS", "Row", "main", "run_row"]

#: The GPU of every row, in GB (10^9 B, as --device-mem-gb takes it), and the share of it every
#: strategy may fill: the seed's 80% rule, the peers' own limit.
DEVICE_GB = 80.0
COMMON_FRACTION = 0.8
#: ALST's host memory per node (its paper's 8 x H100 nodes).
HOST_GB = 1900.0
GPUS_PER_NODE = 8
BANDWIDTH_GBPS = 32.0

STRATEGIES = ("memo", "offloaded-checkpoint", "full-recompute")


@dataclass(frozen=True)
class Row:
    """One model and GPU count, ALST's published length there and the issue's goal for memo."""

    name: str
    model: str
    gpus: int
    alst: int
    """ALST's published longest sequence (tokens)."""
    peer: str
    """The strategy that is ALST's recipe on this row (offloaded-checkpoint, or full recompute where
    ALST's recipe turns checkpoint offload off)."""
    goal: int
    """What issue 41 asks of memo here (tokens)."""
    seq_cap: int = 16 << 20

    @property
    def gpus_per_node(self) -> int:
        return min(self.gpus, GPUS_PER_NODE)


ROWS: tuple[Row, ...] = (
    Row("8b-x8", "llama-3.1-8b", 8, 3_700_000, "offloaded-checkpoint", 5_500_000),
    Row("8b-x32", "llama-3.1-8b", 32, 15_000_000, "offloaded-checkpoint", 16_000_000, seq_cap=32 << 20),
    Row("70b-x32", "llama-3.1-70b", 32, 4_000_000, "offloaded-checkpoint", 5_000_000),
    Row("qwen32b-x8", "qwen3-32b", 8, 1_550_000, "offloaded-checkpoint", 2_000_000),
    Row("70b-x8", "llama-3.1-70b", 8, 200_000, "full-recompute", 300_000),
    Row("8b-x1", "llama-3.1-8b", 1, 500_000, "offloaded-checkpoint", 1_000_000),
)


def common_limit_gib() -> float:
    """The one device limit every strategy is held to: 80% of the GPU, in GiB."""
    return DEVICE_GB * GB * COMMON_FRACTION / GiB


def _estimate(argv: list[str], log: Any) -> tuple[dict[str, Any], float, float]:
    log(f"longest_at_scale: memo {' '.join(argv)}")
    out = io.StringIO()
    start, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        code = memo_main(argv)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if code != 0:
        raise SystemExit(f"longest_at_scale: memo estimate exited {code}: memo {' '.join(argv)}")
    log(f"longest_at_scale: {seconds:.0f} s ({cpu:.0f} s of CPU: the machine is shared)")
    return json.loads(out.getvalue()), round(seconds, 1), round(cpu, 1)


def run_row(row: Row, granularity: str, log: Any) -> dict[str, Any]:
    """The two searches of one row (the common limit, and memo at its own)."""
    base = ["estimate", "--model", row.model, "--gpus", str(row.gpus),
            "--gpus-per-node", str(row.gpus_per_node), "--device-mem-gb", f"{DEVICE_GB:g}",
            "--host-mem-gb", f"{HOST_GB:g}",
            "--bandwidth-gbps", f"{BANDWIDTH_GBPS:g}", "--max-seq", "--search", "--granularity", granularity,
            "--seq-cap", str(row.seq_cap), "--json"]
    common = [*base, "--fit-limit-gib", f"{common_limit_gib():.6f}", "--strategy", *STRATEGIES]
    answer, seconds, cpu = _estimate(common, log)
    own, own_seconds, own_cpu = _estimate([*base, "--strategy", "memo"], log)
    return {"row": row.name, "model": row.model, "gpus": row.gpus, "alst_published_tokens": row.alst,
            "peer": row.peer, "goal_tokens": row.goal,
            "command": "memo " + " ".join(common), "seconds": seconds, "cpu_seconds": cpu, "answer": answer,
            "own_limit_command": "memo " + " ".join([*base, "--strategy", "memo"]),
            "own_limit_seconds": own_seconds, "own_limit_cpu_seconds": own_cpu, "own_limit_answer": own}


def _rows_by_strategy(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["strategy"]: r for r in answer["strategies"]}


def _ratio(n: int, alst: int) -> str:
    """``n`` tokens and its ratio to ALST's published length."""
    return f"{_tokens(n)} ({n / alst:.2f}x)" if n else "-"


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1_000_000 else f"{n / 1e3:.0f}K"


def _layout(lay: dict[str, Any] | None) -> str:
    if lay is None:
        return "-"
    cp = f"CP {lay['cp']}" + (" Ulysses" if lay["cp"] > 1 and lay["cp_comm"] == "a2a" else "") + (
        f" over {lay['head_chunks']} head chunks" if lay.get("head_chunks") else "")
    return f"TP {lay['tp']} x {cp} x PP {lay['pp']}, {lay['sharding']}"


def _memo_policy(est: dict[str, Any] | None) -> str:
    if not est or est.get("policy") is None:
        return "-"
    cell = est["policy"] + ("" if est["alpha"] is None else f" alpha {est['alpha']:.2f}")
    cell += f", {est['segment_layers']} segment" if est.get("segment_layers") else ""
    return cell + (f", {est['recomputed_layers']} recompute" if est.get("recomputed_layers") else "")


def table(runs: list[dict[str, Any]]) -> str:
    """One markdown table of every row: each strategy's longest length under the common limit, its ratio
    to ALST's published one, memo's at its own limit, and memo's layout."""
    limit = f"{common_limit_gib():.1f}"
    head = ("| model, GPUs | ALST published | peer (ALST's recipe) | full recompute | **memo** | memo goal | "
            "memo at its own limit | memo's layout, policy | host GiB/node (memo) | search s (CPU s) |")
    lines = [f"Every strategy held to {limit} GiB per GPU (`--fit-limit-gib`, the peers' own 80% rule); "
             "ratios to ALST's published length.", "", head, "|" + "---|" * 10]
    for run in runs:
        rows = _rows_by_strategy(run["answer"])
        own = _rows_by_strategy(run["own_limit_answer"])["memo"]
        alst = run["alst_published_tokens"]

        def cell(strategy: str, rows: dict[str, dict[str, Any]] = rows, alst: int = alst) -> str:
            return _ratio(rows[strategy]["longest"], alst)

        peer = run["peer"]
        peer_cell = cell(peer) + ("" if peer == "offloaded-checkpoint" else
                                  f"; offloaded-checkpoint {cell('offloaded-checkpoint')}")
        memo = rows["memo"]
        e = memo["estimate"] or {}
        own_e = own["estimate"] or {}
        lines.append(
            f"| {run['model']}, {run['gpus']} | {_tokens(alst)} | {peer_cell} | {cell('full-recompute')} | "
            f"**{cell('memo')}** | {_tokens(run['goal_tokens'])} | {_tokens(own['longest'])} "
            f"({own_e.get('limit_gib', 0):.1f} GiB) | {_layout(memo['layout'])}; {_memo_policy(e)} | "
            f"{e.get('host_gib_per_node') or 0:,.0f} | {run['seconds']:.0f} ({run['cpu_seconds']:.0f}) + "
            f"{run['own_limit_seconds']:.0f} ({run['own_limit_cpu_seconds']:.0f}) |")
    return "\n".join(lines)


def commands(runs: list[dict[str, Any]]) -> str:
    """memo's launch command of every row, at the common limit's answer."""
    out = []
    for run in runs:
        memo = _rows_by_strategy(run["answer"])["memo"]
        out.append(f"- {run['model']}, {run['gpus']} GPUs: `{memo['command']}`")
    return "\n".join(out)


def _load(path: Path) -> dict[str, Any]:
    """A JSON file of runs this script wrote (its version and kind checked)."""
    data = json.loads(path.read_text())
    if data.get("kind") != "memo.benchmark.longest_at_scale" or data.get("version") != 2:
        raise SystemExit(f"longest_at_scale: {path} is not a version-2 run of this script")
    return data


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=[r.name for r in ROWS], nargs="+", default=[r.name for r in ROWS],
                   help="rows to run (default: all)")
    p.add_argument("--granularity", default="32K", help="step of the longest-sequence search")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write the runs as JSON here")
    p.add_argument("--from-json", type=Path, nargs="+", metavar="RUNS.json",
                   help="print the table of runs this script wrote (--json), in ROWS' order, and run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.from_json:
        saved = [run for path in args.from_json for run in _load(path)["runs"]]
        order = [row.name for row in ROWS]
        runs = sorted(saved, key=lambda run: order.index(run["row"]))
    else:
        runs = [run_row(row, args.granularity, log) for row in ROWS if row.name in args.only]
    print(table(runs))
    print("\nmemo's launch commands:\n")
    print(commands(runs))
    if args.json and not args.from_json:
        args.json.write_text(json.dumps({"version": 2, "kind": "memo.benchmark.longest_at_scale",
                                         "common_limit_gib": common_limit_gib(), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    _common.run_main(main)
