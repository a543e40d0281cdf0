"""Reference GPT and Llama models (Megatron-style, sequence-first) and ``build_model``.

Structure that memo's profiler and runtime rely on (names are part of the interface):

- ``model.embedding``: ids ``[b, s]`` (int64) -> hidden ``[s, b, h]``.
- ``model.layers``: ``nn.ModuleList`` of layers with the pre / core / post anatomy
  (NOTE [Layer anatomy] in :mod:`memo.models.layers`).
- ``model.head``: ``(x [s, b, h], labels [b, s]) -> scalar loss``: final norm, LM head and
  cross-entropy, chunked over tokens (:func:`memo.models.loss.chunked_lm_loss`).
- ``model.forward(ids, labels)``: embedding -> layers -> head, as plain loops so that
  :class:`memo.phases.PhaseTracker` hooks on those three parts see every phase.
- ``model.recompute``: ``"none"`` or ``"full"`` (each layer under non-reentrant
  ``torch.utils.checkpoint``).
- ``model.tensor_parallel``: t. With t > 1 the model is one rank of a t-way Megatron
  tensor + sequence parallel group, for profiling its sizes (NOTE [Tensor-parallel rank]
  in :mod:`memo.models.parallel`): it takes the whole ``ids, labels: [b, s]``, its
  embedding hands the layers ``[s/t, b, h]``, and its parameters are the rank's shards.

NOTE [GPT position table]
GPT learns absolute position embeddings, one row per position, so the table bounds
the sequence length. It is sized at build time by ``max_seq_len`` (default
:data:`DEFAULT_MAX_SEQ_LEN` = 4096): a 1M-token table for h = 4096 is 4.3 G parameters,
which nobody should get by accident. Longer sequences need
``build_model(..., max_seq_len=N)``; on the meta device that costs nothing, so profiling
gpt-7b at 1M tokens is ``build_model("gpt-7b", device="meta", max_seq_len=2**20)``.
A sequence longer than the table raises a MemoError saying so. Llama has no table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint
from torch import nn

from memo.errors import MemoError
from memo.models.config import ModelConfig, get_config
from memo.models.layers import GPTLayer, LlamaLayer, output_projection_std
from memo.models.loss import IGNORE_INDEX, chunked_lm_loss
from memo.models.norms import RMSNorm
from memo.models.parallel import (
    check_sequence_parallel,
    check_tensor_parallel,
    rank_shapes,
    scatter_to_sequence_parallel,
    vocab_parallel_embedding,
    vocab_parallel_labels,
)

if TYPE_CHECKING:
    from memo.models.ulysses_attention import SequenceShard

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "RECOMPUTE_MODES",
    "GPTEmbedding",
    "GPTModel",
    "LMHead",
    "LlamaEmbedding",
    "LlamaModel",
    "TransformerModel",
    "build_model",
    "num_parameters",
]

#: Default GPT position-table size (NOTE [GPT position table]).
DEFAULT_MAX_SEQ_LEN = 4096

#: Values of ``model.recompute``.
RECOMPUTE_MODES = ("none", "full")

_INIT_STD = 0.02


def _check_ids(ids: torch.Tensor, labels: torch.Tensor | None = None) -> None:
    if ids.dim() != 2 or ids.dtype != torch.long:
        raise MemoError(
            f"memo.models: input ids must be an int64 tensor [b, s]; got dtype {ids.dtype}, "
            f"shape {tuple(ids.shape)}"
        )
    if labels is not None and labels.shape != ids.shape:
        raise MemoError(
            f"memo.models: labels must have the shape of the ids [b, s] = {tuple(ids.shape)}; "
            f"got {tuple(labels.shape)}"
        )
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        raise MemoError(
            f"memo.models: the ids [b, s] = {tuple(ids.shape)} hold no token; a batch needs at least "
            "one sequence of at least one token"
        )


class LlamaEmbedding(nn.Module):
    """Word embedding only (positions enter through rotary): ids ``[b, s]`` -> ``[s, b, h]``.

    ``tensor_parallel=t``: one rank's vocab-parallel embedding (``ceil(V/t)`` rows), its output
    reduce-scattered to ``[s/t, b, h]`` (NOTE [Tensor-parallel rank]).
    """

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, tensor_parallel: int = 1) -> None:
        super().__init__()
        self.tensor_parallel = check_tensor_parallel(tensor_parallel)
        rows = rank_shapes(config, tensor_parallel).vocab_rows
        self.word = _embedding(rows, config.hidden, device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids)
        t = self.tensor_parallel
        check_sequence_parallel(ids.shape[1], t)
        # Index with the transposed ids so the result is sequence-first without a copy of h-wide rows.
        return scatter_to_sequence_parallel(vocab_parallel_embedding(self.word, ids.t(), t), t)


def _embedding(rows: int, hidden: int, device: torch.device | str | None,
               dtype: torch.dtype | None) -> nn.Embedding:
    """``nn.Embedding(rows, hidden)``, its initial draw skipped on meta: ``normal_`` of a meta tensor runs
    torch's Python reference, whose first call imports torch._dynamo (seconds of CPU at the start of a
    ``memo train`` that sizes its model on meta), and a meta weight has no values to draw. Elsewhere the
    draw stays, so a seed gives the weights it always gave."""
    if device is not None and torch.device(device).type == "meta":
        return nn.Embedding(rows, hidden, _weight=torch.empty(rows, hidden, device="meta", dtype=dtype))
    return nn.Embedding(rows, hidden, device=device, dtype=dtype)


class GPTEmbedding(nn.Module):
    """Word + learned absolute position embeddings: ids ``[b, s]`` -> ``[s, b, h]``.

    The position table has ``max_seq_len`` rows (NOTE [GPT position table]).
    ``tensor_parallel=t``: one rank's vocab-parallel word embedding (``ceil(V/t)`` rows) plus the
    replicated position table, the sum scattered to ``[s/t, b, h]`` (NOTE [Tensor-parallel rank]).
    """

    def __init__(
        self,
        config: ModelConfig,
        max_seq_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tensor_parallel: int = 1,
    ) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tensor_parallel = check_tensor_parallel(tensor_parallel)
        rows = rank_shapes(config, tensor_parallel).vocab_rows
        self.word = _embedding(rows, config.hidden, device, dtype)
        self.position = _embedding(max_seq_len, config.hidden, device, dtype)

    #: This rank's share of a sequence split over Ulysses ranks (NOTE [Contiguous Ulysses] in
    #: memo/models/ulysses_attention.py): its ids are positions ``first_position(s) ..``; None: from 0.
    sequence_shard: SequenceShard | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids)
        s = ids.shape[1]
        whole = s if self.sequence_shard is None else s * self.sequence_shard.size
        if whole > self.max_seq_len:
            raise MemoError(
                f"memo.models: sequence of {whole} tokens is longer than the GPT position table "
                f"(max_seq_len={self.max_seq_len}); build the model with "
                f"build_model(..., max_seq_len={whole}) or more"
            )
        t = self.tensor_parallel
        check_sequence_parallel(s, t)
        words = vocab_parallel_embedding(self.word, ids.t(), t)
        first = 0 if self.sequence_shard is None else self.sequence_shard.first_position(s)
        return scatter_to_sequence_parallel(words + self.position.weight[first:first + s].unsqueeze(1), t)


class LMHead(nn.Module):
    """Final norm + LM head + mean cross-entropy: ``(x [s, b, h], labels [b, s]) -> loss``.

    Args:
        norm: the final norm module.
        weight: ``[V, h]`` output weight; pass the word embedding's weight to tie them.
        chunk_tokens: tokens per loss chunk; ``None`` picks :func:`memo.models.loss.default_chunk_tokens`.
        sequence_gather: t > 1 for one rank of a tensor + sequence parallel group: ``x`` is the
            rank's ``[s/t, b, h]``, ``weight`` its ``[V/t, h]`` vocabulary slice and ``labels`` the
            whole ``[b, s]`` (NOTE [Tensor-parallel rank]).
    """

    def __init__(
        self, norm: nn.Module, weight: nn.Parameter, chunk_tokens: int | None = None, sequence_gather: int = 1
    ) -> None:
        super().__init__()
        self.norm = norm
        self.weight = weight
        self.chunk_tokens = chunk_tokens
        self.sequence_gather = check_tensor_parallel(sequence_gather)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = self.sequence_gather
        labels = vocab_parallel_labels(labels, self.weight.shape[0], t, IGNORE_INDEX)
        if t > 1:  # a sequence-parallel rank norms its own tokens first (NOTE [The final norm in the
            # loss's chunks] in memo/models/loss.py)
            return chunked_lm_loss(self.norm(x), self.weight, labels, self.chunk_tokens, sequence_gather=t)
        return chunked_lm_loss(x, self.weight, labels, self.chunk_tokens, norm=self.norm)


class TransformerModel(nn.Module):
    """embedding -> layers -> head. Subclasses build the three parts."""

    embedding: nn.Module
    layers: nn.ModuleList
    head: LMHead

    def __init__(self, config: ModelConfig, recompute: str = "none", tensor_parallel: int = 1) -> None:
        super().__init__()
        self.config = config
        self.recompute = recompute
        #: t: this model is one rank of a t-way tensor + sequence parallel group (1: the whole model).
        self.tensor_parallel = check_tensor_parallel(tensor_parallel)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``ids, labels: [b, s]`` (int64; labels already shifted by the caller) -> mean loss.

        With ``tensor_parallel=t`` the ids and labels are still the whole ``[b, s]``; the layers
        see ``[s/t, b, h]`` (NOTE [Tensor-parallel rank]).
        """
        if self.recompute not in RECOMPUTE_MODES:
            raise MemoError(
                f"memo.models: model.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}"
            )
        _check_ids(ids, labels)
        x = self.embedding(ids)
        full = self.recompute == "full" and torch.is_grad_enabled()
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if full else layer(x)
        return self.head(x, labels)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron's init: N(0, 0.02) weights, residual-stream outputs scaled by 1/sqrt(2n), zero biases."""
        out_std = output_projection_std(self.config)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = out_std if name.rsplit(".", 1)[-1] in ("proj", "fc2", "down") else _INIT_STD
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, _INIT_STD)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm, RMSNorm)):
                module.reset_parameters()
        if not self.config.tied_embeddings:
            self.head.weight.normal_(0.0, _INIT_STD)


class GPTModel(TransformerModel):
    """Megatron reference GPT: learned positions, LayerNorm, GELU, LM head tied to the word embedding."""

    def __init__(self, config: ModelConfig, *, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                 recompute: str = "none", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, tensor_parallel: int = 1) -> None:
        super().__init__(config, recompute, tensor_parallel)
        t = self.tensor_parallel
        self.embedding = GPTEmbedding(config, max_seq_len, device=device, dtype=dtype, tensor_parallel=t)
        self.layers = nn.ModuleList(
            GPTLayer(config, device=device, dtype=dtype, tensor_parallel=t) for _ in range(config.n_layers)
        )
        norm = nn.LayerNorm(config.hidden, eps=config.norm_eps, device=device, dtype=dtype)
        self.head = LMHead(norm, self.embedding.word.weight, sequence_gather=t)


class LlamaModel(TransformerModel):
    """Llama: RMSNorm (memo's, NOTE [Lean RMSNorm]), rotary, grouped-query attention, SwiGLU, untied
    LM head."""

    def __init__(self, config: ModelConfig, *, recompute: str = "none",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 tensor_parallel: int = 1) -> None:
        super().__init__(config, recompute, tensor_parallel)
        t = self.tensor_parallel
        self.embedding = LlamaEmbedding(config, device=device, dtype=dtype, tensor_parallel=t)
        self.layers = nn.ModuleList(
            LlamaLayer(config, device=device, dtype=dtype, tensor_parallel=t) for _ in range(config.n_layers)
        )
        norm = RMSNorm(config.hidden, eps=config.norm_eps, device=device, dtype=dtype)
        rows = rank_shapes(config, t).vocab_rows
        weight = nn.Parameter(torch.empty(rows, config.hidden, device=device, dtype=dtype))
        self.head = LMHead(norm, weight, sequence_gather=t)


def build_model(
    config_or_name: ModelConfig | str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    recompute: str = "none",
    max_seq_len: int | None = None,
    tensor_parallel: int = 1,
) -> TransformerModel:
    """Build a reference model from a config or a registered name.

    Args:
        config_or_name: a :class:`ModelConfig` or a name from :func:`memo.models.list_configs`.
        device: where parameters live; ``"meta"`` allocates nothing (any size, any length).
        dtype: parameter dtype (default: torch's default dtype).
        recompute: ``"none"`` or ``"full"`` (sets ``model.recompute``).
        max_seq_len: GPT only: rows of the learned position table (default
            :data:`DEFAULT_MAX_SEQ_LEN`; NOTE [GPT position table]). Llama needs none.
        tensor_parallel: t > 1 builds the model as one rank of a t-way Megatron tensor +
            sequence parallel group runs it, to profile its per-rank sizes (NOTE [Tensor-parallel
            rank] in :mod:`memo.models.parallel`); heads, key/value heads and the MLP size must
            be divisible by t, the vocabulary is padded to a multiple of t. Default 1: the
            whole model.

    Returns:
        :class:`GPTModel` or :class:`LlamaModel`, initialised like Megatron (unless on meta).
    """
    config = get_config(config_or_name) if isinstance(config_or_name, str) else config_or_name
    if not isinstance(config, ModelConfig):
        raise MemoError(f"memo.models: expected a ModelConfig or a config name, got {type(config_or_name)}")
    if recompute not in RECOMPUTE_MODES:
        raise MemoError(f"memo.models: recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    rank_shapes(config, tensor_parallel)  # refuses a t that does not divide the heads or the MLP
    if config.arch == "gpt":
        seq = DEFAULT_MAX_SEQ_LEN if max_seq_len is None else max_seq_len
        if not isinstance(seq, int) or seq < 1:
            raise MemoError(f"memo.models: max_seq_len must be a positive int, got {max_seq_len!r}")
        model: TransformerModel = GPTModel(
            config, max_seq_len=seq, recompute=recompute, device=device, dtype=dtype,
            tensor_parallel=tensor_parallel,
        )
    else:
        if max_seq_len is not None:
            raise MemoError(
                f"memo.models: max_seq_len={max_seq_len} given for {config.name!r}, a Llama model; "
                "rotary positions have no table to size, so leave it unset"
            )
        model = LlamaModel(config, recompute=recompute, device=device, dtype=dtype,
                           tensor_parallel=tensor_parallel)
    if torch.device(device if device is not None else "cpu").type != "meta":
        model.reset_parameters()
    return model


def num_parameters(
    config: ModelConfig | str, max_seq_len: int | None = None, tensor_parallel: int = 1
) -> int:
    """Parameter count of :func:`build_model`'s model, computed from the config alone.

    A tied LM head is counted once. For GPT the position table's ``max_seq_len * h``
    is included (default :data:`DEFAULT_MAX_SEQ_LEN` rows, as ``build_model`` does).
    ``tensor_parallel=t`` counts one rank's parameters (NOTE [Tensor-parallel rank]).
    """
    c = get_config(config) if isinstance(config, str) else config
    r = rank_shapes(c, tensor_parallel)
    h, f, v = c.hidden, r.ffn_hidden, r.vocab_rows
    qkv_out, attn_out = r.qkv_out, r.attn_out
    if c.arch == "gpt":
        layer = 2 * h + (h * qkv_out + qkv_out) + (attn_out * h + h) + 2 * h + (h * f + f) + (f * h + h)
        seq = DEFAULT_MAX_SEQ_LEN if max_seq_len is None else max_seq_len
        return c.n_layers * layer + v * h + seq * h + 2 * h
    qk_norms = 2 * r.head_dim if c.qk_norm else 0
    layer = h + h * qkv_out + qk_norms + attn_out * h + h + h * 2 * f + f * h
    return c.n_layers * layer + v * h + h + v * h
