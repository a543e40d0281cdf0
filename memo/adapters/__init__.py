"""memo.adapters: map layer classes onto the pre / core / post anatomy (NOTE [Layer adapters]).

Model adapters (:mod:`memo.adapters.model`, NOTE [Model adapters]) say where a model keeps its
embedding, layers and head, and how it computes its loss.

Built in: memo's reference GPT/Llama layers (:class:`AnatomyAdapter`),
megatron-core's ``TransformerLayer`` (:mod:`memo.adapters.megatron`, loaded when a
megatron model is wrapped) and Hugging Face's Llama/Qwen2/Mistral decoder layers and
causal LMs (:mod:`memo.adapters.hf`, loaded when a transformers model is wrapped).
"""

from memo.adapters.base import (
    AnatomyAdapter,
    LayerAdapter,
    MLPSite,
    find_adapter,
    register_adapter,
    registered_adapters,
    unregister_adapter,
)
from memo.adapters.model import (
    MemoModelAdapter,
    ModelAdapter,
    ModelParts,
    find_model_adapter,
    model_adapter_for,
    register_model_adapter,
    registered_model_adapters,
    unregister_model_adapter,
)

__all__ = [
    "AnatomyAdapter",
    "LayerAdapter",
    "MLPSite",
    "MemoModelAdapter",
    "ModelAdapter",
    "ModelParts",
    "find_adapter",
    "find_model_adapter",
    "model_adapter_for",
    "register_adapter",
    "register_model_adapter",
    "registered_adapters",
    "registered_model_adapters",
    "unregister_adapter",
    "unregister_model_adapter",
]
