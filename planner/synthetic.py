"""Synthetic instances for tests and benchmarks: hard flat DSA packings and layered traces.

:func:`guillotine_instance` cuts the rectangle ``[0, T) x [0, M)`` (time x memory)
into random sub-rectangles; every piece becomes an item, so a perfect packing
with peak ``M`` exists and the lower bound is ``M`` too. Greedy placement often
misses it by tens of percent, which is what the MIP is for.

:func:`layered_trace` builds a transformer-like iteration: embedding, ``n_layers``
forward passes that keep a few skeletal tensors and free many transients, a
head, and the backward passes in reverse order that free the skeletal tensors.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from memo.units import ALIGNMENT

from .dsa import Item
from .trace import TraceBuilder

__all__ = ["guillotine_instance", "items_to_trace", "layered_trace", "write_layered_plan"]


def guillotine_instance(n_items: int, *, time_span: int = 1000, height: int = 1000,
                        seed: int = 0) -> list[Item]:
    """About ``n_items`` items tiling ``[0, time_span) x [0, height)`` exactly (optimum = LB = height)."""
    rng = random.Random(seed)
    pieces = [(0, time_span, 0, height)]  # (t0, t1, y0, y1)
    while len(pieces) < n_items:
        # Split the largest splittable piece so sizes stay varied but not degenerate.
        pieces.sort(key=lambda p: (p[1] - p[0]) * (p[3] - p[2]))
        t0, t1, y0, y1 = pieces.pop()
        vertical = rng.random() < 0.5
        if (vertical and t1 - t0 < 2) or (not vertical and y1 - y0 < 2):
            vertical = not vertical
        if vertical and t1 - t0 >= 2:
            cut = rng.randint(t0 + 1, t1 - 1)
            pieces += [(t0, cut, y0, y1), (cut, t1, y0, y1)]
        elif not vertical and y1 - y0 >= 2:
            cut = rng.randint(y0 + 1, y1 - 1)
            pieces += [(t0, t1, y0, cut), (t0, t1, cut, y1)]
        else:
            pieces.append((t0, t1, y0, y1))
            break
    rng.shuffle(pieces)
    return [Item(size=y1 - y0, start=t0, end=t1) for t0, t1, y0, y1 in pieces]


def layered_trace(n_layers: int = 4, *, hidden: int = 64, seq: int = 128, odd_layer: int | None = None,
                  dtype_bytes: int = 2, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """A trace dict shaped like one training iteration of an ``n_layers`` transformer.

    Each layer forward keeps 4 skeletal tensors (input, qkv, attention output, MLP input)
    and frees 6 transients of mixed sizes; each backward frees its layer's skeletal
    tensors and makes 8 transients. ``odd_layer`` gets one extra transient in its forward
    (a layer whose phase trace differs from the others).
    """
    trace = TraceBuilder()
    next_id = [1]
    act = seq * hidden * dtype_bytes

    def malloc(size: int, phase: str | None) -> int:
        ident = next_id[0]
        next_id[0] += 1
        trace.malloc(ident, int(size), phase)
        return ident

    free = trace.free

    weights = [malloc(hidden * hidden * 12 * dtype_bytes, None) for _ in range(2)]
    x = malloc(act, "embed.fwd")
    tmp = malloc(act * 2, "embed.fwd")
    free(tmp)
    skeletal: list[list[int]] = []
    for i in range(n_layers):
        ph = f"layer.fwd[{i}]"
        keep = [malloc(act, ph)]
        ln = malloc(act, ph)
        qkv = malloc(act * 3, ph)
        keep.append(malloc(act * 3, ph))
        free(ln)
        scores = malloc(act * 2, ph)
        keep.append(malloc(act, ph))
        free(qkv)
        free(scores)
        h = malloc(act * 4, ph)
        g = malloc(act * 4, ph)
        if odd_layer == i:
            extra = malloc(act * 5, ph)
            free(extra)
        keep.append(malloc(act, ph))
        free(h)
        out = malloc(act, ph)
        free(g)
        free(out)
        skeletal.append(keep)
    logits = malloc(act * 8, "head.fwd")
    loss = malloc(512, "head.fwd")
    grad = malloc(act, "head.bwd")
    free(logits)
    for i in reversed(range(n_layers)):
        ph = f"layer.bwd[{i}]"
        a = malloc(act * 4, ph)
        b = malloc(act * 4, ph)
        free(a)
        c = malloc(act * 3, ph)
        d = malloc(act * 2, ph)
        free(b)
        free(d)
        e = malloc(act, ph)
        f = malloc(act * 3, ph)
        free(c)
        free(e)
        for t in skeletal[i]:
            free(t)
        new_grad = malloc(act, ph)
        g2 = malloc(act, ph)
        free(f)
        free(g2)
        free(grad)
        grad = new_grad
    w = malloc(hidden * 8 * dtype_bytes, "embed.bwd")
    free(grad)
    free(x)
    free(w)
    free(loss)
    opt = malloc(hidden * hidden * 12 * dtype_bytes, "optimizer")
    free(opt)
    del weights
    base_meta = {"model": "synthetic", "fingerprint": f"synthetic-{n_layers}-{hidden}-{seq}",
                 "seq_len": seq, "micro_batch": 1, "dtype": "bfloat16" if dtype_bytes == 2 else "float32",
                 "n_layers": n_layers}
    base_meta.update(meta or {})
    trace.meta = base_meta
    return trace.finish()


def items_to_trace(items: list[Item], *, unit: int = ALIGNMENT, phase: str | None = None) -> dict[str, Any]:
    """A flat trace whose allocations are ``items`` (sizes in ``unit`` bytes).

    Events are ordered by time with frees before mallocs at the same instant, so two
    allocations overlap in the trace exactly when their items overlap.
    """
    points = []
    for k, it in enumerate(items):
        points.append((it.start, 1, k))
        points.append((it.end, 0, k))
    points.sort()
    trace = TraceBuilder()
    for _, is_malloc, k in points:
        if is_malloc:
            trace.malloc(k, items[k].size * unit, phase)
        else:
            trace.free(k)
    return trace.finish()


def write_layered_plan(path: str | os.PathLike[str], layers: int, requests: int,
                       size: int = ALIGNMENT) -> int:
    """A valid plan of ``2 * layers * requests`` allocations at ``path``, written row by row in
    save_plan's layout without building it in memory (NOTE [A plan's summary] in planner/summary.py):
    ``layers`` layers, each a forward and a backward pass of ``requests`` allocations that live within
    the pass, every pass one level-1 block at offset 0. Returns the count."""
    phases = [f"layer.fwd[{i}]" for i in range(layers)] + [f"layer.bwd[{i}]" for i in reversed(range(layers))]
    block = [j * size for j in range(requests)]
    n = len(phases) * requests
    head: dict[str, Any] = {
        "version": 1, "kind": "memo.plan", "meta": {"model": "show-scale", "seq_len": 1},
        "alignment": ALIGNMENT, "alpha": None, "alpha_binding": None, "alpha_detail": None,
        "host_bytes": None, "offload": None, "policy": None, "tile_tokens": None, "device": None,
        "pipeline": None,
        "peak": requests * size, "lower_bound": requests * size, "no_reuse_bytes": n * size,
        "solver": {"kind": "synthetic", "seconds": 0.0}, "warnings": [],
        "level1": {"layer.fwd": block, "layer.bwd": block},
        "level1_peak": {"layer.fwd": requests * size, "layer.bwd": requests * size},
        "level2": {p: 0 for p in phases}, "items": {}, "phases": phases,
        "end_time": 2 * n, "unphased": "fallback",
        "allocation_count": n, "phase_peaks": {p: requests * size for p in phases},
    }
    with open(path, "w") as f:
        f.write(json.dumps(head, indent=1)[:-2] + ',\n "allocations": [\n')
        ident = 0
        for p in range(len(phases)):
            # a pass: requests allocations, the j-th live over [t + j, t + requests + j)
            t = 2 * requests * p
            rows = [f"[{p}, {j}, {size}, {t + j}, {t + requests + j}, {ident + j}]" for j in range(requests)]
            ident += requests
            f.write(",\n".join(rows) + (",\n" if p + 1 < len(phases) else "\n"))
        f.write(" ]\n}\n")
    return n
