"""Transformer layers of the reference models, each split into pre / core / post.

NOTE [Layer anatomy]
Every layer is ``forward(x) = post(core(*pre(x)), x)`` with ``x: [s, b, h]``:

- ``pre(x, offset=0) -> (q, k, v)``: norm, fused QKV projection, rotary (Llama).
  ``q: [s, b, n_heads, d]``, ``k, v: [s, b, n_kv_heads, d]``. Token-wise.
- ``core(q, k, v) -> o``: causal attention through the parameter-free submodule
  ``self.core_attention``; ``o: [s, b, n_heads * d]``. The only part that mixes tokens;
  memo's runtime and profiler hook or replace ``core_attention``.
- ``post(o, x) -> y``: output projection, residual, norm, MLP, residual. Token-wise.

Token-wise means token t of the output depends only on token t of the inputs, so the
runtime may recompute ``pre``/``post`` on a token slice ``x[a:b]``. Rotary positions are
the one thing a token needs beyond its own values: ``offset`` is the absolute position of
``x``'s first token, so ``pre(x[a:b], offset=a)`` equals ``pre(x)[a:b]``.
"""

from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F
from torch import nn

from memo.models.attention import attention
from memo.models.config import ModelConfig

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
    """Common shape of the reference layers (NOTE [Layer anatomy])."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.core_attention = CoreAttention()

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        s, b, _ = qkv.shape
        kv_width = c.n_kv_heads * c.head_dim
        q, k, v = qkv.split([c.n_heads * c.head_dim, kv_width, kv_width], -1)
        return (
            q.reshape(s, b, c.n_heads, c.head_dim),
            k.reshape(s, b, c.n_kv_heads, c.head_dim),
            v.reshape(s, b, c.n_kv_heads, c.head_dim),
        )

    @abc.abstractmethod
    def pre(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [s, b, h]`` -> ``q: [s, b, n, d]``, ``k, v: [s, b, n_kv, d]``.

        ``offset`` is the absolute position of ``x[0]`` (only rotary layers use it).
        """

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention through ``self.core_attention``: -> ``o: [s, b, n * d]``."""
        return self.core_attention(q, k, v)

    @abc.abstractmethod
    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o: [s, b, n * d]``, ``x: [s, b, h]`` (the layer input) -> ``y: [s, b, h]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.core(*self.pre(x)), x)


class GPTLayer(TransformerLayer):
    """Megatron GPT layer: pre-LayerNorm, fused QKV with bias, GELU MLP, no dropout."""

    def __init__(
        self, config: ModelConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(config)
        kw = {"device": device, "dtype": dtype}
        h = config.hidden
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.input_norm = nn.LayerNorm(h, eps=config.norm_eps, **kw)
        self.qkv = nn.Linear(h, qkv_out, bias=True, **kw)
        self.proj = nn.Linear(config.n_heads * config.head_dim, h, bias=True, **kw)
        self.post_norm = nn.LayerNorm(h, eps=config.norm_eps, **kw)
        self.fc1 = nn.Linear(h, config.ffn_hidden, bias=True, **kw)
        self.fc2 = nn.Linear(config.ffn_hidden, h, bias=True, **kw)

    def pre(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # GPT positions are added in the embedding, so offset does not change anything here.
        return self._split_qkv(self.qkv(self.input_norm(x)))

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x + self.proj(o)
        return y + self.fc2(F.gelu(self.fc1(self.post_norm(y))))


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
    """Llama layer: RMSNorm, no biases, grouped-query attention with rotary, SwiGLU MLP."""

    def __init__(
        self, config: ModelConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(config)
        kw = {"device": device, "dtype": dtype}
        h = config.hidden
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.input_norm = nn.RMSNorm(h, eps=config.norm_eps, **kw)
        self.qkv = nn.Linear(h, qkv_out, bias=False, **kw)
        self.proj = nn.Linear(config.n_heads * config.head_dim, h, bias=False, **kw)
        self.post_norm = nn.RMSNorm(h, eps=config.norm_eps, **kw)
        self.gate_up = nn.Linear(h, 2 * config.ffn_hidden, bias=False, **kw)
        self.down = nn.Linear(config.ffn_hidden, h, bias=False, **kw)

    def pre(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._split_qkv(self.qkv(self.input_norm(x)))
        theta = float(self.config.rope_theta)
        return apply_rotary(q, offset, theta), apply_rotary(k, offset, theta), v

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x + self.proj(o)
        gate, up = self.gate_up(self.post_norm(y)).chunk(2, dim=-1)
        return y + self.down(F.silu(gate) * up)


def output_projection_std(config: ModelConfig) -> float:
    """Init std of projections that write into the residual stream (Megatron's scaled init)."""
    return 0.02 / math.sqrt(2.0 * config.n_layers)
