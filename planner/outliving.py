"""What a plan does with the allocations that outlive the traced iteration: the parameter
gradients, and caches made in forward (NOTE [Allocations that outlive the iteration])."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memo.phase_names import is_backward_phase

from .trace import Allocation, Trace

__all__ = ["GRADIENT_PLACES", "OUTLIVING_MODES", "gradients", "left_to_fallback", "outliving"]


# NOTE [Allocations that outlive the iteration]
# A plan made for replay (make_plan(..., unphased="fallback")) gives no arena offset to a phased
# allocation that is never freed before the end of the trace (:func:`outliving`). Those are model
# states, not activations: chiefly the parameter gradients AccumulateGrad makes in ``layer.bwd[i]``,
# ``embed.bwd`` and ``head.bwd`` (and, when the traced iteration is the first, optimizer state made
# in ``optimizer``); they live until the optimizer step and zero_grad, past the iteration. An arena
# slot is handed out again every iteration to the same (phase, request index). A gradient placed in
# one would still own it when the next iteration makes the requests planned over those bytes, and
# under gradient accumulation (K micro-batches, forward + backward each, with no zero_grad between)
# that is the very next micro-batch: every such request would find its slot busy and go to the
# fallback as a deviation. So, like unphased allocations (NOTE [Unphased allocations are not planned
# for replay] in planner/plan.py), they are served by the fallback allocator by design and take no
# arena space: the plan's peak, lower bound and no-reuse size count only the planned allocations.
# They are not dropped from the trace: the allocator counts requests per phase, so they keep their
# request index and their phase-table entry reads (size, None); every later request of the phase
# keeps its index and its offset. In micro-batch 2 and later the same request is AccumulateGrad's
# incoming gradient, which it adds into ``.grad`` in place and frees: served by the fallback too,
# and correct either way. ``plan.solver["persistent_left_to_fallback"]`` records their count and
# bytes; validate_plan checks that exactly these have no offset. The trace must start with the
# gradients set to None (the profiler does, as zero_grad(set_to_none=True) does), as the first
# micro-batch of a step sees them.
# That is the safe default, but it costs the gradients' bytes beside the whole arena: the arena is
# reserved at its peak for the run, and at the end of backward, when the gradients are all there,
# most of it is idle (a 16-layer Llama under 40 MiB held 4 MiB of gradients in fallback segments
# beside a 20 MiB arena whose activations were gone). Training without gradient accumulation sets
# the gradients to None after each optimizer step, before the next forward: then a gradient's bytes
# are free before any request planned over them, and make_plan(..., gradients="arena") places the
# gradients (the outliving allocations of backward phases) in the arena, live to the iteration's
# end, where they share bytes with the activations freed before them. The rest that outlives
# (caches made in forward) still goes to the fallback. If a gradient is still alive when a request
# planned over it comes (accumulation after all, or zero_grad called late), the allocator's range
# check sends that request to the fallback as a "slot busy" deviation, counted and said once: more
# memory than planned, never wrong data. ``plan.solver["gradients_in_arena"]`` records their count
# and bytes. `memo train` plans so (it sets gradients to None every step).


def outliving(trace: Trace | Mapping[str, Any]) -> list[Allocation]:
    """Phased allocations never freed before the end of the trace: a replay plan leaves them to
    the fallback allocator, or places the backward passes' ones, the parameter gradients, in the
    arena (NOTE [Allocations that outlive the iteration])."""
    t = trace if isinstance(trace, Trace) else Trace.from_dict(trace)
    return [a for a in t.allocations if a.phase is not None and a.end == t.end_time]


#: What a plan does with the allocations that outlive the traced iteration (:func:`outliving`):
#: "plan" places them as any other; "fallback" leaves them all to the fallback allocator;
#: "gradients-in-arena" places those of backward phases (the parameter gradients) in the arena,
#: live until the iteration's end, and leaves the rest to the fallback (NOTE [Allocations that
#: outlive the iteration]).
OUTLIVING_MODES = ("plan", "fallback", "gradients-in-arena")
#: Where a replay plan puts the parameter gradients (make_plan's ``gradients``).
GRADIENT_PLACES = ("fallback", "arena")


def gradients(t: Trace) -> list[Allocation]:
    """The outliving allocations of backward phases: what AccumulateGrad made, the gradients."""
    return [a for a in outliving(t) if is_backward_phase(a.phase)]


def left_to_fallback(t: Trace, mode: str) -> frozenset[int] | None:
    """The allocations a plan in ``mode`` (:data:`OUTLIVING_MODES`) leaves to the fallback."""
    if mode == "plan":
        return None
    keep = mode == "gradients-in-arena"
    return frozenset(a.index for a in outliving(t) if not (keep and is_backward_phase(a.phase)))
