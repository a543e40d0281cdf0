"""memo.adapters: map layer classes onto the pre / core / post anatomy (NOTE [Layer adapters]).

Built in: memo's reference GPT/Llama layers (:class:`AnatomyAdapter`) and
megatron-core's ``TransformerLayer`` (:mod:`memo.adapters.megatron`, loaded when a
megatron model is wrapped).
"""

from memo.adapters.base import (
    AnatomyAdapter,
    LayerAdapter,
    find_adapter,
    register_adapter,
    registered_adapters,
    unregister_adapter,
)

__all__ = [
    "AnatomyAdapter",
    "LayerAdapter",
    "find_adapter",
    "register_adapter",
    "registered_adapters",
    "unregister_adapter",
]
