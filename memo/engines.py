"""The models ``memo train`` can build: memo's own, megatron-core's ``GPTModel``, Hugging Face causal LMs.

NOTE [Training engines]
Every engine's model goes through the same pipeline and Session (its model adapter says where the
embedding, layers and head are, and how the loss is computed); only how the model is built differs.

- ``memo``: :func:`memo.models.build_model` from a registered name or CONFIG.json.
- ``megatron``: a megatron-core ``GPTModel`` with memo's layer spec
  (:func:`memo.adapters.megatron.get_memo_gpt_layer_local_spec`) and the same shapes as memo's
  model of that name: layers, hidden, heads, query groups, MLP width, vocabulary; GPT configs get
  LayerNorm, GELU, biases and learned positions, Llama configs RMSNorm, SwiGLU, no biases and
  RoPE. One process: megatron's parallel state is set up over a world of one (gloo) when no
  process group exists, as ``tests/test_megatron.py`` does. Several (``torchrun``, NOTE [Parallel
  layout] in memo/distributed/layout.py): the caller has set up the parallel state of its
  ``ParallelLayout`` and the model is one rank's (tensor, sequence and context parallel); the
  vocabulary is padded the same way for every layout, so the shards are slices of the
  single-process model.
- ``--hf-config``: ``transformers.AutoModelForCausalLM.from_config`` of a config given as a
  JSON file, a directory with ``config.json`` (no weights are loaded), or inline JSON with a
  ``model_type``; randomly initialised, no download.
- ``fsdp2``: memo's model of that name, or the ``--hf-config`` model, built as above on every rank
  from the same seed, then sharded by PyTorch FSDP2 (``fully_shard`` per layer and on the root,
  ``CPUOffloadPolicy`` with ``--offload-states``) over data-parallel ranks, under ``torchrun`` or as a
  world of one (memo/distributed/fsdp2.py, NOTE [memo under FSDP2] there).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from torch import nn

from memo.errors import MemoError

# NOTE [Which engine runs which layout] is in planner/engines.py (torch-free, so that the layout checks
# below the engines read the same table): re-exported here, beside the engines it describes.
from memo.planner.engines import RUNNABLE, EngineLayouts, engine_for_layout, layout_problem

__all__ = ["ENGINES", "RUNNABLE", "EngineLayouts", "build_hf_causal_lm", "build_megatron_gpt",
           "build_megatron_stages", "engine_for_layout", "hf_config", "init_megatron_world", "layout_problem"]

ENGINES = ("memo", "megatron", "fsdp2")


def init_megatron_world() -> None:
    """megatron's model-parallel state over one process (gloo), unless a process group exists."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from memo.distributed.layout import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def build_megatron_gpt(config: Any, seq_len: int, device: torch.device | str, dtype: torch.dtype,
                       layout: Any = None) -> nn.Module:
    """A megatron-core ``GPTModel`` with memo's layer spec shaped like memo's ``config`` (NOTE [Training
    engines]); its position table (GPT) covers ``seq_len``.

    ``layout``: a :class:`memo.distributed.layout.ParallelLayout` whose parallel state is set up
    (``ParallelRun.start``); the model is then this rank's. None: one process. A layout with pipeline
    stages takes :func:`build_megatron_stages`."""
    from memo.distributed.layout import ParallelLayout

    if layout is None:
        init_megatron_world()
        layout = ParallelLayout()
    if layout.pipeline_parallel > 1:
        raise MemoError(f"memo.train: this layout has {layout.pipeline_parallel} pipeline stages; a rank "
                        "holds model chunks of its stage: build them with memo.engines.build_megatron_stages")
    return _megatron_models(config, seq_len, device, dtype, layout)[0]


def build_megatron_stages(config: Any, seq_len: int, device: torch.device | str, dtype: torch.dtype,
                          layout: Any) -> list[nn.Module]:
    """This pipeline rank's model chunks (one ``GPTModel`` each, in megatron's interleaved order: chunk v
    of rank r holds the (v·P + r)-th L/(P·V) layers), with ``layout``'s parallel state set up
    (``initialize_model_parallel`` with its pipeline sizes). NOTE [Pipeline stages] in
    memo/distributed/pipeline.py."""
    return _megatron_models(config, seq_len, device, dtype, layout)


def _megatron_models(config: Any, seq_len: int, device: torch.device | str, dtype: torch.dtype,
                     layout: Any) -> list[nn.Module]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected here
        try:
            from megatron.core import parallel_state
            from megatron.core.models.gpt import GPTModel
            from megatron.core.transformer.transformer_config import TransformerConfig

            from memo.adapters.megatron import get_memo_gpt_layer_local_spec
        except ImportError as err:
            raise MemoError(f"memo.train: --engine megatron needs megatron-core ({err}); pip install "
                            "megatron-core==0.16.1, or memo[megatron]") from None
    from memo.distributed.layout import padded_vocab_size

    tp = layout.tensor_parallel
    gpt = config.arch == "gpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's notes on settings memo does not use
        tc = _transformer_config(TransformerConfig, config, dtype, layout, device)
    spec = get_memo_gpt_layer_local_spec()
    if layout.sequence_parallel:
        from memo.distributed.cpu_shims import sequence_parallel_norms

        spec = sequence_parallel_norms(spec, tc)  # norms that accept SP (NOTE [Sequence-parallel norm])
    extra: dict[str, Any] = {"position_embedding_type": "learned_absolute" if gpt else "rope"}
    if not gpt and config.rope_theta:
        extra["rotary_base"] = int(config.rope_theta)
    chunks = []
    vpp = layout.virtual_pipeline if layout.pipeline_parallel > 1 else 1
    for v in range(vpp):
        if layout.pipeline_parallel > 1:
            stage: dict[str, Any] = {
                "pre_process": parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                "post_process": parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                "vp_stage": v if vpp > 1 else None}
        else:
            stage = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPTModel(config=tc, transformer_layer_spec=spec,
                             vocab_size=padded_vocab_size(config.vocab_size, tp), max_sequence_length=seq_len,
                             **extra, **stage)
        # memo's pipeline profiles a model "as one rank runs it" (NOTE [Per-rank sizes]) when told so.
        model.tensor_parallel = tp
        chunks.append(model.to(device=device, dtype=dtype))
    return chunks


def _transformer_config(cls: Any, config: Any, dtype: torch.dtype, layout: Any, device: Any) -> Any:
    """megatron's TransformerConfig of memo's ``config`` in ``layout`` (NOTE [Training engines])."""
    from memo.distributed.pipeline import pipeline_config

    tp, cp = layout.tensor_parallel, layout.context_parallel
    gpt = config.arch == "gpt"
    return cls(
        num_layers=config.n_layers, hidden_size=config.hidden, num_attention_heads=config.n_heads,
        num_query_groups=config.n_kv_heads or config.n_heads, ffn_hidden_size=config.ffn_hidden or
        (4 * config.hidden if gpt else None), layernorm_epsilon=config.norm_eps,
        normalization="LayerNorm" if gpt else "RMSNorm", gated_linear_unit=not gpt,
        activation_func=torch.nn.functional.gelu if gpt else torch.nn.functional.silu, add_bias_linear=gpt,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=layout.sequence_parallel,
        cp_comm_type=layout.cp_comm if cp > 1 else None,  # MemoCoreAttention's all-gather or Ulysses CP
        **pipeline_config(layout, dtype, torch.device(device)))


def hf_config(text: str) -> Any:
    """A transformers config from a JSON file, a directory holding ``config.json``, or inline JSON."""
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise MemoError(f"memo.train: --hf-config needs transformers ({err}); pip install memo[hf]") from None
    if os.path.isdir(text):
        text = os.path.join(text, "config.json")
    if os.path.isfile(text):
        with open(text) as f:
            fields = json.load(f)
    else:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError:
            raise MemoError(f"memo.train: --hf-config {text!r} is neither a file, a directory with "
                            "config.json, nor JSON; give e.g. '{\"model_type\": \"llama\", "
                            "\"num_hidden_layers\": 2, ...}'") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise MemoError("memo.train: --hf-config must be a JSON object with a \"model_type\" (llama, qwen2, "
                        "mistral)")
    fields = dict(fields)
    try:
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, KeyError) as err:
        raise MemoError(f"memo.train: --hf-config: {err}") from None


def build_hf_causal_lm(config: Any, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` (random weights) in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.to(device=device)
