"""memo's planned allocator: PyTorch allocates through it while memo is active.

* :func:`planned` -- serve allocations from a plan's arena by (phase, request index), with a
  fallback caching allocator for everything else (which, at its limit, borrows idle arena ranges:
  NOTE [One device pool] in csrc/core/planned_allocator.h).
* :func:`logging` -- record an allocation trace (the input of ``memo.planner``).
* :func:`set_phase` -- the phase listener for :class:`memo.phases.PhaseTracker`.
* :func:`unplanned` -- a scope whose allocations belong to no phase (one-time set-up work).
* :func:`stats`, :func:`reset_stats`, :func:`empty_cache` -- counters and cache control per device.
* :func:`install_cuda` -- make memo PyTorch's CUDA allocator (before the first CUDA tensor).

Example (CPU)::

    tracker = memo.profiler.phase_tracker(model)   # the model adapter's embedding, layers, head
    tracker.add_listener(memo.allocator.set_phase)
    with memo.allocator.logging() as trace:
        with tracker.iteration():
            model(ids, labels).backward()
    plan = memo.planner.make_plan(trace)
    with memo.allocator.planned(plan):
        ...  # later iterations: layer activations come from the arena

``memo.Session(model, plan)`` does this (and wraps the layers) in one context.
"""

from memo.allocator._api import (
    PlanDeviationWarning,
    empty_cache,
    logging,
    planned,
    reset_stats,
    set_phase,
    stats,
    unplanned,
)
from memo.allocator._backends import cuda_installed, cuda_library_path, install_cuda
from memo.allocator._tables import PhaseTables, normalize_plan

__all__ = [
    "PhaseTables",
    "PlanDeviationWarning",
    "cuda_installed",
    "cuda_library_path",
    "empty_cache",
    "install_cuda",
    "logging",
    "normalize_plan",
    "planned",
    "reset_stats",
    "set_phase",
    "stats",
    "unplanned",
]
