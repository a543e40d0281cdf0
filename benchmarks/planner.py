"""Planner benchmark: lower bound vs heuristic, flat MIP, bi-level and no-reuse peaks.

Traces come from memo's profiler on the meta device (any sequence length, no
memory) when it is importable, otherwise from the synthetic layered generator
in memo.planner.synthetic. One row per (model, sequence length), then the worst
bi-level/lower-bound ratio and the slowest solve. Default run: the issue's range (tiny ...
gpt-65b and the llama configs, 4K ... 1M tokens) and the hard flat instances, about 10
minutes on 2 cores.

    python benchmarks/planner.py [--models gpt-1.3b gpt-7b] [--seqs 8192 32768] [--time-limit 30]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from memo.planner import Trace, lower_bound, make_plan, plan_heuristic

GiB = 2**30


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "gpt-125m", "gpt-1.3b", "gpt-7b", "gpt-65b",
                                                         "llama-tiny", "llama-3-8b"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 131072, 1048576])
    parser.add_argument("--time-limit", type=float, default=20.0,
                        help="seconds each plan may spend in the exact search and the MIP")
    parser.add_argument("--no-flat-mip", action="store_true", help="skip the flat MIP column")
    parser.add_argument("--no-hard", action="store_true", help="skip the hard flat instances")
    args = parser.parse_args()
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
