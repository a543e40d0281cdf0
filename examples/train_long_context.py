#!/usr/bin/env python
"""Long-context training with memo, written out step by step (``memo train`` does the same).

1. build the model;  2. the pipeline: profile one iteration (S_input/S_attn/S_others), alpha
from the LP, the trace of the model wrapped with that alpha, and the plan (bi-level MIP);
3. a memo.Session: the planned allocator, the layers wrapped for token-wise offload/recompute,
the phases tracked and the host buffers sized before step 1;  4. train, every activation served
from its planned address.

Examples:
    python examples/train_long_context.py --model gpt-mini --seq-len 4K --steps 10
    python examples/train_long_context.py --model gpt-1.3b --seq-len 128K --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import memo
from memo import allocator
from memo.cli.args import positive_int, seq_len
from memo.errors import MemoError
from memo.models import DEFAULT_MAX_SEQ_LEN, build_model, get_config
from memo.pipeline import profile
from memo.train.loop import DTYPES, SyntheticTokens, adamw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-mini", help="registered model name (gpt-mini)")
    parser.add_argument("--seq-len", type=seq_len, default=4096, help="tokens per sequence: 4096, 128K, 1M")
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=positive_int, default=10, help="optimizer steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    args = parser.parse_args(argv)
    try:
        return train(args)
    except MemoError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def train(args: argparse.Namespace) -> int:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        allocator.install_cuda()  # memo's allocator must be PyTorch's before the first CUDA tensor

    # 1. The model (GPT's learned position table must cover the sequence).
    config = get_config(args.model)
    extra = {"max_seq_len": max(args.seq_len, DEFAULT_MAX_SEQ_LEN)} if config.arch == "gpt" else {}
    torch.manual_seed(0)
    model = build_model(config, device=device, dtype=dtype, **extra)
    data = iter(SyntheticTokens(config.vocab_size, args.seq_len, args.micro_batch, seed=0))
    ids, labels = (t.to(device) for t in next(data))

    # 2. The pipeline: profile (B and T_layer are measured on this device), solve alpha, plan.
    result = profile(model, args.seq_len, args.micro_batch, device=device, recorder="allocator",
                     time_limit=5.0, log=lambda line: print(f"profile: {line}"))
    plan = result.plan
    for p in model.parameters():
        p.grad = None
    print(f"alpha {plan.alpha:.4f} ({plan.alpha_binding}); arena {plan.peak / 2**20:.1f} MiB, "
          f"lower bound {plan.lower_bound / 2**20:.1f} MiB, pinned host {plan.host_bytes / 2**20:.1f} MiB")
    optimizer = adamw(model.parameters(), lr=args.lr)  # fused: no step temporaries (NOTE [Fused AdamW])

    # 3 + 4. A Session installs the planned allocator, wraps the layers (token-wise offload/recompute
    # in every layer but the last two), tells the allocator which phase (and so which plan table) is
    # open, sizes the host buffers now, and undoes it all when the block ends.
    with memo.Session(model, plan, device=device, example=(ids, labels)) as session:
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_value = session.step(ids, labels).item()
            optimizer.step()
            seconds = time.perf_counter() - start
            st = allocator.stats(device)
            print(f"step {step:>3}  loss {loss_value:.4f}  {seconds * 1e3:,.0f} ms  "
                  f"{args.micro_batch * args.seq_len / seconds:,.0f} tok/s  "
                  f"planned {st['planned_hits']}  deviations {st['deviations']}")
            ids, labels = (t.to(device) for t in next(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
