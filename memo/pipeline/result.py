"""What :func:`memo.pipeline.profile` returns (:class:`ProfileResult`), and what a wrapped pass records
(:class:`WrappedRun`): the results the pipeline's steps fill in, in a module of their own so that every
step imports them directly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memo.profiler.stats import LayerStats

if TYPE_CHECKING:
    from memo.planner import AlphaSolution, LayerCosts, Plan, PolicySolution
    from memo.profiler.measure import Quantity

__all__ = ["ProbeKey", "ProfileResult", "WrappedRun"]

#: What identifies a recorded wrapped iteration: (alpha, layer policy, tile tokens).
ProbeKey = tuple[float, tuple[str, ...], int | None]


@dataclass(frozen=True)
class WrappedRun:
    """What memo's runtime allocated and copied in a wrapped pass."""

    #: The host arena the wrapped pass really needed, to the byte (slots included, NOTE [Slot
    #: alignment] in memo/runtime/buffers.py).
    host_bytes: int
    #: Bytes one offloaded layer copied to the host.
    layer_bytes: int
    offloaded_layers: int
    #: ``(what, bytes)`` per copied tensor of one layer.
    tensors: list[Any]


@dataclass
class ProfileResult:
    """What :func:`profile` found.

    Attributes:
        trace: the trace the plan was made from (pass 2 when it ran, else pass 1), a ``memo.trace`` dict.
        layer_stats: pass 1's per-layer sizes (the alpha LP's S_input, S_attn, S_others).
        plain_trace: pass 1's trace (the unwrapped model).
        quantities: ``bandwidth_gbps``, ``layer_ms``, ``host_memory_bytes`` and where each came from.
        alpha: the planner's AlphaSolution (None when ``solve=False``).
        policy: the planner's PolicySolution: the layer policy and its device need estimate.
        model_states: parameters, gradients and optimizer states of one rank (NOTE [Model states]).
        costs: the layer policy's cost model (``memo.planner.LayerCosts``) as pass 1 and the machine
            give it, before any calibration against a recorded iteration (NOTE [Calibrated policy]).
        plan: the planner's Plan (None when ``plan=False``).
        wrapped: whether ``trace`` comes from the wrapped model (pass 2).
        timings: seconds spent per stage.
        notes: what a user should know (assumed values, a skipped pass).
    """

    trace: dict[str, Any]
    layer_stats: list[LayerStats]
    plain_trace: dict[str, Any]
    quantities: dict[str, Quantity] = field(default_factory=dict)
    alpha: AlphaSolution | None = None
    plan: Plan | None = None
    policy: PolicySolution | None = None
    model_states: dict[str, Any] | None = None
    costs: LayerCosts | None = None
    wrapped: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
