#!/usr/bin/env python
"""Why memo's model of ALST's recipe planned 0.6x of ALST's published lengths, cause by cause.

For each row of benchmarks/longest_at_scale.py, the peer (offloaded-checkpoint; full recompute where
ALST's recipe turns checkpoint offload off) on its best layout there (TP 1 x CP N Ulysses, FSDP2 states
in host memory), its longest sequence under the same limit as every row (80% of an 80 GB GPU), with
the model as it was and each correction added in turn:

1. as issue 41 measured it: torch's ``nn.RMSNorm`` (float32 copies of its input kept for backward),
   Ulysses' exchange counted on top of the recorded peak, 18 bytes per parameter of FSDP2 states;
2. + memo's lean RMSNorm (memo/models/norms.py: saves its input and a float32 rstd per token);
3. + Ulysses' exchange recorded where it lives (NOTE [Ulysses in a meta estimate]);
4. + FSDP2's shard counted as the fp32 master, 16 bytes per parameter (NOTE [Sharded model states]):
   the model as it is.

Each length is the exact search's (the longest multiple of 32K that fits, NOTE [Fast longest-sequence
search]). The earlier states are reproduced by patching this process only.

Usage::

    python benchmarks/peer_attribution.py [--only 8b-x8 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common
import torch
from longest_at_scale import BANDWIDTH_GBPS, COMMON_FRACTION, DEVICE_GB, GPUS_PER_NODE, HOST_GB, ROWS, Row
from memo.planner.vocab import CPComm, Sharding

from memo.estimate import Estimator, Layout, Machine, ParallelLayout, longest_sequences
from memo.units import GB

__all__ = ["STEPS", "main", "peer_longest"]

STEPS = ("issue 41's model", "+ lean RMSNorm", "+ Ulysses exchange recorded", "+ 16 B/parameter (today)")


@contextlib.contextmanager
def _as_before(step: int) -> Iterator[None]:
    """The estimate as it was before correction ``step`` (1-based, NOTE in the module docstring)."""
    import memo.estimate.core as core
    import memo.estimate.plan_method as plan_method
    import memo.models.norms as norms
    from memo.estimate import attention_exchange_bytes

    saved = (norms.rms_norm, plan_method.meta_ulysses, core.Estimator._exchange_on_top,
             core.Estimator.state_bytes)
    if step < 2:
        norms.rms_norm = lambda x, shape, weight=None, eps=None: torch.nn.functional.rms_norm(  # type: ignore
            x, shape, weight, eps)
    if step < 3:
        plan_method.meta_ulysses = lambda *_args, **_kw: None  # type: ignore[assignment]

        def on_top(self: Any, layout: ParallelLayout, seq_len: int) -> int:
            return attention_exchange_bytes(self.config, layout, seq_len, self.dtype.itemsize)

        core.Estimator._exchange_on_top = on_top  # type: ignore[method-assign]
    if step < 4:
        def eighteen(self: Any, layout: ParallelLayout, seq_len: int) -> tuple[int, int, int]:
            params, device, host = saved[3](self, layout, seq_len)
            if layout.sharding == Sharding.OPTIMIZER:
                return params, device, host
            extra = -(-2 * params // (layout.dp * layout.cp))  # the model-dtype copy beside the master
            if layout.sharding == Sharding.FULL:
                return params, device + extra, host
            return params, device, host + extra

        core.Estimator.state_bytes = eighteen  # type: ignore[method-assign]
    try:
        yield
    finally:
        norms.rms_norm, plan_method.meta_ulysses = saved[0], saved[1]
        core.Estimator._exchange_on_top, core.Estimator.state_bytes = saved[2], saved[3]  # type: ignore


def peer_longest(row: Row, step: int, granularity: int = 32 << 10) -> dict[str, Any]:
    """The peer's longest sequence on ``row``'s layout with the model as of ``step``."""
    machine = Machine(device_mem_gb=DEVICE_GB, host_mem_gb=HOST_GB, bandwidth_gbps=BANDWIDTH_GBPS,
                      gpus_per_node=min(row.gpus, GPUS_PER_NODE))
    layout = Layout(row.gpus, cp=row.gpus, cp_comm=CPComm.A2A if row.gpus > 1 else CPComm.ALL_GATHER,
                    sharding=Sharding.FULL_OFFLOAD)
    start = time.perf_counter()
    with _as_before(step):
        est = Estimator(row.model, machine=machine, fit_limit_bytes=int(DEVICE_GB * GB * COMMON_FRACTION))
        (found,) = longest_sequences(est, [layout], (row.peer,), granularity, row.seq_cap)
    best = found["best"]
    return {"row": row.name, "step": STEPS[step - 1], "strategy": row.peer, "alst": row.alst,
            "longest": best["longest"] if best else 0, "seconds": round(time.perf_counter() - start, 1)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=[r.name for r in ROWS], nargs="+", default=[r.name for r in ROWS])
    p.add_argument("--json", type=Path, metavar="OUT.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = []
    lines = ["| model, GPUs (peer) | ALST published | " + " | ".join(STEPS) + " |",
             "|" + "---|" * (2 + len(STEPS))]
    for row in (r for r in ROWS if r.name in args.only):
        cells = []
        for step in range(1, len(STEPS) + 1):
            got = peer_longest(row, step)
            out.append(got)
            print(f"peer_attribution: {row.name} {got['step']}: {got['longest']:,} ({got['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
            n = got["longest"]
            cells.append(f"{n / 1e6:.2f}M ({n / row.alst:.2f}x)" if n else "-")
        lines.append(f"| {row.model}, {row.gpus} ({row.peer}) | {row.alst / 1e6:.2f}M | " + " | ".join(cells)
                     + " |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"version": 1, "kind": "memo.benchmark.peer_attribution",
                                         "runs": out}, indent=1))
    return 0


if __name__ == "__main__":
    _common.run_main(main)
