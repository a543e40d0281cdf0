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
  process group exists, as ``tests/adapters/test_megatron.py`` does. Several (``torchrun``, NOTE [Parallel
  layout] in memo/distributed/layout.py): the caller has set up the parallel state of its
  ``ParallelLayout`` and the model is one rank's (tensor, sequence and context parallel); the
  vocabulary is padded the same way for every layout, so the shards are slices of the
  single-process model.
- ``--hf-config``: ``transformers.AutoModelForCausalLM.from_config`` of a config given as a
  JSON file, a directory with ``config.json`` (no weights are loaded), or inline JSON with a
  ``model_type``; randomly initialised, no download.
- ``--hf-model``: ``transformers.AutoModelForCausalLM.from_pretrained`` of a local checkpoint directory
  (config.json and safetensors weights, offline), in its config's dtype or ``--dtype`` (NOTE [Loading
  a checkpoint]); under ``megatron`` the checkpoint converted into memo's GPTModel
  (:func:`load_megatron_from_hf`). megatron's vocabulary is padded to a multiple of 128; the padded
  logits are -inf before the loss (NOTE [Hugging Face weights in megatron's layout] in
  memo/adapters/megatron_hf.py), so a padded model's loss is its real vocabulary's.
- ``--rope-theta`` / ``--rope-scaling`` change an HF config's rope parameters before its model is built
  (NOTE [Context extension]).
- ``fsdp2``: memo's model of that name, or the ``--hf-config`` / ``--hf-model`` model, built as above on
  every rank (from the same seed, or the same checkpoint), then sharded by PyTorch FSDP2 (``fully_shard``
  per layer and on the root, ``CPUOffloadPolicy`` with ``--offload-states``) over data-parallel ranks,
  under ``torchrun`` or as a world of one (memo/distributed/fsdp2.py, NOTE [memo under FSDP2] there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.errors import MemoError

# NOTE [Which engine runs which layout] is in planner/engines.py (torch-free, so that the layout checks
# below the engines read the same table): re-exported here, beside the engines it describes.
from memo.planner.engines import RUNNABLE, EngineLayouts, engine_for_layout, layout_problem

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import PretrainedConfig

    from memo.distributed.layout import ParallelLayout
    from memo.models.config import ModelConfig

__all__ = ["ENGINES", "RUNNABLE", "EngineLayouts", "apply_rope", "build_hf_causal_lm", "build_megatron_gpt",
           "build_megatron_stages", "check_hf_checkpoint", "checkpoint_dtype", "engine_for_layout",
           "hf_checkpoint_config", "hf_config", "init_megatron_world", "layout_problem", "load_hf_causal_lm",
           "load_megatron_from_hf"]

ENGINES = ("memo", "megatron", "fsdp2")


def init_megatron_world() -> None:
    """megatron's model-parallel state over one process (gloo), unless a process group exists, with the
    CPU shims a parallel run installs too (memo/distributed/cpu_shims.py; nothing where CUDA is usable):
    megatron's rotary embedding moves its frequencies to ``torch.cuda.current_device()``."""
    from megatron.core import parallel_state

    from memo.distributed.cpu_shims import install_cpu_shims

    install_cpu_shims()

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from memo.distributed.layout import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def build_megatron_gpt(config: ModelConfig, seq_len: int, device: torch.device | str, dtype: torch.dtype,
                       layout: ParallelLayout | None = None, tied: bool = False) -> nn.Module:
    """A megatron-core ``GPTModel`` with memo's layer spec shaped like memo's ``config`` (NOTE [Training
    engines]); its position table (GPT) covers ``seq_len``.

    ``layout``: a :class:`memo.distributed.layout.ParallelLayout` whose parallel state is set up
    (``ParallelRun.start``); the model is then this rank's. None: one process. A layout with pipeline
    stages takes :func:`build_megatron_stages`. ``tied``: the output layer shares the word embedding
    (a checkpoint's ``tie_word_embeddings``)."""
    from memo.distributed.layout import ParallelLayout

    if layout is None:
        init_megatron_world()
        layout = ParallelLayout()
    if layout.pipeline_parallel > 1:
        raise MemoError(f"memo.train: this layout has {layout.pipeline_parallel} pipeline stages; a rank "
                        "holds model chunks of its stage: build them with memo.engines.build_megatron_stages")
    return _megatron_models(config, seq_len, device, dtype, layout, tied)[0]


def build_megatron_stages(config: ModelConfig, seq_len: int, device: torch.device | str, dtype: torch.dtype,
                          layout: ParallelLayout) -> list[nn.Module]:
    """This pipeline rank's model chunks (one ``GPTModel`` each, in megatron's interleaved order: chunk v
    of rank r holds the (v·P + r)-th L/(P·V) layers), with ``layout``'s parallel state set up
    (``initialize_model_parallel`` with its pipeline sizes). NOTE [Pipeline stages] in
    memo/distributed/pipeline.py."""
    return _megatron_models(config, seq_len, device, dtype, layout)


def load_megatron_from_hf(path: str, hf: PretrainedConfig, seq_len: int, device: torch.device | str,
                          dtype: torch.dtype, layout: ParallelLayout | None = None
                          ) -> tuple[nn.Module, ModelConfig]:
    """The ``--hf-model`` checkpoint at ``path`` (its config ``hf``, rope flags applied) as this rank's
    megatron-core ``GPTModel`` and memo's ModelConfig of its shapes: the model built as
    :func:`build_megatron_gpt` builds memo's, then filled with the rank's shards of the checkpoint (NOTE
    [Hugging Face weights in megatron's layout] in memo/adapters/megatron_hf.py)."""
    from memo.adapters.megatron_hf import load_hf_weights, megatron_shapes

    where = f"memo.train: --hf-model {path!r}"
    config = megatron_shapes(hf, where)
    # pipeline stages are refused by TrainConfig first (one GPTModel per rank holds the checkpoint)
    model = build_megatron_gpt(config, seq_len, "cpu", dtype, layout,
                               tied=bool(getattr(hf, "tie_word_embeddings", False)))
    load_hf_weights(model, path, hf, config, where)
    model.hf_config = hf  # --export writes it back under this config (memo/train/export.py)
    return model.to(device=device), config


def _megatron_models(config: ModelConfig, seq_len: int, device: torch.device | str, dtype: torch.dtype,
                     layout: ParallelLayout, tied: bool = False) -> list[nn.Module]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected here
        try:
            from megatron.core import parallel_state
            from megatron.core.models.gpt import GPTModel
            from megatron.core.transformer.transformer_config import TransformerConfig

            from memo.adapters.megatron import get_memo_gpt_layer_local_spec
            from memo.adapters.megatron_hf import PaddedVocabMask
        except ImportError as err:
            raise MemoError(f"memo.train: --engine megatron needs megatron-core ({err}); pip install "
                            "megatron-core==0.16.1, or memo[megatron]") from None
    from memo.distributed.layout import padded_vocab_size

    tp = layout.tensor_parallel
    padded = padded_vocab_size(config.vocab_size, tp)
    gpt = config.arch == "gpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's notes on settings memo does not use
        tc = _transformer_config(TransformerConfig, config, dtype, layout, device)
    spec = get_memo_gpt_layer_local_spec(qk_layernorm=bool(getattr(config, "qk_norm", False)))
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
            model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=padded,
                             max_sequence_length=seq_len, share_embeddings_and_output_weights=tied,
                             **extra, **stage)
        # memo's pipeline profiles a model "as one rank runs it" (NOTE [Per-rank sizes]) when told so.
        model.tensor_parallel = tp
        model.memo_config = config  # what --export names the tensors by (memo/train/export.py)
        if getattr(model, "output_layer", None) is not None and padded > config.vocab_size:
            model.output_layer.register_forward_hook(PaddedVocabMask(
                config.vocab_size, padded, parallel_state.get_tensor_model_parallel_rank(), tp))
        chunks.append(model.to(device=device, dtype=dtype))
    return chunks


def _transformer_config(cls: type[TransformerConfig], config: ModelConfig, dtype: torch.dtype,
                        layout: ParallelLayout, device: torch.device | str) -> TransformerConfig:
    """megatron's TransformerConfig of memo's ``config`` in ``layout`` (NOTE [Training engines])."""
    from memo.distributed.pipeline import pipeline_config

    tp, cp = layout.tensor_parallel, layout.context_parallel
    gpt = config.arch == "gpt"
    return cls(
        num_layers=config.n_layers, hidden_size=config.hidden, num_attention_heads=config.n_heads,
        num_query_groups=config.n_kv_heads or config.n_heads, kv_channels=config.head_dim,
        qk_layernorm=bool(getattr(config, "qk_norm", False)), ffn_hidden_size=config.ffn_hidden or
        (4 * config.hidden if gpt else None), layernorm_epsilon=config.norm_eps,
        normalization="LayerNorm" if gpt else "RMSNorm", gated_linear_unit=not gpt,
        activation_func=torch.nn.functional.gelu if gpt else torch.nn.functional.silu, add_bias_linear=gpt,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=layout.sequence_parallel,
        cp_comm_type=layout.cp_comm.value if cp > 1 else None,  # MemoCoreAttention's all-gather or Ulysses CP
        **pipeline_config(layout, dtype, torch.device(device)))


def hf_config(text: str) -> PretrainedConfig:
    """A transformers config from a JSON file, a directory holding ``config.json``, or inline JSON.

    A file that cannot be read as JSON, a size that is not a positive integer, heads that do not
    share out, an unknown ``rope_type`` and anything else transformers refuses is a MemoError naming
    the field and the value (NOTE [An HF config memo can run])."""
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise MemoError(f"memo.train: --hf-config needs transformers ({err}); pip install memo[hf]") from None
    fields = _hf_fields(text)
    fields = dict(fields)
    model_type = fields.pop("model_type")
    if not isinstance(model_type, str):
        raise MemoError(f"memo.train: --hf-config: model_type must be a name such as \"llama\", got "
                        f"{model_type!r:.80}")
    _check_hf_sizes(fields)
    with _rope_refusals() as refused:
        try:
            config = AutoConfig.for_model(model_type, **fields)
        except MemoError:
            raise
        except Exception as err:  # transformers' validators raise ValueError, KeyError, TypeError, ...
            raise MemoError(f"memo.train: --hf-config: transformers refuses this {model_type} config: "
                            f"{_one_line(err)}") from None
    if refused:
        _check_rope_types(config)  # an unknown type said in its own words
        raise MemoError(f"memo.train: --hf-config: transformers refuses the rope parameters "
                        f"{_rope_parameters(config)!r:.200}: {refused[0]}")
    _check_hf_heads(config)
    _check_rope_types(config)
    return config


# NOTE [An HF config memo can run]
# transformers takes many configs it cannot run and says so late or not at all: a zero or negative
# size fails in the model's constructor (a ZeroDivisionError in the rotary init, a negative dimension
# in nn.Embedding), or at the first forward (key/value heads that do not divide the heads, an empty
# vocabulary), or never (a zero-wide MLP); an unknown rope_type is a KeyError in the rotary init;
# out-of-range rope parameters are only logged. memo train would print a traceback, or train a model
# the user did not mean. So: the sizes are checked before transformers sees them, the heads and rope
# types once it has filled in its defaults, rope warnings that say a value "must be" something are
# refusals, and whatever transformers raises while making the config or building the model is a
# MemoError that quotes it.

#: Sizes of a decoder config that must be positive integers where given (null: the model's default).
_HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")
#: What the rope validators of transformers log when they refuse a value (NOTE [An HF config memo can run]).
_ROPE_REFUSALS = ("must be", "Missing validation function", "Missing required keys")


def _hf_fields(text: str) -> dict[str, Any]:
    """The JSON object ``--hf-config`` gives: a file, a directory's config.json, or inline JSON."""
    from memo.jsonio import read_json

    if os.path.isdir(text):
        folder, text = text, os.path.join(text, "config.json")
        if not os.path.isfile(text):
            raise MemoError(f"memo.train: --hf-config {folder!r} is a directory without a config.json; give "
                            "the config file itself, or a directory holding config.json")
    if os.path.isfile(text):
        fields = read_json(text, "memo.train: --hf-config", "give a config.json")
    else:
        try:
            fields = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            raise MemoError(f"memo.train: --hf-config {text!r:.200} is neither a file, a directory with "
                            "config.json, nor JSON; give e.g. '{\"model_type\": \"llama\", "
                            "\"num_hidden_layers\": 2, ...}'") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise MemoError("memo.train: --hf-config must be a JSON object with a \"model_type\" (llama, qwen2, "
                        "mistral)")
    return fields


def _one_line(err: BaseException, limit: int = 300) -> str:
    """The error as one line of at most about ``limit`` characters (transformers' can list every model)."""
    text = " ".join(str(err).split())
    text = text if len(text) <= limit else text[:limit] + " ..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _fields_holding(config: PretrainedConfig, err: BaseException) -> str:
    """``": hidden_act = 'swishy'"``: the config's fields whose value the error is about (a KeyError of
    a lookup table says only the value), or nothing when no field holds it."""
    value = err.args[0] if len(err.args) == 1 else None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        return ""
    fields = config.to_dict()
    found = [f"{k} = {v!r}" for k, v in fields.items() if type(v) is type(value) and v == value]
    found += [f"{k}.{kk} = {vv!r}" for k, v in fields.items() if isinstance(v, dict)
              for kk, vv in v.items() if type(vv) is type(value) and vv == value]
    return f": {', '.join(found[:3])}" if found else ""


def _check_hf_sizes(fields: dict[str, Any]) -> None:
    for name in _HF_SIZES:
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise MemoError(f"memo.train: --hf-config: {name} must be a positive integer, got {value!r:.80}")


def _check_hf_heads(config: PretrainedConfig) -> None:
    heads = getattr(config, "num_attention_heads", None)
    groups = getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(groups, int) and heads % groups:
        raise MemoError(f"memo.train: --hf-config: num_key_value_heads ({groups}) must divide "
                        f"num_attention_heads ({heads}): each key/value head serves the same number of heads")


def _rope_parameters(config: PretrainedConfig) -> object:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)


def _check_rope_types(config: PretrainedConfig, flag: str = "--hf-config") -> None:
    """Every rope_type the config names has a rotary init in transformers (else a KeyError at build)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope_parameters(config)
    if not isinstance(params, dict):
        return
    # one set of parameters, or one per layer type ({"full_attention": {...}, "sliding_attention": ...})
    sets = [params] if "rope_type" in params or "type" in params else [p for p in params.values()
                                                                        if isinstance(p, dict)]
    known = {"default", *ROPE_INIT_FUNCTIONS}
    for one in sets:
        kind = one.get("rope_type", one.get("type", "default"))
        if kind not in known:
            raise MemoError(f"memo.train: {flag}: rope_type {kind!r:.80} is not one transformers "
                            f"{_transformers_version()} knows; use one of {', '.join(sorted(known))}")


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


class _Kept(logging.Handler):
    """Keeps the records it is given, to be judged once the code that logged them has returned."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _rope_refusals(also: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """The rope validators' refusals logged while a config is made (NOTE [An HF config memo can run]),
    and records saying any of ``also``; when there are none, the other records they logged are passed
    on as transformers would have printed them (with a refusal, memo's one line is all that is printed)."""
    logger = logging.getLogger("transformers.modeling_rope_utils")
    handler = _Kept(logging.WARNING)
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.WARNING)  # the user's verbosity must not hide a refusal
    logger.propagate = False
    logger.addHandler(handler)
    refused: list[str] = []
    try:
        yield refused
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    refused += [r.getMessage() for r in handler.records
                if any(w in r.getMessage() for w in (*_ROPE_REFUSALS, *also))]
    if not refused:
        for record in handler.records:
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)


def build_hf_causal_lm(config: PretrainedConfig, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` (random weights) in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except MemoError:
        raise
    except Exception as err:  # NOTE [An HF config memo can run]: the constructors check little themselves
        raise MemoError(f"memo.train: --hf-config: transformers cannot build a {config.model_type} model "
                        f"from this config ({_one_line(err)}){_fields_holding(config, err)}; check the sizes "
                        "and options it names") from None
    return model.to(device=device)


# NOTE [Loading a checkpoint]
# ``--hf-model DIR`` is a directory as ``save_pretrained`` writes it: config.json and safetensors weights
# (model.safetensors, or the shards model.safetensors.index.json lists); pickled weights
# (pytorch_model.bin) are not loaded, and nothing is downloaded. The weights load in the dtype the
# config names (config.json's "dtype", older "torch_dtype"; float32 where it names none) unless --dtype
# is given, with transformers' sdpa attention (memo reproduces eager and sdpa). A parameter the
# checkpoint lacks would be initialised at random by transformers with a warning: it is refused, as is
# a model_type without a causal LM in transformers or without a memo model adapter. megatron-core 0.16 has
# no Hugging Face weight converter (its models/huggingface wraps HF modules, it does not convert them):
# --engine megatron converts Llama-family checkpoints with memo's own (NOTE [Hugging Face weights in
# megatron's layout] in memo/adapters/megatron_hf.py), each rank reading only its tensor-parallel
# shards; pipeline stages (--pp, and the pipelined loop of --micro-batches) are refused.
# Under FSDP2 every rank loads the whole checkpoint (from the same files: the same tensors) and moves it
# to its device, where fully_shard then keeps the rank's shard. So each rank holds the whole model once
# in host memory while loading (the memory-mapped files are shared through the page cache, the tensors
# are each rank's own) and once on its device until it is sharded: 2 bytes a parameter in bfloat16,
# 16 GB for an 8B model on each rank. That is simple and correct for any model one device holds; a
# larger one would be built on the meta device by every rank, sharded, and filled from rank 0's loaded
# tensors (torch.distributed.checkpoint.state_dict.set_model_state_dict with broadcast_from_rank0=True).

#: The files that hold a checkpoint's weights as safetensors, alone or as shards.
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def check_hf_checkpoint(path: str) -> None:
    """A one-line MemoError when ``path`` cannot be a ``--hf-model`` checkpoint: not a directory, no
    config.json, no safetensors weights (NOTE [Loading a checkpoint])."""
    where = f"memo.train: --hf-model {path!r}"
    made = "give the directory save_pretrained wrote (config.json and model.safetensors)"
    if not os.path.isdir(path):
        raise MemoError(f"{where} is not a directory; {made}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise MemoError(f"{where} has no config.json; {made} (--hf-config builds a model from a config "
                        "alone, with random weights)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _WEIGHTS):
        pickled = os.path.isfile(os.path.join(path, "pytorch_model.bin"))
        raise MemoError(f"{where} holds no safetensors weights ({' or '.join(_WEIGHTS)}); " + (
            "its pytorch_model.bin is a pickle, which memo does not load: write the model with "
            "save_pretrained(DIR, safe_serialization=True)" if pickled else made))


def checkpoint_dtype(path: str) -> str:
    """The dtype (a name memo trains in) that a ``--hf-model`` checkpoint's config.json names, float32
    where it names none (NOTE [Loading a checkpoint])."""
    from memo.jsonio import read_json
    from memo.models.dtypes import DTYPES

    check_hf_checkpoint(path)
    fields = read_json(os.path.join(path, "config.json"), f"memo.train: --hf-model {path!r}",
                       "give the directory save_pretrained wrote")
    if not isinstance(fields, dict):
        raise MemoError(f"memo.train: --hf-model {path!r}: its config.json is not a JSON object")
    name = str(fields.get("dtype") or fields.get("torch_dtype") or "float32").removeprefix("torch.")
    if name not in DTYPES:
        raise MemoError(f"memo.train: --hf-model {path!r}: its config.json names dtype {name!r:.40}, which "
                        f"memo does not train in; give --dtype ({', '.join(DTYPES)})")
    return name


def hf_checkpoint_config(path: str, rope_theta: float | None = None,
                         rope_scaling: dict[str, Any] | None = None) -> PretrainedConfig:
    """The config of the ``--hf-model`` checkpoint at ``path``, with the rope parameters given
    (NOTE [Context extension]); a directory that is no causal-LM checkpoint is a one-line MemoError."""
    check_hf_checkpoint(path)
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as err:
        raise MemoError(f"memo.train: --hf-model needs transformers ({err}); pip install memo[hf]") from None
    where = f"memo.train: --hf-model {path!r}"
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers raises ValueError, KeyError, OSError, ... for a bad config
        raise MemoError(f"{where}: transformers cannot read its config.json ({_one_line(err)})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise MemoError(f"{where}: its model_type {config.model_type!r} ({type(config).__name__}) is not a "
                        "causal LM in transformers; memo train fine-tunes causal LMs such as llama, qwen2, "
                        "mistral")
    apply_rope(config, rope_theta, rope_scaling)
    return config


def load_hf_causal_lm(path: str, config: PretrainedConfig, device: torch.device | str,
                      dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, config=config)`` in ``dtype`` on ``device``, offline,
    safetensors only, every parameter from the checkpoint (NOTE [Loading a checkpoint])."""
    from transformers import AutoModelForCausalLM

    from memo.adapters.model import model_adapter_for

    where = f"memo.train: --hf-model {path!r}"
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=dtype, local_files_only=True, use_safetensors=True,
            attn_implementation="sdpa", output_loading_info=True)
    except MemoError:
        raise
    except Exception as err:
        raise MemoError(f"{where}: transformers cannot load it ({_one_line(err)})") from None
    missing = [*sorted(info.get("missing_keys") or []), *(str(k) for k in info.get("mismatched_keys") or [])]
    if missing:
        raise MemoError(f"{where}: its weights lack {len(missing)} of the model's tensors "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); transformers "
                        "would start them at random: give a complete checkpoint of this config")
    model_adapter_for(model, where)  # a causal LM memo has no model adapter for: refused before training
    # from_pretrained returns the model in eval mode (for inference); it is trained, with the dropout its
    # config asks for, as a model from_config is
    return model.to(device=device).train()


# NOTE [Context extension]
# --rope-theta and --rope-scaling change the rope parameters of the Hugging Face config (--hf-model's or
# --hf-config's) before its model is built, so the rotary embedding the model builds, the one it trains
# with and the config.json that --export writes all hold them. --rope-scaling is a JSON object spelt as
# transformers' rope_parameters ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
# 4096}; linear, dynamic, llama3 and longrope the same way; "type" is read as "rope_type"). It replaces
# the config's parameters, keeping its rope_theta unless --rope-theta gives one; a config with one set
# per layer type gets the same change in each. Where --rope-scaling names the pre-trained length
# (original_max_position_embeddings: yarn, llama3, longrope), max_position_embeddings becomes that
# length times its factor, the extended context, as transformers' validators expect (llama3 refuses an
# original length that is not below it, yarn warns when their ratio is not the factor); otherwise it is
# left as it is (dynamic NTK scales from it). What transformers refuses, or only logs as wrong (a value
# that "must be" something, a key it does not know), is a one-line MemoError (NOTE [An HF config memo
# can run]).


def apply_rope(config: PretrainedConfig, rope_theta: float | None = None,
               rope_scaling: dict[str, Any] | None = None) -> None:
    """Set ``config``'s rope parameters in place (NOTE [Context extension]), checked as transformers
    checks them."""
    if rope_theta is None and rope_scaling is None:
        return
    given = [f for f, v in (("--rope-theta", rope_theta), ("--rope-scaling", rope_scaling)) if v is not None]
    where = f"memo.train: {' '.join(given)}"
    params = _rope_parameters(config)
    if not isinstance(params, dict) or not params:
        raise MemoError(f"{where}: this {config.model_type} config has no rope parameters to change")
    nested = config.nested_rope_parameter_keys(params)
    changed: dict[Any, dict[str, Any]] = {}
    for key in nested or [None]:
        old = dict((params[key] if key is not None else params) or {})
        new = old if rope_scaling is None else _scaling(rope_scaling, old)
        if rope_theta is not None:
            new["rope_theta"] = float(rope_theta)
        changed[key] = new
    config.rope_parameters = {**params, **changed} if nested else changed[None]
    scaling = rope_scaling or {}
    original, factor = scaling.get("original_max_position_embeddings"), scaling.get("factor")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (original, factor)):
        config.max_position_embeddings = int(original * factor)
    with _rope_refusals(also=("Unrecognized keys",)) as refused:
        try:
            config.standardize_rope_params()
            _check_rope_types(config, " ".join(given))
            config.validate_rope()
        except MemoError:
            raise
        except Exception as err:
            raise MemoError(f"{where}: transformers refuses the rope parameters "
                            f"{config.rope_parameters!r:.200}: {_one_line(err)}") from None
    if refused:
        raise MemoError(f"{where}: transformers refuses the rope parameters {config.rope_parameters!r:.200}: "
                        f"{refused[0]}")


def _scaling(scaling: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``--rope-scaling``'s parameters in transformers' spelling, with the config's theta and partial
    rotary factor where it gives none."""
    new = dict(scaling)
    if "type" in new and "rope_type" not in new:
        new["rope_type"] = new.pop("type")
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in old:
            new.setdefault(key, old[key])
    return new
