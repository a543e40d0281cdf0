"""Ulysses context parallelism for Hugging Face causal LMs: the model's own attention between two
all-to-alls.

NOTE [Ulysses around HF's attention]
An HF attention module computes q, k, v of its tokens, applies its rotary embedding and calls the
attention function its config names (``config._attn_implementation``, looked up in transformers'
``AttentionInterface``). :func:`shard_hf_sequence` registers one more, ``"memo_ulysses"``: it turns
the rank's contiguous tokens of every head into all tokens of its share of the heads
(:func:`memo.models.ulysses_attention.tokens_to_heads`, differentiable), calls transformers' own sdpa
attention function on them (its scale, its GQA, its causal flag; the eager function builds no causal
mask without one, so sdpa serves eager models too), and exchanges the output back. The rotary
embedding is the model's: a forward pre-hook on the base model hands it ``position_ids`` of the
rank's tokens (``r·s ..``, NOTE [Contiguous Ulysses]) when the caller gives none, so HF computes the
cos/sin rows of the rank's absolute positions. transformers builds no mask for an attention name its
mask interface does not know, so the layers get the caller's mask: None for training on whole
sequences (padding is -100 in the labels); a padding or packing mask cannot be split by tokens and is
refused.

NOTE [Packed documents under Ulysses]
Packed documents reach a rank as the position ids of its tokens (NOTE [Packed documents] in
memo/train/corpus.py), and the block-causal mask they stand for spans the whole sequence, which the
rank's attention sees only after its exchange. So when the caller gives ``position_ids``, the base
model's pre-hook all-gathers them over the Ulysses group (every rank runs the same forward, so the
gather pairs up) and, where they hold a document boundary, turns them once per forward into the
offsets of the whole sequence's documents (a position that does not follow its predecessor starts
one: transformers' rule) and hands them to the layers as ``memo_ulysses_document_offsets``. After its
exchange a rank holds every token of its heads, so :func:`ulysses_sdpa_attention` runs memo's causal
kernels within each document there (NOTE [Attention over packed documents] in
memo/models/causal_attention.py): no ``[s, s]`` mask. Every rank decides from the same gathered
positions, so all ranks take the same path. memo's wrapped layers run memo's causal Ulysses kernels,
which take no documents: they refuse ``memo_ulysses_document_offsets`` (memo/adapters/hf.py), on every
rank alike.

Under memo (``memo.wrap``) the layer adapter recognises ``"memo_ulysses"`` and runs memo's Ulysses
halves with the same exchange (memo/adapters/hf.py), so wrapped and unwrapped ranks compute the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memo.adapters.hf_packed import document_offsets
from memo.errors import MemoError
from memo.models.causal_attention import document_attention
from memo.models.ulysses_attention import SequenceShard, heads_to_tokens, kv_replicas, tokens_to_heads

__all__ = ["DOCUMENT_POSITIONS", "ULYSSES_ATTENTION", "shard_hf_sequence", "ulysses_sdpa_attention"]

#: The attention implementation name memo registers with transformers.
ULYSSES_ATTENTION = "memo_ulysses"
#: The keyword the layers get the whole sequence's document offsets by (NOTE [Packed documents under
#: Ulysses]).
DOCUMENT_POSITIONS = "memo_ulysses_document_offsets"

_WHERE = "memo.adapters.hf_ulysses"


def ulysses_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``query [b, n, s, d]``, ``key, value [b, n_kv, s, d]``
    -> ``([b, s, n, d], None)``) for a rank's contiguous tokens (NOTE [Ulysses around HF's attention])."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shard: SequenceShard | None = getattr(module, "memo_sequence_shard", None)
    if shard is None:
        raise MemoError(f"{_WHERE}: {type(module).__name__} runs attention {ULYSSES_ATTENTION!r} but was not "
                        "given a sequence shard; use memo.distributed.ulysses.shard_sequence(model, group)")
    if attention_mask is not None:
        raise MemoError(f"{_WHERE}: a rank of a Ulysses group got an attention mask "
                        f"{tuple(attention_mask.shape)}; its tokens are a slice of the sequence, which a "
                        "padding or packing mask cannot be cut by. Train on whole sequences without "
                        "attention_mask (mark padding with label -100)")
    window = kwargs.get("sliding_window")
    if window is not None and query.shape[2] * shard.size > window:
        raise MemoError(f"{_WHERE}: sliding_window={window} is shorter than the sequence "
                        f"({query.shape[2] * shard.size} tokens); memo's Ulysses attention is causal over "
                        "the whole sequence and applies no window. Use sequences of at most the window")
    documents = kwargs.pop(DOCUMENT_POSITIONS, None)
    if documents is not None and dropout > 0:
        raise MemoError(f"{_WHERE}: attention dropout {dropout} with packed documents; memo's document "
                        "attention has no dropout (set config.attention_dropout = 0)")
    n, n_kv = query.shape[1], key.shape[1]
    replicas = kv_replicas(n, n_kv, shard.size)
    group = shard.group

    def heads(t: torch.Tensor, copies: int = 1) -> torch.Tensor:  # [b, h, s, d] -> [b, h/c, c·s, d]
        t = t.permute(2, 0, 1, 3)
        if copies > 1:
            t = t.repeat_interleave(copies, dim=2)
        return tokens_to_heads(t, group).permute(1, 2, 0, 3)

    q, k, v = heads(query), heads(key, replicas), heads(value, replicas)
    if documents is not None:  # every token of these heads: attention within each document
        o = document_attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), documents, scaling)
        return heads_to_tokens(o, group).transpose(0, 1), None  # [b, s, n, d]
    # sdpa repeats key/value heads by the module's ratio where it cannot use GQA itself: the ratio of
    # the heads this rank holds, which replicas change
    ratio, had = q.shape[1] // k.shape[1], getattr(module, "num_key_value_groups", None)
    module.num_key_value_groups = ratio
    try:
        out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling,
                                        is_causal=kwargs.pop("is_causal", getattr(module, "is_causal", True)),
                                        **kwargs)
    finally:
        if had is None:
            del module.num_key_value_groups
        else:
            module.num_key_value_groups = had
    return heads_to_tokens(out.transpose(0, 1), group).transpose(0, 1), None  # [b, s, n, d]


def _gathered(positions: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """The whole sequence's position ids, ``[B, c·s]``, from every rank's ``[B, s]``."""
    parts = [torch.empty_like(positions) for _ in range(shard.size)]
    torch.distributed.all_gather(parts, positions.contiguous(), group=shard.group)
    return torch.cat(parts, dim=1)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_sdpa_attention)


def _positions_hook(shard: SequenceShard) -> Callable[
        [nn.Module, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
            tuple[Any, ...], dict[str, Any]]:
        given = kwargs.get("input_ids", args[0] if args else None)
        if given is None:
            given = kwargs.get("inputs_embeds")
        given_positions = kwargs.get("position_ids")
        if given_positions is not None:  # NOTE [Packed documents under Ulysses]
            whole = _gathered(given_positions, shard)
            b = whole.shape[0] if given is None else given.shape[0]
            offsets = document_offsets(whole, b)
            if offsets is not None:
                kwargs[DOCUMENT_POSITIONS] = offsets
            return args, kwargs
        if given is None:
            return args, kwargs
        s = given.shape[1]
        first = shard.first_position(s)
        kwargs["position_ids"] = torch.arange(first, first + s, device=given.device).unsqueeze(0)
        return args, kwargs

    return hook


def shard_hf_sequence(model: nn.Module, shard: SequenceShard) -> None:
    """Make ``model`` (an HF causal LM) one rank of ``shard``'s Ulysses group (NOTE [Ulysses around
    HF's attention]): its attention modules run :data:`ULYSSES_ATTENTION`, its base model's forward
    gets this rank's ``position_ids``. The state dict does not change."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "eager", "sdpa", ULYSSES_ATTENTION):
        raise MemoError(f"{_WHERE}: {type(model).__name__} uses attention {impl!r}; memo's Ulysses runs "
                        "transformers' sdpa attention between its exchanges (load the model with "
                        "attn_implementation='sdpa')")
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads is not None:
        kv_replicas(int(heads), int(kv), shard.size)  # refuses heads the ranks cannot share
    attentions = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not attentions:
        raise MemoError(f"{_WHERE}: {type(model).__name__} has no '*.self_attn' modules to run Ulysses in")
    _register()
    for attn in attentions:
        attn.memo_sequence_shard = shard
    config._attn_implementation = ULYSSES_ATTENTION
    base = getattr(model, "base_model", model)
    base.register_forward_pre_hook(_positions_hook(shard), with_kwargs=True)
