"""The token sources a training run reads: synthetic tokens, or the bytes of a local file.

NOTE [A token source's position]
A source's ``state_dict()`` is where it is in its stream: the state of the generator that draws its
batches, and what it was made for (the kind, the sequence length, the batch, the file's size). Its
``load_state_dict(state)`` puts a source made for the same run back there, so the next batch is the one
the saved source would have yielded next (a resumed run reads the batches of the run it continues,
memo/train/checkpoint.py); a state of another source is refused with what differs. The state holds
plain values and tensors, never the data itself.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from memo.errors import MemoError

__all__ = ["Batch", "ByteFileTokens", "SyntheticTokens"]

Batch = tuple[torch.Tensor, torch.Tensor]


class _GeneratorPosition(abc.ABC):
    """A source whose position is its generator's state (NOTE [A token source's position]); a subclass
    says what it was made for in ``_made_for``."""

    generator: torch.Generator

    @abc.abstractmethod
    def _made_for(self) -> dict[str, Any]:
        """What the source was made for (checked against a saved state before it is loaded)."""

    def state_dict(self) -> dict[str, Any]:
        """NOTE [A token source's position]."""
        return {**self._made_for(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """NOTE [A token source's position]."""
        _check_state(state, self._made_for())
        self.generator.set_state(state["generator"])


class SyntheticTokens(_GeneratorPosition):
    """Learnable synthetic data: a fixed random cycle of distinct tokens, read at random offsets.

    Every token is followed by the same token everywhere in the data, so the loss can fall
    from ln(V) towards zero within a few steps (a bigram the embeddings pick up quickly);
    random offsets keep batches from being identical.

    Yields ``(ids, labels)``, both ``[micro_batch, seq_len]`` int64, labels = ids shifted by one.
    """

    def __init__(self, vocab_size: int, seq_len: int, micro_batch: int, seed: int, period: int = 64) -> None:
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.generator = torch.Generator().manual_seed(seed)
        self.period = min(period, vocab_size)
        self.cycle = torch.randperm(vocab_size, generator=self.generator)[: self.period]

    def __iter__(self) -> Iterator[Batch]:
        index = torch.arange(self.seq_len + 1)
        while True:
            starts = torch.randint(0, self.period, (self.micro_batch, 1), generator=self.generator)
            tokens = self.cycle[(starts + index) % self.period]
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _made_for(self) -> dict[str, Any]:
        return {"kind": "synthetic", "seq_len": self.seq_len, "micro_batch": self.micro_batch,
                "period": self.period}


class ByteFileTokens(_GeneratorPosition):
    """The bytes of a local file as token ids (0..255), read as random windows of ``seq_len + 1``.

    Yields ``(ids, labels)`` like :class:`SyntheticTokens`.
    """

    def __init__(self, path: str | Path, vocab_size: int, seq_len: int, micro_batch: int, seed: int) -> None:
        if vocab_size < 256:
            raise MemoError(
                f"memo.train: --data uses bytes as token ids, which needs vocab_size >= 256; the model "
                f"has {vocab_size}. Pick a model with a larger vocabulary"
            )
        data = Path(path).read_bytes()
        if len(data) < seq_len + 1:
            raise MemoError(
                f"memo.train: {path} has {len(data)} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
                "use a larger file or a shorter --seq-len"
            )
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.path = str(path)
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[Batch]:
        index = torch.arange(self.seq_len + 1)
        last_start = self.tokens.numel() - self.seq_len - 1
        while True:
            starts = torch.randint(0, last_start + 1, (self.micro_batch, 1), generator=self.generator)
            tokens = self.tokens[starts + index]
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _made_for(self) -> dict[str, Any]:
        return {"kind": "bytes", "seq_len": self.seq_len, "micro_batch": self.micro_batch,
                "bytes": int(self.tokens.numel())}


def _check_state(state: dict[str, Any], expected: dict[str, Any]) -> None:
    """Refuse a position saved by another source (NOTE [A token source's position])."""
    differ = [f"{k} {state.get(k)!r} (saved) vs {v!r} (this run)" for k, v in expected.items()
              if state.get(k) != v]
    if differ:
        raise MemoError("memo.train: the saved data position is of another token source: "
                        + ", ".join(differ) + "; resume with the data and shapes the checkpoint was made "
                        "with")
    generator = state.get("generator")
    if not isinstance(generator, torch.Tensor) or generator.dtype != torch.uint8:
        raise MemoError("memo.train: the saved data position has no generator state; the checkpoint is "
                        "damaged")
