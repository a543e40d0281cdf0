"""memo's vocabularies, each defined once: layer policies, training strategies, estimate
methods, trace recorders, context-parallel communications and model-state shardings.

Each is a ``str`` enum, so a member is its name wherever a string is expected (argparse choices,
JSON files, comparisons with what a file or a flag holds), and the tuples beside them are what
flags and checks list. Torch-free, in the bottom of the data flow, so every part can use them.
"""

from __future__ import annotations

import enum

__all__ = ["CP_COMMS", "ESTIMATE_METHODS", "LAYER_POLICIES", "OFFLOADING_POLICIES", "RECORDERS", "SHARDINGS",
           "STRATEGIES", "CPComm", "EstimateMethod", "LayerPolicy", "Recorder", "Sharding", "StrategyName"]


class LayerPolicy(str, enum.Enum):
    """What one layer keeps for backward (NOTE [Layer policy] in memo/runtime/runtime.py)."""

    MEMO = "memo"  # offload alpha of its tokens' activations, recompute the rest
    INPUT_ONLY = "input-only"  # offload its input only, recompute everything else (attention too)
    RECOMPUTE = "recompute"  # keep its input on the device, recompute everything
    KEEP = "keep"  # keep every activation on the device
    #: its input is not kept: backward recomputes it from the input-only layer before it (NOTE
    #: [Segments of two layers] in memo/runtime/segments.py)
    SEGMENT = "segment"

    def __str__(self) -> str:
        return self.value


class StrategyName(str, enum.Enum):
    """What ``memo train --strategy`` runs: the names of the strategy classes behind the ``Strategy``
    protocol (memo/train/strategies.py, memo/train/peers.py)."""

    NONE = "none"
    FULL_RECOMPUTE = "full-recompute"
    FULL_OFFLOAD = "full-offload"
    MEMO = "memo"
    OFFLOADED_CHECKPOINT = "offloaded-checkpoint"
    TORCHTUNE_OFFLOAD = "torchtune-offload"

    def __str__(self) -> str:
        return self.value


class EstimateMethod(str, enum.Enum):
    """How ``memo estimate`` counts a layout's memory (docs/estimate.md)."""

    PLAN = "plan"  # from meta plans of a few layers, extended to the whole depth
    FORMULA = "formula"  # the closed-form estimator of the seed

    def __str__(self) -> str:
        return self.value


class Recorder(str, enum.Enum):
    """How the profiler sees a trace's allocations (docs/profiling.md)."""

    DISPATCH = "dispatch"  # sizes from the dispatched ops: any device, meta included
    ALLOCATOR = "allocator"  # the allocator's own requests on a CPU or CUDA device

    def __str__(self) -> str:
        return self.value


class CPComm(str, enum.Enum):
    """How context-parallel ranks' attention communicates (megatron-core's ``cp_comm_type`` names)."""

    ALL_GATHER = "all_gather"  # K and V gathered (memo/models/cp_attention.py)
    A2A = "a2a"  # Ulysses: heads for tokens by all-to-all (memo/models/ulysses_attention.py)

    def __str__(self) -> str:
        return self.value


class Sharding(str, enum.Enum):
    """How the ranks that hold the same weights share the model states (NOTE [Sharded model states]
    in memo/estimate/core.py)."""

    OPTIMIZER = "optimizer"  # megatron's distributed optimizer (ZeRO-1)
    FULL = "full"  # FSDP2's fully_shard (ZeRO-3)
    FULL_OFFLOAD = "full-offload"  # FSDP2 with CPUOffloadPolicy: the shard in host memory

    def __str__(self) -> str:
        return self.value


LAYER_POLICIES: tuple[str, ...] = tuple(p.value for p in LayerPolicy)
#: The policies whose layers copy to host memory.
#: The policies of the layers that hold a slot in the rounding buffers (the policy's leading layers): a
#: segment layer's slot has no host bytes (NOTE [Segments of two layers] in memo/runtime/segments.py).
OFFLOADING_POLICIES: tuple[str, ...] = (LayerPolicy.MEMO.value, LayerPolicy.INPUT_ONLY.value,
                                        LayerPolicy.SEGMENT.value)
STRATEGIES: tuple[str, ...] = tuple(s.value for s in StrategyName)
ESTIMATE_METHODS: tuple[str, ...] = tuple(m.value for m in EstimateMethod)
RECORDERS: tuple[str, ...] = tuple(r.value for r in Recorder)
CP_COMMS: tuple[str, ...] = tuple(c.value for c in CPComm)
SHARDINGS: tuple[str, ...] = tuple(s.value for s in Sharding)
