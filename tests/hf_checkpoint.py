"""A tiny Hugging Face checkpoint on disk for the fine-tuning tests: a Llama saved by ``save_pretrained``
and a byte-level BPE tokenizer trained here with the ``tokenizers`` library, both in a temporary
directory, with no download. Not a test module (no ``test_`` prefix)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: A few sentences to train the tokenizer on and to write as a JSONL corpus.
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a long context needs memory for every token it keeps",
    "memo offloads some tokens and recomputes the others",
    "every layer input goes to the host and comes back in backward",
    "pack the documents into one sequence and keep their boundaries",
    "the loss of a packed batch equals the loss of its documents",
]


def make_tokenizer(directory: str | Path, vocab_size: int = 256) -> Path:
    """Train a byte-level BPE tokenizer on :data:`SENTENCES` and save it as a transformers tokenizer
    (``AutoTokenizer.from_pretrained(directory)`` loads it). Returns ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(SENTENCES * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    directory = Path(directory)
    fast.save_pretrained(directory)
    return directory


def make_tiny_llama(directory: str | Path, vocab_size: int, *, layers: int = 2, hidden: int = 32,
                    heads: int = 4, kv_heads: int = 2, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Save a randomly initialised tiny ``LlamaForCausalLM`` with ``save_pretrained`` (safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=3)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_checkpoint(directory: str | Path) -> Path:
    """A tokenizer and a tiny Llama of its vocabulary in one directory (an HF checkpoint as users have it)."""
    from transformers import AutoTokenizer

    directory = make_tokenizer(directory)
    make_tiny_llama(directory, len(AutoTokenizer.from_pretrained(directory)))
    return directory


def write_jsonl(path: str | Path, records: list[dict] | None = None) -> Path:
    """A JSONL corpus: one ``{"text": ...}`` per sentence, or ``records`` as given."""
    path = Path(path)
    records = records if records is not None else [{"text": s} for s in SENTENCES]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sharpen_attention(model: torch.nn.Module, scale: float = 20.0) -> None:
    """Scale every layer's query and key weights of an HF causal LM by ``scale``: at the initial 0.02
    scale attention is near uniform whatever the positions, so a loss would not show the rotary
    embedding or the head grouping."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)


def train_catching_export(config: Any, strategy: Any) -> tuple[Any, torch.nn.Module | None]:
    """``memo.train.train(config)`` with ``strategy``: its result and the trained model, as it reached
    ``--export`` (None when the run exported nothing)."""
    from memo.train import export
    from memo.train.loop import train

    caught: dict[str, torch.nn.Module] = {}
    real = export.export_trained

    def catch(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        caught["model"] = model
        return real(model, *args, **kwargs)

    export.export_trained = catch
    try:
        result = train(config, progress=False, log=lambda _line: None, strategy=strategy)
    finally:
        export.export_trained = real
    return result, caught.get("model")
