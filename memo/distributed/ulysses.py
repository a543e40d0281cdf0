"""Ulysses context parallelism for the models FSDP2 shards: memo's reference models and HF causal LMs.

:func:`shard_sequence` makes a model one rank of a Ulysses group (NOTE [Contiguous Ulysses] in
memo/models/ulysses_attention.py): rank r of c holds tokens ``[r·s, (r+1)·s)`` of every sequence, and
attention alone exchanges tokens for heads. For memo's models every layer's parameter-free
``core_attention`` becomes :class:`memo.models.ulysses_attention.UlyssesCoreAttention` and the
embedding and layers learn their first position; an HF model runs its own attention between the
exchanges (NOTE [Ulysses around HF's attention] in memo/adapters/hf_ulysses.py). Neither changes a
parameter or the state dict, so FSDP2 shards the same model over the DP x CP ranks.
Its ``head_chunks`` sets how many chunks of heads memo's models attend over (NOTE [Ulysses over
chunks of heads]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from memo.errors import MemoError
from memo.models.ulysses_attention import SequenceShard, UlyssesCoreAttention, head_chunk_slices, kv_replicas

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["shard_sequence"]


def shard_sequence(model: nn.Module, group: ProcessGroup, head_chunks: int | None = None) -> SequenceShard:
    """Make ``model`` this rank's part of the Ulysses ``group``, attending over ``head_chunks`` chunks of
    heads (None: the default count, NOTE [Ulysses over chunks of heads]); -> its :class:`SequenceShard`.

    Raises a MemoError for a model memo cannot split this way (heads the ranks cannot share, a model
    that is neither memo's nor an HF causal LM), and for a count of chunks its heads cannot split into
    or on a Hugging Face model, which runs its own attention between the exchanges."""
    from memo.models.model import TransformerModel

    shard = SequenceShard(group, head_chunks)
    if isinstance(model, TransformerModel):
        config = model.config
        kv_replicas(config.n_heads, config.n_kv_heads or config.n_heads, shard.size)
        if head_chunks is not None:
            head_chunk_slices(config.n_heads, config.n_kv_heads or config.n_heads, shard.size, head_chunks)
        if model.tensor_parallel > 1:
            raise MemoError("memo.distributed: a model built as a tensor-parallel rank cannot also be a "
                            "Ulysses rank; build it with tensor_parallel=1")
        for layer in model.layers:
            layer.core_attention = UlyssesCoreAttention(shard)
            layer.sequence_shard = shard
        model.embedding.sequence_shard = shard
        return shard
    if type(model).__module__.startswith("transformers.") or hasattr(model, "base_model_prefix"):
        if head_chunks is not None:
            raise MemoError("memo.distributed: chunks of heads are memo's Ulysses core attention's, on "
                            "memo's reference models; a Hugging Face model runs its own attention between "
                            "the exchanges (NOTE [Ulysses around HF's attention])")
        from memo.adapters.hf_ulysses import shard_hf_sequence

        shard_hf_sequence(model, shard)
        return shard
    raise MemoError(f"memo.distributed: Ulysses context parallelism runs memo's reference models and Hugging "
                    f"Face causal LMs; {type(model).__name__} is neither")
