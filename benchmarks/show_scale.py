#!/usr/bin/env python
"""``memo show`` on a plan of 10^7 allocations (issue 31, item 7): seconds and peak memory.

The plan is a layered one as `memo profile` makes them (NOTE [A plan's summary] in planner/summary.py),
written row by row in save_plan's layout without building it in memory: ``layers`` layers, each a
forward and a backward pass of ``requests`` allocations that live within the pass, every pass one
level-1 block at offset 0. ``memo show`` then runs in a child process, timed, its peak resident memory
read from the kernel. ``--check`` also loads the whole plan (load_plan: every row checked) and compares
what ``memo show`` prints from it; that is what the test does at a smaller size.

``--no-summary`` takes the summary fields (``allocation_count``, ``phase_peaks``) out, as in a plan an
older memo wrote: ``memo show`` then scans the rows (NOTE [A plan without its summary] in
planner/summary.py). ``--one-line`` also writes the whole plan on one line, as no memo writes it (a
plan edited or made by hand): above the size memo loads whole, ``memo show`` refuses it, and the
benchmark reports how long that took.

Usage::

    python benchmarks/show_scale.py                           # 10^7 allocations
    python benchmarks/show_scale.py --layers 50 --requests 100 --check
    python benchmarks/show_scale.py --no-summary              # 10^7 allocations, no summary fields
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memo.planner.synthetic import write_layered_plan

#: The bars of issue 31: seconds and resident bytes for 10^7 allocations.
SECONDS_BAR, MEMORY_BAR = 30.0, 2 << 30


#: Where save_plan's layout starts the rows (NOTE [A plan's summary]).
_ROWS = b'\n "allocations": [\n'


def strip_summary(path: str, one_line: bool) -> None:
    """``path`` without ``allocation_count`` and ``phase_peaks``, in save_plan's layout or on one line;
    the rows are copied as bytes, never parsed."""
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        at = head.find(_ROWS)
        if at < 0:
            raise SystemExit("show_scale: the plan's head is over 1 MiB; give fewer layers")
        fields = json.loads(head[:at].rstrip(b",") + b"}")
        for key in ("allocation_count", "phase_peaks"):
            fields.pop(key)
        f.seek(at + len(_ROWS))
        with open(path + ".tmp", "wb") as out:
            if one_line:
                out.write(json.dumps(fields)[:-1].encode() + b', "allocations": [')
                for line in f:  # a row per line: the newlines go
                    out.write(line.rstrip(b"\n"))
            else:
                out.write(json.dumps(fields, indent=1)[:-2].encode() + b"," + _ROWS)
                shutil.copyfileobj(f, out, 64 << 20)
    os.replace(path + ".tmp", path)


def show(path: str) -> tuple[str, str | None, float, int]:
    """``memo show path`` in a child: its output, its refusal (None when it printed the summary), seconds
    and peak resident bytes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memo", "show", path], capture_output=True, text=True,
                          timeout=600)
    seconds = time.perf_counter() - t0
    if done.returncode != 0 and "error: memo show:" not in done.stderr:
        raise SystemExit(f"show_scale: memo show failed:\n{done.stderr[-2000:]}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return done.stdout, done.stderr.strip() if done.returncode else None, seconds, max(rss, before * 1024)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=5000)
    p.add_argument("--requests", type=int, default=1000, help="allocations per layer pass")
    p.add_argument("--check", action="store_true", help="also load the whole plan and compare the summary")
    p.add_argument("--no-summary", action="store_true",
                   help="without the summary fields, as an older memo wrote plans")
    p.add_argument("--one-line", action="store_true",
                   help="without the summary fields and on one line, as no memo writes plans")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memo-show-") as tmp:
        path = str(Path(tmp) / "plan.json")
        t0 = time.perf_counter()
        n = write_layered_plan(path, args.layers, args.requests)
        if args.no_summary or args.one_line:
            strip_summary(path, args.one_line)
        layout = ("on one line, no summary fields" if args.one_line else
                  "no summary fields" if args.no_summary else "with its summary fields")
        print(f"show_scale: wrote {n:,} allocations ({os.path.getsize(path) / 2**20:,.0f} MiB, {layout}) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        out, refused, seconds, rss = show(path)
        print(out if refused is None else refused)
        print(f"memo show: {n:,} allocations {'refused' if refused else 'summarised'} in {seconds:.1f} s, "
              f"peak resident {rss / 2**30:.2f} GiB "
              f"(bars: {SECONDS_BAR:.0f} s, {MEMORY_BAR / 2**30:.0f} GiB): "
              + ("within" if seconds <= SECONDS_BAR and rss <= MEMORY_BAR else "OVER"))
        if args.check and refused is None:
            from memo.planner import load_plan

            from memo.cli.show import format_plan

            whole = format_plan(load_plan(path))
            print("the whole plan's summary is " + ("the same" if whole == out.rstrip("\n") else "DIFFERENT"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
