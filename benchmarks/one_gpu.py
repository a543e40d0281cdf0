#!/usr/bin/env python
"""The longest sequence on ONE GPU: Llama-3.1-8B, frozen bf16 base + LoRA adapters (issue 27).

One 80 GB GPU (``--device-mem-gb``), 128 GiB of host memory (``--host-mem-gib``, the GPU machines
here), Llama-3.1-8B with every base parameter frozen in bf16 and rank-16 adapters on the attention
projections and MLP linears (:func:`memo.models.lora.add_lora`). Everything is sized on the meta
device (no GPU; NOTE [Sizes from meta] in memo/pipeline/__init__.py); each row says how its number was got.

- **full recompute**: every layer ``"recompute"`` under memo's runtime (benchmarks/at_scale.py's
  definition), recorded at full depth: ``memo.pipeline.profile(model, s, policy=[...])``; its total
  is the recorded iteration's peak + parameters + optimizer states (NOTE [Device total]).
- **memo**: the planner's own choice (memo / input-only / recompute / keep per layer, alpha, tile)
  within the plan's usable budget, host memory and link. NOTE [One-GPU memo row] says how.
- **memo, all input-only (recorded)**: memo's runtime with the policy the planner picks where the
  host binds (every layer ``"input-only"``), recorded by the dispatch recorder at reduced depth
  (NOTE [Peer depth]) with the runtime's default tile: a recording of memo's own device need, beside
  the planner's estimate of the memo row. Lengths whose layer inputs do not fit the host share are
  refused before recording.
- **offloaded-checkpoint**: the peer of ``memo train --strategy offloaded-checkpoint`` (ALST's recipe:
  every layer under non-reentrant ``torch.utils.checkpoint``, its input moved to host by saved-tensor
  hooks, ALST's tiled MLP), its own code (:class:`memo.train.peers.CheckpointedLayers`,
  :class:`~memo.train.peers.TiledMLP`) recorded by memo's dispatch recorder; only the host copy is
  shimmed for meta (:class:`MetaHostOffload`). NOTE [Peer depth] says how its depth is extrapolated.

Every row is judged against the same limits: the device total within the plan's usable budget
(``usable_budget`` with the pipeline's FALLBACK_HEADROOM / FALLBACK_SEGMENT_BYTES: 76 GB of 80 GB)
and the host bytes within the share memo may pin (``--host-safety`` x the host memory: 110 GB of
128 GiB). The table says which binds.

NOTE [One-GPU memo row]
A recorded iteration of memo's chosen policy at 8B and ~400K tokens dispatches ~2.7M ops on meta
(~156 token tiles of ~2,500 tokens per layer, NOTE [Tiles bounded by memory], x ~550 ops per tile
with the adapters, x 32 layers): ~45 minutes per recording on the 2-core machine here, and the
pipeline records the chosen policy twice (its probe, then pass 2). So the memo row reproduces the
pipeline's choice up to that probe: pass 1 and a recorded full-recompute iteration at full depth
(the same as the full recompute row), the cost model's constant part corrected by the difference
between that recording and the model's full-recompute estimate (what ``_calibrated_costs`` does;
the second calibration, a recorded all-memo iteration at alpha 0, is skipped by the pipeline itself
at these lengths: the host cannot hold every layer at alpha 0), then ``choose_policy`` within the
usable budget. Its device need is that calibrated estimate, not a recording; ``--check-memo``
records the chosen policy with depth reduced (NOTE [Peer depth]) at the longest length found, to
compare with it, and the "all input-only (recorded)" row records memo's runtime directly.

The cost model's constant part (pass 1's plain peak less n x (S_input + S_attn + S_others), plus the
model states) also carries whatever the plain model's kept layers hold beyond their S_*, and the
calibration corrects it by the full-recompute recording's own difference (-13.4 GB at 336K), which
is not what an input-only split holds: the estimate of the all-input-only policy lands above its
recording (73.4 GB against 55.7 GB at 336K, benchmarks/results/one_gpu.md). Compare the two rows.

NOTE [Peer depth]
An offloaded checkpoint holds nothing of a layer on the device between its forward and its backward
(its input is on the host), so the recorded peak does not depend on the depth but for the adapters'
gradients, which grow by a fixed amount per layer. The peer is recorded at ``--peer-depths`` (two
depths, default 2 and 3) and extrapolated linearly to 32 layers; ``--peer-full`` records all 32
layers at the longest length found, as a check (~4 minutes).

Usage::

    python benchmarks/one_gpu.py                                  # the table, benchmarks/results/one_gpu.md
    python benchmarks/one_gpu.py --strategies "full recompute" --start 256K
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memo.cli.args import positive_float, positive_int, seq_len
from memo.errors import DeviceBudgetError, MemoError
from memo.units import GB, GiB

__all__ = ["MetaHostOffload", "main"]

K = 1024
INPUT_ONLY = "memo, all input-only (recorded)"
STRATEGIES = ("memo", "full recompute", "offloaded-checkpoint", INPUT_ONLY)


def _tok(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n // K}K" if n % K == 0 else f"{n:,}"


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / GB:.1f}"


class MetaHostOffload:
    """:class:`memo.train.peers.HostOffload`'s hooks for the meta device: a saved tensor is counted as
    host bytes and forgotten on the device (nothing is allocated for the host copy, which holds no
    device memory); unpacking allocates it on the device again, as ``host.to(device)`` does on a GPU."""

    def __init__(self) -> None:
        self.live = self.peak = self.copies = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "meta" or isinstance(tensor, torch.nn.Parameter):
            return False, tensor
        n = tensor.numel() * tensor.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        self.copies += 1
        return True, (tuple(tensor.shape), tensor.dtype)

    def unpack(self, packed: Any) -> torch.Tensor:
        moved, value = packed
        if not moved:
            return value
        shape, dtype = value
        return torch.empty(shape, dtype=dtype, device="meta")

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class OneGPU:
    """The job and every evaluation so far, cached by (strategy, length)."""

    def __init__(self, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        from memo.models import get_config
        from memo.pipeline import usable_device_bytes

        self.args = args
        self.config = get_config(args.model)
        self.budget = int(args.device_mem_gb * GB)
        self.usable = usable_device_bytes(self.budget)
        self.host_bytes = int(args.host_mem_gib * GiB)
        self.host_usable = int(self.host_bytes * args.host_safety)
        self.log = log
        self.cache: dict[tuple[str, int], dict[str, Any]] = {}
        self.profiles = 0
        #: (strategy, depth, length) -> peak_breakdown of a recording made here.
        self.breakdowns: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.model = self.build()
        from memo.profiler.device import model_states

        self.states = model_states(self.model)
        self.static = int(self.states["parameters"]["bytes"] + self.states["optimizer"]["bytes"])

    def build(self, n_layers: int | None = None) -> torch.nn.Module:
        from memo.models import build_model
        from memo.models.lora import add_lora

        config = self.config if n_layers is None else dataclasses.replace(
            self.config, n_layers=n_layers, name=f"{self.config.name}-{n_layers}l")
        return add_lora(build_model(config, device="meta", dtype=torch.bfloat16), rank=self.args.rank)

    def _profile(self, length: int, **kw: Any) -> Any:
        from memo.pipeline import profile

        a = self.args
        self.profiles += 1
        return profile(self.model, length, 1, "bfloat16", "meta", bandwidth_gbps=a.bandwidth_gbps, gpu=a.gpu,
                       host_mem_gb=self.host_bytes / GB, gpus_per_node=1, host_safety=a.host_safety,
                       plan=False, time_limit=a.time_limit, **kw)

    # ------------------------------------------------------------ rows

    def run(self, strategy: str, length: int) -> dict[str, Any]:
        key = (strategy, length)
        if key not in self.cache:
            start = time.perf_counter()
            row = {"full recompute": self._full_recompute, "memo": self._memo,
                   "offloaded-checkpoint": self._peer, INPUT_ONLY: self._input_only}[strategy](length)
            row.update(strategy=strategy, seq_len=length, seconds=time.perf_counter() - start)
            dev_ok = row["device_bytes"] is not None and row["device_bytes"] <= self.usable
            host_ok = row["host_bytes"] <= self.host_usable
            row["fits"] = bool(dev_ok and host_ok and not row.get("error"))
            if not row["fits"]:
                row["binds"] = "device" if not dev_ok else "host"
            else:
                tighter = self.usable - row["device_bytes"] < self.host_usable - row["host_bytes"]
                row["binds"] = "device" if tighter else "host"
            self.cache[key] = row
            self.log(_progress(row, self.usable, self.host_usable))
        return self.cache[key]

    def _full_recompute(self, length: int) -> dict[str, Any]:
        from memo.pipeline import _iteration_total

        n = self.config.n_layers
        r = self._profile(length, policy=["recompute"] * n, device_mem_gb=self.args.device_mem_gb)
        total = _iteration_total(r.trace, self.static)
        return {"device_bytes": total, "host_bytes": 0, "how": f"recorded ({n} layers)",
                "estimate_bytes": int(r.policy.full_recompute_bytes),
                "policy": list(r.policy.policy), "s_input": int(r.plain_trace["layers"]["S_input"]),
                "parts": {k: int(v) for k, v in r.policy.parts.items()}}

    def _memo(self, length: int) -> dict[str, Any]:
        """NOTE [One-GPU memo row]."""
        from memo.planner.policy import usable_budget

        from memo.pipeline import FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES

        fr = self.run("full recompute", length)
        delta = fr["device_bytes"] - fr["estimate_bytes"]  # _calibrated_costs' correction of base_bytes
        want = self.usable - delta
        budget = int(math.ceil(want / (1 - FALLBACK_HEADROOM)))
        while usable_budget(budget, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES) > want:
            budget -= 1
        while usable_budget(budget, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES) < want:
            budget += 1
        how = (f"planner's estimate, calibrated by a recorded full-recompute iteration "
               f"({self.config.n_layers} layers)")
        row: dict[str, Any] = {"how": how, "calibration_bytes": delta}
        try:
            r = self._profile(length, device_mem_gb=budget / GB, wrap_pass=False)
        except DeviceBudgetError as err:
            # Every layer offloaded needs at least its input on the host (input-only): where that is
            # over the host share, some layer holds its activations on the device.
            need = re.search(r"smallest need is ([^(]+) \((.*?)\)", str(err))
            row.update(device_bytes=None, host_bytes=0, error=str(err),
                       host_all_offloaded=self.config.n_layers * fr["s_input"],
                       smallest_need=f"{need.group(1).strip()} ({need.group(2)})" if need else None)
            return row
        p = r.policy
        parts = {k: int(v) for k, v in p.parts.items()}
        base = "base (model states, other activations)"
        parts[base] += delta
        s_in = int(r.plain_trace["layers"]["S_input"])
        s_attn = int(r.plain_trace["layers"]["S_attn"])
        s_others = int(r.plain_trace["layers"]["S_others"])
        n_memo, n_in = p.counts.get("memo", 0), p.counts.get("input-only", 0)
        host = n_memo * int(s_in + s_attn + p.alpha * s_others) + n_in * s_in
        row.update(device_bytes=int(p.device_bytes) + delta, host_bytes=host, policy=list(p.policy),
                   alpha=float(p.alpha), tile_tokens=p.tile_tokens, binding=p.binding, parts=parts,
                   s_input=s_in, s_attn=s_attn, s_others=s_others)
        return row

    def record_peer(self, length: int, n_layers: int) -> tuple[int, int]:
        """The offloaded checkpoint of an ``n_layers``-deep model recorded at ``length``: (iteration
        peak, peak host bytes)."""
        from memo.planner import Trace, lower_bound

        from memo.profiler.record import phase_tracker, record
        from memo.train.peers import CheckpointedLayers

        model = self.build(n_layers)
        offload = MetaHostOffload()
        layers = CheckpointedLayers(model.layers, offload=offload, tile_mlp=True)  # type: ignore[arg-type]
        layers.install()
        tracker = phase_tracker(model)
        ids = torch.zeros(1, length, dtype=torch.long, device="meta")
        try:
            meta = {"model": model.config.name, "seq_len": length}
            rec = record(model, ids, ids, tracker=tracker, meta=meta)
        finally:
            tracker.remove()
            layers.remove()
        self.profiles += 1
        self.breakdowns[("offloaded-checkpoint", n_layers, length)] = peak_breakdown(rec.trace)
        return int(lower_bound(Trace.from_dict(rec.trace))), int(offload.peak)

    def record_memo(self, length: int, n_layers: int, kind: str) -> tuple[int, int]:
        """memo's runtime with every layer of an ``n_layers``-deep model ``kind`` (memo at alpha 0 or
        input-only), the runtime's default tile, recorded at ``length``: (iteration peak, host bytes)."""
        from memo.planner import Trace, lower_bound

        import memo.runtime as mr
        from memo.profiler.record import phase_tracker, record

        model = self.build(n_layers)
        mr.wrap(model, alpha=0.0, policy=[kind] * n_layers)
        tracker = phase_tracker(model)
        ids = torch.zeros(1, length, dtype=torch.long, device="meta")
        try:
            meta = {"model": model.config.name, "seq_len": length}
            rec = record(model, ids, ids, tracker=tracker, meta=meta)
            host = int(mr.runtime_of(model).host_bytes)
        finally:
            tracker.remove()
            mr.unwrap(model)
        self.profiles += 1
        self.breakdowns[("memo", n_layers, length)] = peak_breakdown(rec.trace)
        return int(lower_bound(Trace.from_dict(rec.trace))), host

    def check_memo(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """NOTE [One-GPU memo row]: memo's chosen policy recorded at reduced depth (NOTE [Peer depth]),
        where every layer of it offloads one way (the depth then adds no device bytes but the adapters'
        gradients); None for a policy with layers on the device."""
        kinds = set(row.get("policy") or [])
        if len(kinds) != 1 or not kinds <= {"memo", "input-only"} or (kinds == {"memo"} and row["alpha"] > 0):
            return None
        kind = kinds.pop()
        d1, d2 = self.args.peer_depths
        t = time.perf_counter()
        p1, _ = self.record_memo(row["seq_len"], d1, kind)
        p2, _ = self.record_memo(row["seq_len"], d2, kind)
        n = self.config.n_layers
        peak = p2 + (n - d2) * (p2 - p1) // (d2 - d1)
        return {"seq_len": row["seq_len"], "policy": f"{n} {kind}", "recorded_bytes": peak + self.static,
                "estimate_bytes": row["device_bytes"], "peaks": {d1: p1, d2: p2},
                "at_peak": self.breakdowns[("memo", d2, row["seq_len"])], "seconds": time.perf_counter() - t}

    def _input_only(self, length: int) -> dict[str, Any]:
        """memo's runtime with every layer input-only (the policy the planner picks where host memory
        binds), recorded at reduced depth (NOTE [Peer depth]) with the runtime's default tile. The
        host bytes come first: over the host share, nothing is recorded."""
        n = self.config.n_layers
        host = n * length * self.config.hidden * 2  # every layer's input, bf16
        d1, d2 = self.args.peer_depths
        how = f"memo's runtime recorded at {d1} and {d2} layers, extrapolated to {n}"
        row: dict[str, Any] = {"how": how, "host_all_offloaded": host}
        if host > self.host_usable:
            row.update(device_bytes=None, host_bytes=host, error="host", smallest_need="-")
            return row
        p1, h1 = self.record_memo(length, d1, "input-only")
        p2, h2 = self.record_memo(length, d2, "input-only")
        row.update(device_bytes=p2 + (n - d2) * (p2 - p1) // (d2 - d1) + self.static,
                   host_bytes=h2 + (n - d2) * (h2 - h1) // (d2 - d1), policy=["input-only"] * n)
        return row

    def _peer(self, length: int) -> dict[str, Any]:
        """NOTE [Peer depth]."""
        d1, d2 = self.args.peer_depths
        (p1, h1), (p2, h2) = self.record_peer(length, d1), self.record_peer(length, d2)
        n = self.config.n_layers
        peak = p2 + (n - d2) * (p2 - p1) // (d2 - d1)
        host = h2 + (n - d2) * (h2 - h1) // (d2 - d1)
        return {"device_bytes": peak + self.static, "host_bytes": host,
                "how": f"recorded at {d1} and {d2} layers, extrapolated to {n}",
                "peaks": {d1: p1, d2: p2}, "per_layer_bytes": (p2 - p1) // (d2 - d1)}


def peak_breakdown(trace: dict[str, Any], top: int = 6) -> dict[str, Any]:
    """What is live at the recorded iteration's peak: the phase it happens in and the largest groups of
    live allocations by (phase born in, size)."""
    live: dict[int, tuple[int, str | None]] = {}
    cur = best = 0
    at, snap = 0, {}
    events = trace["events"]
    for i, e in enumerate(events):
        if e["op"] == "malloc":
            live[e["id"]] = (int(e["size"]), e.get("phase"))
            cur += int(e["size"])
            if cur > best:
                best, at, snap = cur, i, dict(live)
        elif e["op"] == "free" and e["id"] in live:
            cur -= live.pop(e["id"])[0]
    phase = next((events[j].get("phase") for j in range(at, -1, -1) if events[j].get("phase")), None)
    groups: dict[tuple[str | None, int], int] = {}
    for size, born in snap.values():
        groups[(born, size)] = groups.get((born, size), 0) + 1
    largest = sorted(groups.items(), key=lambda kv: -kv[0][1] * kv[1])[:top]
    return {"peak_bytes": best, "phase": phase,
            "groups": [{"born_in": born, "count": n, "bytes_each": size} for (born, size), n in largest]}


def _breakdown(b: dict[str, Any]) -> str:
    return "; ".join(f"{g['count']} x {g['bytes_each'] / GB:.2f} GB born in {g['born_in']}"
                     for g in b["groups"])


def _progress(row: dict[str, Any], usable: int, host_usable: int) -> str:
    from memo.planner import describe_policy

    dev = "no policy fits" if row["device_bytes"] is None else f"{row['device_bytes'] / GB:.2f} GB"
    extra = ""
    if row.get("policy") and row["strategy"] == "memo":
        extra = (f", {describe_policy(row['policy'])}, alpha {row['alpha']:.4f}, tile "
                 f"{row['tile_tokens'] or 'default'}, binding {row['binding']}")
    return (f"  {row['strategy']:<21} @ {_tok(row['seq_len']):>6}: device {dev} (usable {usable / GB:.1f}), "
            f"host {row['host_bytes'] / GB:.1f} GB (usable {host_usable / GB:.1f}): "
            f"{'fits' if row['fits'] else 'does not fit'}{extra} [{row['seconds']:.0f} s]")


def search(bench: OneGPU, strategy: str) -> dict[str, Any]:
    """The longest multiple of ``--granularity`` that fits, from ``--start``: steps of ``--step``
    until the answer is bracketed, then the secant of the margins (device or host, whichever binds)
    where both ends have one, else bisection, down to the granularity."""
    a = bench.args
    g = a.granularity
    tried: list[int] = []

    def margin(row: dict[str, Any]) -> float | None:
        if row["device_bytes"] is None:
            return None
        return min(bench.usable - row["device_bytes"], bench.host_usable - row["host_bytes"])

    def ok(length: int) -> dict[str, Any]:
        tried.append(length)
        return bench.run(strategy, length)

    lo: tuple[int, dict] | None = None
    hi: tuple[int, dict] | None = None
    row = ok(a.start)
    if row["fits"]:
        lo = (a.start, row)
        length = a.start + a.step
        while length <= a.max_seq:
            row = ok(length)
            if not row["fits"]:
                hi = (length, row)
                break
            lo = (length, row)
            m = margin(row)
            m0 = margin(bench.cache[(strategy, tried[-2])])
            if m is not None and m0 is not None and m0 > m:  # secant guess, at least one step on
                guess = length + (length - tried[-2]) * m / (m0 - m)
                length = max(length + g, int(guess) // g * g)
            else:
                length += a.step
    else:
        hi = (a.start, row)
        length = a.start - a.step
        while length >= g:
            row = ok(length)
            if row["fits"]:
                lo = (length, row)
                break
            hi = (length, row)
            length -= a.step
    while lo is not None and hi is not None and hi[0] - lo[0] > g:
        m_lo, m_hi = margin(lo[1]), margin(hi[1])
        mid = (lo[0] + hi[0]) // 2 // g * g
        if m_lo is not None and m_hi is not None and m_lo > m_hi:
            guess = lo[0] + (hi[0] - lo[0]) * m_lo / (m_lo - m_hi)
            mid = int(guess) // g * g
            # stay strictly inside; try the side that closes the bracket
            mid = min(max(mid, lo[0] + g), hi[0] - g)
        row = ok(mid)
        if row["fits"]:
            lo = (mid, row)
        else:
            hi = (mid, row)
    return {"strategy": strategy, "longest": lo[0] if lo else 0, "first_failure": hi[0] if hi else None,
            "tried": tried, "row": lo[1] if lo else None, "failure_row": hi[1] if hi else None}


# ---------------------------------------------------------------- output


def format_table(bench: OneGPU, results: list[dict[str, Any]]) -> str:
    from memo.planner import describe_policy

    head = ("strategy", "longest seq", "device GB at it", "host GB at it",
            f"first failure (+{_tok(bench.args.granularity)})", "binds", "how it was sized", "policy / notes")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row, fail = r["row"], r["failure_row"]
        binds = "-"
        if fail is not None and fail.get("error"):
            binds = "host" if fail.get("host_all_offloaded", 0) > bench.host_usable else "device"
        elif fail is not None:
            binds = "device" if fail["device_bytes"] > bench.usable else "host"
        notes = ""
        if r["strategy"] == "memo" and row and row.get("policy"):
            notes = (f"{describe_policy(row['policy'])}, alpha {row['alpha']:.4f}, tile "
                     f"{row['tile_tokens'] or 'default'} tokens; planner binding: {row['binding']}")
        elif r["strategy"] == "offloaded-checkpoint" and row:
            notes = f"{row['per_layer_bytes'] / 2**20:.1f} MiB per extra layer (adapter gradients)"
        elif r["strategy"] == INPUT_ONLY and row:
            at = bench.breakdowns.get(("memo", bench.args.peer_depths[1], r["longest"]))
            notes = f"peak in {at['phase']}: {_breakdown(at)}" if at else ""
        elif r["strategy"] == "full recompute" and row:
            notes = f"every layer's input kept on the device ({row['s_input'] / GB:.2f} GB each)"
        lines.append("| " + " | ".join((
            r["strategy"], f"**{_tok(r['longest'])}**" + (f" ({r['longest']:,})" if r["longest"] else ""),
            _gb(row["device_bytes"]) if row else "-", _gb(row["host_bytes"]) if row else "-",
            _tok(r["first_failure"]) + _failure(fail),
            binds, row["how"] if row else "-", notes)) + " |")
    return "\n".join(lines)


def _failure(fail: dict[str, Any] | None) -> str:
    if fail is None:
        return ""
    if fail.get("error") == "host":
        return f": every layer's input on the host needs {_gb(fail['host_all_offloaded'])} GB"
    if fail.get("error"):
        return (f": no policy fits (every layer offloaded needs {_gb(fail.get('host_all_offloaded'))} GB of "
                f"host; the smallest device need is {fail.get('smallest_need')})")
    return f": device {_gb(fail['device_bytes'])}, host {_gb(fail['host_bytes'])}"


def format_parts(row: dict[str, Any]) -> str:
    lines = [f"memo at {_tok(row['seq_len'])}: device need {row['device_bytes'] / GB:.2f} GB "
             f"({row['device_bytes'] / GiB:.2f} GiB), parts (the planner's, base calibrated by "
             f"{row['calibration_bytes'] / GB:+.2f} GB against the recorded full-recompute iteration):"]
    for k, v in row["parts"].items():
        lines.append(f"  - {k}: {v / GB:.2f} GB")
    lines.append(f"  S_input {row['s_input'] / GB:.2f} GB, S_attn {row['s_attn'] / GB:.2f} GB, "
                 f"S_others {row['s_others'] / GB:.2f} GB per layer; host {row['host_bytes'] / GB:.1f} GB")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--rank", type=positive_int, default=16, help="LoRA rank (16)")
    p.add_argument("--device-mem-gb", type=positive_float, default=80.0, help="GPU memory, 10^9 bytes (80)")
    p.add_argument("--host-mem-gib", type=positive_float, default=128.0, help="host memory, GiB (128)")
    p.add_argument("--host-safety", type=positive_float, default=0.8, help="share memo may pin (0.8)")
    p.add_argument("--bandwidth-gbps", type=positive_float, default=32.0, help="host<->device GB/s (32)")
    p.add_argument("--gpu", default="h100", help="layer time estimated from FLOPs on this GPU (h100)")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--start", type=seq_len, default=384 * K, help="first length (384K)")
    p.add_argument("--step", type=seq_len, default=64 * K, help="first step (64K)")
    p.add_argument("--granularity", type=seq_len, default=16 * K, help="(16K)")
    p.add_argument("--max-seq", type=seq_len, default=4 << 20)
    p.add_argument("--peer-depths", type=positive_int, nargs=2, default=[2, 3])
    p.add_argument("--peer-full", action="store_true", help="check the peer at 32 layers at its longest")
    p.add_argument("--check-memo", action="store_true",
                   help="record memo's chosen policy at its longest, depth reduced (NOTE [One-GPU memo row])")
    p.add_argument("--time-limit", type=positive_float, default=10.0)
    p.add_argument("--json", default="benchmarks/results/one_gpu.json")
    p.add_argument("--md", default="benchmarks/results/one_gpu.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    bench = OneGPU(args, lambda line: print(f"[{time.perf_counter() - t0:6.0f} s] {line}", file=sys.stderr,
                                             flush=True))
    st = bench.states
    job = (f"{args.model}, frozen bf16 base + rank-{args.rank} adapters (params "
           f"{st['parameters']['bytes'] / GB:.2f} GB, adapter grads {st['gradients']['bytes'] / GB:.3f} GB, "
           f"AdamW {st['optimizer']['bytes'] / GB:.3f} GB); one GPU of {args.device_mem_gb:g} GB (usable "
           f"{bench.usable / GB:.1f} GB), host {args.host_mem_gib:g} GiB (usable "
           f"{bench.host_usable / GB:.1f} GB = {args.host_safety:g} x), {args.bandwidth_gbps:g} GB/s, "
           f"T_layer from FLOPs on {args.gpu}")
    print(f"one_gpu: {job}", flush=True)
    results = [search(bench, s) for s in args.strategies]
    check = None
    if args.peer_full:
        peer = next((r for r in results if r["strategy"] == "offloaded-checkpoint" and r["longest"]), None)
        if peer is not None:
            t = time.perf_counter()
            full, host = bench.record_peer(peer["longest"], bench.config.n_layers)
            check = {"seq_len": peer["longest"], "recorded_bytes": full + bench.static, "host_bytes": host,
                     "extrapolated_bytes": peer["row"]["device_bytes"], "seconds": time.perf_counter() - t}
            bench.log(f"  peer at {bench.config.n_layers} layers, {_tok(peer['longest'])}: recorded "
                      f"{check['recorded_bytes'] / GB:.2f} GB, extrapolated "
                      f"{check['extrapolated_bytes'] / GB:.2f} GB")
    memo_check = None
    memo = next((r for r in results if r["strategy"] == "memo"), None)
    if args.check_memo and memo is not None and memo["row"] is not None:
        memo_check = bench.check_memo(memo["row"])
        if memo_check is None:
            bench.log("  memo check: skipped (the chosen policy keeps layers on the device)")
        else:
            bench.log(f"  memo check at {_tok(memo_check['seq_len'])} ({memo_check['policy']}, default "
                      "tile): "
                      f"recorded {memo_check['recorded_bytes'] / GB:.2f} GB, estimated "
                      f"{memo_check['estimate_bytes'] / GB:.2f} GB")
    wall = time.perf_counter() - t0
    table = format_table(bench, results)
    text = [f"### One GPU: {job}", "", table, ""]
    for r in (memo["row"], memo["failure_row"]) if memo else ():
        if r and r.get("parts"):
            text += [format_parts(r), ""]
    if memo_check:
        depths = " and ".join(map(str, memo_check["peaks"]))
        text += [f"memo check: its chosen policy ({memo_check['policy']}) recorded with memo's runtime at "
                 f"{_tok(memo_check['seq_len'])}, the runtime's default tile, at {depths} layers, "
                 f"extrapolated to {bench.config.n_layers}: {memo_check['recorded_bytes'] / GB:.2f} GB "
                 f"(the estimate above: {memo_check['estimate_bytes'] / GB:.2f} GB). At its peak (in "
                 f"{memo_check['at_peak']['phase']}), besides the model states: "
                 f"{_breakdown(memo_check['at_peak'])}.", ""]
    peer = next((r for r in results if r["strategy"] == "offloaded-checkpoint" and r["row"]), None)
    if peer is not None:
        b = bench.breakdowns.get(("offloaded-checkpoint", args.peer_depths[1], peer["longest"]))
        if b:
            text += [f"offloaded-checkpoint at {_tok(peer['longest'])}: its peak is in {b['phase']}; live "
                     f"there besides the model states: {_breakdown(b)}.", ""]
    if check:
        text += [f"Peer check: all {bench.config.n_layers} layers recorded at {_tok(check['seq_len'])}: "
                 f"{check['recorded_bytes'] / GB:.2f} GB (extrapolated "
                 f"{check['extrapolated_bytes'] / GB:.2f} GB).", ""]
    text.append(f"{bench.profiles} meta recordings/profiles in {wall:.0f} s "
                "(`python benchmarks/one_gpu.py`).")
    out = "\n".join(text)
    print("\n" + out)
    if args.md:
        Path(args.md).write_text(out + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"job": vars(args), "usable_bytes": bench.usable,
                                               "host_usable_bytes": bench.host_usable, "states": st,
                                               "results": results, "peer_check": check,
                                               "memo_check": memo_check, "wall_s": wall},
                                              indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MemoError as err:
        sys.exit(f"error: {err}")
