"""Packed documents in Hugging Face causal LMs without an ``[s, s]`` mask: memo's attention
implementation for transformers.

NOTE [Packed attention in HF models]
transformers 5.x reads packed documents from ``position_ids`` (a position that does not follow its
predecessor starts a document) and, for eager and sdpa attention, builds the block-causal mask
``[b, 1, s, s]`` they stand for: s^2 bytes, 4 GB at 64K tokens, 1 TB at 1M. :func:`use_packed_attention`
makes a model run :data:`PACKED_ATTENTION` instead, registered with transformers' ``AttentionInterface``
(the attention function) and ``AttentionMaskInterface`` (its mask function), the way flash-attention's
path needs no mask either:

- the mask function builds nothing when the caller gave no 2-D ``attention_mask``: the layers get None.
  Given one (padding), it builds sdpa's full mask, never the causal shortcut (None), so the attention
  function can tell the two apart: transformers ignores position resets when a padding mask is given,
  and so does memo;
- a forward pre-hook on the base model turns the ``position_ids`` into document offsets once per
  forward (:func:`document_offsets`: cu_seqlens per batch row; one host sync) and hands them to every
  layer as the keyword :data:`DOCUMENT_OFFSETS` (None: no document boundary, or a padding mask or KV
  cache, where transformers does not look for packing either);
- :func:`packed_attention_forward` runs the attention: causal within each document by memo's causal
  kernels (NOTE [Attention over packed documents] in memo/models/causal_attention.py) when there are
  documents; transformers' own sdpa function otherwise (a mask, a cache's decode step, or one document
  per row: then its numbers are exactly sdpa's). Without the keyword (a model given the name without
  the hook) it reads the offsets from the layer's ``position_ids`` itself.
memo's layer adapter (memo/adapters/hf.py) takes the same offsets when it runs the attention itself.
The math is sdpa's (an eager model switched to it computes sdpa's softmax); attention dropout, a
sliding window shorter than a document and bidirectional attention are refused with a MemoError.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memo.errors import MemoError
from memo.models.causal_attention import DocumentOffsets, document_attention, longest_document

__all__ = ["DOCUMENT_OFFSETS", "PACKED_ATTENTION", "document_offsets", "packed_attention_forward",
           "packed_attention_mask", "use_packed_attention"]

#: The attention implementation name memo registers with transformers.
PACKED_ATTENTION = "memo_packed"
#: The keyword the layers get their batch's document offsets by (NOTE [Packed attention in HF models]).
DOCUMENT_OFFSETS = "memo_document_offsets"

_WHERE = "memo.adapters.hf_packed"
#: memo's Ulysses attention (memo/adapters/hf_ulysses.py), which reads packed documents itself.
_ULYSSES_ATTENTION = "memo_ulysses"
_MISSING = object()


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """``[B, s]`` boolean: where a document starts, a position that does not follow its predecessor
    (transformers' ``find_packed_sequence_indices`` rule; a row's first token always starts one)."""
    return torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1


def document_offsets(positions: torch.Tensor, b: int) -> DocumentOffsets | None:
    """The offsets of the documents in each of ``b`` rows (NOTE [Attention over packed documents] in
    memo/models/causal_attention.py) from ``position_ids [B, s]`` (B = 1 or b), or None when no row
    holds a boundary (plain causal attention)."""
    if positions.dim() != 2 or positions.shape[0] not in (1, b):
        raise MemoError(f"{_WHERE}: position_ids must be [1 or {b}, s]; got {tuple(positions.shape)}")
    starts = document_starts(positions)
    starts[:, 0] = False
    s = positions.shape[1]
    rows, cols = starts.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return None
    per_row: list[list[int]] = [[0] for _ in range(positions.shape[0])]
    for r, c in zip(rows.tolist(), cols.tolist(), strict=True):  # one host sync per forward
        per_row[r].append(c)
    offsets = tuple(tuple(row) + (s,) for row in per_row)
    return offsets * b if len(offsets) == 1 and b > 1 else offsets


def packed_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                          kv_offset: Any = 0, attention_mask: torch.Tensor | None = None,
                          **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask-function contract for :data:`PACKED_ATTENTION` (NOTE [Packed attention in HF
    models]): None when no padding mask is given and queries and keys are the same tokens; else sdpa's
    mask, built in full where a padding mask is given."""
    from transformers.masking_utils import sdpa_mask

    same_tokens = q_length == kv_length and isinstance(q_offset, int) and isinstance(kv_offset, int) \
        and q_offset == kv_offset == 0
    if attention_mask is None and same_tokens:
        return None
    if attention_mask is not None:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def _check_supported(module: nn.Module, dropout: float, kwargs: dict[str, Any],
                     offsets: DocumentOffsets | None, s: int) -> None:
    where = f"{_WHERE}: {type(module).__name__}"
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise MemoError(f"{where} is bidirectional (is_causal=False); memo's packed attention is causal "
                        "(load the model with attn_implementation='sdpa')")
    if dropout > 0:
        raise MemoError(f"{where}: attention dropout {dropout}; memo's packed attention has no dropout (set "
                        "config.attention_dropout = 0)")
    window = kwargs.get("sliding_window")
    longest = s if offsets is None else longest_document(offsets)
    if window is not None and longest > window:
        raise MemoError(f"{where}: sliding_window={window} is shorter than a document ({longest} tokens); "
                        "memo's packed attention applies no window. Use documents of at most the window, or "
                        "attn_implementation='sdpa'")


def packed_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``query [b, n, s, d]``, ``key, value [b, n_kv, s, d]``
    -> ``([b, s, n, d], None)``) for :data:`PACKED_ATTENTION` (NOTE [Packed attention in HF models])."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    offsets = kwargs.pop(DOCUMENT_OFFSETS, _MISSING)
    b, _, s, _ = query.shape
    if attention_mask is not None or key.shape[2] != s:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if offsets is _MISSING:
        positions = kwargs.get("position_ids")
        offsets = document_offsets(positions, b) if isinstance(positions, torch.Tensor) else None
    _check_supported(module, dropout, kwargs, offsets, s)
    if offsets is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q, k, v = (t.permute(2, 0, 1, 3) for t in (query, key, value))  # [s, b, heads, d] views
    return document_attention(q, k, v, offsets, scaling).transpose(0, 1), None


def _offsets_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
        tuple[Any, ...], dict[str, Any]]:
    """The base model's forward pre-hook: the batch's document offsets, once per forward, for every
    layer (NOTE [Packed attention in HF models])."""
    positions = kwargs.get("position_ids")
    given = kwargs.get("input_ids", args[0] if args else None)
    if given is None:
        given = kwargs.get("inputs_embeds")
    offsets = None
    if isinstance(positions, torch.Tensor) and given is not None and kwargs.get("attention_mask") is None \
            and kwargs.get("past_key_values") is None:
        offsets = document_offsets(positions, given.shape[0])
    kwargs[DOCUMENT_OFFSETS] = offsets
    return args, kwargs


def _register() -> None:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        import transformers

        raise MemoError(f"{_WHERE}: memo's packed attention needs transformers >= 5 (its attention and mask "
                        f"interfaces); this is {transformers.__version__} ({err})") from None

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_attention_mask)


def use_packed_attention(model: nn.Module) -> None:
    """Make ``model`` (an HF causal LM, transformers >= 5) run :data:`PACKED_ATTENTION`: packed documents
    from ``position_ids`` with no ``[s, s]`` mask (NOTE [Packed attention in HF models]). Idempotent; a
    model under memo's Ulysses keeps its own attention (NOTE [Packed documents under Ulysses] in
    memo/adapters/hf_ulysses.py). The state dict does not change."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl in (PACKED_ATTENTION, _ULYSSES_ATTENTION):
        return
    if impl not in (None, "eager", "sdpa"):
        raise MemoError(f"{_WHERE}: {type(model).__name__} uses attention {impl!r}; memo's packed attention "
                        "replaces 'eager' or 'sdpa' (load the model with attn_implementation='sdpa')")
    base = getattr(model, "base_model", model)
    if not hasattr(base, "forward"):
        raise MemoError(f"{_WHERE}: {type(model).__name__} has no base model to hand document offsets to")
    _register()
    base.register_forward_pre_hook(_offsets_hook, with_kwargs=True)
    config._attn_implementation = PACKED_ATTENTION
