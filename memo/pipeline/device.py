"""What a rank's device holds: the budget the policy plans within, a recorded iteration's device total,
the optimizer's moment, and the model states' share of them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memo.planner import Trace

__all__ = ["FALLBACK_HEADROOM", "FALLBACK_SEGMENT_BYTES", "iteration_total", "optimizer_moment",
           "static_bytes", "usable_device_bytes"]

# NOTE [Fallback headroom]
# Under a device budget the plan's total (iteration peak + model states) is the bytes in use at
# the worst moment, but memo's allocator serves what the plan does not place (gradients,
# optimizer states, temporaries) from a caching pool whose segments fragment, and the plan's
# arena can lend it only whole idle ranges (NOTE [One device pool]). A plan that fills the
# budget to the byte can thus fail on a later step, once the optimizer states live through the
# iteration. The policy is therefore chosen within the budget less this share of it, as a user
# of PyTorch's allocator leaves room between "allocated" and "reserved"; the plan still records
# the whole budget, which `memo train` enforces. The share is at least one segment of the pool
# (FALLBACK_SEGMENT_BYTES): under a small budget 5% is less than one segment's rounding, and a
# plan that "fits" then fails in step 2 (tiny at 1,024 tokens under 16 MiB did). memo's two rounding
# buffers are such fallback allocations, which live through the training: the policy counts them in
# whole segments (LayerCosts.buffer_rounding), else at a large alpha their rounding alone can eat the
# headroom (a 16-layer Llama at 2,048 tokens under 40 MiB: two 7.2 MiB buffers in 8 MiB of segments,
# and AdamW's states, made at the end of step 1, had to borrow the arena's idle bytes: step 2 left
# the plan and ran out of memory).
FALLBACK_HEADROOM = 0.05
#: The fallback pool's segment granularity: kSegmentGranularity in csrc/core/fallback_allocator.h
#: (tests/runtime/test_layer_policy.py reads it there).
FALLBACK_SEGMENT_BYTES = 2 << 20


def usable_device_bytes(budget_bytes: int) -> int:
    """The part of a device budget the policy plans within (NOTE [Fallback headroom]): the policy's
    own rule, ``usable_budget`` with FALLBACK_HEADROOM and FALLBACK_SEGMENT_BYTES."""
    from memo.planner.policy import usable_budget

    return usable_budget(budget_bytes, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)


def static_bytes(states: dict[str, Any]) -> int:
    """What lives across iterations and is not in a trace: parameters and optimizer states (NOTE
    [Model states]; gradients appear in the iteration)."""
    return int(states["parameters"]["bytes"] + states["optimizer"]["bytes"])


# NOTE [The optimizer's moment]
# The plan's arena is reserved for the whole run, also while the optimizer steps, when none of it is
# in use: then the fallback pool holds every gradient, the rounding buffers and the optimizer's states
# (made at the end of step 1) beside it. A policy whose recorded iteration fits the cap can still
# not fit that moment (its peak came early in backward, with few gradients yet): the optimizer's
# states then borrow the arena's idle bytes and the next iteration leaves the plan (a 16-layer Llama at
# 2,048 tokens under 40 MiB ran out of memory in step 2). So the chosen policy must fit both: the
# iteration's peak, and the arena (the most bytes live at once of the allocations it places: those the
# iteration frees, and with gradients in the arena the gradients too) beside what else outlives the
# iteration, plus the model states. Under a budget only: without one, the cap is full recompute's
# iteration need, and an iteration is compared with an iteration.
def optimizer_moment(trace: Trace, static: int, gradients: str = "fallback") -> int:
    """NOTE [The optimizer's moment]: the arena's bytes, what else outlives the iteration, and
    ``static``; ``gradients`` as make_plan's, whose rule for what the arena holds
    (memo.planner.outliving) decides it here too."""
    from memo.planner.dsa import Item, lower_bound
    from memo.planner.outliving import left_to_fallback

    mode = "gradients-in-arena" if gradients == "arena" else "fallback"
    left = left_to_fallback(trace, mode) or frozenset()
    placed = [Item(a.size, a.start, a.end) for a in trace.allocations
              if a.phase is not None and a.index not in left]  # the arena serves phased requests only
    # What else outlives the iteration: those, and what was made outside every phase and never
    # freed (the rounding buffers, made once).
    outliving = sum(a.size for a in trace.allocations
                    if a.index in left or (a.phase is None and a.end == trace.end_time))
    return int(lower_bound(placed)) + outliving + int(static)


def iteration_total(trace: Trace | dict[str, Any], static: int) -> int:
    """NOTE [Device total]: the most bytes live at once in a recorded iteration (activations, memo's
    rounding buffers, gradients as they appear, temporaries) plus ``static`` (parameters and
    optimizer states, which live across iterations and are not in the trace)."""
    from memo.planner import Trace, lower_bound

    return int(lower_bound(trace if isinstance(trace, Trace) else Trace.from_dict(trace))) + int(static)
