#!/usr/bin/env python
"""Hugging Face ``Trainer`` + PEFT LoRA + memo, in the few lines a user adds to a run they have.

A tiny random Llama is built from a config (no download; ``--model-path DIR`` loads local weights
instead), PEFT puts LoRA adapters (with dropout) on its attention and MLP projections, the batches
are packed (sequences of varying lengths end to end, HF's ``DataCollatorWithFlattening``), and
``memo.wrap`` wraps its decoder layers: ``alpha`` of each layer's tokens go to host memory, the
rest are recomputed in backward. Then HF's ``Trainer`` trains it as it trains any model: the stock
call ``model(input_ids=..., labels=...)`` (HF's labels, its default ``use_cache=True`` turned off in
training by memo as by HF's gradient checkpointing). ``--compare`` trains the same run without memo
and prints both loss curves: under one seed they are the same.

Examples:
    python examples/trainer_hf.py --seq-len 256 --steps 4 --compare
    python examples/trainer_hf.py --model-path ./Llama-3.2-1B --seq-len 32K --alpha 0.5
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import memo
from memo.cli.args import positive_int, seq_len


def build(model_path: str | None, lora_dropout: float) -> torch.nn.Module:
    """The causal LM with PEFT LoRA adapters; only they train."""
    import peft
    import transformers

    if model_path is None:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          attn_implementation="sdpa")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True,
                                                                  attn_implementation="sdpa")
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=lora_dropout,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    return peft.get_peft_model(model, lora)


class Sequences(torch.utils.data.Dataset):
    """Random token sequences of varying lengths (half to all of ``length``), as a dataset of
    documents gives them; the collator packs a batch of them into one row."""

    def __init__(self, vocab: int, length: int, count: int) -> None:
        gen = torch.Generator().manual_seed(1)
        sizes = torch.randint(length // 2, length + 1, (count,), generator=gen)
        self.ids = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in sizes]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.ids[i]}


def train(*, use_memo: bool, seq: int = 256, steps: int = 4, batch: int = 2, alpha: float = 0.5,
          model_path: str | None = None, lora_dropout: float = 0.1) -> list[float]:
    """One Trainer run; returns its per-step training losses."""
    import transformers

    model = build(model_path, lora_dropout)
    if use_memo:  # the one line memo adds
        memo.wrap(model, alpha=alpha, policy=["memo"] * model.config.num_hidden_layers)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-3,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(),
            seed=0, dataloader_num_workers=0, disable_tqdm=True)
        data = Sequences(model.config.vocab_size, seq, steps * batch)
        # Packing: the batch's sequences end to end in one row, position_ids restarting at each, so
        # that no token attends across a boundary; labels as HF takes them (the model shifts them).
        packing = transformers.DataCollatorWithFlattening(return_tensors="pt")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=packing)
        trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="local HF model folder (default: a tiny random Llama)")
    p.add_argument("--seq-len", type=seq_len, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--steps", type=positive_int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--batch", type=positive_int, default=2, help="sequences per step (default 2)")
    p.add_argument("--alpha", type=float, default=0.5, help="tokens offloaded per layer (default 0.5)")
    p.add_argument("--compare", action="store_true", help="train the same run without memo too")
    args = p.parse_args()
    common = {"seq": args.seq_len, "steps": args.steps, "batch": args.batch, "model_path": args.model_path}
    with_memo = train(use_memo=True, alpha=args.alpha, **common)
    print("with memo:   ", " ".join(f"{x:.4f}" for x in with_memo))
    if args.compare:
        without = train(use_memo=False, **common)
        print("without memo:", " ".join(f"{x:.4f}" for x in without))


if __name__ == "__main__":
    main()
