#!/usr/bin/env python
"""The host's share of a training step, with no kernels to hide it (issue 45).

``python benchmarks/host_share.py`` runs steps of a Llama with llama-3.2-1b's layer (hidden 2048, GQA
32/8, ffn 8192) on the meta device, where an op is dispatched, shaped and allocated but computes
nothing: what a step costs there is the host's work (Python, dispatch, memo's bookkeeping) that on a
GPU must hide behind the kernels. For none, full recompute and memo (alpha 0.5, every layer memo's, the
tiles a GPU run uses: :func:`memo.runtime.tiles.default_tile_tokens` for "cuda") at 8K, 128K and 1M
tokens it counts the ops dispatched per layer and step (a TorchDispatchMode) and the host's CPU
seconds per layer and step (``time.process_time``, one thread, the fastest of TIMED_STEPS steps),
each the difference between a 2-layer and a 1-layer model (the embedding, head and loss cancel), and
prints the table of benchmarks/RESULTS.md's "The host's share of a step".

NOTE [Host work per tile]
A memo layer runs its token-wise parts tile by tile, and every tile costs host work whatever its size
(its ops, memo's per-tile bookkeeping): HOST per tile = (memo's host seconds per layer - plain autograd's)
/ tiles per layer, measured here. A tile of t tokens gives the device at least 6·t·P FLOPs to run
(forward and backward of a layer of P matmul parameters; a recomputed tile more), so the host work
hides behind the kernels while 6·t·P / (peak x MFU) >= HOST, that is for tiles of at least
:func:`min_tile_tokens_hidden` tokens. Below it the device waits on the host. memo.runtime.tiles's tile
choice should never go below that length on an accelerator (it has its own work floor,
MIN_CHUNK_WORK; the table says whether that floor is above the measured bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: The lengths of the table (issue 45).
LENGTHS = (8192, 131072, 1 << 20)
STRATEGIES = ("none", "full-recompute", "memo")
#: memo's alpha here: half the tokens offloaded, half recomputed (both halves' tiles run).
ALPHA = 0.5
#: The bound's device: an H100's dense bf16 peak, at the MFU memo reached at 32K on an H200.
PEAK_FLOPS = 989e12
MFU = 0.25
#: Host seconds per op of eager PyTorch on a GPU (dispatch and a kernel launch): an assumption, not a
#: measurement here (meta's ops run Python shape functions a CUDA dispatch does not, so meta's seconds
#: per op are an upper bound); the last column's bound uses it with the counted ops per tile.
CUDA_S_PER_OP = 10e-6
#: Steps timed per measurement; the fastest counts.
TIMED_STEPS = 3

__all__ = ["OpCounter", "measure", "min_tile_tokens_hidden", "main"]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def min_tile_tokens_hidden(host_s_per_tile: float, layer_params: int, peak_flops: float = PEAK_FLOPS,
                           mfu: float = MFU) -> int:
    """The fewest tokens per tile whose device work hides the tile's host work (NOTE [Host work per
    tile]): 6·t·P / (peak x MFU) >= host seconds per tile."""
    if host_s_per_tile <= 0:
        return 1
    return max(1, int(-(-host_s_per_tile * peak_flops * mfu // (6 * layer_params))))


def _config(n_layers: int) -> Any:
    from memo.models import get_config

    base = get_config("llama-3.2-1b")
    return dataclasses.replace(base, name=f"llama-3.2-1b-{n_layers}l", n_layers=n_layers)


def gpu_tile_tokens(seq_len: int) -> int:
    """Tokens per tile a GPU run of llama-3.2-1b's layer uses at ``seq_len`` (memo.runtime.tiles)."""
    from memo.models import build_model
    from memo.runtime.tiles import default_tile_tokens, layer_token_bytes

    layer = build_model(_config(1), device="meta", dtype=torch.bfloat16).layers[0]
    hidden = _config(1).hidden
    return default_tile_tokens(seq_len, batch=1, hidden=hidden, device_type="cuda",
                               token_bytes=layer_token_bytes(layer, hidden, 2))


def _step(model: Any, ids: torch.Tensor) -> None:
    model(ids, ids).backward()


def _one(strategy: str, seq_len: int, n_layers: int, tile: int) -> tuple[int, float]:
    """(ops, seconds) of one step after a warm-up step (memo's first step runs more: NOTE [The first step
    of a wrapped model] in benchmarks/flops.py); the seconds of the fastest of TIMED_STEPS steps."""
    import memo
    from memo.models import build_model

    model = build_model(_config(n_layers), device="meta", dtype=torch.bfloat16)
    if strategy == "full-recompute":
        model.recompute = "full"
    elif strategy == "memo":
        memo.wrap(model, alpha=ALPHA, policy=["memo"] * n_layers, recompute_chunk_tokens=tile)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    _step(model, ids)
    counter = OpCounter()
    with counter:
        _step(model, ids)
    seconds = float("inf")
    for _ in range(TIMED_STEPS):  # the fastest: a shared machine only ever adds time
        # The process's CPU time: on meta every second of a step is this process's host work, and
        # other processes on a shared machine do not count in it.
        start = time.process_time()
        _step(model, ids)
        seconds = min(seconds, time.process_time() - start)
    if strategy == "memo":
        memo.unwrap(model)
    return counter.ops, seconds


def measure(strategy: str, seq_len: int) -> dict[str, Any]:
    """Ops and host seconds per layer and step of ``strategy`` at ``seq_len`` tokens (a 2-layer model
    less a 1-layer one)."""
    tile = gpu_tile_tokens(seq_len)
    (ops1, s1), (ops2, s2) = (_one(strategy, seq_len, n, tile) for n in (1, 2))
    return {"strategy": strategy, "seq_len": seq_len, "tile_tokens": tile if strategy == "memo" else None,
            "tiles": -(-seq_len // tile) if strategy == "memo" else None,
            "ops_per_layer": ops2 - ops1, "host_s_per_layer": max(s2 - s1, 0.0)}


def _layer_device_s(seq_len: int) -> float:
    """One layer's share of a step's model FLOPs on the bound's device (memo.utils.flops' formula)."""
    flops = 6.0 * seq_len * layer_params() + 6.0 * _config(1).hidden * float(seq_len) ** 2
    return flops / (PEAK_FLOPS * MFU)


def layer_params() -> int:
    """Parameters of one llama-3.2-1b layer."""
    from memo.models.model import num_parameters

    return num_parameters(_config(2), max_seq_len=0) - num_parameters(_config(1), max_seq_len=0)


def format_markdown(rows: list[dict[str, Any]]) -> str:
    from memo.runtime.tiles import MIN_CHUNK_WORK

    lines = ["| strategy | seq | tiles/layer (tokens) | ops/layer/step | host ms/layer/step (meta) | "
             "H100 layer compute ms | host / compute | ops per tile | host ms per tile (meta) | "
             "tile that hides it (meta) | tile that hides it (10 µs/op) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    none = {r["seq_len"]: r for r in rows if r["strategy"] == "none"}
    for r in rows:
        device = _layer_device_s(r["seq_len"])
        ops, per_tile, hides, hides_cuda = "-", "-", "-", "-"
        if r["strategy"] == "memo" and r["seq_len"] in none:
            extra = r["host_s_per_layer"] - none[r["seq_len"]]["host_s_per_layer"]
            tile_ops = (r["ops_per_layer"] - none[r["seq_len"]]["ops_per_layer"]) / r["tiles"]
            ops = f"{tile_ops:,.0f}"
            per_tile = f"{1e3 * extra / r['tiles']:.2f}"
            hides = f"{min_tile_tokens_hidden(extra / r['tiles'], layer_params()):,}"
            hides_cuda = f"{min_tile_tokens_hidden(tile_ops * CUDA_S_PER_OP, layer_params()):,}"
        tiles = "-" if r["tiles"] is None else f"{r['tiles']} ({r['tile_tokens']:,})"
        lines.append(f"| {r['strategy']} | {r['seq_len'] // 1024:,}K | {tiles} | {r['ops_per_layer']:,} | "
                     f"{1e3 * r['host_s_per_layer']:,.1f} | {1e3 * device:,.1f} | "
                     f"{r['host_s_per_layer'] / device:.3f} | {ops} | {per_tile} | {hides} | {hides_cuda} |")
    floor = MIN_CHUNK_WORK // _config(1).hidden ** 2
    return "\n".join(lines) + (f"\n\nmemo.runtime.tiles's work floor for this layer: {floor:,} tokens "
                               f"(MIN_CHUNK_WORK / hidden²).\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", nargs="+", default=None, help="lengths (default 8K 128K 1M)")
    p.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    p.add_argument("--from-json", default=None, help="print the table of a JSON file this script wrote")
    args = p.parse_args(argv)
    if args.from_json:
        print(format_markdown(json.loads(Path(args.from_json).read_text())["rows"]))
        return 0
    from memo.cli.args import seq_len

    torch.set_num_threads(1)
    lengths = [seq_len(n) for n in args.seq_lens] if args.seq_lens else list(LENGTHS)
    rows = []
    for n in lengths:
        for strategy in STRATEGIES:
            rows.append(measure(strategy, n))
            print(f"host_share: {strategy} at {n:,}: {rows[-1]['ops_per_layer']:,} ops, "
                  f"{rows[-1]['host_s_per_layer'] * 1e3:,.1f} ms per layer", file=sys.stderr, flush=True)
    print(format_markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"version": 1, "kind": "memo.benchmark.host_share",
                                               "peak_flops": PEAK_FLOPS, "mfu": MFU, "rows": rows}, indent=2)
                                   + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
