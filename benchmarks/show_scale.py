#!/usr/bin/env python
"""``memo show`` on a plan of 10^7 allocations (issue 31, item 7): seconds and peak memory.

The plan is a layered one as `memo profile` makes them (NOTE [A plan's summary] in planner/summary.py),
written row by row in save_plan's layout without building it in memory: ``layers`` layers, each a
forward and a backward pass of ``requests`` allocations that live within the pass, every pass one
level-1 block at offset 0. ``memo show`` then runs in a child process, timed, its peak resident memory
read from the kernel. ``--check`` also loads the whole plan (load_plan: every row checked) and compares
what ``memo show`` prints from it; that is what the test does at a smaller size.

Usage::

    python benchmarks/show_scale.py                           # 10^7 allocations
    python benchmarks/show_scale.py --layers 50 --requests 100 --check
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memo.planner.synthetic import write_layered_plan

#: The bars of issue 31: seconds and resident bytes for 10^7 allocations.
SECONDS_BAR, MEMORY_BAR = 30.0, 2 << 30


def show(path: str) -> tuple[str, float, int]:
    """``memo show path`` in a child: its output, seconds and peak resident bytes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memo", "show", path], capture_output=True, text=True,
                          timeout=600)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"show_scale: memo show failed:\n{done.stderr[-2000:]}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return done.stdout, seconds, max(rss, before * 1024)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=5000)
    p.add_argument("--requests", type=int, default=1000, help="allocations per layer pass")
    p.add_argument("--check", action="store_true", help="also load the whole plan and compare the summary")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memo-show-") as tmp:
        path = str(Path(tmp) / "plan.json")
        t0 = time.perf_counter()
        n = write_layered_plan(path, args.layers, args.requests)
        print(f"show_scale: wrote {n:,} allocations ({os.path.getsize(path) / 2**20:,.0f} MiB) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        out, seconds, rss = show(path)
        print(out)
        print(f"memo show: {n:,} allocations in {seconds:.1f} s, peak resident {rss / 2**30:.2f} GiB "
              f"(bars: {SECONDS_BAR:.0f} s, {MEMORY_BAR / 2**30:.0f} GiB): "
              + ("within" if seconds <= SECONDS_BAR and rss <= MEMORY_BAR else "OVER"))
        if args.check:
            from memo.planner import load_plan

            from memo.cli.show import format_plan

            whole = format_plan(load_plan(path))
            print("the whole plan's summary is " + ("the same" if whole == out.rstrip("\n") else "DIFFERENT"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
