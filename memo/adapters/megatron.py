"""megatron-core integration: a memo core attention, a GPT layer spec, and the TransformerLayer adapter.

Two lines turn a megatron-core GPT into a memo one::

    from memo.adapters.megatron import get_memo_gpt_layer_local_spec
    model = GPTModel(config, transformer_layer_spec=get_memo_gpt_layer_local_spec(), ...)
    memo.wrap(model, alpha=alpha)          # or plan=plan

``get_memo_gpt_layer_local_spec(**kw)`` is megatron's ``get_gpt_layer_local_spec(**kw)``
with the core attention swapped for :class:`MemoCoreAttention` (causal softmax
attention that returns the log-sum-exp memo needs and runs on CPU and CUDA).
The swap keeps every parameter and state-dict key: core attention has none.
An existing spec can be converted in place with :func:`use_memo_core_attention`.

NOTE [Megatron layer anatomy]
``TransformerLayer.forward`` = ``_forward_attention`` then ``_forward_mlp``. For a
GPT layer (no cross attention) memo splits it as
- pre:  ``input_layernorm`` -> ``self_attention.get_query_key_value_tensors``
  (QKV projection, optional q/k layernorm) -> rotary on ``q`` and ``k`` with the
  ``rotary_pos_emb`` rows of the slice's absolute positions;
- core: the layer's core attention. memo's own (:class:`MemoCoreAttention`, causal, scale
  ``1/sqrt(head_dim)``, context parallel by all-gather or all-to-all) runs as memo's core, once, without
  autograd; any other core attention (a sliding window, a custom mask, TransformerEngine's) runs
  as a black box, once, with autograd, its saved tensors offloaded (NOTE [Black-box core
  attention] in memo/runtime/core_attention.py). memo never substitutes its attention for another one;
- post: ``self_attention.linear_proj`` -> ``self_attn_bda`` (bias, dropout,
  residual ``x``) -> ``_forward_mlp`` (pre-MLP norm, MLP, bias-dropout-add).
Everything in pre and post is token-wise. Layers with cross attention, MoE,
gated attention output, packed sequences, inference contexts, a non-causal mask
or megatron's own recompute/offload switches are refused with a MemoError.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

from memo.adapters.base import AttentionBackward, AttentionForward, CoreFunction, LayerAdapter
from memo.adapters.exact import unhonoured
from memo.adapters.megatron_config import CORE_DEFAULT, LAYER_DEFAULT, changed_fields
from memo.adapters.model import ModelAdapter, ModelParts
from memo.errors import MemoError
from memo.models.ulysses_attention import CP_COMM_TYPES
from memo.planner.vocab import CPComm

try:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.utils import get_pg_size
except ImportError as e:  # pragma: no cover - exercised only without megatron-core
    raise MemoError(
        "memo.adapters.megatron: megatron-core is not installed (pip install megatron-core==0.16.1, or "
        "pip install memo[megatron])"
    ) from e

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.distributed import ProcessGroup

__all__ = [
    "GPTModelAdapter",
    "MegatronLayerAdapter",
    "MemoCoreAttention",
    "get_memo_gpt_layer_local_spec",
    "use_memo_core_attention",
]


class MemoCoreAttention(nn.Module):
    """Causal attention for megatron-core specs: ``(q [s,b,np,hn], k, v [s,b,ng,hn]) -> [s, b, np*hn]``.

    Takes the constructor and forward arguments of megatron's ``DotProductAttention``;
    refuses what it does not implement (non-causal masks, attention bias, packed sequences, a
    custom softmax scale, attention dropout, a context-parallel communication other than
    all-gather or all-to-all, arguments ``DotProductAttention`` does not take) instead of ignoring it.

    Context parallelism (``context_parallel_size > 1``), in megatron's load-balanced causal layout,
    by the config's ``cp_comm_type``:

    - ``None`` or ``"all_gather"``: K and V are all-gathered over the context-parallel group (their
      gradients reduce-scattered back) and each rank's queries attend to the keys before them
      (NOTE [Context-parallel attention] in memo/models/cp_attention.py);
    - ``"a2a"`` (Ulysses): an all-to-all gives each rank all tokens of n/c of its heads, a full
      causal attention runs over them, and a second all-to-all brings the output back (NOTE
      [Ulysses context parallelism] in memo/models/ulysses_attention.py); the heads (this
      tensor-parallel rank's) must split over the group, checked when the module is built.

    ``"p2p"`` and ``"a2a+p2p"`` (TransformerEngine's ring attention) are refused. The group is the
    ``pg_collection``'s ``cp`` (megatron's ``SelfAttention`` always passes one), else megatron's
    global context-parallel group.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None, **unknown: object) -> None:
        super().__init__()
        where = f"memo.adapters.megatron: MemoCoreAttention (layer {layer_number})"
        if unknown:
            raise MemoError(
                f"{where}: got argument(s) {', '.join(sorted(unknown))}, which megatron-core 0.16's "
                "DotProductAttention does not take and memo's attention does not implement; build this "
                "spec with megatron's own core attention (without use_memo_core_attention), or drop them"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise MemoError(f"{where}: only causal self-attention is supported, got {attn_mask_type}")
        changed = changed_fields(config, CORE_DEFAULT)  # NOTE [megatron-core's config fields under memo]
        if changed:
            raise MemoError(f"{where}: {', '.join(changed)} changes the attention's arithmetic, which memo's "
                            "core attention does not implement (it would run plain causal softmax); "
                            "build the layers with megatron's own core attention (memo runs it as it is), or "
                            "leave these at their defaults")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise MemoError(f"{where}: attention_dropout={dropout}; memo's attention has no dropout, use 0")
        scale = softmax_scale if softmax_scale is not None else getattr(config, "softmax_scale", None)
        if scale is not None or getattr(config, "apply_query_key_layer_scaling", False):
            raise MemoError(f"{where}: a custom softmax scale is not supported (memo uses 1/sqrt(head_dim))")
        self.config = config
        self.layer_number = layer_number
        #: The context-parallel group when it has more than one rank, else None.
        self.cp_group = _context_parallel_group(where, config, cp_comm_type, pg_collection)
        #: How the context-parallel group communicates: "all_gather" or "a2a" (None without a group).
        self.cp_comm_type = None if self.cp_group is None else (cp_comm_type or CPComm.ALL_GATHER.value)
        if self.cp_comm_type == CPComm.A2A:
            _check_ulysses_heads(where, config, get_pg_size(self.cp_group))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None = None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: PackedSeqParams | None = None,
                **unknown: object) -> torch.Tensor:
        if unknown:
            raise MemoError(
                "memo.adapters.megatron: MemoCoreAttention.forward got argument(s) "
                f"{', '.join(sorted(unknown))}, which DotProductAttention.forward does not take and memo's "
                "attention does not implement; use megatron's own core attention for this model"
            )
        if attention_bias is not None or packed_seq_params is not None:
            raise MemoError("memo.adapters.megatron: MemoCoreAttention supports neither attention_bias nor "
                            "packed sequences")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise MemoError(f"memo.adapters.megatron: attention must be causal, not {attn_mask_type}")
        if self.cp_comm_type == CPComm.A2A:
            from memo.models.ulysses_attention import ulysses_attention

            o = ulysses_attention(query, key, value, self.cp_group)
        elif self.cp_group is not None:
            from memo.models.cp_attention import cp_attention

            o = cp_attention(query, key, value, self.cp_group)
        else:
            from memo.models.causal_attention import attention

            o = attention(query, key, value)
        s, b, n, d = o.shape
        return o.view(s, b, n * d)

    def attention_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor]:
        """:meth:`forward` without autograd -> ``(o [s, b, n, d], lse)`` (memo's runtime calls it)."""
        if self.cp_comm_type == CPComm.A2A:
            from memo.models.ulysses_attention import ulysses_attention_forward

            return ulysses_attention_forward(q, k, v, self.cp_group)
        if self.cp_group is not None:
            from memo.models.cp_attention import cp_attention_forward

            return cp_attention_forward(q, k, v, self.cp_group)
        from memo.models.causal_attention import attention_forward

        return attention_forward(q, k, v)

    def attention_backward(self, grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           o: torch.Tensor, lse: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients of :meth:`attention_forward`, from its inputs and outputs."""
        if self.cp_comm_type == CPComm.A2A:
            from memo.models.ulysses_attention import ulysses_attention_backward

            return ulysses_attention_backward(grad_o, q, k, v, o, lse, self.cp_group)
        if self.cp_group is not None:
            from memo.models.cp_attention import cp_attention_backward

            return cp_attention_backward(grad_o, q, k, v, o, lse, self.cp_group)
        from memo.models.causal_attention import attention_backward

        return attention_backward(grad_o, q, k, v, o, lse)


#: Context-parallel communication memo's attention implements (None: megatron's default, unset,
#: which is all-gather here).
_CP_COMM_TYPES = (None, *CP_COMM_TYPES)


def _context_parallel_group(where: str, config: TransformerConfig, cp_comm_type: str | None,
                            pg_collection: ProcessGroupCollection | None) -> ProcessGroup | None:
    """The context-parallel group of a core attention, or None when it has one rank."""
    cp_size = int(getattr(config, "context_parallel_size", 1) or 1)
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and cp_size > 1:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    group_size = get_pg_size(group) if group is not None else 1
    if group_size != cp_size:
        raise MemoError(f"{where}: context_parallel_size={cp_size} but the context-parallel group has "
                        f"{group_size} rank(s); initialise megatron's parallel state with the config's "
                        "layout")
    if group_size > 1 and cp_comm_type not in _CP_COMM_TYPES:
        raise MemoError(
            f"{where}: cp_comm_type={cp_comm_type!r}; memo's context-parallel attention supports None or "
            "\"all_gather\" (K and V all-gathered) and \"a2a\" (Ulysses all-to-all), not ring attention "
            "(\"p2p\", \"a2a+p2p\"). Set cp_comm_type to one of those, or use TransformerEngine's attention "
            "(a spec without use_memo_core_attention)")
    return group if group_size > 1 else None


def _check_ulysses_heads(where: str, config: TransformerConfig, cp_size: int) -> None:
    """Refuse, when the module is built, heads that a Ulysses group of ``cp_size`` cannot split (NOTE
    [Ulysses context parallelism]); the heads are one tensor-parallel rank's."""
    from memo.models.ulysses_attention import ulysses_heads_problem

    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    heads = int(config.num_attention_heads)
    groups = int(getattr(config, "num_query_groups", None) or heads)
    if heads % tp or groups % tp:
        return  # megatron's own attention refuses this layout
    problem = ulysses_heads_problem(heads // tp, groups // tp, cp_size)
    if problem is not None:
        raise MemoError(
            f"{where}: cp_comm_type=\"a2a\" with {heads} attention heads and {groups} query groups over "
            f"tensor_model_parallel_size={tp}: per rank, {problem}. Use a context_parallel_size that divides "
            "the heads per tensor-parallel rank and divides or is a multiple of its query groups, or "
            "cp_comm_type \"all_gather\"")


def use_memo_core_attention(spec: ModuleSpec) -> ModuleSpec:
    """Replace the core attention of a megatron-core layer spec by :class:`MemoCoreAttention` (in place)."""
    try:
        spec.submodules.self_attention.submodules.core_attention = MemoCoreAttention
    except AttributeError as e:
        raise MemoError(
            "memo.adapters.megatron: the spec has no submodules.self_attention.submodules.core_attention "
            "(MoE/MLA/hybrid specs are not supported)"
        ) from e
    return spec


def get_memo_gpt_layer_local_spec(**kwargs: bool | int | str | None) -> ModuleSpec:
    """megatron's ``get_gpt_layer_local_spec(**kwargs)`` (its flags, counts and names) with
    :class:`MemoCoreAttention` as core attention."""
    return use_memo_core_attention(get_gpt_layer_local_spec(**kwargs))


# Arguments of TransformerLayer._forward_attention (what TransformerLayer.forward takes).
_SIGNATURE = inspect.signature(TransformerLayer._forward_attention)
# Arguments memo honours; every other one must be None (or absent).
_HONOURED = {"self", "hidden_states", "attention_mask", "rotary_pos_emb", "padding_mask"}


class _Call(TypedDict):
    """What one ``TransformerLayer`` call leaves to pre / core / post."""

    #: The rotary tables of the queries and the keys (``rotary_pos_emb``), None without rotary.
    q_pos: torch.Tensor | None
    k_pos: torch.Tensor | None
    #: Tokens of the layer input on this rank.
    tokens: int
    attention_mask: torch.Tensor | None


class MegatronLayerAdapter(LayerAdapter[_Call]):
    """megatron-core ``TransformerLayer`` -> pre / core / post (NOTE [Megatron layer anatomy])."""

    name = "megatron"

    def check(self, layer: nn.Module) -> None:
        where = f"memo.adapters.megatron: layer {getattr(layer, 'layer_number', '?')}"
        cfg = layer.config
        problems = _not_exact(layer)
        changed = changed_fields(cfg, LAYER_DEFAULT)  # NOTE [megatron-core's config fields under memo]
        if changed:
            problems.append(f"{', '.join(changed)} (memo computes the layer from its submodules and does its "
                            "own recomputation and offloading; it runs these only at their defaults)")
        if not isinstance(layer.cross_attention, IdentityOp) or not isinstance(
                layer.pre_cross_attn_layernorm, IdentityOp):
            problems.append("it has cross attention")
        if getattr(layer, "is_moe_layer", False):
            problems.append("it is a MoE layer")
        if getattr(layer.self_attention, "attn_mask_type", AttnMaskType.causal) != AttnMaskType.causal:
            problems.append(f"its attention mask type is {layer.self_attention.attn_mask_type}")
        if not hasattr(layer.self_attention, "get_query_key_value_tensors"):
            problems.append("its self attention has no get_query_key_value_tensors")
        tp = int(getattr(cfg, "tensor_model_parallel_size", 1))
        if getattr(cfg, "sequence_parallel", False) and tp < 2:
            problems.append("sequence_parallel is on with tensor_model_parallel_size 1")
        if problems:
            raise MemoError(f"{where}: cannot be split into pre/core/post because " + "; ".join(problems))

    def split_args(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
            torch.Tensor, _Call]:
        problems = _not_exact(layer)
        if problems:
            raise MemoError(f"memo.adapters.megatron: layer {getattr(layer, 'layer_number', '?')}: "
                            + "; ".join(problems))
        kwargs = dict(kwargs)
        kwargs.pop("dynamic_inference_decode_only", None)
        try:
            bound = _SIGNATURE.bind(layer, *args, **kwargs)
        except TypeError as e:
            raise MemoError(f"memo.adapters.megatron: unexpected TransformerLayer arguments: {e}") from e
        given = bound.arguments
        for name, value in given.items():
            if name not in _HONOURED and value is not None:
                raise MemoError(
                    f"memo.adapters.megatron: TransformerLayer argument {name!r} is not supported by memo's "
                    "token-wise recompute (only hidden_states, attention_mask for a causal mask and "
                    "rotary_pos_emb)"
                )
        rotary = given.get("rotary_pos_emb")
        if isinstance(rotary, tuple):
            q_pos, k_pos = rotary
        else:
            q_pos = k_pos = rotary
        x = given["hidden_states"]
        return x, _Call(q_pos=q_pos, k_pos=k_pos, tokens=x.shape[0],
                        attention_mask=given.get("attention_mask"))

    # NOTE [Megatron sequence parallelism]
    # With sequence_parallel a tensor-parallel rank holds s/t tokens of the layer input and its QKV
    # projection (a column-parallel linear) all-gathers its input over the group: pre on local tokens
    # [o:o+n] yields q, k, v rows of the t ranks' tokens [o:o+n] one rank after the other, that is of
    # sequence positions r·s/t + o .. r·s/t + o+n-1 for r = 0 .. t-1 (gather_layout "rank-major").
    # The rotary rows are those positions'. The attention output's rows for the slice go back
    # through the output projection's reduce-scatter, which hands each rank its own n tokens, so
    # post stays token-wise on local slices. Every rank runs the same slices in the same order
    # (alpha, the chunks and the sequence length are the same on all of them), so the collectives
    # inside pre and post (and their backward) match up across the group.
    gather_layout = "rank-major"

    def sequence_gather(self, layer: nn.Module) -> int:
        cfg = layer.config
        return int(cfg.tensor_model_parallel_size) if getattr(cfg, "sequence_parallel", False) else 1

    def pre(self, layer: nn.Module, x: torch.Tensor, offset: int, ctx: _Call) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        attn = layer.self_attention
        qkv = attn.get_query_key_value_tensors(layer.input_layernorm(x))
        q, k, v = qkv[0], qkv[1], qkv[2]
        no_rope = layer.config.no_rope_freq  # per layer (1-based numbers), as SelfAttention.forward reads it
        if (ctx["q_pos"] is None and ctx["k_pos"] is None) or (no_rope and no_rope[layer.layer_number - 1]):
            return q, k, v
        kw = {"config": layer.config, "cp_group": getattr(getattr(attn, "pg_collection", None), "cp", None)}
        rows = _rotary_rows(offset, x.shape[0], ctx["tokens"], self.sequence_gather(layer), q.device)
        if ctx["q_pos"] is not None:
            q = apply_rotary_pos_emb(q, ctx["q_pos"][rows], **kw)
        if ctx["k_pos"] is not None:
            k = apply_rotary_pos_emb(k, ctx["k_pos"][rows], **kw)
        return q, k, v

    def core_module(self, layer: nn.Module) -> nn.Module | None:
        core = getattr(layer.self_attention, "core_attention", None)
        return core if isinstance(core, nn.Module) else None

    def core_function(self, layer: nn.Module, ctx: _Call) -> CoreFunction | None:
        attn = layer.self_attention
        core = attn.core_attention
        if isinstance(core, MemoCoreAttention):
            return None

        # NOTE [Black-box core attention] (memo/runtime/core_attention.py): the layer's own core attention,
        # called as megatron's SelfAttention calls it.
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return core(q, k, v, ctx["attention_mask"], attn_mask_type=attn.attn_mask_type,
                        attention_bias=None, packed_seq_params=None)

        return run

    def attention_kernels(self, layer: nn.Module) -> tuple[AttentionForward, AttentionBackward]:
        core = layer.self_attention.core_attention  # MemoCoreAttention (context parallel or not)
        return core.attention_forward, core.attention_backward

    def post(self, layer: nn.Module, o: torch.Tensor, x: torch.Tensor, ctx: _Call) -> torch.Tensor:
        out_with_bias = layer.self_attention.linear_proj(o)
        # Megatron runs bias-dropout-add under torch.enable_grad (its exec handler); memo calls it
        # directly so that the no-grad token range records nothing.
        h = layer.self_attn_bda(layer.training, layer.config.bias_dropout_fusion)(
            out_with_bias, x, layer.hidden_dropout)
        return layer._forward_mlp(h)

    def pack_output(self, layer: nn.Module, y: torch.Tensor, ctx: _Call) -> tuple[torch.Tensor, None]:
        return y, None  # (hidden_states, context); no cross attention, so no context



def _not_exact(layer: nn.Module) -> list[str]:
    """NOTE [memo runs the layer the user wrote, or refuses it] (memo/adapters/exact.py): memo computes
    megatron's TransformerLayer and SelfAttention from their submodules, never calling their forward."""
    from megatron.core.transformer.attention import SelfAttention

    return unhonoured(layer, (TransformerLayer,), {"self_attention": (SelfAttention,)})


def _whole(model: nn.Module) -> None:
    """Refuse a pipeline stage's chunk where the whole model is needed: its parts and its loss."""
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise MemoError(
            "memo.adapters.megatron: this GPTModel is one pipeline stage's chunk (pre_process="
            f"{model.pre_process}, post_process={model.post_process}): it has no loss of its own, its input "
            "and its output's gradient come from the other stages. memo.wrap it and run megatron's pipeline "
            "schedule (NOTE [Pipeline stages] in memo/distributed/pipeline.py); memo profiles and plans a "
            "whole GPTModel per process")


def _rotary_rows(offset: int, n: int, tokens: int, gather: int, device: torch.device) -> slice | torch.Tensor:
    """Rows of the rotary table for pre's output on local tokens ``[offset:offset+n]`` of ``tokens``
    (NOTE [Megatron sequence parallelism]): a slice when nothing is gathered."""
    if gather == 1:
        return slice(offset, offset + n)
    ranks = torch.arange(gather, device=device)[:, None] * tokens
    return (ranks + torch.arange(offset, offset + n, device=device)).reshape(-1)


class GPTModelAdapter(ModelAdapter):
    """megatron-core's ``GPTModel`` as a whole (NOTE [Model adapters] in memo/adapters/model.py).

    Parts: ``model.embedding`` (word and position embeddings, ``[b, s] -> [s, b, h]``), the
    decoder's layers, and the head: ``decoder.final_layernorm`` then ``output_layer``. The loss is
    megatron's own: ``GPTModel.forward`` with ``labels`` returns the per-token cross entropy
    ``[b, s]``; megatron's labels are the next tokens already, as memo's are, so they are passed
    as they are. Tokens labelled ``-100`` (memo's "not counted", which megatron does not know)
    get label 0 and weight 0, and the mean is over the counted tokens. Position ids are
    ``0..s-1``; the attention mask is None (memo's core attention is causal).
    """

    name = "megatron-gpt"

    def check(self, model: nn.Module) -> None:
        # A pipeline stage's chunk (pre_process or post_process False) is wrapped as any model (NOTE
        # [Pipeline stages] in memo/distributed/pipeline.py); only its loss needs the whole model.
        if getattr(model, "mtp_process", False):
            raise MemoError("memo.adapters.megatron: multi-token prediction (mtp_num_layers) is not "
                            "supported; build the GPTModel without it")

    def parts(self, model: nn.Module) -> ModelParts:
        _whole(model)
        decoder = model.decoder
        head = [m for m in (getattr(decoder, "final_layernorm", None), model.output_layer) if m is not None]
        return ModelParts(model.embedding, list(decoder.layers), head)

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _whole(model)
        b, s = ids.shape
        position_ids = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
        counted = labels != -100
        per_token = model(ids, position_ids, None, labels=torch.where(counted, labels, 0))
        weight = counted.to(per_token.dtype)
        return (per_token * weight).sum() / weight.sum().clamp(min=1)

    def vocab_size(self, model: nn.Module) -> int:
        return int(model.vocab_size)
