"""Causal attention over a context-parallel group by all-to-all: every rank attends all tokens of its heads.

NOTE [Ulysses context parallelism]
megatron-core's ``cp_comm_type="a2a"`` (DeepSpeed's Ulysses). The tokens are laid out as for the
all-gather form (NOTE [Context-parallel attention] in memo/models/cp_attention.py): over c ranks
a sequence of S tokens is cut into 2·c chunks of m = S/(2c), rank r holds chunks r and 2c-1-r,
so its q ``[2m, b, n, d]``, k and v ``[2m, b, n_kv, d]`` are its own s = S/c tokens of every head.
Attention alone needs other ranks' tokens. Instead of gathering K and V, one all-to-all turns
sequence shards into head shards:

- forward: every rank cuts its heads into c groups and sends group j of its s tokens to rank j;
  rank j receives every rank's tokens of its own n/c heads (rank-major: rank 0's two chunks, then
  rank 1's, ...), puts them in sequence order (``_sequence_order``, the all-gather form's), and
  runs memo's full causal attention (:func:`memo.models.causal_attention.attention_forward`) over
  all S tokens of its heads. A second all-to-all, the inverse reshuffle, sends ``o`` and ``lse``
  back, so the caller holds ``o [s, b, n, d]`` and ``lse [b, n, s]`` of its own tokens, exactly
  as from the all-gather form (memo's runtime offloads that attention output unchanged);
- backward: the same reshuffle of ``grad_o, q, k, v, o, lse`` to head shards, the full causal
  backward, and the inverse reshuffle of ``dq, dk, dv``.

Both directions go through one collective (:func:`_all_to_all`, ``all_to_all_single`` on a
``[c, ...]`` tensor whose part j goes to rank j); the reshuffles around it are pure functions.

What a rank holds: during the kernel, q, k, v and o of all S tokens for n/c heads (k, v for its
share of the key/value heads), as many elements as its own S/c tokens of all n heads; the
all-gather form holds the full K and V of every key/value head instead. Nothing is saved across
the calls: :func:`ulysses_attention` (differentiable) saves q, k, v, o, lse at the rank's own
length, as :func:`memo.models.cp_attention.cp_attention` does.

Grouped-query attention: query head i uses key/value head i // (n/n_kv), so query head group j
(heads ``[j·n/c, (j+1)·n/c)``) needs key/value heads ``[j·n_kv/c, (j+1)·n_kv/c)``. c must divide
n. When c divides n_kv the key/value heads are split the same way. When c > n_kv and n_kv divides
c, each key/value head is replicated c/n_kv times before the all-to-all (rank j gets one, the one
its query heads use), and backward sums the replicas' dk, dv (in float32 for low-precision inputs)
after the inverse all-to-all. Any other head count is refused (:func:`ulysses_heads_problem`).

NOTE [Ulysses over chunks of heads]
Attention heads are independent, so the exchange and the attention may run over a few heads at a
time (UPipe, arXiv 2602.21196): chunk i of the query heads and the key/value heads they use go to
head shards, attend, and come back into their place in the output before the next chunk starts.
The result is the same (to the bit, but for the order in which the gradients of a key/value head
sent by several chunks are summed); what changes is what a rank holds during attention: the head
shards of one chunk instead of all of them (q, k, v, o and, in backward, grad_o and dq, dk, dv of
all S tokens). By default memo runs as many chunks as each rank receives key/value heads
(:func:`head_chunks`), so every chunk sends each rank exactly one key/value head and the query heads
that share it: key/value heads are never sent twice. Llama-3.1-8B (32 query, 8 key/value heads) at
CP 2 runs 4 chunks, a quarter of the head shards at a time; at CP 8, one.

A finer count (``memo train --ulysses-head-chunks N``) splits the query heads further, as UPipe
does: each chunk is an equal run of query heads that holds whole key/value head groups or lies
inside one (:func:`head_chunk_slices`, which the estimate's meta rank runs too), and it sends the
key/value heads its query heads use, replicated over the ranks where fewer than the ranks, so a
key/value head shared by several chunks or ranks is sent once for each. That trades N / (the
default's count) times the key/value traffic for 1/N of the head shards. Backward sums the
gradients of a key/value head over the chunks that sent it (and over its replicas), in float32 for
low-precision inputs. Llama-3.1-8B at CP 8 splits into at most 4 chunks: 8 query heads and 2
key/value heads each, one query head per rank, a quarter of the head shards for 4x the key/value
traffic.

NOTE [Contiguous Ulysses]
Ulysses needs no load balancing: after the exchange every rank attends all S tokens of its heads,
so every rank does the same work whatever tokens it holds. Under FSDP2 (memo/distributed/fsdp2.py)
rank r therefore holds the contiguous tokens ``[r·s, (r+1)·s)``, as DeepSpeed's Ulysses does: the
rank-major rows of the exchange are then already in sequence order, and a rank's positions are one
offset (``r·s``), which memo's reference models and Hugging Face's rotary embeddings take as they
are. Every function here takes ``contiguous=True`` for that layout; the default is megatron's
load-balanced one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from memo.errors import MemoError
from memo.models.causal_attention import _check, attention_backward, attention_forward
from memo.models.cp_attention import GroupAttention, _lse_for_kernel, _lse_rows, _sequence_order
from memo.planner.vocab import CP_COMMS

__all__ = ["CP_COMM_TYPES", "SequenceShard", "UlyssesCoreAttention", "finest_head_chunks",
           "head_chunk_slices", "head_chunks", "heads_to_tokens", "kv_replicas", "legal_head_chunks",
           "tokens_to_heads", "ulysses_attention",
           "ulysses_attention_backward", "ulysses_attention_forward", "ulysses_backward",
           "ulysses_chunked_backward", "ulysses_chunked_forward", "ulysses_forward", "ulysses_heads_problem"]

#: megatron-core's names (``cp_comm_type``) for the context-parallel communications memo's attention
#: implements: K/V all-gather (memo/models/cp_attention.py) and Ulysses all-to-all (this module);
#: the vocabulary is planner/vocab.py's.
CP_COMM_TYPES = CP_COMMS

#: ``t: [c, ...] -> [c, ...]``: part j goes to rank j; part i of the result came from rank i.
Exchange = Callable[[torch.Tensor], torch.Tensor]

_WHERE = "memo.models.ulysses_attention"


def ulysses_heads_problem(n_heads: int, n_kv_heads: int, size: int) -> str | None:
    """Why ``n_heads`` query and ``n_kv_heads`` key/value heads (one tensor-parallel rank's) cannot be
    shared by ``size`` Ulysses ranks, or None when they can (NOTE [Ulysses context parallelism])."""
    if n_heads % size == 0 and (n_kv_heads % size == 0 or size % n_kv_heads == 0):
        return None
    if n_heads % size:
        return (f"{n_heads} query heads cannot be split over {size} context-parallel ranks (each attends "
                f"all tokens of n/c of the heads; c must divide the query heads)")
    return (f"{n_kv_heads} key/value heads cannot be shared by {size} context-parallel ranks (c must divide "
            f"them, or be a multiple of them so that each is replicated c/n_kv times)")


def kv_replicas(n_heads: int, n_kv_heads: int, size: int) -> int:
    """Copies of each key/value head sent by the all-to-all: 1, or ``size / n_kv_heads`` when there are
    fewer key/value heads than ranks; a MemoError for heads the ranks cannot share."""
    problem = ulysses_heads_problem(n_heads, n_kv_heads, size)
    if problem is not None:
        raise MemoError(f"{_WHERE}: {problem}. Use a context-parallel size that divides the query heads "
                        "and divides or is a multiple of the key/value heads, or cp_comm_type "
                        "\"all_gather\"")
    return 1 if n_kv_heads % size == 0 else size // n_kv_heads


def _all_to_all(t: torch.Tensor, group: Any) -> torch.Tensor:
    """The collective of both directions (an :data:`Exchange` over ``group``)."""
    t = t.contiguous()
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group)
    return out


def _to_heads(t: torch.Tensor, size: int, exchange: Exchange, contiguous: bool = False) -> torch.Tensor:
    """This rank's ``t: [s, b, h, d]`` (its tokens, all heads) -> ``[c·s, b, h/c, d]``: every rank's
    tokens of its share of the heads, in sequence order (NOTE [Contiguous Ulysses])."""
    s, b, h, d = t.shape
    parts = t.reshape(s, b, size, h // size, d).permute(2, 0, 1, 3, 4)  # part j: heads of rank j
    received = exchange(parts).reshape(size * s, b, h // size, d)  # rank-major rows
    return received if contiguous else received.index_select(0, _sequence_order(size, s, t.device))


def _to_tokens(t: torch.Tensor, size: int, exchange: Exchange, contiguous: bool = False) -> torch.Tensor:
    """Inverse of :func:`_to_heads`: ``[c·s, b, h/c, d]`` in sequence order -> contiguous ``[s, b, h, d]``
    (the layout the output projection reads, as from causal attention)."""
    total, b, hc, d = t.shape
    s = total // size
    if contiguous:
        rank_major = t.contiguous()
    else:
        rank_major = torch.empty_like(t)
        rank_major.index_copy_(0, _sequence_order(size, s, t.device), t)
    received = exchange(rank_major.view(size, s, b, hc, d))  # part i: heads of rank i, my tokens
    return received.permute(1, 2, 0, 3, 4).contiguous().view(s, b, size * hc, d)


def _lse_to_heads(lse: torch.Tensor, size: int, exchange: Exchange, contiguous: bool = False) -> torch.Tensor:
    """``lse [b, n, s]`` -> ``[b, n/c, c·s]``: :func:`_to_heads` of lse as ``[s, b, n, 1]``."""
    heads = _to_heads(lse.permute(2, 0, 1).unsqueeze(-1), size, exchange, contiguous)
    return heads.squeeze(-1).permute(1, 2, 0)


def _lse_to_tokens(lse: torch.Tensor, size: int, exchange: Exchange,
                   contiguous: bool = False) -> torch.Tensor:
    """Inverse of :func:`_lse_to_heads`: ``[b, n/c, c·s]`` -> contiguous ``[b, n, s]``."""
    out = _to_tokens(lse.permute(2, 0, 1).unsqueeze(-1), size, exchange, contiguous)
    return out.squeeze(-1).permute(1, 2, 0).contiguous()


def _layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: int, contiguous: bool = False) -> int:
    """Checks a rank's inputs; its key/value replicas (:func:`kv_replicas`)."""
    _check(q, k, v)
    if q.shape[0] % 2 and not contiguous:
        raise MemoError(
            f"{_WHERE}: a context-parallel rank holds two equal chunks of the sequence (megatron's "
            f"load-balanced layout), so its local sequence must be even; got {q.shape[0]} tokens. Make "
            "the sequence a multiple of 2·cp")
    return kv_replicas(q.shape[2], k.shape[2], size)


def _replicate(t: torch.Tensor, replicas: int) -> torch.Tensor:
    return t if replicas == 1 else t.repeat_interleave(replicas, dim=2)


def _sum_replicas(grad: torch.Tensor, replicas: int, dtype: torch.dtype) -> torch.Tensor:
    """dk or dv of the replicated heads ``[s, b, n_kv·replicas, d]`` -> ``[s, b, n_kv, d]`` in ``dtype``,
    summed in float32 for low-precision inputs."""
    if replicas == 1:
        return grad
    s, b, h, d = grad.shape
    acc = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    return grad.to(acc).view(s, b, h // replicas, replicas, d).sum(dim=3).to(dtype)


def ulysses_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: int, exchange: Exchange,
                    contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's Ulysses attention over all heads at once, ``exchange`` the all-to-all among the
    ``size`` ranks -> ``o`` and its log-sum-exp in the rank's tokens."""
    replicas = _layout(q, k, v, size, contiguous)
    heads = functools.partial(_to_heads, size=size, exchange=exchange, contiguous=contiguous)
    with torch.no_grad():
        qh = heads(q)
        kh, vh = (heads(_replicate(t, replicas)) for t in (k, v))
        o, lse = attention_forward(qh, kh, vh)
        del qh, kh, vh
        lse = _lse_rows(lse, o.shape[0])  # NOTE [fp32 attention on CUDA]: no padded rows in the exchange
        return (_to_tokens(o, size, exchange, contiguous), _lse_to_tokens(lse, size, exchange, contiguous))


def ulysses_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     o: torch.Tensor, lse: torch.Tensor, size: int, exchange: Exchange,
                     contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`ulysses_forward` for the rank's ``q, k, v`` -> ``dq, dk, dv``."""
    replicas = _layout(q, k, v, size, contiguous)
    heads = functools.partial(_to_heads, size=size, exchange=exchange, contiguous=contiguous)
    tokens = functools.partial(_to_tokens, size=size, exchange=exchange, contiguous=contiguous)
    with torch.no_grad():
        qh, gh, oh = (heads(t) for t in (q, grad_o, o))
        kh, vh = (heads(_replicate(t, replicas)) for t in (k, v))
        lseh = _lse_for_kernel(_lse_to_heads(lse, size, exchange, contiguous), qh)
        dq, dk, dv = attention_backward(gh, qh, kh, vh, oh, lseh)
        del qh, gh, oh, kh, vh, lseh
        dk = _sum_replicas(tokens(dk), replicas, k.dtype)
        dv = _sum_replicas(tokens(dv), replicas, v.dtype)
        return tokens(dq), dk, dv


def head_chunks(n_heads: int, n_kv_heads: int, size: int) -> int:
    """memo's default count of chunks of heads (NOTE [Ulysses over chunks of heads]): one per key/value
    head each rank receives, so that every chunk sends each rank one key/value head."""
    return max(n_kv_heads * kv_replicas(n_heads, n_kv_heads, size) // size, 1)


def head_chunk_slices(n: int, n_kv: int, size: int, chunks: int) -> list[tuple[slice, slice]]:
    """(query heads, key/value heads) of each of ``chunks`` chunks (NOTE [Ulysses over chunks of
    heads]): equal runs of query heads, each holding whole key/value head groups or lying inside one,
    and each one the ``size`` ranks can share; a MemoError for a count the heads cannot split into."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise MemoError(f"{_WHERE}: the count of head chunks must be a positive integer, got {chunks!r}")
    per_kv = n // n_kv
    if n % chunks or (n // chunks) % per_kv and per_kv % (n // chunks):
        raise MemoError(f"{_WHERE}: {n} query heads do not split into {chunks} chunks of whole key/value "
                        f"head groups (or of equal parts of one); legal counts: "
                        f"{', '.join(map(str, legal_head_chunks(n, n_kv, size)))}")
    q = n // chunks
    out = []
    for j in range(chunks):
        first, last = j * q // per_kv, ((j + 1) * q - 1) // per_kv + 1
        problem = ulysses_heads_problem(q, last - first, size)
        if problem is not None:
            raise MemoError(f"{_WHERE}: {chunks} chunks of heads: a chunk of {q} query heads: {problem}; "
                            f"legal counts: {', '.join(map(str, legal_head_chunks(n, n_kv, size)))}")
        out.append((slice(j * q, (j + 1) * q), slice(first, last)))
    return out


def legal_head_chunks(n: int, n_kv: int, size: int) -> list[int]:
    """Every count of chunks :func:`head_chunk_slices` accepts for these heads, ascending."""
    per_kv = n // n_kv
    return [c for c in range(1, n + 1) if not n % c and not ((n // c) % per_kv and per_kv % (n // c))
            and ulysses_heads_problem(n // c, max(n // c // per_kv, 1), size) is None]


def finest_head_chunks(n: int, n_kv: int, size: int) -> int:
    """The most chunks the heads split into (each rank gets one query head per chunk where it can):
    the least a rank holds during attention, for the most key/value traffic."""
    kv_replicas(n, n_kv, size)  # a MemoError for heads the ranks cannot share at all
    return legal_head_chunks(n, n_kv, size)[-1]


def ulysses_chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: int, exchange: Exchange,
                            contiguous: bool, chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ulysses_forward` over ``chunks`` chunks of heads, one at a time (None: :func:`head_chunks`;
    NOTE [Ulysses over chunks of heads])."""
    n, n_kv = q.shape[2], k.shape[2]
    slices = head_chunk_slices(n, n_kv, size, head_chunks(n, n_kv, size) if chunks is None else chunks)
    if len(slices) == 1:
        return ulysses_forward(q, k, v, size, exchange, contiguous)
    s, b = q.shape[:2]
    o = torch.empty_like(q)
    lse: torch.Tensor | None = None
    for heads, kv_heads in slices:
        o_i, lse_i = ulysses_forward(q[:, :, heads], k[:, :, kv_heads], v[:, :, kv_heads], size, exchange,
                                     contiguous)
        o[:, :, heads] = o_i
        if lse is None:
            lse = lse_i.new_empty((b, n, s))
        lse[:, heads] = lse_i
        del o_i, lse_i
    assert lse is not None
    return o, lse


def ulysses_chunked_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             o: torch.Tensor, lse: torch.Tensor, size: int, exchange: Exchange,
                             contiguous: bool, chunks: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ulysses_backward` over ``chunks`` chunks of heads (NOTE [Ulysses over chunks of heads]);
    a key/value head that several chunks send has their gradients summed, in float32 for low precision."""
    n, n_kv = q.shape[2], k.shape[2]
    slices = head_chunk_slices(n, n_kv, size, head_chunks(n, n_kv, size) if chunks is None else chunks)
    if len(slices) == 1:
        return ulysses_backward(grad_o, q, k, v, o, lse, size, exchange, contiguous)
    shared = any(a[1].stop > b[1].start for a, b in zip(slices, slices[1:], strict=False))
    if shared:
        acc = torch.float32 if k.dtype in (torch.float16, torch.bfloat16) else k.dtype
        dk, dv = k.new_zeros(k.shape, dtype=acc), v.new_zeros(v.shape, dtype=acc)
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = torch.empty_like(q)
    for heads, kv_heads in slices:
        dq_i, dk_i, dv_i = ulysses_backward(grad_o[:, :, heads], q[:, :, heads], k[:, :, kv_heads],
                                            v[:, :, kv_heads], o[:, :, heads], lse[:, heads], size, exchange,
                                            contiguous)
        dq[:, :, heads] = dq_i
        if shared:
            dk[:, :, kv_heads] += dk_i
            dv[:, :, kv_heads] += dv_i
        else:
            dk[:, :, kv_heads], dv[:, :, kv_heads] = dk_i, dv_i
        del dq_i, dk_i, dv_i
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _exchange(group: Any) -> tuple[int, Exchange]:
    return dist.get_world_size(group), functools.partial(_all_to_all, group=group)


def ulysses_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                              contiguous: bool = False, chunks: int | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's causal attention over the context-parallel ``group`` by all-to-all (NOTE [Ulysses
    context parallelism]); ``q: [2m, b, n, d]``, ``k, v: [2m, b, n_kv, d]`` in megatron's
    load-balanced layout (``contiguous``: rank r's tokens are ``[r·s, (r+1)·s)``, NOTE [Contiguous
    Ulysses]) -> ``o [2m, b, n, d]``, ``lse [b, n, 2m]`` as
    :func:`memo.models.causal_attention.attention_forward` (float32; float64 for float64 inputs); over
    ``chunks`` chunks of heads (None: :func:`head_chunks`)."""
    return ulysses_chunked_forward(q, k, v, *_exchange(group), contiguous=contiguous, chunks=chunks)


def ulysses_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               o: torch.Tensor, lse: torch.Tensor, group: Any, contiguous: bool = False,
                               chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`ulysses_attention_forward` for this rank's ``q, k, v`` -> ``dq [2m, b, n, d]``,
    ``dk, dv [2m, b, n_kv, d]``."""
    return ulysses_chunked_backward(grad_o, q, k, v, o, lse, *_exchange(group), contiguous=contiguous,
                                    chunks=chunks)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                      contiguous: bool = False, chunks: int | None = None) -> torch.Tensor:
    """Differentiable :func:`ulysses_attention_forward`: ``-> o [2m, b, n, d]``; saves q, k, v, o, lse
    at the rank's own length."""
    halves = ((ulysses_attention_forward, ulysses_attention_backward) if not contiguous and chunks is None
              else (functools.partial(ulysses_attention_forward, contiguous=contiguous, chunks=chunks),
                    functools.partial(ulysses_attention_backward, contiguous=contiguous, chunks=chunks)))
    return GroupAttention.apply(q, k, v, group, halves)


class _TokensToHeads(torch.autograd.Function):
    """The exchange alone, differentiable: its adjoint is the inverse exchange (a permutation of rows
    over the ranks), so a library's own attention can run between the two (NOTE [Contiguous Ulysses])."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, inverse: bool) -> torch.Tensor:
        size, exchange = _exchange(group)
        ctx.group, ctx.inverse = group, inverse
        return (_to_tokens if inverse else _to_heads)(t, size, exchange, True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        size, exchange = _exchange(ctx.group)
        return (_to_heads if ctx.inverse else _to_tokens)(grad, size, exchange, True), None, None


def tokens_to_heads(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable: this rank's contiguous tokens of every head ``[s, b, h, d]`` -> all ``c·s`` tokens
    of its ``h/c`` heads ``[c·s, b, h/c, d]`` (NOTE [Contiguous Ulysses]); c must divide h."""
    return _TokensToHeads.apply(t, group, False)


def heads_to_tokens(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable inverse of :func:`tokens_to_heads`: ``[c·s, b, h/c, d]`` -> ``[s, b, h, d]``."""
    return _TokensToHeads.apply(t, group, True)


class SequenceShard:
    """This rank's contiguous share of a sequence split over a Ulysses group (NOTE [Contiguous
    Ulysses]): rank r of c holds tokens ``[r·s, (r+1)·s)`` of every sequence, s its local length.

    Set on memo's reference modules (``sequence_shard``) by :func:`memo.distributed.ulysses.
    shard_sequence`; a plain attribute, so the state dict does not change. ``head_chunks``: the chunks
    of heads its attention runs over (None: :func:`head_chunks`; NOTE [Ulysses over chunks of heads]),
    set by :func:`memo.distributed.ulysses.shard_sequence`."""

    def __init__(self, group: Any, head_chunks: int | None = None) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.head_chunks = head_chunks

    def first_position(self, local_len: int) -> int:
        """The absolute position of this rank's first token, for ``local_len`` tokens per rank."""
        return self.rank * local_len

    def attention_kernels(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``(forward(q, k, v) -> (o, lse), backward(grad_o, q, k, v, o, lse) -> (dq, dk, dv))`` of causal
        attention over this shard's group, without autograd, as memo's runtime runs a layer's core."""
        return (functools.partial(ulysses_attention_forward, group=self.group, contiguous=True,
                                  chunks=self.head_chunks),
                functools.partial(ulysses_attention_backward, group=self.group, contiguous=True,
                                  chunks=self.head_chunks))

    def __repr__(self) -> str:
        chunks = "" if self.head_chunks is None else f", head_chunks={self.head_chunks}"
        return f"SequenceShard(rank={self.rank}, size={self.size}{chunks})"


class UlyssesCoreAttention(torch.nn.Module):
    """Causal attention over a :class:`SequenceShard`'s group by all-to-all, contiguous layout:
    ``(q [s, b, n, d], k, v [s, b, n_kv, d]) -> o [s, b, n·d]`` of this rank's tokens. No parameters;
    it replaces a reference layer's ``core_attention`` (NOTE [Layer anatomy] in memo/models/layers.py),
    and memo's runtime takes its two halves from :meth:`attention_kernels`."""

    def __init__(self, shard: SequenceShard) -> None:
        super().__init__()
        self.shard = shard

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = ulysses_attention(q, k, v, self.shard.group, contiguous=True, chunks=self.shard.head_chunks)
        s, b, n, d = o.shape
        return o.view(s, b, n * d)

    def attention_kernels(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The shard's halves (:meth:`SequenceShard.attention_kernels`)."""
        return self.shard.attention_kernels()
