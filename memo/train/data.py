"""The token sources a training run reads: synthetic tokens, or the bytes of a local file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from memo.errors import MemoError

__all__ = ["Batch", "ByteFileTokens", "SyntheticTokens"]

Batch = tuple[torch.Tensor, torch.Tensor]


class SyntheticTokens:
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


class ByteFileTokens:
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
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[Batch]:
        index = torch.arange(self.seq_len + 1)
        last_start = self.tokens.numel() - self.seq_len - 1
        while True:
            starts = torch.randint(0, last_start + 1, (self.micro_batch, 1), generator=self.generator)
            tokens = self.tokens[starts + index]
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
