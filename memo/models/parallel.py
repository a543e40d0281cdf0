"""One rank of Megatron tensor + sequence parallelism, emulated on one process for profiling.

NOTE [Tensor-parallel rank]
Under megatron-core's tensor parallelism of size t with sequence parallelism
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"), every rank of the group holds 1/t of every activation. memo profiles
(and plans) per rank, so :func:`memo.models.build_model` can build the model *as one
rank runs it* (``tensor_parallel=t``), with the per-rank shapes megatron-core uses:

- sequence-parallel regions (norms, residual adds, the layer input and output)
  hold s/t tokens: ``x: [s/t, b, h]``;
- a column-parallel linear (QKV, fc1, SwiGLU gate+up; weight ``[out/t, h]``, bias
  ``[out/t]``) all-gathers its input along the sequence to ``[s, b, h]``. Like
  megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` it saves only
  the *local* ``[s/t, b, h]`` input for backward and all-gathers it again there, so
  the gathered tensor is transient (:func:`column_parallel_linear`);
- attention runs on ``n_heads/t`` query and ``n_kv_heads/t`` key/value heads over
  all s tokens;
- a row-parallel linear (attention out-projection, fc2 / down; weight ``[h, in/t]``)
  produces ``[s, b, h]`` partial sums that a reduce-scatter turns into ``[s/t, b, h]``;
  its bias (replicated, ``[h]``) is added after the reduce-scatter, as megatron does
  (:func:`row_parallel_linear`);
- the word embedding and the LM head are vocab-parallel (``ceil(V/t)`` rows, see
  below); the embedding's ``[s, b, h]`` output is scattered to ``[s/t, b, h]`` and the
  head's input is gathered like a column-parallel linear's, so its logits are
  ``[s, b, V/t]``, computed chunk by chunk as :mod:`memo.models.loss` always does.

What is emulated, and why: memory. On one process there is no group to talk to, so
an all-gather is t copies of the local tensor (:func:`all_gather_tokens`) and a
reduce-scatter sums those t copies back (:func:`reduce_scatter_tokens`); they are
each other's adjoints, so the emulated rank is an ordinary differentiable function
and its gradients are its true gradients. Every collective allocates the tensor the
real one produces, and what autograd keeps follows megatron-core (the local input of
a column-parallel linear, never the gathered one; nothing for a reduce-scatter), so
meta-device profiles (sizes only) and CPU/GPU runs of one rank see the per-rank
tensors, their sizes and their lifetimes. Where the rank's index matters (which
vocabulary slice it holds) the emulated rank is rank 0.

What is not: there is no communication (no time spent in collectives, no NCCL
buffers), and the values are not those of any real rank: the "gathered" tokens
are replicas of the local ones, vocab-parallel lookups and targets are taken
modulo the rank's vocabulary slice, and the loss is not the group's loss. Use the
rank model for sizes and compute times, never for training.

Token order. megatron's all-gather lays out the ranks' chunks rank-major (global
token r·s/t + j). The emulation lays the t replicas of local token j out token-major,
at rows ``j·t … j·t+t-1``: the same sizes, but ``pre(x[a:b])`` is then exactly rows
``a·t … b·t-1`` of ``pre(x)`` and ``post(o[a·t:b·t], x[a:b])`` is ``post(o, x)[a:b]``,
so the layer stays token-wise in the sense of NOTE [Layer anatomy] for memo's
runtime, which splits the local tokens into ranges (the o range is the x range
scaled by ``layer.sequence_gather``). Rotary positions follow the same convention:
the gathered rows of local tokens ``[a:b]`` (``offset=a``) take positions
``a·t … b·t-1``.

Vocabulary. A vocabulary that t does not divide is padded up to the next multiple of
t (each rank holds ``ceil(V/t)`` rows), as megatron pads its vocabulary; megatron pads
further, to a multiple of ``make_vocab_size_divisible_by · t`` (128 · t by default): to
profile exactly its shapes, give the config the padded ``vocab_size`` (e.g. 50304 for
GPT-2's 50257).

Context parallelism (size c) needs no emulation for sizes: every activation of a rank
holds s/c tokens, so the profiler runs the model on ``s/c`` tokens
(:func:`context_parallel_seq_len`; with tensor parallelism too, the layer input is
``[s/(c·t), b, h]``, :func:`per_rank_seq_len`). Ring attention is not emulated: a
rank's attention does about ``s²/(2c)`` work, the s/c-token profile ``(s/c)²/2``, so
attention *times* from such a profile are ~c times too small; its saved tensors
(q, k, v, o, lse of the local s/c tokens) are right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memo.errors import MemoError
from memo.models.config import ModelConfig
from memo.token_split import check_seq_len

__all__ = [
    "RankShapes",
    "all_gather_tokens",
    "check_sequence_parallel",
    "check_tensor_parallel",
    "column_parallel_linear",
    "context_parallel_seq_len",
    "per_rank_seq_len",
    "rank_shapes",
    "reduce_scatter_tokens",
    "row_parallel_linear",
    "scatter_to_sequence_parallel",
    "vocab_parallel_embedding",
    "vocab_parallel_labels",
]


def check_tensor_parallel(tensor_parallel: object) -> int:
    """``tensor_parallel`` as an int >= 1, or a MemoError."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise MemoError(f"memo.models: tensor_parallel must be a positive int, got {tensor_parallel!r}")
    return tensor_parallel


@dataclass(frozen=True)
class RankShapes:
    """Per-rank sizes of a model under tensor parallelism (NOTE [Tensor-parallel rank]).

    With ``tensor_parallel == 1`` they are the config's own sizes.
    """

    tensor_parallel: int
    """t: ranks in the tensor-parallel group; also the sequence gather factor."""
    n_heads: int
    """Query heads of one rank: ``n_heads / t``."""
    n_kv_heads: int
    """Key/value heads of one rank: ``n_kv_heads / t``."""
    head_dim: int
    """Per-head size d (not sharded): the config's ``head_dim``, ``h / n_heads`` unless it sets one."""
    ffn_hidden: int
    """MLP inner size of one rank: ``ffn_hidden / t`` (SwiGLU's gate+up weight has twice that rows)."""
    vocab_rows: int
    """Rows of the rank's word embedding / LM head: ``ceil(V / t)`` (the vocabulary padded to a
    multiple of t)."""

    @property
    def qkv_out(self) -> int:
        """Rows of the rank's fused QKV weight: ``(n_heads + 2 n_kv_heads) / t · head_dim``."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def attn_out(self) -> int:
        """Width of the rank's attention output (columns of its out-projection weight):
        ``n_heads / t · head_dim`` (``h / t`` unless the config sets a ``head_dim``)."""
        return self.n_heads * self.head_dim


def rank_shapes(config: ModelConfig, tensor_parallel: int = 1) -> RankShapes:
    """The sizes one rank of a ``tensor_parallel``-way group holds of ``config``'s model.

    Heads, key/value heads and the MLP inner size must be divisible by t (megatron-core
    shards them whole); the vocabulary is padded (NOTE [Tensor-parallel rank]).
    """
    t = check_tensor_parallel(tensor_parallel)
    where = f"memo.models: tensor_parallel={t} for config {config.name!r}"
    n_kv = int(config.n_kv_heads)  # filled in by ModelConfig
    for field, value in (("n_heads", config.n_heads), ("n_kv_heads", n_kv),
                         ("ffn_hidden", config.ffn_hidden)):
        if value % t != 0:
            raise MemoError(
                f"{where}: {field}={value} is not divisible by {t}; megatron's tensor parallelism gives "
                f"every rank {field}/t of them, so use a tensor_parallel size that divides {value}"
            )
    return RankShapes(
        tensor_parallel=t,
        n_heads=config.n_heads // t,
        n_kv_heads=n_kv // t,
        head_dim=int(config.head_dim),  # filled in by ModelConfig
        ffn_hidden=int(config.ffn_hidden) // t,
        vocab_rows=-(-config.vocab_size // t),
    )


def context_parallel_seq_len(seq_len: int, cp: int = 1) -> int:
    """Tokens of one context-parallel rank: ``seq_len / cp`` (what the profiler feeds the rank model).

    megatron-core splits the sequence into 2·cp chunks (rank r holds chunks r and 2cp-1-r, which
    balances causal attention), so for ``cp > 1`` ``seq_len`` must be divisible by ``2·cp``.
    """
    for name, value in (("seq_len", seq_len), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemoError(f"memo.models: {name} must be a positive int, got {value!r}")
    check_seq_len(seq_len, 1, cp, "memo.models")  # NOTE [Tokens per rank] in memo/token_split.py
    return seq_len // cp


def per_rank_seq_len(seq_len: int, tp: int = 1, cp: int = 1) -> int:
    """Tokens of one rank's layer input under tensor (+ sequence) and context parallelism: ``s/(cp·tp)``.

    The rank model is fed ``context_parallel_seq_len(seq_len, cp)`` tokens
    (``build_model(..., tensor_parallel=tp)``); its layers see ``[s/(cp·tp), b, h]``.
    """
    s = context_parallel_seq_len(seq_len, cp)
    t = check_tensor_parallel(tp)
    check_sequence_parallel(s, t)
    return s // t


def check_sequence_parallel(seq_len: int, tensor_parallel: int) -> None:
    """A MemoError unless ``tensor_parallel`` divides ``seq_len`` (sequence parallelism shards the tokens)."""
    check_seq_len(seq_len, tensor_parallel, 1, "memo.models")  # NOTE [Tokens per rank] in memo/token_split.py


def all_gather_tokens(x: torch.Tensor, t: int) -> torch.Tensor:
    """Emulated all-gather along the sequence: ``x: [n, ...]`` -> ``[n·t, ...]`` (a new tensor).

    The t replicas of local token j are rows ``j·t … j·t+t-1`` (NOTE [Tensor-parallel rank]).
    Plain tensor ops; the layers call it inside the autograd Functions below, which decide what
    is saved and what backward allocates, as megatron-core's collectives do.
    """
    n, rest = x.shape[0], x.shape[1:]
    return x.unsqueeze(1).expand(n, t, *rest).contiguous().view(n * t, *rest)


def reduce_scatter_tokens(y: torch.Tensor, t: int) -> torch.Tensor:
    """Emulated reduce-scatter along the sequence: ``y: [n·t, ...]`` -> ``[n, ...]``, the sum of
    each token's t rows (the adjoint of :func:`all_gather_tokens`; a new tensor)."""
    m, rest = y.shape[0], y.shape[1:]
    if m % t != 0:
        raise MemoError(f"memo.models: reduce-scatter of {m} rows over tensor_parallel={t} ranks; "
                        f"the row count must be a multiple of {t}")
    return y.reshape(m // t, t, *rest).sum(1)


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter to the sequence-parallel region; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, t: int) -> torch.Tensor:
        ctx.t = t
        return reduce_scatter_tokens(y, t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_tokens(grad, ctx.t), None


def scatter_to_sequence_parallel(y: torch.Tensor, t: int) -> torch.Tensor:
    """``y: [n·t, b, h]`` (a rank's partial sums over all tokens) -> ``[n, b, h]``; saves nothing.

    Emulates megatron's ``reduce_scatter_to_sequence_parallel_region`` (and, for GPT's embedding,
    ``scatter_to_sequence_parallel_region``, which allocates the same ``[n, b, h]``); identity
    for ``t == 1``.
    """
    return y if t == 1 else _ScatterToSequenceParallel.apply(y, t)


class _ColumnParallelLinear(torch.autograd.Function):
    """All-gather + linear that saves the local input only (megatron-core with sequence_parallel)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                t: int) -> torch.Tensor:
        ctx.t = t
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_tokens(x, t), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        # Under autocast, forward's matmul ran in the autocast dtype; backward computes in the
        # gradient's dtype and returns each gradient in its input's dtype.
        if need_x:
            grad_x = reduce_scatter_tokens(grad.matmul(weight.to(grad.dtype)), ctx.t).to(x.dtype)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if need_w:
            total = all_gather_tokens(x, ctx.t)  # gathered again, as megatron-core does
            grad_w = flat_grad.t().matmul(total.reshape(-1, total.shape[-1]).to(grad.dtype))
            grad_w = grad_w.to(weight.dtype)
            del total
        if ctx.has_bias and need_b:
            grad_b = flat_grad.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def column_parallel_linear(x: torch.Tensor, linear: nn.Linear, t: int) -> torch.Tensor:
    """``x: [n, b, h]`` (local tokens) -> ``[n·t, b, out/t]`` through ``linear``'s rank shard.

    Saves ``x`` and the weight only; the gathered ``[n·t, b, h]`` input is transient in forward
    and re-gathered in backward (NOTE [Tensor-parallel rank]). ``t == 1`` is ``linear(x)``.
    """
    if t == 1:
        return linear(x)
    return _ColumnParallelLinear.apply(x, linear.weight, linear.bias, t)


def row_parallel_linear(o: torch.Tensor, linear: nn.Linear, t: int) -> torch.Tensor:
    """``o: [n·t, b, in/t]`` -> ``[n, b, h]``: the rank's partial product, reduce-scattered, then
    the replicated bias (NOTE [Tensor-parallel rank]). ``t == 1`` is ``linear(o)``."""
    if t == 1:
        return linear(o)
    y = scatter_to_sequence_parallel(F.linear(o, linear.weight), t)
    return y if linear.bias is None else y + linear.bias


def vocab_parallel_embedding(word: nn.Embedding, ids: torch.Tensor, t: int) -> torch.Tensor:
    """Rank 0's lookup in its vocabulary slice, megatron's ``VocabParallelEmbedding`` forward: ids
    outside ``[0, rows)`` look up row 0 and are zeroed. ``t == 1`` is ``word(ids)``."""
    if t == 1:
        return word(ids)
    outside = ids >= word.num_embeddings
    out = word(ids.masked_fill(outside, 0))
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_parallel_labels(labels: torch.Tensor, vocab_rows: int, t: int, ignore_index: int) -> torch.Tensor:
    """Targets for a rank's ``vocab_rows``-row LM head: each label modulo ``vocab_rows``
    (``ignore_index`` kept). Emulation only: the values are not those of a real rank
    (NOTE [Tensor-parallel rank]). ``t == 1`` returns ``labels``."""
    if t == 1:
        return labels
    return torch.where(labels == ignore_index, labels, labels.remainder(vocab_rows))
