#!/usr/bin/env python
"""The longest sequence on ONE GPU: Llama-3.1-8B, frozen bf16 base + LoRA adapters (issue 27).

One 80 GB GPU (``--device-mem-gb``), 128 GiB of host memory (``--host-mem-gib``, the GPU machines
here), Llama-3.1-8B with every base parameter frozen in bf16 and rank-16 adapters on the attention
projections and MLP linears (:func:`memo.models.lora.add_lora`). Everything is sized on the meta
device (no GPU; NOTE [Sizes from meta] in memo/pipeline/__init__.py); each row says how its number was got.

- **full recompute**: every layer ``"recompute"`` under memo's runtime (benchmarks/at_scale.py's
  definition), recorded at full depth: ``memo.pipeline.profile(model, s, policy=[...])``; its total
  is the recorded iteration's peak + parameters + optimizer states (NOTE [Device total]).
- **memo**: the pipeline's own choice (memo / input-only / recompute / keep per layer, alpha, tile)
  within the plan's usable budget, host memory and link, with both of its calibrations. NOTE [One-GPU
  memo row] says how.
- **memo, all input-only (recorded)**: memo's runtime with the policy the planner picks where the
  host binds (every layer ``"input-only"``), recorded by the dispatch recorder at reduced depth
  (NOTE [Peer depth]; ``--memo-full``: every layer) with the plan's tile: the recording the memo
  row's second calibration uses, shown as a row of its own. Lengths whose layer inputs do not fit
  the host share are refused before recording.
- **offloaded-checkpoint**: the peer of ``memo train --strategy offloaded-checkpoint`` (ALST's recipe:
  every layer under non-reentrant ``torch.utils.checkpoint``, its input moved to host by saved-tensor
  hooks, ALST's tiled MLP), its own code (:class:`memo.runtime.peers.CheckpointedLayers`,
  :class:`~memo.runtime.peers.TiledMLP`) recorded by memo's dispatch recorder; only the host copy is
  shimmed for meta (:class:`memo.runtime.peers.MetaHostOffload`). NOTE [Peer depth] says how its depth
  is extrapolated.

Every row is judged against the same limits: the device total within the plan's usable budget
(``usable_budget`` with the pipeline's FALLBACK_HEADROOM / FALLBACK_SEGMENT_BYTES: 76 GB of 80 GB)
and the host bytes within the share memo may pin (``--host-safety`` x the host memory: 110 GB of
128 GiB). The table says which binds.

NOTE [One-GPU memo row]
The memo row is what ``memo.pipeline.profile(model, s, device_mem_gb=80, ...)`` chooses (NOTE
[Calibrated policy] in memo/pipeline/policy.py), made in its steps so that its recordings of memo's
runtime can be made at reduced depth:

1. pass 1 and the layer policy's cost model, exactly the pipeline's: ``OneGPU.pipeline_costs`` runs
   ``profile`` without pass 2 and takes its ``ProfileResult.costs`` (the model before calibration;
   nothing is re-derived here);
2. ``with_recorded_full_recompute``: the constant part corrected by a recorded full-recompute
   iteration at full depth (the full recompute row's recording at the same length);
3. ``memo_calibration`` names the policy to record at alpha 0: at these lengths the host cannot hold
   every layer at alpha 0 but can hold every layer's input, so every layer input-only (the "all
   input-only (recorded)" row: memo's runtime at ``--peer-depths``, extrapolated, NOTE [Peer depth];
   ``--memo-full`` records all 32 layers), and ``with_recorded_memo`` sets the measured correction so
   that its estimate is that recording. Where the host cannot hold every layer's input either, the
   pipeline records nothing here, and neither does the row;
4. ``choose_policy`` within the usable budget (FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES).

The pipeline then records the chosen policy once more (``probe_policy``) and corrects only an
estimate that the recording puts over the cap. Where the choice is the policy step 3 recorded, at
its tile, that probe is step 3's recording, whose total the estimate now equals, so the choice
stands; the row says so ("the pipeline's probe of it is the calibration's recording"). Any other
choice (at 8B and ~400K: a few memo layers at a small alpha, the rest input-only) is an estimate
until ``--check-memo`` makes that probe: the chosen policy, alpha and tile recorded at every layer,
at the longest length found, against the cap.

Recordings use the tile of the GPU the plan is for (NOTE [Tiles of the device a plan is for] in
memo/pipeline/job.py: ``--gpu h100``, the GPU's default, 2,507 tokens at 8B and 384K, given to the
runtime explicitly as the pipeline does; the runtime's own default on meta is the same size, so
these recordings ran ~2,500-token tiles before too, while the pipeline's ran the planner's ~311).
On the shared 2-core machine here a recording of memo's runtime at 8B and 384-400K takes ~72 s at
2 layers, ~79 s at 3 and 9-10 minutes at 32, not the ~45 minutes this NOTE gave before,
so ``--memo-full`` (step 3 at every layer, as the pipeline records it) is affordable: ~10-11
minutes per length tried, against ~2.5 at 2 and 3 layers. A full-recompute profile at 32 layers
takes 10-40 s, pass 1 ~10 s.

NOTE [Peer depth]
An offloaded checkpoint holds nothing of a layer on the device between its forward and its backward
(its input is on the host), so the recorded peak does not depend on the depth but for the adapters'
gradients, which grow by a fixed amount per layer. The peer is recorded at ``--peer-depths`` (two
depths, default 2 and 3) and extrapolated linearly to 32 layers; ``--peer-full`` records all 32
layers at the longest length found, as a check (~4 minutes). memo's runtime with every layer
input-only holds on the device, between a layer's forward and its backward, only the two rounding
buffers, whatever the depth: the same extrapolation holds for it
(tests/benchmarks/test_one_gpu_bench.py checks both against full depth on a small model).

Usage::

    python benchmarks/one_gpu.py                                  # the table, benchmarks/results/one_gpu.md
    python benchmarks/one_gpu.py --start 384K --step 16K --memo-full --check-memo   # as in RESULTS.md
    python benchmarks/one_gpu.py --strategies "full recompute" --start 256K
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memo.cli.args import positive_float, positive_int, seq_len
from memo.errors import DeviceBudgetError, MemoError
from memo.units import GB, GiB

if TYPE_CHECKING:
    from memo.planner import LayerCosts

__all__ = ["main"]

K = 1024
INPUT_ONLY = "memo, all input-only (recorded)"
STRATEGIES = ("memo", "full recompute", "offloaded-checkpoint", INPUT_ONLY)


def _tok(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n // K}K" if n % K == 0 else f"{n:,}"


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / GB:.1f}"


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
        #: (strategy, depth or memo's policy described, length) -> peak_breakdown of a recording made here.
        self.breakdowns: dict[tuple[str, int | str, int], dict[str, Any]] = {}
        #: (policy described, alpha, length) -> (iteration peak, host bytes) of memo's runtime.
        self.memo_recordings: dict[tuple[str, float, int], tuple[int, int]] = {}
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
        from memo.pipeline import iteration_total

        n = self.config.n_layers
        r = self._profile(length, policy=["recompute"] * n, device_mem_gb=self.args.device_mem_gb)
        total = iteration_total(r.trace, self.static)
        return {"device_bytes": total, "host_bytes": 0, "how": f"recorded ({n} layers)",
                "estimate_bytes": int(r.policy.full_recompute_bytes),
                "policy": list(r.policy.policy), "s_input": int(r.plain_trace["layers"]["S_input"]),
                "parts": {k: int(v) for k, v in r.policy.parts.items()}}

    def pipeline_costs(self, length: int) -> LayerCosts:
        """The layer policy's cost model exactly as the pipeline builds it from pass 1 at ``length``
        (``_policy_costs`` in memo/pipeline/policy.py, before any calibration): ``ProfileResult.costs``
        of a profile without pass 2 or a plan (NOTE [One-GPU memo row]). Nothing is recorded beyond
        pass 1."""
        # No device budget: the cost model does not depend on it (choose_policy takes it apart), and
        # without one the profile cannot stop at "no policy fits" before returning the model.
        r = self._profile(length, wrap_pass=False)
        if r.costs is None:
            raise MemoError("one_gpu: memo.pipeline.profile returned no cost model (ProfileResult.costs)")
        return r.costs

    def _memo(self, length: int) -> dict[str, Any]:
        """NOTE [One-GPU memo row]."""
        from memo.planner import choose_policy, full_recompute_need
        from memo.planner.calibrate import memo_calibration, with_recorded_full_recompute, with_recorded_memo

        from memo.pipeline import FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES

        n = self.config.n_layers
        fr = self.run("full recompute", length)
        plain = self.pipeline_costs(length)
        costs = with_recorded_full_recompute(plain, fr["device_bytes"])
        row: dict[str, Any] = {"calibration_bytes": costs.base_bytes - plain.base_bytes,
                               "full_recompute_estimate_bytes": full_recompute_need(plain),
                               "memo_calibration": None}
        how = f"planner's choice, calibrated by recorded full recompute ({n} layers)"
        calibration = memo_calibration(costs)
        if calibration is not None:
            policy, estimate = calibration
            kind = policy[0]
            recorded, host, depths = self.memo_total(length, kind)
            costs = with_recorded_memo(costs, recorded, estimate)
            row["memo_calibration"] = {"policy": f"{n} {kind}", "estimate_bytes": int(estimate),
                                       "recorded_bytes": recorded, "host_bytes": host,
                                       "correction_bytes": costs.memo_overhead - plain.memo_overhead}
            how += f" and every layer {kind}, {depths}"
        row["how"] = how
        try:
            p = choose_policy(costs, self.budget, None, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)
        except DeviceBudgetError as err:
            # Every layer offloaded needs at least its input on the host (input-only): where that is
            # over the host share, some layer holds its activations on the device.
            need = re.search(r"smallest need is ([^(]+) \((.*?)\)", str(err))
            row.update(device_bytes=None, host_bytes=0, error=str(err), host_all_offloaded=n * fr["s_input"],
                       smallest_need=f"{need.group(1).strip()} ({need.group(2)})" if need else None)
            return row
        s_in, s_attn, s_others = costs.s_input, costs.s_attn, costs.s_others
        n_memo, n_in = p.counts.get("memo", 0), p.counts.get("input-only", 0)
        host = n_memo * int(s_in + s_attn + p.alpha * s_others) + n_in * s_in
        # The pipeline then records the chosen policy once (its probe): where that is the policy the
        # calibration recorded, at the same tile, its recording is the calibration's, and it fits.
        probed = (calibration is not None and p.tile_tokens is None and list(p.policy) == calibration[0]
                  and (p.counts.get("memo", 0) == 0 or p.alpha == 0.0))
        row.update(device_bytes=int(p.device_bytes), host_bytes=host, policy=list(p.policy),
                   alpha=float(p.alpha), tile_tokens=p.tile_tokens or self.tile(length), binding=p.binding,
                   parts={k: int(v) for k, v in p.parts.items()}, s_input=s_in, s_attn=s_attn,
                   s_others=s_others, probe_is_calibration=probed)
        return row

    def record_peer(self, length: int, n_layers: int) -> tuple[int, int]:
        """The offloaded checkpoint of an ``n_layers``-deep model recorded at ``length``: (iteration
        peak, peak host bytes)."""
        from memo.planner import Trace, lower_bound

        from memo.profiler.record import phase_tracker, record
        from memo.runtime.peers import CheckpointedLayers, MetaHostOffload

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

    def tile(self, length: int) -> int:
        """The tile memo's runtime runs a layer of ``length`` tokens in, in every recording here: the
        pipeline's for this plan (NOTE [Tiles of the device a plan is for] in memo/pipeline/job.py),
        the default of the GPU (``--gpu``) the plan is for, given to the runtime explicitly."""
        from memo.runtime.tiles import default_tile_tokens, layer_token_bytes

        h = self.config.hidden
        layer = self.model.layers[0]  # type: ignore[index]
        return default_tile_tokens(length, batch=1, hidden=h, device_type="cuda" if self.args.gpu else "meta",
                                   token_bytes=layer_token_bytes(layer, h, 2))

    def record_memo(self, length: int, policy: list[str], alpha: float = 0.0) -> tuple[int, int]:
        """memo's runtime with ``policy`` (its length is the model's depth) at ``alpha``, the plan's
        tile (:meth:`tile`), recorded at ``length``: (iteration peak, host bytes). Each recording is
        made once (the memo row's calibration, the all-input-only row and the check share them)."""
        from memo.planner import Trace, describe_policy, lower_bound

        key = (describe_policy(policy), alpha, length)
        if key in self.memo_recordings:
            return self.memo_recordings[key]
        import memo.runtime as mr
        from memo.profiler.record import phase_tracker, record

        n_layers = len(policy)
        model = self.build(n_layers)
        mr.wrap(model, alpha=alpha, policy=list(policy), recompute_chunk_tokens=self.tile(length))
        tracker = phase_tracker(model)
        ids = torch.zeros(1, length, dtype=torch.long, device="meta")
        t = time.perf_counter()
        try:
            meta = {"model": model.config.name, "seq_len": length}
            rec = record(model, ids, ids, tracker=tracker, meta=meta)
            host = int(mr.runtime_of(model).host_bytes)
        finally:
            tracker.remove()
            mr.unwrap(model)
        self.profiles += 1
        self.log(f"    recorded {key[0]} at alpha {alpha:.4f} @ {_tok(length)}, tile {self.tile(length)} "
                 f"tokens [{time.perf_counter() - t:.0f} s]")
        self.breakdowns[("memo", key[0], length)] = peak_breakdown(rec.trace)
        self.memo_recordings[key] = int(lower_bound(Trace.from_dict(rec.trace))), host
        return self.memo_recordings[key]

    def memo_total(self, length: int, kind: str) -> tuple[int, int, str]:
        """Every layer ``kind`` at alpha 0 under memo's runtime at ``length``: the device total (peak
        + model states) and host bytes, recorded at ``--peer-depths`` and extrapolated to every layer
        (NOTE [Peer depth]), or at every layer with ``--memo-full``; and how."""
        n = self.config.n_layers
        if self.args.memo_full:
            peak, host = self.record_memo(length, [kind] * n)
            return peak + self.static, host, f"recorded ({n} layers)"
        d1, d2 = self.args.peer_depths
        (p1, h1), (p2, h2) = self.record_memo(length, [kind] * d1), self.record_memo(length, [kind] * d2)
        return (p2 + (n - d2) * (p2 - p1) // (d2 - d1) + self.static, h2 + (n - d2) * (h2 - h1) // (d2 - d1),
                f"recorded at {d1} and {d2} layers, extrapolated to {n}")

    def input_only_breakdown(self, length: int) -> dict[str, Any] | None:
        """What is live at the peak of the deepest all-input-only recording at ``length``."""
        depth = self.config.n_layers if self.args.memo_full else self.args.peer_depths[1]
        return self.breakdowns.get(("memo", f"{depth} input-only", length))

    def check_memo(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """NOTE [One-GPU memo row]: the pipeline's probe of memo's chosen policy: the policy, its alpha
        and tile recorded with memo's runtime at full depth; None for a policy the pipeline does not
        probe (no memo or input-only layer)."""
        if not any(k in ("memo", "input-only") for k in row.get("policy") or []):
            return None
        from memo.planner import describe_policy

        t = time.perf_counter()
        peak, host = self.record_memo(row["seq_len"], row["policy"], row["alpha"])
        return {"seq_len": row["seq_len"], "policy": describe_policy(row["policy"]), "alpha": row["alpha"],
                "recorded_bytes": peak + self.static, "host_bytes": host,
                "estimate_bytes": row["device_bytes"],
                "cap_bytes": self.usable, "same_as_calibration": bool(row.get("probe_is_calibration")),
                "at_peak": self.breakdowns[("memo", describe_policy(row["policy"]), row["seq_len"])],
                "seconds": time.perf_counter() - t}

    def _input_only(self, length: int) -> dict[str, Any]:
        """memo's runtime with every layer input-only (the policy the planner picks where host memory
        binds), recorded at reduced depth (NOTE [Peer depth]; ``--memo-full``: every layer) with the
        plan's tile. The host bytes come first: over the host share, nothing is recorded."""
        n = self.config.n_layers
        host = n * length * self.config.hidden * 2  # every layer's input, bf16
        row: dict[str, Any] = {"host_all_offloaded": host}
        if host > self.host_usable:
            row.update(device_bytes=None, host_bytes=host, error="host", smallest_need="-",
                       how="not recorded")
            return row
        total, host, how = self.memo_total(length, "input-only")
        row.update(device_bytes=total, host_bytes=host, policy=["input-only"] * n,
                   how=f"memo's runtime {how}")
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
    """The longest multiple of ``--granularity`` that fits, from ``--start``: steps of ``--step`` up or
    down, or the secant of the last two margins (device or host, whichever binds) where both have
    one, until the answer is bracketed; then the secant where both ends have a margin, else
    bisection, down to the granularity."""
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
            m, m0 = margin(row), margin(bench.cache[(strategy, hi[0])])
            hi = (length, row)
            if m is not None and m0 is not None and m > m0:  # secant guess down, at least one step
                guess = length - (tried[-2] - length) * -m / (m - m0)
                length = min(length - g, max(g, int(guess) // g * g))
            else:
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
                     f"{row['tile_tokens']} tokens; planner binding: {row['binding']}")
            if row.get("probe_is_calibration"):
                notes += "; the pipeline's probe of it is the calibration's recording"
        elif r["strategy"] == "offloaded-checkpoint" and row:
            notes = f"{row['per_layer_bytes'] / 2**20:.1f} MiB per extra layer (adapter gradients)"
        elif r["strategy"] == INPUT_ONLY and row:
            at = bench.input_only_breakdown(r["longest"])
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
    cal = row.get("memo_calibration")
    against = ("" if cal is None else f", measured correction {cal['correction_bytes'] / GB:+.2f} GB against "
               f"the recorded iteration of {cal['policy']} ({cal['recorded_bytes'] / GB:.2f} GB recorded, "
               f"{cal['estimate_bytes'] / GB:.2f} GB estimated after the first calibration)")
    lines = [f"memo at {_tok(row['seq_len'])}: device need {row['device_bytes'] / GB:.2f} GB "
             f"({row['device_bytes'] / GiB:.2f} GiB), parts (the planner's, base calibrated by "
             f"{row['calibration_bytes'] / GB:+.2f} GB against the recorded full-recompute iteration"
             f"{against}):"]
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
    p.add_argument("--memo-full", action="store_true",
                   help="record memo's runtime at every layer, not --peer-depths (NOTE [One-GPU memo row])")
    p.add_argument("--check-memo", action="store_true",
                   help="record the chosen policy at its longest, every layer (NOTE [One-GPU memo row])")
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
            bench.log("  memo check: skipped (the chosen policy offloads no layer: nothing to probe)")
        else:
            bench.log(f"  memo check at {_tok(memo_check['seq_len'])} ({memo_check['policy']}): "
                      f"recorded {memo_check['recorded_bytes'] / GB:.2f} GB, estimated "
                      f"{memo_check['estimate_bytes'] / GB:.2f} GB")
    wall = time.perf_counter() - t0
    table = format_table(bench, results)
    text = [f"### One GPU: {job}", "", table, ""]
    for r in (memo["row"], memo["failure_row"]) if memo else ():
        if r and r.get("parts"):
            text += [format_parts(r), ""]
    if memo_check:
        same = (" (the recording the calibration made: the policy it names is the one chosen)"
                if memo_check["same_as_calibration"] else "")
        fits = "within" if memo_check["recorded_bytes"] <= memo_check["cap_bytes"] else "OVER"
        text += [f"memo check (the pipeline's probe): its chosen policy ({memo_check['policy']}, alpha "
                 f"{memo_check['alpha']:.4f}) recorded with memo's runtime at {_tok(memo_check['seq_len'])}, "
                 f"tile {bench.tile(memo_check['seq_len'])} tokens, all {bench.config.n_layers} layers"
                 f"{same}: "
                 f"{memo_check['recorded_bytes'] / GB:.2f} GB, {fits} the cap of "
                 f"{memo_check['cap_bytes'] / GB:.2f} GB; host {memo_check['host_bytes'] / GB:.1f} GB "
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
    from _common import run_main  # run as a script, benchmarks/ is first on sys.path

    run_main(main)
