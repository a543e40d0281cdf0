"""Planner benchmark: lower bound vs heuristic, flat MIP, bi-level and no-reuse peaks.

Traces come from memo's profiler on the meta device (any sequence length, no
memory) when it is importable, otherwise from the synthetic layered generator
in memo.planner.synthetic. One row per (model, sequence length), then the worst
bi-level/lower-bound ratio and the slowest solve. Default run: the issue's range (tiny ...
gpt-65b and the llama configs, 4K ... 1M tokens) and the hard flat instances, about 10
minutes on 2 cores.

    python benchmarks/planner.py [--models gpt-1.3b gpt-7b] [--seqs 8192 32768] [--time-limit 30]

``--suite minimalloc DIR`` runs every MiniMalloc-format CSV in DIR (``id,lower,upper,size``:
one buffer per row, alive on [lower, upper), sizes in bytes) through memo's flat solve, the one
``memo plan --expand`` makes on a flat trace (``solve_items``, on the CSV's own lifetimes;
``--via-trace``: as a trace through ``make_plan``), and prints per instance: buffers, lower
bound, peak, peak/LB, seconds, whether the peak fits ``--capacity`` and whether the plan is
proven optimal (else the optimality gap left). ``--capacity BYTES`` is also the search's
target: it stops at the first placement within it (omit it to minimise). ``--minimalloc BIN``
runs a MiniMalloc binary on the same files, side by side:

    python benchmarks/planner.py --suite minimalloc /tmp/minimalloc/challenging \
        --capacity 1048576 --time-limit 10 [--minimalloc /path/to/minimalloc]
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import subprocess
import tempfile
import time
from typing import Any

from memo.planner import Trace, lower_bound, make_plan, plan_heuristic

from memo.units import GiB


def record(model: str, seq: int) -> tuple[dict[str, Any], str]:
    """A trace dict for ``model`` at ``seq`` tokens, and where it came from."""
    try:
        from memo.pipeline import profile
    except ImportError:
        profile = None
    if profile is not None and model != "synthetic":
        result = profile(model, seq, device="meta", solve=False, plan=False, layer_ms=100.0,
                         bandwidth_gbps=20.0, host_mem_gb=10_000)
        return result.trace, "profiler (meta)"
    from memo.planner.synthetic import layered_trace

    return layered_trace(32, hidden=4096, seq=seq), "synthetic"


def bench(model: str, seq: int, time_limit: float, flat_mip: bool) -> dict[str, Any]:
    data, source = record(model, seq)
    trace = Trace.from_dict(data)
    row: dict[str, Any] = {"model": model, "seq": seq, "source": source, "allocs": len(trace.allocations)}
    row["lb"] = lower_bound(trace)
    t0 = time.perf_counter()
    heur = plan_heuristic(trace)
    row["heur"], row["heur_s"] = heur.peak, time.perf_counter() - t0
    if flat_mip:
        t0 = time.perf_counter()
        flat = make_plan(trace, method="flat", time_limit=time_limit, progress=False)
        row["mip"], row["mip_s"] = flat.peak, time.perf_counter() - t0
    t0 = time.perf_counter()
    bi = make_plan(trace, method="bilevel", time_limit=time_limit, progress=False)
    row["bi"], row["bi_s"] = bi.peak, time.perf_counter() - t0
    row["no_reuse"] = bi.no_reuse_bytes
    row["fallback"] = bi.solver.get("heuristic_fallback", False)
    return row


def read_minimalloc_csv(path: str) -> list[tuple[str, int, int, int]]:
    """The buffers of a MiniMalloc CSV as (id, lower, upper, size), in file order."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"id", "lower", "upper", "size"} <= set(rows[0]):
        raise SystemExit(f"benchmarks/planner.py: {path} is not a MiniMalloc CSV "
                         "(header id,lower,upper,size)")
    return [(r["id"], int(r["lower"]), int(r["upper"]), int(r["size"])) for r in rows]


def run_minimalloc(binary: str, path: str, capacity: int, timeout: float, minimise: bool
                   ) -> tuple[int | None, float]:
    """MiniMalloc's peak on one CSV (None when it found no placement) and its wall time; with
    ``minimise``, its binary search for the smallest capacity up to ``capacity``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.csv")
        t0 = time.perf_counter()
        cmd = [binary, f"--capacity={capacity}", f"--input={path}", f"--output={out}"]
        if minimise:
            cmd.append("--minimize_capacity=true")
        try:
            subprocess.run(cmd, check=False, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, time.perf_counter() - t0
        seconds = time.perf_counter() - t0
        if not os.path.exists(out) or os.path.getsize(out) == 0:
            return None, seconds
        with open(out, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or "offset" not in rows[0]:
            return None, seconds
        return max(int(r["offset"]) + int(r["size"]) for r in rows), seconds


def minimalloc_suite(folder: str, capacity: int | None, time_limit: float, binary: str | None,
                     via_trace: bool, minimise: bool) -> None:
    """Every MiniMalloc CSV in ``folder`` through memo's planner (and MiniMalloc, given its binary).

    By default the buffers go to ``solve_items`` with the CSV's lifetimes, as MiniMalloc sees
    them; ``minimise`` keeps ``capacity`` out of the search (it only says what fits).
    ``via_trace`` writes them as a trace first and plans it with ``make_plan``, as
    ``memo plan --expand`` would: a trace keeps only the order of events, so lifetimes count
    events and the search's orders by lifetime length lose the real durations.
    """
    from memo.planner import solve_items
    from memo.planner.dsa import Item, check_placement, lower_bound
    from memo.planner.synthetic import items_to_trace

    paths = sorted(glob.glob(os.path.join(folder, "*.csv")))
    if not paths:
        raise SystemExit(f"benchmarks/planner.py: no .csv files in {folder}")
    target = None if minimise else capacity
    cap = (f"capacity {capacity:,} bytes ({'minimise, then check' if minimise else 'the target'})"
           if capacity else "no capacity (minimise)")
    how = "as a trace through make_plan" if via_trace else "with their lifetimes through solve_items"
    print(f"MiniMalloc-format instances in {folder}, {how}: {cap}, --time-limit {time_limit:g} s each")
    head = (f"{'instance':<18} {'buffers':>7} {'LB bytes':>10} {'peak':>10} {'peak/LB':>8} {'t s':>6} "
            f"{'fits':>4} {'optimal':>7} {'gap':>7}  status")
    if binary:
        head += "  | MiniMalloc peak/LB, fits, t s"
    print(head)
    print("-" * len(head))
    fits_all = at_lb = 0
    for path in paths:
        rows = read_minimalloc_csv(path)
        items = [Item(size, lower, upper) for _, lower, upper, size in rows]
        lb = lower_bound(items)
        t0 = time.perf_counter()
        if via_trace:
            plan = make_plan(items_to_trace(items, unit=1), time_limit=time_limit, capacity=target,
                             progress=False)
            seconds = time.perf_counter() - t0
            total = plan.solver.get("total", {})
            peak, optimal, gap, status = (plan.peak, total.get("optimal", False),
                                          total.get("optimality_gap", 0.0), total.get("status", ""))
        else:
            result = solve_items(items, time_limit=time_limit, capacity=target)
            seconds = time.perf_counter() - t0
            problem = check_placement(items, result.offsets, result.peak)
            if problem is not None:
                raise SystemExit(f"benchmarks/planner.py: {path}: invalid placement: {problem}")
            bound = result.extra.get("bound", lb)
            peak, optimal, status = result.peak, result.optimal, result.status
            gap = 0.0 if optimal else (peak - bound) / bound
        fits = capacity is None or peak <= capacity
        fits_all += fits
        at_lb += peak <= lb
        line = (f"{os.path.basename(path):<18} {len(rows):>7} {lb:>10} {peak:>10} {peak / lb:8.4f} "
                f"{seconds:6.2f} {'yes' if fits else 'no':>4} {'yes' if optimal else 'no':>7} "
                f"{100 * gap:6.2f}%  {status}")
        if binary:
            # MiniMalloc decides the capacity given (its own use); with none, it minimises.
            mm_peak, mm_seconds = run_minimalloc(binary, path, capacity or sum(it.size for it in items),
                                                 max(60.0, 2 * time_limit), minimise=capacity is None)
            line += ("  | none found" if mm_peak is None else
                     f"  | {mm_peak / lb:.4f}, {'yes' if capacity is None or mm_peak <= capacity else 'no'}, "
                     f"{mm_seconds:.2f}")
        print(line, flush=True)
    print(f"{fits_all} of {len(paths)} fit the capacity; {at_lb} reach the lower bound")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", nargs=2, metavar=("NAME", "DIR"), default=None,
                        help="run another suite instead: 'minimalloc DIR' (MiniMalloc-format CSVs in DIR)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="bytes each --suite instance must fit (also the search's target)")
    parser.add_argument("--minimalloc", default=None, metavar="BIN",
                        help="a MiniMalloc binary to run on the --suite files too")
    parser.add_argument("--minimise", action="store_true",
                        help="with --capacity: minimise the peak anyway; the capacity only says what fits")
    parser.add_argument("--via-trace", action="store_true",
                        help="plan each --suite instance as a trace (event order only), as `memo plan` would")
    parser.add_argument("--models", nargs="+", default=["tiny", "gpt-125m", "gpt-1.3b", "gpt-7b", "gpt-65b",
                                                         "llama-tiny", "llama-3-8b"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 131072, 1048576])
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds each plan may take in all (default 20; 10 for --suite)")
    parser.add_argument("--no-flat-mip", action="store_true", help="skip the flat MIP column")
    parser.add_argument("--no-hard", action="store_true", help="skip the hard flat instances")
    args = parser.parse_args()
    if args.suite is not None:
        if args.suite[0] != "minimalloc":
            parser.error(f"unknown suite {args.suite[0]!r}; the one suite is 'minimalloc DIR'")
        minimalloc_suite(args.suite[1], args.capacity, args.time_limit or 10.0, args.minimalloc,
                         args.via_trace, args.minimise)
        return
    if args.time_limit is None:
        args.time_limit = 20.0
    head = (f"{'model':<12} {'seq':>7} {'allocs':>6} {'LB GiB':>9} {'heur':>7} {'MIP':>7} {'bi-lvl':>7} "
            f"{'no-reuse':>8} {'t_heur':>7} {'t_mip':>7} {'t_bi':>7}  source")
    print(head)
    print("-" * len(head))
    worst = (0.0, "")
    slowest = (0.0, "")
    for model in args.models:
        for seq in args.seqs:
            r = bench(model, seq, args.time_limit, not args.no_flat_mip)
            lb = r["lb"]
            mip = f"{r['mip'] / lb:7.4f}" if "mip" in r else f"{'-':>7}"
            t_mip = f"{r['mip_s']:7.1f}" if "mip_s" in r else f"{'-':>7}"
            print(f"{model:<12} {seq:>7} {r['allocs']:>6} {lb / GiB:9.2f} {r['heur'] / lb:7.4f} {mip} "
                  f"{r['bi'] / lb:7.4f} {r['no_reuse'] / lb:8.2f} {r['heur_s']:7.1f} {t_mip} "
                  f"{r['bi_s']:7.1f}  "
                  f"{r['source']}{' (heuristic fallback)' if r['fallback'] else ''}", flush=True)
            ratio = r["bi"] / lb
            if ratio > worst[0]:
                worst = (ratio, f"{model} seq {seq}")
            for what in ("heur_s", "mip_s", "bi_s"):
                if r.get(what, 0.0) > slowest[0]:
                    slowest = (r[what], f"{what[:-2]} of {model} seq {seq}")
    print(f"peaks are ratios to the lower bound; worst bi-level ratio: {worst[0]:.4f} ({worst[1]}; "
          f"goal <= 1.05); slowest solve: {slowest[0]:.1f} s ({slowest[1]}; goal <= 60 s)")
    if not args.no_hard:
        hard(args.time_limit)


def hard(time_limit: float) -> None:
    """Flat DSA instances whose optimum equals the lower bound but greedy misses it (tilings)."""
    from memo.planner import plan_mip
    from memo.planner.synthetic import guillotine_instance, items_to_trace

    print()
    print("hard flat instances (rectangle tilings: optimum = lower bound)")
    print(f"{'items':>6} {'seed':>4} {'heur':>7} {'plan':>7} {'gap closed':>10} {'t_plan':>6}  method")
    cases = [(32, 11), (32, 0), (40, 1), (100, 4)] + [(300, s) for s in range(5)] + [(500, 2), (500, 0)]
    closed_at_300 = []
    for n, seed in cases:
        trace = Trace.from_dict(items_to_trace(guillotine_instance(n, seed=seed)))
        lb = lower_bound(trace)
        heur = plan_heuristic(trace).peak
        t0 = time.perf_counter()
        plan = plan_mip(trace, time_limit=time_limit)
        closed = (heur - plan.peak) / (heur - lb) if heur > lb else 1.0
        if n == 300:
            closed_at_300.append(closed)
        print(f"{n:>6} {seed:>4} {heur / lb:7.4f} {plan.peak / lb:7.4f} {100 * closed:9.0f}% "
              f"{time.perf_counter() - t0:6.1f}  {plan.solver['total']['method']}", flush=True)
    print(f"gap closed on the 300-buffer instances: {100 * min(closed_at_300):.0f}% at worst, "
          f"{100 * sum(closed_at_300) / len(closed_at_300):.0f}% on average")


if __name__ == "__main__":
    main()
