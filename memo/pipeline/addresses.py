"""Step 5 of the pipeline: the planner's bi-level addresses for the planned trace, and the plan's
record of one rank's device memory (NOTE [Device total] in memo/pipeline/device.py)."""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Any

from memo.profiler.stats import offloaded_bytes

from .device import iteration_total, static_bytes

if TYPE_CHECKING:
    from memo.planner import PolicySolution

    from .job import ProfileJob
    from .result import ProfileResult, WrappedRun

__all__ = ["plan_addresses"]


def plan_addresses(job: ProfileJob, result: ProfileResult, chosen: PolicySolution, states: dict[str, Any],
                   wrapped: WrappedRun | None, time_limit: float, solver: str | None) -> None:
    """The planner's bi-level addresses for the planned trace, with the device record."""
    req, st = job.request, job.state
    from memo.planner import Trace, make_plan, offload_difference
    from memo.runtime import offload_tokens

    t0 = time.perf_counter()
    # The plan is for memo's allocator, which serves only phased requests from the arena.
    kwargs: dict[str, Any] = {"alpha_solution": result.alpha, "time_limit": time_limit,
                              "progress": req.progress, "unphased": "fallback", "gradients": req.gradients}
    if solver is not None:
        kwargs["solver"] = solver
    if wrapped is not None:
        # The host arena the wrapped pass really needed, to the byte (slots included, NOTE [Slot
        # alignment] in memo/runtime/buffers.py): what the runtime will check the plan against.
        kwargs["host_bytes"] = wrapped.host_bytes
    with warnings.catch_warnings():
        # memo's last two layers are never offloaded, so their passes differ from the others by
        # design; the planner plans them on their own and keeps its notes in plan.warnings
        # (`memo show` prints them).
        warnings.filterwarnings("ignore", message=r"memo\.planner: phase layer\.", category=UserWarning)
        result.plan = make_plan(Trace.from_dict(result.trace), **kwargs)
    if wrapped is not None and wrapped.offloaded_layers:
        # NOTE [Planned and actual offload] in planner/plan.py
        local = req.seq_len // req.tp  # a rank's layer input holds seq_len / tp tokens
        a = offload_tokens(result.alpha.alpha, local)
        result.plan.offload = {
            "offloaded_layers": wrapped.offloaded_layers,
            "planned_bytes_per_layer": offloaded_bytes(result.plain_trace["layers"], a, local,
                                                       list(chosen.policy)),
            "actual_bytes_per_layer": wrapped.layer_bytes,
            "tensors": [list(t) for t in wrapped.tensors],
        }
        warning = offload_difference(result.plan.offload)
        if warning is not None:
            st.notes.append(warning)
    result.plan.policy = list(chosen.policy)
    # NOTE [Tiles of the device a plan is for] (memo/pipeline/job.py): the tile pass 2 ran, also the
    # default where pass 2 ran elsewhere than the device the plan is for.
    result.plan.tile_tokens = job.tile_tokens(chosen.tile_tokens)
    static = static_bytes(states)
    iteration = iteration_total(result.trace, 0)
    result.plan.device = {
        "budget_bytes": req.machine.device_budget_bytes,
        "model_states": states,
        "activations_bytes": int(result.plan.peak),
        "iteration_peak_bytes": iteration,
        "total_bytes": iteration + static,
        "estimate": {"bytes": int(chosen.device_bytes), "parts": dict(chosen.parts),
                     "full_recompute_bytes": int(chosen.full_recompute_bytes)},
        "binding": chosen.binding,
    }
    st.timings["plan"] = time.perf_counter() - t0
    req.say(f"plan made in {st.timings['plan']:.1f} s")
