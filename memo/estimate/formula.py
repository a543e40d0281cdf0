"""The closed-form per-GPU memory of the 4D-parallel estimator (``--method formula``).

NOTE [Estimator formula]
From the seed's derivation (../shared/seeds/000_memory_estimator.md, Section 3; equation numbers
are its own), for the first pipeline stage, the one that runs out of memory first. Variables:
a heads, k key/value heads, h hidden, h_ffn MLP size, L layers, v vocabulary, s sequence, b
micro-batch, t/c/p/d tensor/context/pipeline/data parallel sizes. Bytes, GiB = 2^30.

Model states (eq. 10; bf16 weights 2 B, fp32 gradients 4 B, fp32 master weights and Adam moments
12 B, the latter split by ZeRO-1 / the distributed optimizer over d·c ranks)::

    (6 + 12/(d·c)) · P_stage
    P_stage = h·v/t + 2·(L/p)·h²·((1 + k/a + 3/2 · h_ffn/h)/t + 1/h)        (p > 1, eq. 7/10)
    P_stage = 2·h·v/t + h + 2·L·h²·((1 + k/a + 3/2 · h_ffn/h)/t + 1/h)      (p = 1, eq. 6)

With p = 1 the single stage holds the embedding, the untied LM head (the second h·v/t) and the
final RMSNorm (h) besides the layers.

Activations (eq. 17: FlashAttention, no dropout, sequence parallel; 1F1B, so the first stage
holds p micro-batches of L/p layers, i.e. L layers' worth)::

    s·b·h/(t·c) · ((12 + 4·k/a + 8·h_ffn/h)·L + 8·p + δ(p,1)·4·(1 + v/h))

The seed writes the embedding term as 8·s·b·h·p (eq. 13) and the LM head's as 4·s·b·h·(1 + v/h)
(eq. 14, p = 1 only); both are kept exactly as written.

memo's reference GPT (the paper's models) differs from the seed's Llama in two places, which
change the counts the same way the derivation would: its MLP is two matrices with GELU, not
SwiGLU's three (3/2 · h_ffn/h becomes h_ffn/h in P; its skeletal MLP tensors are the input,
the GELU input and the GELU output, 2sbh + 4sb·h_ffn, so 8·h_ffn/h becomes 4·h_ffn/h: with
h_ffn = 4h, 16·s·b·h elements per layer, the paper's count), and its LM head is tied to the
embedding (no second h·v/t). GPT's learned position table, biases and LayerNorm shifts are not
terms of the seed's formula and are not counted here (``memo estimate`` prints their size).

Head size. The seed writes every attention term with the head size h/a (q and o are s·b·h, k and v
s·b·h·k/a). Models whose heads are another size d (Qwen3: 64 heads of 128 at h = 5120) are counted
with it: the attention's parameters are 2·h·d·(a + k) (q and o projections h·a·d each, k and v h·k·d
each), its activations 2·s·b·h (input) + 4·s·b·a·d (q, o) + 4·s·b·k·d (k, v), which are the seed's
2h² (1 + k/a) and 6·s·b·h + 4·s·b·h·k/a where d = h/a. QK-norm (Qwen3) adds two norms of d weights per
layer and keeps q and k in front of them as well (4·s·b·(a + k)·d more activation bytes).

Strategies. The seed's activations are those of ``none``. ``full-recompute`` keeps only every
layer's input (2·s·b·h/(t·c) bytes under sequence parallelism) and rebuilds one layer at a time
in backward, so its layer term becomes ``2·L + (12 + 4·k/a + 8·h_ffn/h)``: an extension of the
seed's counting, not in the seed. ``memo`` has no closed form here (its device share depends on
alpha, the host memory and the link): use ``--method plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memo.errors import MemoError
from memo.estimate.layout import ParallelLayout
from memo.planner.vocab import StrategyName

if TYPE_CHECKING:
    from memo.models.config import ModelConfig

__all__ = ["FORMULA_STRATEGIES", "FormulaShape", "formula_activations", "formula_layer_parameters",
           "formula_model_states", "formula_parameters"]

#: Strategies the closed form covers (NOTE [Estimator formula]).
FORMULA_STRATEGIES = (StrategyName.NONE.value, StrategyName.FULL_RECOMPUTE.value)


@dataclass(frozen=True)
class FormulaShape:
    """The seed's variables for one model, plus the two places memo's GPT differs (NOTE [Estimator
    formula])."""

    h: int
    a: int
    k: int
    h_ffn: int
    n_layers: int
    v: int
    mlp_matrices: int = 3
    """3 for Llama's SwiGLU (up, gate, down), 2 for GPT's GELU MLP (fc1, fc2)."""
    tied_head: bool = False
    """The LM head shares the embedding's weights (GPT); Llama's is untied."""
    head_dim: int | None = None
    """d, the size of one attention head (None: h/a, the seed's assumption)."""
    qk_norm: bool = False
    """An RMSNorm of every query and key head before rotary (Qwen3)."""

    @property
    def d(self) -> float:
        """The head size, h/a unless given."""
        return self.h / self.a if self.head_dim is None else self.head_dim

    @classmethod
    def of(cls, config: ModelConfig) -> FormulaShape:
        gpt = config.arch == "gpt"
        d = config.head_dim
        return cls(h=config.hidden, a=config.n_heads, k=config.n_kv_heads, h_ffn=config.ffn_hidden,
                   n_layers=config.n_layers, v=config.vocab_size, mlp_matrices=2 if gpt else 3,
                   tied_head=config.tied_embeddings,
                   head_dim=None if d * config.n_heads == config.hidden else d,
                   qk_norm=bool(getattr(config, "qk_norm", False)))

    @property
    def layer_activation_coefficient(self) -> float:
        """``12 + 4·k/a + 8·h_ffn/h`` (Llama; 4·h_ffn/h for GPT's MLP): bytes per s·b·h of one layer;
        with a head size d other than h/a, ``8 + 4·(a + k)·d/h + 8·h_ffn/h`` (NOTE [Estimator
        formula]), and QK-norm's inputs on top."""
        mlp = 8 if self.mlp_matrices == 3 else 4
        heads = (self.a + self.k) * self.d / self.h
        return 8 + 4 * heads * (2 if self.qk_norm else 1) + mlp * self.h_ffn / self.h


def formula_layer_parameters(shape: FormulaShape, layout: ParallelLayout) -> float:
    """Parameters of one transformer layer on one GPU: ``2·h²·((1 + k/a + m/2 · h_ffn/h)/t + 1/h)``,
    the attention's ``2h²(1 + k/a)`` being ``2·h·d·(a + k)`` for a head size d other than h/a, and
    QK-norm's ``2·d`` weights on top (NOTE [Estimator formula])."""
    h = shape.h
    attention = shape.d * (shape.a + shape.k) / h
    split = (attention + shape.mlp_matrices / 2 * shape.h_ffn / h) / layout.tp
    return 2 * h * h * (split + 1 / h) + (2 * shape.d if shape.qk_norm else 0)


def formula_parameters(shape: FormulaShape, layout: ParallelLayout) -> float:
    """P_stage: the parameters one GPU of the first pipeline stage holds (NOTE [Estimator formula])."""
    h, t, p = shape.h, layout.tp, layout.pp
    if shape.n_layers % p:
        raise MemoError(f"memo estimate: PP {p} does not divide {shape.n_layers} layers")
    per_layer = formula_layer_parameters(shape, layout)
    embedding = h * shape.v / t
    total = embedding + shape.n_layers / p * per_layer
    if p == 1:
        # The single stage also holds the final RMSNorm and, when untied, the LM head (eq. 6).
        total += h + (0 if shape.tied_head else embedding)
    return total


def formula_model_states(shape: FormulaShape, layout: ParallelLayout) -> float:
    """Bytes of weights, gradients and optimizer states: ``(6 + 12/(d·c)) · P_stage`` (eq. 10)."""
    return (6 + 12 / (layout.dp * layout.cp)) * formula_parameters(shape, layout)


def formula_activations(shape: FormulaShape, layout: ParallelLayout, seq_len: int,
                        strategy: str = "none") -> float:
    """Activation bytes of the first stage (eq. 17 for ``none``; NOTE [Estimator formula] for
    ``full-recompute``)."""
    if strategy not in FORMULA_STRATEGIES:
        raise MemoError(f"memo estimate: the formula has no closed form for strategy {strategy!r} (memo's "
                        "device share depends on alpha, host memory and the link); use --method plan")
    t, c, p = layout.tp, layout.cp, layout.pp
    sbh = seq_len * layout.micro_batch * shape.h / (t * c)
    layer = shape.layer_activation_coefficient
    layers = layer * shape.n_layers if strategy == StrategyName.NONE else 2 * shape.n_layers + layer
    head = 4 * (1 + shape.v / shape.h) if p == 1 else 0.0
    return sbh * (layers + 8 * p + head)
