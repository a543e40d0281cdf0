"""memo's Ulysses attention on a meta rank model, its exchange recorded where it allocates (NOTE
[Ulysses in a meta estimate]), over chunks of heads as a what-if (NOTE [Head-chunked Ulysses, a
what-if])."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from memo.models.model import TransformerModel

__all__ = ["head_chunk_slices", "meta_ulysses"]


# NOTE [Ulysses in a meta estimate]
# A Ulysses rank's attention exchanges its tokens of every head for every rank's tokens of its share
# of the heads, runs the kernel over those, and exchanges the output back; in backward the same for
# grad_o, q, k, v, o and lse, and dq, dk, dv back (NOTE [Ulysses context parallelism] in
# memo/models/ulysses_attention.py), over the chunks of heads ``memo train`` runs (NOTE [Ulysses over
# chunks of heads]). The meta rank model runs memo's own Ulysses functions, with the
# collective replaced by what it allocates on a rank (a contiguous copy of the parts sent and the
# tensor received, ``_all_to_all``'s two allocations): so every head-sharded copy, every reshuffle's
# temporary and the kernel over all tokens of n/c heads are recorded where they live, and the peak is
# the iteration's true one. Counting them on top of a peak recorded without them (NOTE
# [Context-parallel exchange in an estimate], still what the all-gather form gets) double-counts
# wherever the peak is elsewhere, e.g. in an RMSNorm's backward. The exchange is recorded in the
# contiguous layout FSDP2 runs; megatron's load-balanced chunks put the received rows in sequence
# order by one more copy, made as the exchange's send buffer is freed (the same peak), and an index
# of 8 bytes per token of the sequence, which is not recorded (building it on the host for every
# exchange of a meta rank costs seconds per profile at millions of tokens).
#
# NOTE [Head-chunked Ulysses, a what-if]
# UPipe (arXiv 2602.21196) runs Ulysses' exchange and the kernel over chunks of heads, one chunk at a
# time, so the head-sharded copies and the kernel's own transients are a chunk's, not every head's.
# ``memo train`` chunks so that no key/value head is sent twice: one chunk per key/value head a rank
# receives (NOTE [Ulysses over chunks of heads]), one chunk where a rank receives one (Llama-3.1-8B
# at CP 8). ``head_chunks`` > 1 chunks the query heads further, as UPipe does, each chunk sending
# the key/value heads its query heads share again: memo's own unchunked Ulysses functions called once
# per chunk, each chunk's outputs written into the full-size ones, so that an estimate can say what
# it would buy. Such an estimate is labelled as not runnable and no answer of ``memo estimate``
# uses it (benchmarks/longest_at_scale.py reports it beside memo's row).


class _MetaShard:
    """Rank 0 of a Ulysses group of ``size`` on the meta device (what :class:`memo.models.
    ulysses_attention.SequenceShard` says of a rank, without a process group)."""

    def __init__(self, size: int) -> None:
        self.rank, self.size, self.group = 0, size, None

    def first_position(self, local_len: int) -> int:
        return 0


def _meta_all_to_all(t: torch.Tensor) -> torch.Tensor:
    """What ``all_to_all_single`` allocates on a rank: the contiguous parts sent and the received tensor."""
    import torch

    return torch.empty_like(t.contiguous())


def head_chunk_slices(n: int, n_kv: int, size: int, chunks: int) -> list[tuple[slice, slice]]:
    """(query heads, key/value heads) of each of ``chunks`` chunks (NOTE [Head-chunked Ulysses, a
    what-if]); a MemoError where the heads do not split so that Ulysses can share each chunk."""
    from memo.errors import MemoError
    from memo.models.ulysses_attention import ulysses_heads_problem

    per_kv = n // n_kv
    if n % chunks or (n // chunks) % per_kv and per_kv % (n // chunks):
        raise MemoError(f"memo estimate: {n} query heads do not split into {chunks} chunks of whole "
                        "key/value head groups")
    q = n // chunks
    out = []
    for j in range(chunks):
        first, last = j * q // per_kv, ((j + 1) * q - 1) // per_kv + 1
        problem = ulysses_heads_problem(q, last - first, size)
        if problem is not None:
            raise MemoError(f"memo estimate: a chunk of {q} query heads: {problem}")
        out.append((slice(j * q, (j + 1) * q), slice(first, last)))
    return out


def meta_ulysses(model: TransformerModel, size: int, contiguous: bool = True, head_chunks: int = 1) -> None:
    """Every layer of memo's meta rank ``model`` attends as one rank of a Ulysses group of ``size``
    (NOTE [Ulysses in a meta estimate]); ``head_chunks`` > 1: over that many chunks of heads, one at
    a time (NOTE [Head-chunked Ulysses, a what-if])."""
    from memo.models.cp_attention import GroupAttention
    from memo.models.ulysses_attention import (
        UlyssesCoreAttention,
        ulysses_backward,
        ulysses_chunked_backward,
        ulysses_chunked_forward,
        ulysses_forward,
    )

    shard = _MetaShard(size)

    def forward_half(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _group: object = None) -> tuple[
            torch.Tensor, torch.Tensor]:
        if head_chunks == 1:  # what memo train runs
            return ulysses_chunked_forward(q, k, v, size, _meta_all_to_all, contiguous)
        o, lse = q.new_empty(q.shape), None
        for qh, kh in head_chunk_slices(q.shape[2], k.shape[2], size, head_chunks):
            o_c, lse_c = ulysses_forward(q[:, :, qh], k[:, :, kh], v[:, :, kh], size, _meta_all_to_all,
                                         contiguous)
            if lse is None:
                lse = lse_c.new_empty((lse_c.shape[0], q.shape[2], lse_c.shape[2]))
            o[:, :, qh], lse[:, qh] = o_c, lse_c
            del o_c, lse_c
        return o, lse

    def backward_half(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      o: torch.Tensor, lse: torch.Tensor, _group: object = None) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        if head_chunks == 1:
            return ulysses_chunked_backward(grad_o, q, k, v, o, lse, size, _meta_all_to_all, contiguous)
        dq, dk, dv = q.new_empty(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
        for qh, kh in head_chunk_slices(q.shape[2], k.shape[2], size, head_chunks):
            dq_c, dk_c, dv_c = ulysses_backward(grad_o[:, :, qh], q[:, :, qh], k[:, :, kh], v[:, :, kh],
                                                o[:, :, qh], lse[:, qh], size, _meta_all_to_all, contiguous)
            dq[:, :, qh] = dq_c
            dk[:, :, kh] += dk_c  # chunks that share a key/value head add their parts
            dv[:, :, kh] += dv_c
            del dq_c, dk_c, dv_c
        return dq, dk, dv

    class MetaUlyssesCoreAttention(UlyssesCoreAttention):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            o = GroupAttention.apply(q, k, v, None, (forward_half, backward_half))
            s, b, n, d = o.shape
            return o.view(s, b, n * d)

        def attention_kernels(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
            return forward_half, backward_half

    for layer in model.layers:
        layer.core_attention = MetaUlyssesCoreAttention(shard)  # type: ignore[arg-type]
        layer.sequence_shard = shard
    model.embedding.sequence_shard = shard
