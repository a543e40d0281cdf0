#!/usr/bin/env python
"""Variable sequence lengths: memo against the unwrapped model, side by side in one process.

A dataloader of varying lengths is what fine-tuning runs see. memo sizes its host buffers for the
inputs it meets (a dry run of the layers per new input shape, NOTE [Sizing the host arena]), and
they only grow; this measures what that costs. ``--steps`` optimizer steps draw their lengths from
``--lengths`` distinct ones; the same batches run unwrapped, under memo, and under memo at one
fixed length of the same mean (which separates the cost of the lengths from that of the recompute).
The four runs take turns step by step in a rotating order (a shared machine's load falls on all
alike); ``--rounds`` rounds do so on fresh copies (memo sizes every new length again), and each row
is its median round.
Every step's loss is compared with the unwrapped model's (exact, not timed).

Example:
    python benchmarks/varlen.py --model hf-llama --steps 20 --lengths 8
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
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


class _Run:
    """One model training on its batches, a step at a time: the runs take turns step by step, so
    the load of a shared machine falls on all of them alike."""

    def __init__(self, model: torch.nn.Module, hf: bool) -> None:
        self.model, self.hf = model, hf
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.seconds, self.losses = 0.0, []

    def step(self, ids: torch.Tensor) -> None:
        start = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss if self.hf else self.model(ids, ids)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(float(loss))
        self.seconds += time.perf_counter() - start


def _worst_gradient(model: torch.nn.Module, wrapped: torch.nn.Module, batches: list[torch.Tensor],
                    hf: bool) -> float:
    """The largest relative error (norm of the difference over the norm) of any parameter's
    gradient, memo against the unwrapped model, over one backward per batch, without a step."""
    worst = 0.0
    for ids in batches:
        for net in (model, wrapped):
            net.zero_grad(set_to_none=True)
            (net(input_ids=ids, labels=ids).loss if hf else net(ids, ids)).backward()
        for p, q in zip(model.parameters(), wrapped.parameters(), strict=True):
            if p.grad is not None:
                err = float((q.grad - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
                worst = max(worst, err)
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hf-llama",
                   help="hf-llama (a small random HF Llama) or a memo model name")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--lengths", type=int, default=8, help="distinct sequence lengths (default 8)")
    p.add_argument("--base", type=int, default=256, help="lengths are multiples of this (default 256)")
    p.add_argument("--alpha", type=float, default=0.5, help="memo's offloaded fraction (default 0.5)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the four runs; each row is the median "
                   "(default 3)")
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

    runs = (("unwrapped, varying lengths", lambda: copy.deepcopy(model), varying),
            ("memo, varying lengths", wrapped, varying),
            ("unwrapped, one length", lambda: copy.deepcopy(model), fixed),
            ("memo, one length", wrapped, fixed))
    seconds: list[list[float]] = [[] for _ in runs]
    losses: list[list[float]] = [[] for _ in runs]
    for r in range(max(1, args.rounds)):
        trainers = [_Run(make(), hf) for _, make, _ in runs]
        for k in range(args.steps):
            for j in range(len(runs)):
                i = (j + k + r) % len(runs)
                trainers[i].step(runs[i][2][k])
        for i, trainer in enumerate(trainers):
            seconds[i].append(trainer.seconds)
            losses[i] = trainer.losses
    rows = []
    for (label, _, _), times, run_losses in zip(runs, seconds, losses, strict=True):
        rows.append((label, statistics.median(times), run_losses))
        print(f"{label:<28} {rows[-1][1]:7.2f} s   (rounds: {', '.join(f'{t:.2f}' for t in times)})")
    worst = max(abs(a - b) / abs(b) for a, b in zip(rows[1][2], rows[0][2], strict=True))
    print(f"\n{args.model}, {args.steps} steps over {args.lengths} lengths ({lengths[0]}..{lengths[-1]} "
          f"tokens), alpha {args.alpha}, {args.threads} thread(s)")
    # The ratio of each round (its runs took turns, under the same load), then the median of those.
    varying_ratio = statistics.median(m / u for m, u in zip(seconds[1], seconds[0], strict=True))
    fixed_ratio = statistics.median(m / u for m, u in zip(seconds[3], seconds[2], strict=True))
    print(f"memo / unwrapped, varying lengths: {varying_ratio:.2f}x   (one length of {mean} tokens: "
          f"{fixed_ratio:.2f}x; median of the rounds' ratios)")
    print(f"losses, memo against unwrapped: largest relative difference {worst:.1e}")
    distinct = sorted({b.shape[1]: b for b in varying}.items())
    gradient = _worst_gradient(copy.deepcopy(model), wrapped(), [b for _, b in distinct], hf)
    print(f"gradients at each of the {len(distinct)} lengths, memo against unwrapped: largest relative "
          f"error {gradient:.1e} (bar 1e-5)")
    return 0


if __name__ == "__main__":
    run_main(main)
