"""What ``make gpu-bench`` needs before a row's first step, made or checked off the device (issue 45).

A loan is 15 minutes of device time; what does not need the device is done before it, on the CPU,
and carried (``build/gpu_bench_plans``):

- each row's device memory, predicted before the row runs (NOTE [Rows that cannot fit]);
- memo's plans for its rows (the headline rows, then the wide stage's), made on meta (NOTE [Plans made
  ahead on meta]);
- the cache keys both are found by (NOTE [Plan cache] in benchmarks/gpu_bench.py).

``make gpu-bench-plans`` (``python benchmarks/gpu_bench.py --make-plans``) makes them; ``make gpu-bench``
uses what it finds.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NEED_KIND = "memo.benchmark.gpu_bench.need"
NEED_VERSION = 1

__all__ = ["GPU_MEMORY_GIB", "device_gib", "gpu_key", "gpu_table_key", "make_plans", "need", "plan_path",
           "refuse_unfit", "source_hash"]

#: Memory of one GPU in GiB as torch reports it (``total_memory``), by a key of
#: memo.utils.flops.GPU_PEAK_TFLOPS: measured on the lent machines (benchmarks/RESULTS.md: the H100
#: 80GB HBM3 of 2026-11-22, 79.2 GiB; the H200 of 2026-11-26, 139.8 GiB). Used by ``--predict`` only;
#: a run reads its own device's.
GPU_MEMORY_GIB = {"H100": 79.2, "H200": 139.8}

# NOTE [Plans made ahead on meta]
# memo's timed row needs a plan: profiled on the device, it costs ~42 s at 32K on an H200 (more than
# the row's steps) and grows with the length. ``make gpu-bench-plans`` makes memo's rows' plans on the
# CPU instead (the headline rows' and the wide stage's: ~2 CPU minutes), by ``memo profile``'s own path
# on meta for the GPU named (``--predict-gpu``, the lent kind, H200), and the device's child loads the one
# whose key matches (``plan_source`` "meta cache").
# The key is everything the plan depends on: the model's fingerprint, the length, dtype, device budget,
# planner time limit, the GPU, the machine numbers assumed below, and memo's sources (source_hash).
# What the device's own profile would have changed, and what it costs:
# - B and T_layer are assumed, not measured: PLAN_BANDWIDTH_GBPS (PCIe 5.0 x16) and T_layer from FLOPs
#   at memo.profiler's default efficiency (0.5 of the GPU's bf16 peak). Alpha, and with it the plan's
#   offloaded bytes and buffers, is the LP's answer for those: a device whose link is slower than assumed
#   exposes copies (step time), one whose layers run slower would have allowed a larger alpha (less
#   recompute). The plan's own numbers say what it assumed (``alpha_detail``).
# - The host memory is the lent machine's (PLAN_HOST_GB); pinned buffers are sized from the plan before
#   step 1, and a host that cannot give them fails there, with the numbers.
# - The trace is the dispatch recorder's (on meta it is all there is; NOTE [Which recorder] in
#   docs/profiling.md): its sizes are the device's, but requests below the dispatcher (cuBLAS and cuDNN
#   workspaces) are not in it, and the planned allocator serves the rest of a phase whose order they
#   shift from its fallback. That costs device memory, not correctness; the row reports the allocator's
#   counts (planned, fallback) and memo's peak against the plan's total (the 3% bar), so the cost is
#   measured where it occurs, not assumed away.
# A plan profiled on the device by an earlier loan (its own key, ``plan_source`` "cache") is preferred.
PLAN_BANDWIDTH_GBPS = 50.0
PLAN_HOST_GB = 128.0
PLAN_GPU = "H200"

# NOTE [Rows that cannot fit]
# A row whose device memory exceeds the device's is not run: it would spend a model build and a first
# step to learn what is known before it (plain autograd at 128K needs ~205 GiB). Each row's need is
# memo.estimate's meta profile of the strategy (``method="plan"``, model states as memo train keeps
# them: AdamW in the model's dtype): none, full-recompute and offloaded-checkpoint; memo's is its plan's
# ``device["total_bytes"]`` when the plan comes from the cache. Against the H200's measured peaks
# (2026-11-26) those estimates were within 0.3% for none at 32K (57.91 GiB against 58.10) and full
# recompute at 32K and 64K (14.88 against 14.95, 20.87 against 20.94), and 11% and 1% under
# offloaded-checkpoint's at 32K and 64K, never over: a row is refused only where the estimate exceeds
# the device (or its --device-mem-mb budget), so a row near the edge runs and its out-of-memory is
# measured. A refused row is reported as "does not fit" with the
# estimate's numbers: a result from the estimate, labelled so, not a measurement. The estimates are
# cached by their key (a few CPU seconds each, ~5 s more for the first in a process).


@functools.cache
def source_hash() -> str:
    """sha256 of memo's and the planner's Python and C++ sources: a plan is memo's code's."""
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "memo").rglob("*.py"), *(ROOT / "planner").rglob("*.py"),
                        *(ROOT / "csrc").rglob("*.*")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _config(model: str) -> Any:
    from memo.models import get_config

    return get_config(model)


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps([*parts, source_hash()]).encode()).hexdigest()[:20]


def plan_path(plan_dir: str | Path, model: str, length: int, dtype: str, device_mem_mb: float | None,
              time_limit: float, target: str) -> Path:
    """The cache file of memo's plan (NOTE [Plan cache] in benchmarks/gpu_bench.py). ``target``: where it
    was made for, e.g. "cuda NVIDIA H200" (profiled there) or "meta H200" (NOTE [Plans made ahead on
    meta]); a meta plan's key holds the machine numbers it assumed."""
    from memo.models import fingerprint

    extra = [PLAN_BANDWIDTH_GBPS, PLAN_HOST_GB] if target.startswith("meta ") else []
    key = _key(fingerprint(_config(model)), length, dtype, device_mem_mb, time_limit, target, *extra)
    return Path(plan_dir) / f"memo-{key}.json"


def gpu_key(name: str) -> str | None:
    """A GPU's name (``torch.cuda.get_device_name``) as a key of memo.utils.flops.GPU_PEAK_TFLOPS."""
    from memo.utils.flops import GPU_PEAK_TFLOPS

    return next((k for k in GPU_PEAK_TFLOPS if k in name), None)


def gpu_table_key(gpu: str) -> str:
    """``gpu`` as given (any case) as its key of memo.utils.flops.GPU_PEAK_TFLOPS; exits where unknown."""
    from memo.utils.flops import GPU_PEAK_TFLOPS

    key = next((k for k in GPU_PEAK_TFLOPS if k.lower() == gpu.lower()), None)
    if key is None:
        sys.exit(f"error: gpu_bench: --predict-gpu {gpu!r} is not in memo.utils.flops.GPU_PEAK_TFLOPS "
                 f"({', '.join(GPU_PEAK_TFLOPS)})")
    return key


def device_gib(gpu: str) -> float | None:
    """The memory of ``gpu`` (a GPU_PEAK_TFLOPS key, any case) in GiB, where known."""
    return next((v for k, v in GPU_MEMORY_GIB.items() if k.lower() == gpu.lower()), None)


def need(model: str, length: int, dtype: str, strategy: str, cache_dir: str | Path) -> dict[str, Any] | None:
    """The device bytes a row of ``strategy`` needs (NOTE [Rows that cannot fit]), or None where
    memo.estimate does not cover the strategy; cached in ``cache_dir``."""
    from memo.estimate import PLAN_STRATEGIES
    from memo.models import fingerprint

    if strategy not in PLAN_STRATEGIES or strategy == "memo":
        return None
    key = _key(NEED_KIND, fingerprint(_config(model)), length, dtype, strategy)
    path = Path(cache_dir) / f"need-{key}.json"
    if path.exists():
        found = json.loads(path.read_text())
        if (found.get("kind"), found.get("version"), found.get("key")) == (NEED_KIND, NEED_VERSION, key):
            return found
    from memo.estimate import estimate

    start = time.process_time()
    # The machine numbers only matter to memo's own estimate; these strategies need none of them.
    e = estimate(model, length, strategy=strategy, method="plan", model_states="same", dtype=dtype,
                 device_mem_gb=1.0, bandwidth_gbps=PLAN_BANDWIDTH_GBPS, gpu=PLAN_GPU.lower())
    found = {"kind": NEED_KIND, "version": NEED_VERSION, "key": key, "strategy": strategy, "seq_len": length,
             "bytes": int(e.total_bytes), "model_states_bytes": int(e.model_states_bytes),
             "activations_bytes": int(e.activations_bytes), "cpu_s": time.process_time() - start,
             "how": "memo.estimate, method plan (a meta profile), model states 'same'"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found) + "\n")
    return found


def refuse_unfit(need_bytes: int | None, device_bytes: int | None) -> str | None:
    """Why a row that needs ``need_bytes`` must not run on a device of ``device_bytes``, or None."""
    from memo.units import format_bytes

    if need_bytes is None or device_bytes is None or need_bytes <= device_bytes:
        return None
    return (f"does not fit: needs {format_bytes(need_bytes)} of {format_bytes(device_bytes)} "
            "(estimated, not run: NOTE [Rows that cannot fit])")


def _short(model: str) -> str:
    """A model's name for a line: a registered name, or a config file's stem."""
    return Path(model).stem if model.endswith(".json") else model


def make_plans(args: argparse.Namespace, plans: list[tuple[str, int]],
               rows: list[tuple[str, int, str]]) -> int:
    """``make gpu-bench-plans``: memo's plan for each of ``plans`` (model, length) made on meta for
    ``args.predict_gpu`` (NOTE [Plans made ahead on meta]), and the predicted device memory of each of
    ``rows`` (model, length, strategy; NOTE [Rows that cannot fit]), into ``args.plan_dir``; what exists
    is kept."""
    from memo.planner import save_plan

    from memo.pipeline import profile

    gpu = gpu_table_key(args.predict_gpu)
    budget_gb = None if args.device_mem_mb is None else args.device_mem_mb * 2**20 / 1e9
    print(f"gpu_bench: plans ahead for an {gpu} in {args.plan_dir} (assumed: "
          f"{PLAN_BANDWIDTH_GBPS:g} GB/s link, {PLAN_HOST_GB:g} GB host memory, T_layer from FLOPs)",
          flush=True)
    for model, length, name in rows:
        start = time.process_time()
        found = need(model, length, args.dtype, name, args.plan_dir)
        if found is not None:
            print(f"  {name} @ {length:,} ({_short(model)}): needs {found['bytes'] / 2**30:,.2f} GiB "
                  f"(estimated; {time.process_time() - start:.1f} CPU s)", flush=True)
    for model, length in plans:
        path = plan_path(args.plan_dir, model, length, args.dtype, args.device_mem_mb, args.time_limit,
                         f"meta {gpu}")
        if path.exists():
            print(f"  memo @ {length:,} ({_short(model)}): {path} (already made)", flush=True)
            continue
        start = time.process_time()
        result = profile(model, length, 1, args.dtype, "meta", recorder="dispatch",
                         time_limit=args.time_limit, device_mem_gb=budget_gb,
                         gpu=gpu.lower().replace(" ", "-"), bandwidth_gbps=PLAN_BANDWIDTH_GBPS,
                         host_mem_gb=PLAN_HOST_GB, gpus_per_node=1)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_plan(result.plan, path)
        device = result.plan.device or {}
        print(f"  memo @ {length:,} ({_short(model)}): alpha {result.alpha.alpha:.4f}, device total "
              f"{device.get('total_bytes', 0) / 2**30:,.2f} GiB; {path} "
              f"({time.process_time() - start:.1f} CPU s)", flush=True)
    return 0
