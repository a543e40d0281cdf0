"""The one entry point of planning a trace: :func:`make_plan` chooses the bi-level plan (NOTE
[Bi-level plan] in planner/bilevel.py) or a flat one (planner/flat.py) and records the alpha solution.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from memo.errors import MemoError

from .alpha import AlphaSolution
from .bilevel import plan_bilevel
from .flat import as_trace, lower_bound, plan_flat, plan_heuristic, plan_mip, solve_items
from .outliving import GRADIENT_PLACES, outliving
from .plan import UNPHASED_MODES, Plan, without_unphased
from .solvers import require_solver
from .trace import Trace

__all__ = ["lower_bound", "make_plan", "outliving", "plan_bilevel", "plan_heuristic", "plan_mip",
           "solve_items"]


def _check_plan_arguments(capacity: int | None, time_limit: float, use_mip: bool, solver: str,
                          unphased: str, gradients: str) -> None:
    """Refuse :func:`make_plan`'s arguments that are out of range before any work (a missing
    solver too, where one is asked for)."""
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity <= 0):
        raise MemoError("memo.planner: capacity must be a positive number of bytes (an int), "
                        f"got {capacity!r}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise MemoError(f"memo.planner: time_limit must be a positive number of seconds, got {time_limit!r}")
    if use_mip or solver not in ("cbc", "highs"):
        require_solver(solver)
    if unphased not in UNPHASED_MODES:
        raise MemoError(f"memo.planner: unphased must be 'plan' or 'fallback', got {unphased!r}")
    if gradients not in GRADIENT_PLACES:
        raise MemoError(f"memo.planner: gradients must be 'fallback' or 'arena', got {gradients!r}")


def _smaller_of_flat(plan: Plan, t: Trace, outliving: str, deadline: float) -> Plan:
    """The bi-level ``plan``, or the flat heuristic's plan of ``t`` where that is smaller.

    Blocks cost a little where skeletal tensors grow inside a pass; the flat heuristic
    costs a second, so keep it when it is smaller (the allocator only needs phase tables).
    The flat plan kept carries the bi-level plan's warnings and a record of what it replaced.
    """
    left = deadline - time.perf_counter()
    if left <= 0:  # the time limit is the whole plan's: the bi-level plan it has is the answer
        plan.solver["flat_comparison"] = "skipped: the time limit was reached"
        return plan
    flat = plan_heuristic(t, outliving=outliving, time_limit=left)
    if flat.peak >= plan.peak:
        return plan
    flat.warnings.extend(plan.warnings)
    flat.solver["replaced"] = {"kind": "bilevel", "peak": plan.peak, "seconds":
                               plan.solver.get("seconds"), "stages": plan.solver.get("stages")}
    flat.solver["note"] = (f"flat heuristic peak {flat.peak} < bi-level peak {plan.peak}; "
                           "kept the flat plan")
    return flat


def _record_alpha(plan: Plan, alpha_solution: AlphaSolution, host_bytes: int | None) -> int | None:
    """Record the alpha solution in ``plan``; returns the host bytes: those given, else its own."""
    plan.alpha = float(alpha_solution.alpha)
    plan.alpha_binding = str(alpha_solution.binding)
    plan.alpha_detail = alpha_solution.to_dict()
    if host_bytes is None:
        host_bytes = int(alpha_solution.host_bytes)
    return host_bytes


def make_plan(trace: Trace | Mapping[str, Any], alpha_solution: AlphaSolution | None = None, *,
              time_limit: float = 60.0, solver: str = "cbc", use_mip: bool = True, method: str = "auto",
              threads: int = 2, host_bytes: int | None = None, progress: bool | None = None,
              unphased: str = "plan", capacity: int | None = None, gradients: str = "fallback") -> Plan:
    """Plan a trace (a Trace or its JSON dict): the one call `memo profile` and `memo plan` make.

    Args:
        trace: the iteration's allocation trace.
        alpha_solution: an :class:`AlphaSolution` to record in the plan (alpha, binding
            constraint, host bytes), or None.
        time_limit: seconds for the whole plan; the level-1 and level-2 solves share them.
        solver: "cbc" (bundled with PuLP) or "highs" (needs highspy).
        use_mip: False keeps the greedy heuristic everywhere (fast: no search, no MIP).
        method: "auto" (bi-level when the trace has layer phases, flat otherwise; the flat
            heuristic replaces the bi-level plan when it is smaller), "bilevel", "flat" or
            "heuristic".
        host_bytes: pinned host bytes the runtime needs (defaults to the alpha solution's).
        unphased: "plan" gives allocations outside phases an address too (any DSA instance);
            "fallback" leaves them out, for plans memo's allocator replays
            (NOTE [Unphased allocations are not planned for replay] in planner/plan.py), and with
            them the phased allocations never freed in the trace, such as parameter gradients: their
            phase-table entries keep their request index with offset None
            (NOTE [Allocations that outlive the iteration]).
        gradients: where a replay plan puts the parameter gradients made in backward (those of its
            allocations that outlive the iteration in a backward phase): "fallback" (default), or
            "arena", live from their backward pass to the iteration's end, sharing the arena's bytes
            with the activations freed before them. "arena" is for training that sets the gradients
            to None after each optimizer step (no gradient accumulation; NOTE [Allocations that
            outlive the iteration]).
        capacity: bytes the arena may take. None (default) minimises the peak; a capacity is a
            target instead: the exact search stops at the first placement within it (a decision
            is often much easier than the minimum; NOTE [Capacity ladder] in search.py), and
            minimises as usual when it proves the capacity out of reach.
    """
    _check_plan_arguments(capacity, time_limit, use_mip, solver, unphased, gradients)
    started = time.perf_counter()
    t = as_trace(trace)
    left_out = None
    outliving = "plan"
    if unphased == "fallback":
        t, count, nbytes = without_unphased(t)
        left_out = {"allocations": count, "bytes": nbytes}
        outliving = "gradients-in-arena" if gradients == "arena" else "fallback"
    if method == "heuristic":
        plan = plan_heuristic(t, outliving=outliving)
    elif method == "flat":
        plan = plan_flat(t, use_mip=use_mip, time_limit=time_limit, solver=solver, threads=threads,
                     progress=progress, outliving=outliving, capacity=capacity)
    elif method == "bilevel":
        plan = plan_bilevel(t, time_limit=time_limit, solver=solver, threads=threads, use_mip=use_mip,
                            progress=progress, outliving=outliving, capacity=capacity)
    elif method == "auto":
        plan = plan_bilevel(t, time_limit=time_limit, solver=solver, threads=threads, use_mip=use_mip,
                            progress=progress, outliving=outliving, capacity=capacity)
        if plan.solver.get("kind") == "bilevel":
            plan = _smaller_of_flat(plan, t, outliving, started + time_limit)
    else:
        raise MemoError(f"memo.planner: unknown method {method!r}; choose auto, bilevel, flat or heuristic")
    if alpha_solution is not None:
        host_bytes = _record_alpha(plan, alpha_solution, host_bytes)
    plan.host_bytes = host_bytes
    plan.unphased = unphased
    if left_out is not None:
        plan.solver["unphased_left_to_fallback"] = left_out  # what `memo plan` reports
    return plan
