#!/usr/bin/env python
"""Step time of memo's runtime against the number of recompute chunks (NOTE [How small a chunk]).

One model, one sequence length, one alpha, every layer ``memo``; for each chunk count the layers
are wrapped with ``recompute_chunk_tokens`` set so that the recomputed range ``[a:s]`` runs in
that many chunks, then forward + backward is timed (median of ``--steps`` after two warm-up
steps). The plain model and full recompute run in the same process as baselines, and the row
``default`` is memo's own choice of chunks. Ratios are to full recompute.

On a GPU, chunks too small for their kernels leave the GPU waiting on the host (the session-7
finding in benchmarks/RESULTS.md); on a CPU the kernels dominate and the counts differ little.

    python benchmarks/chunk_size.py --device cuda --model gpt-125m --seq-len 8K --alpha 0.11
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import memo.runtime as mr
from memo.cli.args import seq_len
from memo.models import build_model
from memo.runtime.layer import offload_tokens, token_chunks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> float:
    """Median seconds of one forward + backward (after two warm-up steps)."""
    times = []
    for n in range(steps + 2):
        _sync(ids.device)
        start = time.perf_counter()
        model(ids, ids).backward()
        _sync(ids.device)
        if n >= 2:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="tiny", help="registered model name")
    parser.add_argument("--seq-len", type=seq_len, default="2048", help="tokens per sequence: 2048, 8K, ...")
    parser.add_argument("--alpha", type=float, default=0.1, help="share of tokens offloaded")
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 4, 2, 1], help="chunk counts to time")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    seq = args.seq_len
    torch.manual_seed(0)
    model = build_model(args.model, device=device, dtype=getattr(torch, args.dtype), max_seq_len=seq)
    n_layers = len(model.layers)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
    span = seq - offload_tokens(args.alpha, seq)
    hidden = model.config.hidden

    rows: list[tuple[str, int | None, float]] = [("plain", None, _time_steps(model, ids, args.steps))]
    model.recompute = "full"
    rows.append(("full-recompute", None, _time_steps(model, ids, args.steps)))
    model.recompute = "none"
    default = len(token_chunks(span, batch=1, hidden=hidden, device_type=device.type))
    for label, count in [("default", default)] + [(f"{c} chunks", c) for c in args.chunks]:
        chunk_tokens = None if label == "default" else max(1, -(-span // count))
        runtime = mr.MemoRuntime(args.alpha, recompute_chunk_tokens=chunk_tokens, policy=["memo"] * n_layers)
        mr.wrap(model, runtime=runtime)
        try:
            got = len(token_chunks(span, chunk_tokens, batch=1, hidden=hidden,
                                       device_type=device.type))
            rows.append((label, got, _time_steps(model, ids, args.steps)))
        finally:
            mr.unwrap(model)

    full = rows[1][2]
    print(f"{args.model}, {seq:,} tokens, alpha {args.alpha}, {args.dtype} on {device} "
          f"(recomputed range {span:,} tokens; default: {default} chunk(s))")
    print(f"{'row':<16} {'chunks':>6} {'step':>10} {'/FR':>6}")
    for label, count, seconds in rows:
        print(f"{label:<16} {'-' if count is None else count:>6} {seconds * 1e3:>8.1f} ms "
              f"{seconds / full:>5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
