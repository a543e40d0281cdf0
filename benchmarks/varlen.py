#!/usr/bin/env python
"""Variable sequence lengths: memo against the unwrapped model, side by side in one process.

A dataloader of varying lengths is what fine-tuning runs see. memo sizes its host buffers for the
inputs it meets (a dry run of the layers per new input shape, NOTE [Sizing the host arena]), and
they only grow; this measures what that costs. ``--steps`` optimizer steps draw their lengths from
``--lengths`` distinct ones; the same batches run unwrapped, under memo, and under memo at one
fixed length of the same mean (which separates the cost of the lengths from that of the recompute).
Every step's loss is compared with the unwrapped model's (exact, not timed).

Example:
    python benchmarks/varlen.py --model hf-llama --steps 20 --lengths 8
"""

from __future__ import annotations

import argparse
import copy
import random
import time
import warnings

import torch
from _common import run_main

import memo


def _model(name: str) -> tuple[torch.nn.Module, int, bool]:
    """The model, its vocabulary, and whether it is a Hugging Face one (it takes keywords)."""
    if name == "hf-llama":
        import transformers

        config = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                          attn_implementation="sdpa", use_cache=False)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train(), 512, True
    from memo.models import build_model

    torch.manual_seed(0)
    model = build_model(name)
    return model, model.config.vocab_size, False


def _train(model: torch.nn.Module, batches: list[torch.Tensor], hf: bool) -> tuple[float, list[float]]:
    """Seconds for the steps, and each step's loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    start = time.perf_counter()
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss if hf else model(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return time.perf_counter() - start, losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hf-llama",
                   help="hf-llama (a small random HF Llama) or a memo model name")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--lengths", type=int, default=8, help="distinct sequence lengths (default 8)")
    p.add_argument("--base", type=int, default=256, help="lengths are multiples of this (default 256)")
    p.add_argument("--alpha", type=float, default=0.5, help="memo's offloaded fraction (default 0.5)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    model, vocab, hf = _model(args.model)
    rng = random.Random(0)
    lengths = [args.base * (k + 1) for k in range(args.lengths)]
    gen = torch.Generator().manual_seed(1)
    varying = [torch.randint(0, vocab, (1, rng.choice(lengths)), generator=gen) for _ in range(args.steps)]
    mean = round(sum(b.shape[1] for b in varying) / len(varying) / args.base) * args.base
    fixed = [torch.randint(0, vocab, (1, mean), generator=gen) for _ in range(args.steps)]
    n = len(model.model.layers) if hf else len(model.layers)

    def wrapped() -> torch.nn.Module:
        return memo.wrap(copy.deepcopy(model), alpha=args.alpha, policy=["memo"] * n)

    rows = []
    for label, net, batches in (("unwrapped, varying lengths", copy.deepcopy(model), varying),
                                ("memo, varying lengths", wrapped(), varying),
                                ("unwrapped, one length", copy.deepcopy(model), fixed),
                                ("memo, one length", wrapped(), fixed)):
        seconds, losses = _train(net, batches, hf)
        rows.append((label, seconds, losses))
        print(f"{label:<28} {seconds:7.2f} s")
    worst = max(abs(a - b) / abs(b) for a, b in zip(rows[1][2], rows[0][2], strict=True))
    print(f"\n{args.model}, {args.steps} steps over {args.lengths} lengths ({lengths[0]}..{lengths[-1]} "
          f"tokens), alpha {args.alpha}, {args.threads} thread(s)")
    print(f"memo / unwrapped, varying lengths: {rows[1][1] / rows[0][1]:.2f}x   "
          f"(one length of {mean} tokens: {rows[3][1] / rows[2][1]:.2f}x)")
    print(f"losses, memo against unwrapped: largest relative difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    run_main(main)
