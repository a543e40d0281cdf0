"""Hugging Face ``transformers`` integration: the decoder-layer adapter.

``memo.wrap(model, ...)`` of a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``MistralForCausalLM``
finds their decoder layers through :class:`HFDecoderLayerAdapter` (registered the first time a
``transformers`` module is met, NOTE [Layer adapters]); ``CausalLMAdapter``
(memo/adapters/hf_model.py) is their model adapter (NOTE [Model adapters]). Importing this module
imports ``transformers``; memo does so only when a model from it is wrapped or profiled. Tested with
transformers 5.23 (``pip install memo[hf]``); written against attributes, not versions, so that 4.4x
layers (which return a tuple and take ``past_key_value``) work too.

NOTE [HF decoder layer anatomy]
An HF decoder layer (Llama, Qwen2, Mistral: the three are the same code) takes
``hidden_states: [b, s, h]`` (batch first) and keyword arguments; memo splits it as

- split_args: ``x = hidden_states.transpose(0, 1)`` (``[s, b, h]``, a view); the rotary
  ``position_embeddings = (cos, sin)`` (``[B, s, d]``, B = 1 or b, the rows HF computed from
  ``position_ids``) and the attention mask go into the context;
- pre: ``input_layernorm`` -> ``q_proj``/``k_proj``/``v_proj`` (with their biases, Qwen2) ->
  the family's own ``apply_rotary_pos_emb`` with the cos/sin rows of tokens
  ``[offset:offset+t]``; like post, it runs the layer's submodules on ``[b, t, h]``, the layer's own
  layout (NOTE [HF layout]);
- core: softmax attention with HF's scale (the attention module's ``scaling``, else
  ``1/sqrt(head_dim)``), through memo's causal kernels when the mask is plain causal, else
  through memo/models/masked_attention.py (NOTE [HF attention masks]);
- post: ``o_proj`` -> residual -> ``post_attention_layernorm`` -> ``mlp`` -> residual;
- pack_output: ``y.transpose(0, 1)``, as a 1-tuple where the layer's ``forward`` returns a tuple
  (transformers 4.4x), else the tensor.

NOTE [HF layout]
memo's runtime holds a layer's tokens as ``[s, b, h]`` and runs pre and post on token ranges. The
HF submodules (norms, projections, the MLP, PEFT's LoRA modules) get their range as ``[b, t, h]``,
a transposed view, the layout they see unwrapped: so a forward hook on ``layer.mlp`` sees
``[b, t, h]``, and a dropout inside draws its mask in the unwrapped order (the adapter's
``batch_first``, NOTE [Dropout as unwrapped] in memo/runtime/dropout.py). What pre and post return
goes back to ``[t, b, ...]`` the same way.

Refused with a MemoError naming the layer class and the reason: a KV cache that already holds
tokens (an empty one, and ``use_cache=True``, are turned off in training forwards: NOTE [The KV
cache in a training forward]), ``output_attentions``, attention dropout > 0, an attention
implementation other than ``eager``, ``sdpa``, ``memo_packed`` (or ``memo_ulysses``), HF gradient
checkpointing, flash-attention varlen arguments, a mask that is not ``[B, 1 or n, s, s]``, and an
active sliding window without a mask (or documents) that encodes it.

NOTE [HF attention masks]
HF's eager and sdpa paths build the whole ``[B, 1, s, s]`` mask in the model and hand it to every
layer: ``None`` when sdpa can use ``is_causal`` (no padding), a boolean mask (sdpa, transformers
5.x; True = attend) or an additive float mask (eager, and sdpa in 4.4x; 0 or the dtype's min). It
already encodes everything HF does with masks: causality, left or right padding from a 2-D
``attention_mask``, packed sequences (5.x: from ``position_ids`` resets) and sliding windows. memo
uses the same mask the same way, so it computes what HF computes:

- ``None``, or a mask that is exactly causal for every batch row (checked in row blocks): memo's
  causal kernels (:mod:`memo.models.causal_attention`);
- no mask in a model running memo's packed attention (``memo_packed``: NOTE [Packed attention in HF
  models] in memo/adapters/hf_packed.py): causal attention within each document of the offsets the
  base model's hook read from ``position_ids`` (memo's causal kernels per document,
  :func:`memo.models.causal_attention.document_attention_forward`), no ``[s, s]`` mask anywhere;
- any other mask: :func:`masked_attention_forward` / :func:`masked_attention_backward`, plain
  matrix products over blocks of query rows in float32 (float64 for float64 inputs), forward and
  backward without autograd. A boolean mask is applied as ``-inf`` and a query row with no key
  left gets output 0 and gradient 0 (what ``torch.nn.functional.scaled_dot_product_attention``
  does); a float mask is added to the scaled scores, as HF's eager attention does (a row whose
  keys are all at the dtype's min then averages every key, as eager does).
Such rows matter: with left padding the last padded position predicts the first real token, so
unless its label is -100 its output reaches the loss. For them memo's gradient is the exact one of
its forward. torch 2.13's CPU sdpa with a float mask is not (its forward averages every key, its
backward does not), so with transformers 4.4x on CPU (float masks in sdpa) memo agrees with HF's
eager there, not with HF's sdpa; 5.x hands sdpa a boolean mask and agrees with memo.
The mask is kept in the context until the layer's backward (sdpa's own autograd keeps it too).
Under autocast, attention runs in the autocast dtype (HF's sdpa and eager matmuls do too).

Gradient checkpointing: 4.52+ flags each layer (``layer.gradient_checkpointing``), which the
layer adapter refuses at wrap time and at every call; 4.4x before that flags only the base model,
which :class:`CausalLMAdapter`'s check refuses.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import typing
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memo.adapters.base import AttentionBackward, AttentionForward, LayerAdapter, MLPSite
from memo.adapters.exact import unhonoured
from memo.adapters.hf_packed import DOCUMENT_OFFSETS, PACKED_ATTENTION, document_offsets
from memo.errors import MemoError
from memo.models.causal_attention import (
    DocumentOffsets,
    document_attention_backward,
    document_attention_forward,
    longest_document,
)
from memo.models.masked_attention import is_plain_causal, masked_attention_backward, masked_attention_forward

try:
    import transformers  # noqa: F401  (fail here, clearly, when transformers is missing)
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise MemoError(
        "memo.adapters.hf: transformers is not installed (pip install memo[hf], or pip install transformers)"
    ) from e

__all__ = [
    "HFDecoderLayerAdapter",
    "masked_attention_backward",
    "masked_attention_forward",
]

#: (module, class) of the decoder layers memo adapts.
DECODER_LAYERS = (
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"),
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer"),
)

#: Attention implementations whose math memo reproduces (NOTE [HF attention masks]), and memo's own
#: Ulysses one (NOTE [Ulysses around HF's attention] in memo/adapters/hf_ulysses.py).
SUPPORTED_ATTENTION = (None, "eager", "sdpa", "memo_ulysses", PACKED_ATTENTION)

# ---------------------------------------------------------------------------------------------
# Masked attention (NOTE [HF attention masks])


def _layer_mask(mask: torch.Tensor, s: int, b: int, n: int, where: str) -> torch.Tensor:
    """The layer's ``[B, 1 or n, s, s]`` mask; a wider one is cut to its first s keys, as HF's own
    attention does (``attention_mask[:, :, :, :s]``; 4.4x eager masks have a spare column)."""
    if mask.dim() != 4 or mask.shape[-2] != s or mask.shape[-1] < s or mask.shape[0] not in (1, b) or \
            mask.shape[1] not in (1, n) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        got = f"{str(mask.dtype).removeprefix('torch.')} {tuple(mask.shape)}"
        raise MemoError(
            f"{where}: the attention mask must be a boolean or float [B, 1 or {n}, {s}, {s}] with B in "
            f"(1, {b}) (the 4-D mask HF's eager/sdpa models build); got {got}. Pass the 2-D padding mask "
            "to the model, not to the layers"
        )
    return mask[..., :s]


class _MaskVerdicts:
    """Remembers whether the last mask seen was plain causal: every layer of a forward gets the same
    mask tensor from the model, and checking it once is enough (keyed by that tensor and its version)."""

    def __init__(self) -> None:
        self.last: tuple[weakref.ref[torch.Tensor], int, int, bool] | None = None

    def plain_causal(self, given: torch.Tensor, mask: torch.Tensor) -> bool:
        """``mask``: the layer's ``[B, H, s, s]`` cut of the tensor ``given`` to it."""
        s = mask.shape[-1]
        if self.last is not None and self.last[0]() is given and self.last[1:3] == (given._version, s):
            return self.last[3]
        verdict = is_plain_causal(mask)
        self.last = (weakref.ref(given), given._version, s, verdict)
        return verdict


# ---------------------------------------------------------------------------------------------
# Layer adapter (NOTE [HF decoder layer anatomy])


@dataclass
class _Ctx:
    """What one call of an HF decoder layer leaves to pre / core / post (NOTE [HF decoder layer anatomy])."""

    #: ``[s, B, d]`` rotary rows (the layer's ``position_embeddings`` with tokens first).
    cos: torch.Tensor
    sin: torch.Tensor
    #: The layer's attention mask when it is not plain causal (NOTE [HF attention masks]), else None.
    mask: torch.Tensor | None
    scale: float
    as_tuple: bool
    #: The documents packed into each row (NOTE [Packed attention in HF models] in
    #: memo/adapters/hf_packed.py), None when attention is plain causal or under ``mask``.
    offsets: DocumentOffsets | None = None
    #: dtype attention ran in (the autocast dtype under autocast), set by core_forward.
    attn_dtype: torch.dtype | None = None


# Arguments HF's own model loop passes that do not change the layer's math.
_IGNORED = {"position_ids", "cache_position", "output_hidden_states", "return_dict", "num_items_in_batch"}
# Arguments split_args reads.
_TAKEN = {"self", "hidden_states", "attention_mask", "position_embeddings", DOCUMENT_OFFSETS}
# Arguments that must be absent, None or False.
_CACHE = ("past_key_values", "past_key_value", "layer_past")
_REFUSED_IF_SET = {
    "use_cache": "use_cache=True (pass use_cache=False or set model.config.use_cache = False to train)",
    "output_attentions": "output_attentions=True (memo never forms the attention weights)",
    "memo_ulysses_document_offsets": "packed documents under Ulysses context parallelism (memo's Ulysses "
                               "kernels take no document mask; train packed data under --cp with --strategy "
                               "none, or without --cp: NOTE [Packed documents under Ulysses] in "
                               "memo/adapters/hf_ulysses.py)",
    **{name: f"{name} (flash-attention's packed-sequence arguments; use attn_implementation='sdpa' and "
             "position_ids or an attention mask)" for name in
       ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")},
}


# NOTE [The KV cache in a training forward]
# HF configs default to use_cache=True, so the stock training call model(input_ids=..., labels=...)
# hands every layer a fresh DynamicCache to fill. A training forward never reads it back, and HF's
# own gradient checkpointing turns the cache off there with one warning. memo does the same: in a
# grad-enabled forward an empty cache (and use_cache=True) is ignored, said once; the model returns
# it empty. A cache that already holds tokens (a forward continuing from earlier ones) would change
# the layer's attention, so it is still refused. Forwards without grad (eval, generate) never reach
# memo's layer path and keep their cache.
def _cache_turned_off(cache: object) -> bool:
    """Whether ``cache`` (None: the use_cache flag alone) is ignored in this forward (NOTE [The KV
    cache in a training forward]), with one warning the first time."""
    if not torch.is_grad_enabled():
        return False
    if cache is not None:
        length = getattr(cache, "get_seq_length", None)
        if length is None:
            return False
        try:
            if int(length()) != 0:
                return False
        except (TypeError, ValueError):
            return False
    warnings.warn("memo.adapters.hf: `use_cache=True` is incompatible with memo's token-wise recompute; "
                  "the KV cache is off in training forwards, as HF's gradient checkpointing does "
                  "(set model.config.use_cache = False to silence this)", UserWarning, stacklevel=2)
    return True


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


@functools.cache
def _returns_tuple(cls: type) -> bool:
    """Whether the layer class's ``forward`` returns a tuple (transformers 4.4x) or the tensor (>= 4.54)."""
    sig = _signature(cls)
    ann = sig.return_annotation
    if isinstance(ann, str):
        return ann.replace("typing.", "").lower().startswith("tuple")
    if ann is not inspect.Signature.empty:
        return typing.get_origin(ann) is tuple or ann is tuple
    return "output_attentions" in sig.parameters


@functools.cache
def _rotary_fn(cls: type) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The ``apply_rotary_pos_emb`` of the layer's model family (its module, or a base class's)."""
    for klass in cls.__mro__:
        fn = getattr(sys.modules.get(klass.__module__), "apply_rotary_pos_emb", None)
        if callable(fn):
            return fn
    return None


def _attn_implementation(layer: nn.Module) -> str | None:
    cfg = getattr(layer.self_attn, "config", None)
    return getattr(cfg, "_attn_implementation", None)


def _sliding_window(layer: nn.Module) -> int | None:
    """The window the layer's attention would use, or None (Qwen2 5.x keeps it per layer; Mistral in
    the config; Qwen2 4.4x in the config behind ``use_sliding_window``)."""
    attn = layer.self_attn
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    cfg = attn.config
    if hasattr(cfg, "use_sliding_window") and not cfg.use_sliding_window:
        return None
    return getattr(cfg, "sliding_window", None)


@functools.cache
def _known_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """The decoder layer classes memo's adapter computes, and their attention classes."""
    import importlib

    layers, attentions = [], []
    for module_name, class_name in DECODER_LAYERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        layer_cls = getattr(module, class_name, None)
        attn_cls = getattr(module, class_name.replace("DecoderLayer", "Attention"), None)
        if layer_cls is not None and attn_cls is not None:
            layers.append(layer_cls)
            attentions.append(attn_cls)
    return tuple(layers), tuple(attentions)


def _not_exact(layer: nn.Module) -> list[str]:
    """NOTE [memo runs the layer the user wrote, or refuses it] (memo/adapters/exact.py): the layer and
    its attention are exactly transformers' own, unpatched, with no hooks on the attention, and an
    attention memo computes (causal)."""
    layers, attentions = _known_classes()
    options = []
    attn = getattr(layer, "self_attn", None)
    if attn is not None and getattr(attn, "is_causal", True) is False:
        options.append("self_attn.is_causal is False (bidirectional attention); memo's attention is causal")
    return unhonoured(layer, layers, {"self_attn": attentions}, options)


def _causal_kernels(layer: nn.Module) -> tuple[AttentionForward, AttentionBackward]:
    """``(forward, backward)`` of the layer's causal attention without autograd: memo's, or memo's
    Ulysses halves over the layer's sequence shard (NOTE [Ulysses around HF's attention])."""
    shard = getattr(layer.self_attn, "memo_sequence_shard", None)
    if _attn_implementation(layer) == "memo_ulysses" and shard is not None:
        return shard.attention_kernels()
    from memo.models.causal_attention import attention_backward, attention_forward

    return attention_forward, attention_backward


def _document_offsets(layer: nn.Module, given: dict[str, Any], b: int) -> DocumentOffsets | None:
    """The documents of a maskless call of a layer running memo's packed attention: the offsets the
    base model's hook computed once for the forward, else the layer's ``position_ids``' (NOTE [Packed
    attention in HF models] in memo/adapters/hf_packed.py); None for any other attention."""
    if _attn_implementation(layer) != PACKED_ATTENTION:
        return None
    if DOCUMENT_OFFSETS in given:
        return given[DOCUMENT_OFFSETS]
    positions = given.get("position_ids")
    return document_offsets(positions, b) if isinstance(positions, torch.Tensor) else None


def _scale(layer: nn.Module) -> float:
    attn = layer.self_attn
    scale = getattr(attn, "scaling", None)
    return float(scale) if scale is not None else 1.0 / math.sqrt(attn.head_dim)


def _rotary(layer: nn.Module, hidden: torch.Tensor, given: Sequence[torch.Tensor] | None,
            position_ids: torch.Tensor | None, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's rotary ``(cos, sin)``: what the model passed, else (the attention owns its rotary
    embedding, as Mistral and Qwen2 in 4.4x) what the attention would compute from ``position_ids``,
    in the dtype its value projection has (the autocast dtype under autocast)."""
    if isinstance(given, (tuple, list)) and len(given) == 2:
        return given[0], given[1]
    rotary_emb = getattr(layer.self_attn, "rotary_emb", None)
    if given is None and rotary_emb is not None and isinstance(position_ids, torch.Tensor):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        with torch.no_grad():
            cos, sin = rotary_emb(torch.empty(0, dtype=dtype, device=hidden.device), position_ids)
        return cos, sin
    raise MemoError(f"{where}: memo needs the rotary position_embeddings=(cos, sin) that the model passes to "
                    "its layers, or position_ids for the attention's own rotary embedding; got neither")


class HFDecoderLayerAdapter(LayerAdapter[_Ctx]):
    """``LlamaDecoderLayer`` / ``Qwen2DecoderLayer`` / ``MistralDecoderLayer`` -> pre / core / post
    (NOTE [HF decoder layer anatomy], NOTE [HF attention masks])."""

    name = "hf"
    batch_first = True  # HF layers run [b, s, h]: their dropouts draw masks in that order

    def __init__(self) -> None:
        self._verdicts = _MaskVerdicts()

    def check(self, layer: nn.Module) -> None:
        where = f"memo.adapters.hf: {type(layer).__name__}"
        problems = _not_exact(layer)
        attn = getattr(layer, "self_attn", None)
        missing = [name for name in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
                   if getattr(layer, name, None) is None]
        missing += [f"self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")
                    if attn is not None and getattr(attn, name, None) is None]
        if missing:
            problems.append(f"it has no {', '.join(missing)}")
        elif getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
            problems.append("its attention normalises q/k (a Qwen3/OLMo-style layer; no memo adapter for it)")
        if _rotary_fn(type(layer)) is None:
            problems.append("its module has no apply_rotary_pos_emb")
        if attn is not None:
            impl = _attn_implementation(layer)
            if impl not in SUPPORTED_ATTENTION:
                problems.append(f"its attention implementation is {impl!r}; memo reproduces 'eager' and "
                                "'sdpa' (load the model with attn_implementation='sdpa')")
            dropout = float(getattr(attn, "attention_dropout", 0.0) or 0.0)
            if dropout > 0:
                problems.append(f"attention_dropout={dropout}; memo's attention has no dropout (set "
                                "config.attention_dropout = 0)")
        problems += _gradient_checkpointing(layer)
        if problems:
            raise MemoError(f"{where}: memo cannot split this layer into pre/core/post because "
                            + "; ".join(problems))

    def split_args(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
            torch.Tensor, _Ctx]:
        cls = type(layer)
        where = f"memo.adapters.hf: {cls.__name__}"
        try:
            bound = _signature(cls).bind(layer, *args, **kwargs)
        except TypeError as e:
            raise MemoError(f"{where}: unexpected arguments: {e}") from None
        given = dict(bound.arguments)
        for name, p in _signature(cls).parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                given.update(given.pop(name, {}))
        problems = _gradient_checkpointing(layer) + _not_exact(layer)
        for name, value in given.items():
            if name in _TAKEN or name in _IGNORED:
                continue
            if name in _CACHE:
                if value is not None and not _cache_turned_off(value):
                    problems.append(f"a KV cache ({name}={type(value).__name__}) that holds tokens already; "
                                    "memo trains without one (pass use_cache=False)")
            elif name == "use_cache" and value and _cache_turned_off(None):
                continue
            elif name in _REFUSED_IF_SET:
                if isinstance(value, torch.Tensor) or value:
                    problems.append(_REFUSED_IF_SET[name])
            elif value is not None and value is not False:
                problems.append(f"argument {name!r}, which memo does not know how to honour")
        if problems:
            raise MemoError(f"{where}: cannot run under memo's token-wise recompute: " + "; ".join(problems))

        hidden = given.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise MemoError(f"{where}: hidden_states must be a [b, s, h] tensor, got {got}")
        b, s, _ = hidden.shape
        cos, sin = _rotary(layer, hidden, given.get("position_embeddings"), given.get("position_ids"), where)
        if cos.dim() != 3 or cos.shape[1] != s or cos.shape[0] not in (1, b):
            raise MemoError(f"{where}: position_embeddings must be [B, {s}, head_dim] with B in (1, {b}); "
                            f"got {tuple(cos.shape)}")
        attn = layer.self_attn
        # Heads from the module or its config: q_proj may be a wrapper (LoRA) without out_features.
        n = getattr(attn, "num_heads", None) or attn.config.num_attention_heads
        mask = given.get("attention_mask")
        shard = getattr(attn, "memo_sequence_shard", None)
        if mask is not None and shard is not None:  # NOTE [Ulysses around HF's attention]
            raise MemoError(f"{where}: a rank of a Ulysses group got an attention mask; its tokens are a "
                            "slice of the sequence, which a mask cannot be cut by. Train on whole sequences "
                            "without attention_mask (mark padding with label -100)")
        if mask is not None:
            cut = _layer_mask(mask, s, b, n, where)
            mask = None if self._verdicts.plain_causal(mask, cut) else cut
        offsets = _document_offsets(layer, given, b) if mask is None else None
        window = _sliding_window(layer)
        longest = s * (1 if shard is None else shard.size) if offsets is None else longest_document(offsets)
        if mask is None and window is not None and longest > window:
            raise MemoError(
                f"{where}: sliding_window={window} is shorter than the sequence ({longest} tokens"
                f"{' in its longest document' if offsets else ''}) but the layer "
                "got no attention mask that applies it; memo's causal attention would see every earlier "
                "token. Call the model (with attn_implementation 'eager' or 'sdpa' its mask carries the "
                f"window), or use sequences of at most {window} tokens")
        ctx = _Ctx(cos=cos, sin=sin, mask=mask, scale=_scale(layer), as_tuple=_returns_tuple(cls),
                   offsets=offsets)
        return hidden.transpose(0, 1), ctx

    # The submodules run in the layer's own layout, [b, t, h] (NOTE [HF layout]): a hook on
    # layer.mlp sees what it sees unwrapped (a range of tokens of it), and dropout draws in that order.
    def pre(self, layer: nn.Module, x: torch.Tensor, offset: int, ctx: _Ctx) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = layer.self_attn
        t, b, _ = x.shape
        d = attn.head_dim
        h = layer.input_layernorm(x.transpose(0, 1))
        q = attn.q_proj(h).view(b, t, -1, d)
        k = attn.k_proj(h).view(b, t, -1, d)
        v = attn.v_proj(h).view(b, t, -1, d)
        cos, sin = ctx.cos[:, offset:offset + t], ctx.sin[:, offset:offset + t]  # [B, t, d]
        q, k = _rotary_fn(type(layer))(q, k, cos, sin, unsqueeze_dim=2)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def post(self, layer: nn.Module, o: torch.Tensor, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        h = x.transpose(0, 1) + layer.self_attn.o_proj(o.transpose(0, 1))
        return (h + layer.mlp(layer.post_attention_layernorm(h))).transpose(0, 1)

    def core_forward(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     ctx: _Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        device = q.device.type
        if torch.is_autocast_enabled(device):
            ctx.attn_dtype = torch.get_autocast_dtype(device)
        else:
            ctx.attn_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        dt = ctx.attn_dtype
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        s, b, n, d = q.shape
        if ctx.offsets is not None:
            o, lse = document_attention_forward(q, k, v, ctx.offsets, ctx.scale)
        elif ctx.mask is None:
            forward, _ = _causal_kernels(layer)
            o, lse = forward(_rescale(q, ctx.scale), k, v)
        else:
            o, lse = masked_attention_forward(q, k, v, ctx.mask, ctx.scale)
        return o.view(s, b, n * d), lse

    def core_backward(self, layer: nn.Module, grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, ctx: _Ctx) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        dt = ctx.attn_dtype
        s, b, n, d = q.shape
        qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
        grad_o = grad_o.reshape(s, b, n, d).to(dt)
        if ctx.offsets is not None:
            dq, dk, dv = document_attention_backward(grad_o, qc, kc, vc, o.view(s, b, n, d), lse, ctx.offsets,
                                                     ctx.scale)
        elif ctx.mask is None:
            _, attention_backward = _causal_kernels(layer)
            factor = _factor(ctx.scale, d)
            dq, dk, dv = attention_backward(grad_o, _rescale(qc, ctx.scale), kc, vc, o.view(s, b, n, d), lse)
            if factor != 1.0:
                dq = dq * factor
        else:
            dq, dk, dv = masked_attention_backward(grad_o, qc, kc, vc, o.view(s, b, n, d), lse, ctx.mask,
                                                   ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def pack_output(self, layer: nn.Module, y: torch.Tensor, ctx: _Ctx) -> Any:
        out = y.transpose(0, 1)
        return (out,) if ctx.as_tuple else out

    def mlp_site(self, layer: nn.Module) -> MLPSite | None:
        """``layer.mlp``: the gate/up/down MLP after ``post_attention_layernorm``, on ``[b, s, h]``."""
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            return None
        return MLPSite(mlp, "forward", 1, tuple(mlp.parameters()))


def _factor(scale: float, d: int) -> float:
    """memo's causal kernels scale by ``1/sqrt(d)``; q is multiplied by this to get HF's ``scale``."""
    factor = scale * math.sqrt(d)
    return 1.0 if abs(factor - 1.0) < 1e-12 else factor


def _rescale(q: torch.Tensor, scale: float) -> torch.Tensor:
    factor = _factor(scale, q.shape[-1])
    return q if factor == 1.0 else q * factor


_CHECKPOINTING_OFF = ("turn it off with model.activation_checkpointing_disable(), or "
                      "gradient_checkpointing_disable() in older transformers; memo does the recomputation "
                      "itself, token-wise")


def _gradient_checkpointing(module: nn.Module) -> list[str]:
    if getattr(module, "gradient_checkpointing", False):
        return [f"HF gradient checkpointing is on ({_CHECKPOINTING_OFF})"]
    return []
