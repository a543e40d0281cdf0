#!/usr/bin/env python
"""Fine-tune a Hugging Face causal LM at long context with memo: LoRA-style, optionally in bf16.

By default a tiny random Llama is built from a config (no download); ``--model-path DIR`` loads
local weights instead (Llama, Qwen2 or Mistral; ``from_pretrained(DIR, local_files_only=True)``).
Every weight is frozen except PEFT's LoRA adapters on the attention's q and v projections
(examples/trainer_hf.py trains the same way under HF Trainer), the decoder layers are wrapped by
memo (token-wise offload of ``alpha`` of each layer's tokens, the rest recomputed in backward),
and the loss is memo's chunked LM loss through the model adapter, so the ``[b, s, vocab]``
logits never exist.

This is the plain path: ``memo.wrap`` + a training loop, no profile or plan. ``--compare`` trains
the same run a second time, from the same weights, under Hugging Face's own gradient checkpointing
(``use_reentrant=False``) instead of memo, and prints both side by side: losses, the median step
time, and on a GPU the peak device memory (``torch.cuda.max_memory_allocated``).

Examples:
    python examples/finetune_hf.py --seq-len 2048 --steps 5
    python examples/finetune_hf.py --model-path ./Llama-3.2-1B --seq-len 32K --device cuda --bf16
    python examples/finetune_hf.py --seq-len 32K --device cuda --bf16 --hidden 2048 --layers 16 \
        --heads 16 --compare --json finetune-32k.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import memo
from memo.adapters import model_adapter_for
from memo.adapters.model import ModelAdapter
from memo.cli.args import positive_int, seq_len
from memo.errors import MemoError
from memo.runtime.wrap import runtime_of
from memo.train.loop import SyntheticTokens, adamw


def add_lora(model: nn.Module, rank: int) -> nn.Module:
    """PEFT's LoRA on each layer's q_proj and v_proj, everything else frozen; returns the model the
    adapters live in (PEFT injects them in place, so memo wraps and trains that model)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config).get_base_model()


def build(args: argparse.Namespace) -> nn.Module:
    import transformers

    if args.model_path:
        return transformers.AutoModelForCausalLM.from_pretrained(
            args.model_path, local_files_only=True, attn_implementation="sdpa", torch_dtype=torch.float32)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2), vocab_size=args.vocab,
        max_position_embeddings=max(args.seq_len, 2048), attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="local directory of a Llama/Qwen2/Mistral checkpoint")
    parser.add_argument("--seq-len", type=seq_len, default=2048, help="tokens per sequence: 2048, 32K")
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=positive_int, default=5, help="optimizer steps")
    parser.add_argument("--alpha", type=float, default=0.5, help="offloaded fraction of each layer's tokens")
    parser.add_argument("--lora-rank", type=positive_int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--bf16", action="store_true", help="run forward under bfloat16 autocast")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=positive_int, default=128, help="tiny config: hidden size")
    parser.add_argument("--layers", type=positive_int, default=4, help="tiny config: decoder layers")
    parser.add_argument("--heads", type=positive_int, default=4, help="tiny config: attention heads")
    parser.add_argument("--vocab", type=positive_int, default=512, help="tiny config: vocabulary")
    parser.add_argument("--compare", action="store_true",
                        help="train the same run again under HF's gradient checkpointing and print both")
    parser.add_argument("--json", type=Path, help="with --compare: write both runs' numbers here")
    args = parser.parse_args(argv)
    try:
        return finetune(args)
    except MemoError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def finetune(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    model = build(args).to(device).train()
    model.config.use_cache = False  # no KV cache while training (memo would turn it off, with a warning)
    model = add_lora(model, args.lora_rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapter = model_adapter_for(model, "finetune_hf")  # refuses what memo cannot train, with the reason
    n_layers = len(model.model.layers)
    precision = "bf16 autocast" if args.bf16 else "fp32"
    print(f"{type(model).__name__}: {n_layers} layers, vocab {adapter.vocab_size(model)}, "
          f"{trainable:,} trainable of {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"seq_len {args.seq_len}, alpha {args.alpha}, {precision} on {device}")
    # The starting weights for --compare, kept on the host: a second copy on the device would count in
    # the first run's peak.
    start = None
    if args.compare:
        start = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    # Every decoder layer offloads alpha of its tokens and recomputes the rest in backward.
    memo.wrap(model, alpha=args.alpha, policy=["memo"] * n_layers)
    try:
        runs = {"memo": train(model, adapter, args, device)}
        print("memo:", json.dumps(runtime_of(model).describe()))
    finally:
        memo.unwrap(model)
    if start is not None:
        # HF's own: every decoder layer's input kept, the layer recomputed in backward.
        model.load_state_dict(start)
        _hf_checkpointing(model)
        print("HF gradient checkpointing (use_reentrant=False), the same run:")
        runs["hf-checkpointing"] = train(model, adapter, args, device)
        _print_comparison(runs, args)
    return 0


def _hf_checkpointing(model: nn.Module) -> None:
    """HF's gradient checkpointing, non-reentrant (``activation_checkpointing_enable`` in newer
    transformers, which deprecates the older name)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train(model: nn.Module, adapter: ModelAdapter, args: argparse.Namespace, device: torch.device) -> dict:
    """``args.steps`` steps on the same synthetic batches; -> losses, step seconds, their median past
    the first (warm-up, sizing), device peak."""
    optimizer = adamw(model.parameters(), lr=args.lr)  # fused: no step temporaries (NOTE [Fused AdamW])
    data = iter(SyntheticTokens(adapter.vocab_size(model), args.seq_len, args.micro_batch, seed=0))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = [], []
    for step in range(1, args.steps + 1):
        ids, labels = (t.to(device) for t in next(data))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = adapter.loss(model, ids, labels)  # labels[:, t] is the token after ids[:, t]
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        print(f"step {step:>3}  loss {losses[-1]:.4f}  {seconds[-1] * 1e3:,.0f} ms  "
              f"{args.micro_batch * args.seq_len / seconds[-1]:,.0f} tok/s")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"losses": losses, "step_seconds": seconds,
            "median_step_seconds": statistics.median(seconds[1:] or seconds), "peak_device_bytes": peak}


def _print_comparison(runs: dict[str, dict], args: argparse.Namespace) -> None:
    """Both runs side by side."""
    print(f"\n{'run':<18} {'median step':>12} {'peak device':>12}  losses")
    for name, run in runs.items():
        peak = run["peak_device_bytes"]
        peak_text = f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a (cpu)"
        print(f"{name:<18} {run['median_step_seconds'] * 1e3:>9,.0f} ms {peak_text:>12}  "
              + " ".join(f"{x:.4f}" for x in run["losses"]))
    memo_run, hf_run = runs["memo"], runs["hf-checkpointing"]
    time_ratio = memo_run["median_step_seconds"] / hf_run["median_step_seconds"]
    line = f"memo / HF checkpointing: step time {time_ratio:.2f}x"
    if memo_run["peak_device_bytes"] is not None:
        line += f", peak device memory {memo_run['peak_device_bytes'] / hf_run['peak_device_bytes']:.2f}x"
    print(line)
    if args.json is not None:
        args.json.write_text(json.dumps({"version": 1, "kind": "memo.finetune_compare",
                                         "seq_len": args.seq_len, "alpha": args.alpha, "bf16": args.bf16,
                                         "runs": runs}, indent=2) + "\n")
        print(f"written to {args.json}")


if __name__ == "__main__":
    sys.exit(main())
