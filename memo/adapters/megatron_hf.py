"""Hugging Face Llama-family checkpoints in memo's megatron-core ``GPTModel``, and back.

NOTE [Hugging Face weights in megatron's layout]
A Llama-family causal LM (``llama``, ``mistral`` without a sliding window, ``qwen3``: RMSNorm, SwiGLU, no
biases, grouped-query attention, rotary embeddings; Qwen3's RMSNorm of every query and key head is
megatron's q/k layernorm) is the GPTModel memo builds from its ModelConfig (memo/engines.py, local spec),
tensor for tensor:

- ``linear_qkv``: one block per query group ``g``, the group's query heads, then its key head, then its
  value head: rows ``[q_proj[g]; k_proj[g]; v_proj[g]]``. Column parallel: TP rank ``r`` holds the
  groups ``r·G/t .. (r+1)·G/t``, so the full tensor is the ranks' shards one after the other.
- ``linear_fc1``: SwiGLU's gate and up projections, each split over TP; rank ``r`` holds
  ``[gate_proj[r]; up_proj[r]]`` (megatron's ``glu`` takes the first half of its output as the gate).
- ``linear_proj`` (``o_proj``) and ``linear_fc2`` (``down_proj``): row parallel, split by column.
- the word embedding and the output layer: rows of the vocabulary padded to a multiple of 128 (the same
  for every layout, memo/distributed/layout.py ``padded_vocab_size``), split over TP. The padded rows are
  zero and their logits are set to -inf before the loss (:class:`PaddedVocabMask`), so the softmax is
  over the checkpoint's vocabulary as in Hugging Face's model, and the padded rows get no gradient.
  ``tie_word_embeddings`` is megatron's ``share_embeddings_and_output_weights``.
- the norms (``input_layernorm``, ``pre_mlp_layernorm``, ``q/k_layernorm``, ``final_layernorm``) are
  whole on every rank.
- rotary: the inverse frequencies are those transformers computes for the config's rope parameters
  (``rope_theta``, ``linear`` and ``llama3`` scaling), written into megatron's ``RotaryEmbedding``;
  megatron rotates halves as Llama's ``rotate_half`` does, so no permutation of q/k rows is needed.
  Types that scale the attention (yarn, longrope) or change with the length (dynamic) are refused.

A rank reads only its shards (``safetensors.safe_open`` slices), never the whole model. Export inverts it
all: the ranks' shards gathered over the TP group, the padded rows cut, the tensors under Hugging Face's
names (memo/train/export.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.errors import MemoError, internal_assert
from memo.jsonio import read_json
from memo.models import ModelConfig, hf_shapes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["CONVERTED_TYPES", "PaddedVocabMask", "gather_full_state", "hf_config_of", "hf_state_dict",
           "load_hf_weights", "megatron_shapes", "rope_inv_freq"]

#: The Hugging Face model types converted (Qwen3's q/k norms: memo.models.hf_shapes).
CONVERTED_TYPES = ("llama", "mistral", "qwen3")
#: Rope types whose frequencies megatron's rotary embedding takes as they are (no attention scaling, no
#: change with the sequence length).
_ROPE_TYPES = ("default", "linear", "llama3")


def megatron_shapes(hf: PretrainedConfig, where: str) -> ModelConfig:
    """memo's ModelConfig (``arch="llama"``) of a Hugging Face config the converter takes (NOTE [Hugging
    Face weights in megatron's layout]); anything else is a one-line MemoError naming what differs."""
    kind = hf.model_type
    if kind not in CONVERTED_TYPES:
        raise MemoError(f"{where}: --engine megatron converts {', '.join(CONVERTED_TYPES)} checkpoints, not "
                        f"model_type {kind!r}; use --engine memo or fsdp2 for it")
    differs = [f"{name} = {value!r}" for name, value, ok in (
        ("hidden_act", getattr(hf, "hidden_act", "silu"), getattr(hf, "hidden_act", "silu") == "silu"),
        ("attention_bias", getattr(hf, "attention_bias", False), not getattr(hf, "attention_bias", False)),
        ("mlp_bias", getattr(hf, "mlp_bias", False), not getattr(hf, "mlp_bias", False)),
        ("sliding_window", getattr(hf, "sliding_window", None), getattr(hf, "sliding_window", None) is None),
        ("pretraining_tp", getattr(hf, "pretraining_tp", 1), getattr(hf, "pretraining_tp", 1) in (None, 1)),
    ) if not ok]
    if differs:
        raise MemoError(f"{where}: its config has {', '.join(differs)}; memo's megatron GPTModel is a Llama "
                        "(SiLU gate, no biases, full attention): use --engine memo or fsdp2 for it")
    rope_inv_freq(hf, where)  # a rope type megatron cannot run is refused before anything is built
    # the shapes every engine reads of an HF config, and the rotary base megatron's GPTModel is built with
    return dataclasses.replace(hf_shapes(hf), rope_theta=float(_rope(hf)["rope_theta"]))


def _rope(hf: PretrainedConfig) -> dict[str, Any]:
    params = getattr(hf, "rope_parameters", None) or {}
    return {"rope_type": "default", "rope_theta": getattr(hf, "rope_theta", 10000.0), **params}


def rope_inv_freq(hf: PretrainedConfig, where: str) -> torch.Tensor:
    """The rotary inverse frequencies (float32, ``[head_dim / 2]``) transformers uses for ``hf``'s rope
    parameters; a type megatron's rotary embedding cannot run is a MemoError."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise MemoError(f"{where}: rope_type {kind!r} scales the attention or changes with the length, "
                        "which megatron's rotary embedding does not; --engine megatron takes "
                        f"{', '.join(_ROPE_TYPES)}")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if kind == "default":
        theta = float(params["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
        if scaling != 1.0:
            raise MemoError(f"{where}: rope_type {kind!r} scales the attention by {scaling}, which "
                            "megatron's rotary embedding does not")
    if inv_freq.numel() != head_dim // 2:
        raise MemoError(f"{where}: its rope rotates {2 * inv_freq.numel()} of {head_dim} channels per head "
                        "(partial_rotary_factor); memo's megatron GPTModel rotates them all")
    return inv_freq.float()


class PaddedVocabMask:
    """A forward hook of megatron's output layer: the logits of the padded vocabulary rows (global index
    ``>= vocab_size``) are -inf, in place (NOTE [Hugging Face weights in megatron's layout])."""

    def __init__(self, vocab_size: int, padded: int, tp_rank: int, tp_size: int) -> None:
        self.vocab_size, self.padded, self.tp_rank, self.tp_size = vocab_size, padded, tp_rank, tp_size

    def __call__(self, module: nn.Module, args: object, output: tuple[torch.Tensor, object]) -> None:
        logits = output[0]
        width = logits.shape[-1]
        first = 0 if width == self.padded else self.tp_rank * width  # gathered, or this rank's columns
        start = max(self.vocab_size - first, 0)
        if start < width:
            logits[..., start:].fill_(float("-inf"))


# ----------------------------------------------------------------------------- reading a checkpoint


class _Weights:
    """The tensors of a safetensors checkpoint (one file or shards), read a slice at a time."""

    def __init__(self, path: str, stack: ExitStack, where: str) -> None:
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            fields = read_json(index, where, "give the index save_pretrained wrote")
            shards = fields.get("weight_map") if isinstance(fields, dict) else None
            if not isinstance(shards, dict) or not all(isinstance(f, str) for f in shards.values()):
                raise MemoError(f"{where}: {index} has no weight_map of tensor names to files; give the "
                                "index save_pretrained wrote")
            files = {name: os.path.join(path, file) for name, file in shards.items()}
        else:
            one = os.path.join(path, "model.safetensors")
            with safe_open(one, framework="pt") as f:
                files = dict.fromkeys(f.keys(), one)
        handles = {file: stack.enter_context(safe_open(file, framework="pt")) for file in set(files.values())}
        self.handles = {name: handles[file] for name, file in files.items()}
        self.used: set[str] = set()
        self.where = where

    def slice(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None,
              cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[a, b)`` or columns of tensor ``name``, whose full shape must be ``shape``."""
        if name not in self.handles:
            raise MemoError(f"{self.where}: its weights lack {name}; give a complete checkpoint of this "
                            "config")
        part = self.handles[name].get_slice(name)
        found = tuple(part.get_shape())
        if found != shape:
            raise MemoError(f"{self.where}: {name} has shape {list(found)}, its config.json says "
                            f"{list(shape)}")
        self.used.add(name)
        if rows is not None:
            return part[rows[0]:rows[1]]
        if cols is not None:
            return part[:, cols[0]:cols[1]]
        return part[:]

    def unused(self) -> list[str]:
        return sorted(n for n in set(self.handles) - self.used if not n.endswith("rotary_emb.inv_freq"))


def _sizes(c: ModelConfig) -> tuple[int, int, int, int, int]:
    """hidden, head_dim, heads, query groups, MLP width (ModelConfig fills in the ones left None)."""
    internal_assert(None not in (c.head_dim, c.n_kv_heads, c.ffn_hidden), f"memo: unfilled ModelConfig {c}")
    return c.hidden, int(c.head_dim or 0), c.n_heads, int(c.n_kv_heads or 0), int(c.ffn_hidden or 0)


def _split(n: int, rank: int, size: int) -> tuple[int, int]:
    return rank * n // size, (rank + 1) * n // size


def _local_tensors(c: ModelConfig, tied: bool, padded: int, w: _Weights, rank: int, tp: int
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, this TP rank's tensor) of every weight (NOTE [Hugging Face weights in megatron's
    layout])."""
    h, d, heads, groups, ffn = _sizes(c)
    per = heads // groups
    yield "embedding.word_embeddings.weight", _vocab_rows(w, "model.embed_tokens.weight", c, padded, rank, tp)
    g0, g1 = _split(groups, rank, tp)
    f0, f1 = _split(ffn, rank, tp)
    for i in range(c.n_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = w.slice(hf + "self_attn.q_proj.weight", (heads * d, h), rows=(g0 * per * d, g1 * per * d))
        k = w.slice(hf + "self_attn.k_proj.weight", (groups * d, h), rows=(g0 * d, g1 * d))
        v = w.slice(hf + "self_attn.v_proj.weight", (groups * d, h), rows=(g0 * d, g1 * d))
        n = g1 - g0
        yield mg + "self_attention.linear_qkv.weight", torch.cat(
            [q.reshape(n, per * d, h), k.reshape(n, d, h), v.reshape(n, d, h)], dim=1).reshape(-1, h)
        a0, a1 = _split(heads * d, rank, tp)
        o = w.slice(hf + "self_attn.o_proj.weight", (h, heads * d), cols=(a0, a1))
        yield mg + "self_attention.linear_proj.weight", o
        if c.qk_norm:
            yield mg + "self_attention.q_layernorm.weight", w.slice(hf + "self_attn.q_norm.weight", (d,))
            yield mg + "self_attention.k_layernorm.weight", w.slice(hf + "self_attn.k_norm.weight", (d,))
        yield mg + "input_layernorm.weight", w.slice(hf + "input_layernorm.weight", (h,))
        yield mg + "pre_mlp_layernorm.weight", w.slice(hf + "post_attention_layernorm.weight", (h,))
        yield mg + "mlp.linear_fc1.weight", torch.cat(
            [w.slice(hf + f"mlp.{p}_proj.weight", (ffn, h), rows=(f0, f1)) for p in ("gate", "up")])
        yield mg + "mlp.linear_fc2.weight", w.slice(hf + "mlp.down_proj.weight", (h, ffn), cols=(f0, f1))
    yield "decoder.final_layernorm.weight", w.slice("model.norm.weight", (h,))
    if not tied:
        yield "output_layer.weight", _vocab_rows(w, "lm_head.weight", c, padded, rank, tp)


def _vocab_rows(w: _Weights, name: str, c: ModelConfig, padded: int, rank: int, tp: int) -> torch.Tensor:
    """This rank's rows of the padded vocabulary: the checkpoint's where it has them, zero after."""
    r0, r1 = _split(padded, rank, tp)
    real = w.slice(name, (c.vocab_size, c.hidden), rows=(min(r0, c.vocab_size), min(r1, c.vocab_size)))
    return torch.cat([real, real.new_zeros(r1 - r0 - real.shape[0], c.hidden)])


def load_hf_weights(model: nn.Module, path: str, hf: PretrainedConfig, config: ModelConfig, where: str
                    ) -> None:
    """Fill this rank's megatron ``model`` (built from ``config`` = :func:`megatron_shapes` of ``hf``) with
    its shards of the checkpoint at ``path``, and its rotary embedding with ``hf``'s frequencies."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tied = bool(model.share_embeddings_and_output_weights)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    with ExitStack() as stack, torch.no_grad():
        weights = _Weights(path, stack, where)
        if tied and "lm_head.weight" in weights.handles:
            weights.used.add("lm_head.weight")  # save_pretrained may write the tied head too
        for name, tensor in _local_tensors(config, tied, int(model.vocab_size), weights, rank, tp):
            mine = state.pop(name, None)
            if mine is None or mine.shape != tensor.shape:
                raise MemoError(f"{where}: the converter made {name} {list(tensor.shape)}, the megatron "
                                f"model has {None if mine is None else list(mine.shape)}: a layout memo "
                                "cannot map")
            mine.copy_(tensor)
        unused = weights.unused()
    if unused or state:
        what = f"tensors memo's megatron model has no place for ({', '.join(unused[:3])}" if unused else \
            f"no tensor for megatron's {', '.join(sorted(state)[:3])}"
        raise MemoError(f"{where}: its weights hold {what}{', ...' if len(unused or state) > 3 else ''}); "
                        "use --engine memo or fsdp2 for this model")
    model.rotary_pos_emb.inv_freq = rope_inv_freq(hf, where).to(model.rotary_pos_emb.inv_freq.device)


# ----------------------------------------------------------------------------- export


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of the megatron ``model`` whole, in host memory, on the first rank of its TP group
    (a collective over that group; the other ranks get an empty dict): the ranks' shards of a
    column-parallel tensor one after the other, of a row-parallel one side by side (``linear_fc1``'s
    stay per rank, as :func:`hf_state_dict` splits them)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    first = parallel_state.get_tensor_model_parallel_rank() == 0
    params = dict(model.named_parameters())
    full: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not isinstance(tensor, torch.Tensor):
            continue  # _extra_state
        param = params.get(name)
        dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
        if tp == 1 or dim < 0:
            if first:
                full[name] = tensor.detach().to("cpu", copy=True)
            continue
        parts = [torch.empty_like(tensor) for _ in range(tp)] if first else None
        torch.distributed.gather(tensor.detach().contiguous(), parts,
                                 dst=torch.distributed.get_global_rank(group, 0), group=group)
        if parts is not None:
            full[name] = torch.stack([p.cpu() for p in parts]) if name.endswith("linear_fc1.weight") \
                else torch.cat([p.cpu() for p in parts], dim=dim)
    return full


def hf_state_dict(full: dict[str, torch.Tensor], c: ModelConfig, tied: bool) -> dict[str, torch.Tensor]:
    """Hugging Face's tensors of a megatron model's :func:`gather_full_state` (the inverse of the
    loading, NOTE [Hugging Face weights in megatron's layout])."""
    h, d, heads, groups, ffn = _sizes(c)
    per = heads // groups
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:c.vocab_size],
           "model.norm.weight": full["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if tied else \
        full["output_layer.weight"][:c.vocab_size]
    for i in range(c.n_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = full[mg + "self_attention.linear_qkv.weight"].reshape(groups, (per + 2) * d, h)
        q, k, v = qkv.split([per * d, d, d], dim=1)
        out[hf + "self_attn.q_proj.weight"] = q.reshape(-1, h)
        out[hf + "self_attn.k_proj.weight"] = k.reshape(-1, h)
        out[hf + "self_attn.v_proj.weight"] = v.reshape(-1, h)
        out[hf + "self_attn.o_proj.weight"] = full[mg + "self_attention.linear_proj.weight"]
        if c.qk_norm:
            out[hf + "self_attn.q_norm.weight"] = full[mg + "self_attention.q_layernorm.weight"]
            out[hf + "self_attn.k_norm.weight"] = full[mg + "self_attention.k_layernorm.weight"]
        out[hf + "input_layernorm.weight"] = full[mg + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = full[mg + "pre_mlp_layernorm.weight"]
        fc1 = full[mg + "mlp.linear_fc1.weight"]
        shards = fc1 if fc1.dim() == 3 else fc1[None]  # [tp, 2·ffn/tp, h]: each rank's gate, then up
        gate, up = shards.chunk(2, dim=1)
        out[hf + "mlp.gate_proj.weight"] = gate.reshape(ffn, h)
        out[hf + "mlp.up_proj.weight"] = up.reshape(ffn, h)
        out[hf + "mlp.down_proj.weight"] = full[mg + "mlp.linear_fc2.weight"]
    return {name: t.contiguous() for name, t in out.items()}


def hf_config_of(c: ModelConfig, tied: bool, dtype: torch.dtype) -> PretrainedConfig:
    """A transformers config of memo's llama-arch ``c`` (Qwen3's with ``qk_norm``), for the export of a
    megatron model not loaded from a checkpoint."""
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if c.qk_norm else LlamaConfig
    h, d, heads, groups, ffn = _sizes(c)
    return cls(vocab_size=c.vocab_size, hidden_size=h, intermediate_size=ffn, num_hidden_layers=c.n_layers,
               num_attention_heads=heads, num_key_value_heads=groups, head_dim=d, rms_norm_eps=c.norm_eps,
               tie_word_embeddings=tied, dtype=dtype,
               rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta or 10000.0)})
