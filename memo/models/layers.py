"""Transformer layers of the reference models, each split into pre / core / post.

NOTE [Layer anatomy]
Every layer is ``forward(x) = post(core(*pre(x)), x)`` with ``x: [s, b, h]``:

- ``pre(x, offset=0) -> (q, k, v)``: norm, fused QKV projection, the norm of each query and
  key head (Llama with ``qk_norm``), rotary (Llama). ``q: [s, b, n_heads, d]``,
  ``k, v: [s, b, n_kv_heads, d]``, d the config's ``head_dim``. Token-wise.
- ``core(q, k, v) -> o``: causal attention through the parameter-free submodule
  ``self.core_attention``; ``o: [s, b, n_heads * d]``. The only part that mixes tokens;
  memo's runtime and profiler hook or replace ``core_attention``.
- ``post(o, x) -> y``: output projection, residual, norm, MLP, residual. Token-wise.

NOTE [Layer MLP]
``post`` ends with ``y + self.mlp(self.post_norm(y))``: ``mlp(z)`` is the layer's MLP alone
(no norm, no residual), token-wise, with the parameters ``mlp_parameters()`` names. It is a
method, not a submodule, so that the state dict keeps its names (``fc1``, ``gate_up``, ...);
the layer adapter names it (``LayerAdapter.mlp_site``) for strategies that run the MLP their
own way (the tiled MLP of ``memo train --strategy offloaded-checkpoint``).

Token-wise means token t of the output depends only on token t of the inputs, so the
runtime may recompute ``pre``/``post`` on a token slice ``x[a:b]``. Rotary positions are
the one thing a token needs beyond its own values: ``offset`` is the absolute position of
``x``'s first token, so ``pre(x[a:b], offset=a)`` equals ``pre(x)[a:b]``.

A layer built with ``tensor_parallel=t > 1`` is one rank of a Megatron tensor +
sequence parallel group (NOTE [Tensor-parallel rank] in :mod:`memo.models.parallel`):
``x`` and ``y`` hold the rank's local tokens ``[n, b, h]`` while ``q, k, v`` and ``o``
cover the ``n·t`` gathered tokens (``n_heads/t`` and ``n_kv_heads/t`` heads, ``o:
[n·t, b, n_heads/t · d]``). ``layer.sequence_gather`` (t; 1 for an ordinary layer) is that factor:
token-wise then means ``pre(x[a:b], offset=a)`` equals rows ``a·t … b·t-1`` of
``pre(x)`` and ``post(o[a·t:b·t], x[a:b])`` equals ``post(o, x)[a:b]``.
"""

from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from memo.models.causal_attention import attention
from memo.models.config import ModelConfig
from memo.models.norms import RMSNorm
from memo.models.parallel import column_parallel_linear, rank_shapes, row_parallel_linear

if TYPE_CHECKING:
    from memo.models.ulysses_attention import SequenceShard

__all__ = [
    "CoreAttention",
    "GPTLayer",
    "LlamaLayer",
    "TransformerLayer",
    "apply_rotary",
    "output_projection_std",
]


class CoreAttention(nn.Module):
    """Causal attention, ``(q [s,b,n,d], k, v [s,b,n_kv,d]) -> o [s, b, n*d]``. No parameters."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = attention(q, k, v)
        s, b, n, d = o.shape
        return o.view(s, b, n * d)


class TransformerLayer(nn.Module, abc.ABC):
    """Common shape of the reference layers (NOTE [Layer anatomy]).

    ``tensor_parallel=t`` builds one rank of a t-way tensor + sequence parallel group
    (NOTE [Tensor-parallel rank]); ``self.shapes`` holds the rank's sizes and
    ``self.sequence_gather`` is t.
    """

    def __init__(self, config: ModelConfig, tensor_parallel: int = 1, *, norm: type[nn.Module], bias: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.shapes = rank_shapes(config, tensor_parallel)
        #: Tokens of q, k, v and o per token of x and y: the tensor-parallel size t (1 without it).
        self.sequence_gather = self.shapes.tensor_parallel
        self.core_attention = CoreAttention()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        h, r = config.hidden, self.shapes
        self.input_norm = norm(h, eps=config.norm_eps, **kw)
        self.qkv = nn.Linear(h, r.qkv_out, bias=bias, **kw)
        self.proj = nn.Linear(r.attn_out, h, bias=bias, **kw)
        self.post_norm = norm(h, eps=config.norm_eps, **kw)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self.shapes
        s, b, _ = qkv.shape
        kv_width = r.n_kv_heads * r.head_dim
        q, k, v = qkv.split([r.n_heads * r.head_dim, kv_width, kv_width], -1)
        return (
            q.reshape(s, b, r.n_heads, r.head_dim),
            k.reshape(s, b, r.n_kv_heads, r.head_dim),
            v.reshape(s, b, r.n_kv_heads, r.head_dim),
        )

    @abc.abstractmethod
    def pre(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [s, b, h]`` -> ``q: [s·g, b, n, d]``, ``k, v: [s·g, b, n_kv, d]`` (g = ``sequence_gather``).

        ``offset`` is the absolute position of ``x[0]`` (only rotary layers use it).
        """

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention through ``self.core_attention``: -> ``o: [s, b, n * d]``."""
        return self.core_attention(q, k, v)

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o: [s·g, b, n * d]``, ``x: [s, b, h]`` (the layer input) -> ``y: [s, b, h]``.

        g is ``sequence_gather`` (1 unless the layer is a tensor-parallel rank).
        """
        y = x + row_parallel_linear(o, self.proj, self.sequence_gather)
        return y + self.mlp(self.post_norm(y))

    @abc.abstractmethod
    def mlp(self, z: torch.Tensor) -> torch.Tensor:
        """The MLP (NOTE [Layer MLP]): ``z: [s, b, h]`` (the post-norm output) -> ``[s, b, h]``."""

    #: This rank's share of a sequence split over Ulysses ranks (NOTE [Contiguous Ulysses] in
    #: memo/models/ulysses_attention.py), None for the whole sequence; set with the core attention by
    #: memo.distributed.ulysses.shard_sequence.
    sequence_shard: SequenceShard | None = None

    def first_position(self, x: torch.Tensor) -> int:
        """The absolute position of ``x[0]`` (``x``: the layer's whole input ``[s, b, h]``): 0, or this
        rank's first token under a :attr:`sequence_shard`."""
        return 0 if self.sequence_shard is None else self.sequence_shard.first_position(x.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.core(*self.pre(x, offset=self.first_position(x))), x)


class GPTLayer(TransformerLayer):
    """Megatron GPT layer: pre-LayerNorm, fused QKV with bias, GELU MLP, no dropout.

    ``tensor_parallel=t``: one rank of a t-way group (NOTE [Tensor-parallel rank]): ``qkv`` and
    ``fc1`` are column-parallel (``[3·n·d/t, h]``, ``[ffn/t, h]``; n·d is h unless the config sets
    ``head_dim``), ``proj`` and ``fc2`` row-parallel (``[h, n·d/t]``, ``[h, ffn/t]``); the norms
    and row-parallel biases are replicated.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, tensor_parallel: int = 1) -> None:
        super().__init__(config, tensor_parallel, norm=nn.LayerNorm, bias=True, device=device, dtype=dtype)
        h, r = config.hidden, self.shapes
        self.fc1 = nn.Linear(h, r.ffn_hidden, bias=True, device=device, dtype=dtype)
        self.fc2 = nn.Linear(r.ffn_hidden, h, bias=True, device=device, dtype=dtype)

    def pre(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # GPT positions are added in the embedding, so offset does not change anything here.
        return self._split_qkv(column_parallel_linear(self.input_norm(x), self.qkv, self.sequence_gather))

    def mlp(self, z: torch.Tensor) -> torch.Tensor:
        """The MLP (NOTE [Layer MLP]): ``z: [s, b, h]`` (the post-norm output) -> ``[s, b, h]``."""
        t = self.sequence_gather
        # One expression: the GELU output is freed as soon as fc2 has run.
        return row_parallel_linear(F.gelu(column_parallel_linear(z, self.fc1, t)), self.fc2, t)

    def mlp_parameters(self) -> list[nn.Parameter]:
        """The parameters :meth:`mlp` uses."""
        return [*self.fc1.parameters(), *self.fc2.parameters()]


def apply_rotary(t: torch.Tensor, offset: int, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of ``t: [s, b, n, d]`` at positions offset..offset+s-1.

    Angles are computed in float32 from the absolute positions, so a slice rotated with its
    offset equals the same slice of the whole sequence rotated.
    """
    s, d = t.shape[0], t.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=t.device, dtype=torch.float32) / d))
    positions = torch.arange(offset, offset + s, device=t.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    first, second = t.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return t * cos + rotated * sin


class LlamaLayer(TransformerLayer):
    """Llama layer: RMSNorm (:class:`memo.models.norms.RMSNorm`, NOTE [Lean RMSNorm]), no biases,
    grouped-query attention with rotary, SwiGLU MLP. With ``config.qk_norm`` the queries and keys
    are normed per head (``q_norm``, ``k_norm``: RMSNorm over ``head_dim``) before rotary, as Qwen3.

    ``tensor_parallel=t``: one rank of a t-way group (NOTE [Tensor-parallel rank]): ``qkv`` and
    ``gate_up`` are column-parallel (``[(n + 2 n_kv)/t · d, h]``, ``[2 ffn/t, h]``), ``proj`` and
    ``down`` row-parallel (``[h, n/t · d]``, ``[h, ffn/t]``); the norms are replicated.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, tensor_parallel: int = 1) -> None:
        super().__init__(config, tensor_parallel, norm=RMSNorm, bias=False, device=device, dtype=dtype)
        h, r = config.hidden, self.shapes
        if config.qk_norm:
            self.q_norm = RMSNorm(r.head_dim, eps=config.norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(r.head_dim, eps=config.norm_eps, device=device, dtype=dtype)
        self.gate_up = nn.Linear(h, 2 * r.ffn_hidden, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(r.ffn_hidden, h, bias=False, device=device, dtype=dtype)

    def pre(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.sequence_gather
        q, k, v = self._split_qkv(column_parallel_linear(self.input_norm(x), self.qkv, t))
        if self.config.qk_norm:  # per token and head, so pre stays token-wise
            q, k = self.q_norm(q), self.k_norm(k)
        theta = float(self.config.rope_theta)
        # The gathered rows of local tokens [offset:] sit at positions offset·t onward
        # (NOTE [Tensor-parallel rank]); t = 1 is the plain absolute position.
        return apply_rotary(q, offset * t, theta), apply_rotary(k, offset * t, theta), v

    def mlp(self, z: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP (NOTE [Layer MLP]): ``z: [s, b, h]`` (the post-norm output) -> ``[s, b, h]``."""
        t = self.sequence_gather
        gate, up = column_parallel_linear(z, self.gate_up, t).chunk(2, dim=-1)
        return row_parallel_linear(F.silu(gate) * up, self.down, t)

    def mlp_parameters(self) -> list[nn.Parameter]:
        """The parameters :meth:`mlp` uses."""
        return [*self.gate_up.parameters(), *self.down.parameters()]


def output_projection_std(config: ModelConfig) -> float:
    """Init std of projections that write into the residual stream (Megatron's scaled init)."""
    return 0.02 / math.sqrt(2.0 * config.n_layers)
