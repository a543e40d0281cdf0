"""Reference transformer models (GPT, Llama) with the pre / core / post layer anatomy.

See :mod:`memo.models.model` for the structure memo's profiler and runtime rely on.
``memo.models.attention`` is the function; its module is :mod:`memo.models.causal_attention`
(a submodule of the same name would be shadowed by the function the package re-exports).
"""

from memo.models.causal_attention import attention, attention_backend, attention_backward, attention_forward
from memo.models.config import (
    ModelConfig,
    fingerprint,
    get_config,
    hf_shapes,
    list_configs,
    load_config,
    register_config,
)
from memo.models.layers import CoreAttention, GPTLayer, LlamaLayer, TransformerLayer, apply_rotary
from memo.models.loss import DEFAULT_CHUNK_BYTES, IGNORE_INDEX, chunked_lm_loss, default_chunk_tokens
from memo.models.model import (
    DEFAULT_MAX_SEQ_LEN,
    RECOMPUTE_MODES,
    GPTEmbedding,
    GPTModel,
    LlamaEmbedding,
    LlamaModel,
    LMHead,
    TransformerModel,
    build_model,
    num_parameters,
)
from memo.models.norms import RMSNorm
from memo.models.parallel import RankShapes, context_parallel_seq_len, per_rank_seq_len, rank_shapes

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_SEQ_LEN",
    "IGNORE_INDEX",
    "RECOMPUTE_MODES",
    "RMSNorm",
    "CoreAttention",
    "GPTEmbedding",
    "GPTLayer",
    "GPTModel",
    "LMHead",
    "LlamaEmbedding",
    "LlamaLayer",
    "LlamaModel",
    "ModelConfig",
    "RankShapes",
    "TransformerLayer",
    "TransformerModel",
    "apply_rotary",
    "attention",
    "attention_backend",
    "attention_backward",
    "attention_forward",
    "build_model",
    "chunked_lm_loss",
    "context_parallel_seq_len",
    "default_chunk_tokens",
    "fingerprint",
    "get_config",
    "hf_shapes",
    "list_configs",
    "load_config",
    "num_parameters",
    "per_rank_seq_len",
    "rank_shapes",
    "register_config",
]
