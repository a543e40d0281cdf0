"""memo.runtime: wrapped layers, token-wise offload/recompute, rounding buffers.

Public surface::

    memo.runtime.wrap(model, alpha=0.5)      # in place; returns model
    rt = memo.runtime.runtime_of(model)      # MemoRuntime: buffers, stats, switches
    memo.runtime.unwrap(model)

See NOTE [Token-wise recompute] (layer.py), NOTE [Rounding buffer reuse]
(buffers.py) and NOTE [Wrapping in place] (wrap.py).
"""

from memo.runtime.buffers import BufferState, RoundingBuffers, RuntimeStats
from memo.runtime.layer import offload_tokens
from memo.runtime.runtime import (
    LAYER_POLICIES,
    OFFLOADING_POLICIES,
    MemoRuntime,
    default_policy,
    validate_alpha,
    validate_policy,
)
from memo.runtime.wrap import find_layers, is_wrapped, runtime_of, unwrap, wrap

__all__ = [
    "LAYER_POLICIES",
    "OFFLOADING_POLICIES",
    "BufferState",
    "MemoRuntime",
    "RoundingBuffers",
    "RuntimeStats",
    "default_policy",
    "find_layers",
    "is_wrapped",
    "offload_tokens",
    "runtime_of",
    "unwrap",
    "validate_alpha",
    "validate_policy",
    "wrap",
]
