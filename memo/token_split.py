"""The one rule for splitting a sequence over a parallel layout.

Torch-free and light (it imports memo.errors alone, not the planner and its PuLP), so every part
uses it: the models (context- and sequence-parallel shapes), the profiler
(a rank's tokens), ``memo train``'s layout check and ``memo estimate``'s layout search.

NOTE [Tokens per rank]
Under t-way tensor (+ sequence) and c-way context parallelism, megatron-core cuts the sequence into
2·c load-balanced chunks (c > 1; rank r holds chunks r and 2c-1-r, which balances causal attention),
and each of the c·t ranks of a replica holds seq_len/(c·t) tokens of a layer's input (memo's profile
of a rank takes that share also without sequence parallelism). So seq_len must be a multiple of
lcm(2·c, c·t); a length that is not is refused with the nearest lengths that are.
"""

from __future__ import annotations

import math

from memo.errors import MemoError

__all__ = ["check_seq_len", "seq_len_problem", "token_multiple"]


def token_multiple(tensor_parallel: int = 1, context_parallel: int = 1) -> int:
    """The smallest number every valid ``seq_len`` is a multiple of (NOTE [Tokens per rank])."""
    chunks = 1 if context_parallel == 1 else 2 * context_parallel
    return math.lcm(chunks, context_parallel * tensor_parallel)


def seq_len_problem(seq_len: int, tensor_parallel: int = 1, context_parallel: int = 1) -> str | None:
    """None where the ranks share ``seq_len`` evenly; else what is wrong, why, and the nearest lengths
    that split, in one sentence (NOTE [Tokens per rank])."""
    t, c = tensor_parallel, context_parallel
    m = token_multiple(t, c)
    if seq_len % m == 0:
        return None
    why = []
    if c > 1:
        why.append(f"context parallelism cuts it into 2·c = {2 * c} load-balanced chunks")
    if c * t > 1:
        why.append(f"each of the c·t = {c * t} ranks holds seq_len/(c·t) tokens of a layer's input")
    lower, upper = seq_len // m * m, (seq_len // m + 1) * m
    nearest = f"{lower:,} or {upper:,}" if lower else f"{upper:,}"
    return (f"seq len {seq_len:,} cannot be split over TP {t} x CP {c}: {' and '.join(why)}, so it must be "
            f"a multiple of {m}; use {nearest}")


def check_seq_len(seq_len: int, tensor_parallel: int = 1, context_parallel: int = 1,
                  who: str = "memo") -> None:
    """A MemoError from ``who`` unless the layout splits ``seq_len`` (:func:`seq_len_problem`)."""
    problem = seq_len_problem(seq_len, tensor_parallel, context_parallel)
    if problem is not None:
        raise MemoError(f"{who}: {problem}")
