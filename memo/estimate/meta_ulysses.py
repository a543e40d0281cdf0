"""memo's Ulysses attention on a meta rank model, its exchange recorded where it allocates (NOTE
[Ulysses in a meta estimate]), over the chunks of heads ``memo train`` runs (NOTE [Head chunks in an
estimate])."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from memo.models.model import TransformerModel

__all__ = ["meta_ulysses"]


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
# NOTE [Head chunks in an estimate]
# ``memo train --ulysses-head-chunks N`` runs Ulysses' exchange and the kernel over N chunks of heads,
# one at a time (NOTE [Ulysses over chunks of heads] in memo/models/ulysses_attention.py), so the
# head-sharded copies and the kernel's own transients are a chunk's, not every head's. A layout's
# ``head_chunks`` (None: memo train's default, one chunk per key/value head a rank receives) is
# recorded by the very functions memo train runs, ``ulysses_chunked_forward`` and ``_backward`` over
# the chunks ``head_chunk_slices`` cuts, so the estimate and the runtime cannot chunk differently. The
# longest-sequence search tries memo's Ulysses layouts at the finest count beside the default
# (NOTE [Head chunks in the search] in memo/estimate/search.py), and the launch command carries it.


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


def meta_ulysses(model: TransformerModel, size: int, contiguous: bool = True,
                 head_chunks: int | None = None) -> None:
    """Every layer of memo's meta rank ``model`` attends as one rank of a Ulysses group of ``size``
    (NOTE [Ulysses in a meta estimate]), over ``head_chunks`` chunks of heads (None: memo train's
    default; NOTE [Head chunks in an estimate])."""
    from memo.models.cp_attention import GroupAttention
    from memo.models.ulysses_attention import (
        UlyssesCoreAttention,
        ulysses_chunked_backward,
        ulysses_chunked_forward,
    )

    shard = _MetaShard(size)

    def forward_half(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _group: object = None) -> tuple[
            torch.Tensor, torch.Tensor]:
        return ulysses_chunked_forward(q, k, v, size, _meta_all_to_all, contiguous, head_chunks)

    def backward_half(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      o: torch.Tensor, lse: torch.Tensor, _group: object = None) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        return ulysses_chunked_backward(grad_o, q, k, v, o, lse, size, _meta_all_to_all, contiguous,
                                        head_chunks)

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
