"""What one training iteration runs, for the profile, the calibration and :class:`memo.Session` alike.

NOTE [One step, one path]
Every shape of training iteration is a :class:`Step`: the model chunks memo's runtime wraps (one
model, or a pipeline stage's chunks), the step function that runs the iteration's forwards and
backwards (one batch, or a schedule's micro-batches), and the phase listener that tells memo's
allocator which plan table is open (a :class:`memo.phases.PhaseTracker`, or a stage's
:class:`memo.pipeline.stage_plan.StagePhases`). The rest is written once, for any step:

- the allocator recorder (:func:`record_step`): one unlogged warm-up (on the CPU, for the first
  recording of a job only), then the step logged with its phases open;
- the calibration of the layer policy against recorded iterations (NOTE [Calibrated policy]): one
  loop, :func:`memo.pipeline.policy.calibrated_choice`, which records through a step;
- the construction of a run (:class:`memo.Session`): allocator, wrapped chunks, phases.

Why: a second loop beside the first is a fork. Two calibration loops drift apart in their correction
rules, two construction paths in the order they open the allocator and attach the phases, and a fix
made to one silently misses the other. A new kind of step (a schedule, micro-batches) implements
this protocol and inherits the one path; it never gets its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from memo.adapters.model import model_adapter_for
from memo.errors import internal_assert
from memo.phases import PhaseTracker

__all__ = ["ModelStep", "PhaseListener", "Phases", "Step", "open_with_kept_buffers", "record_step",
           "runtime_device_buffers", "split_policy"]

#: Told each phase as it opens (None: no phase open), e.g. ``memo.allocator.set_phase``.
PhaseListener = Callable[[str | None], None]


class Phases(Protocol):
    """A step's phase listener, attached to its chunks until :meth:`remove`."""

    def iteration(self) -> contextlib.AbstractContextManager[None]:
        """One iteration of the step: no phase is open before or after it."""
        ...

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Open no phase in the body (a batch its plan was not made for)."""
        ...

    def remove(self) -> None:
        ...


class Step(Protocol):
    """What one training iteration runs (NOTE [One step, one path])."""

    #: The modules memo's runtime wraps, their layers in order (chunk after chunk).
    chunks: list[nn.Module]

    def chunk_layers(self) -> list[int]:
        """How many layers each chunk holds (a layer policy is cut into the chunks' by these)."""
        ...

    def run(self) -> None:
        """The iteration's forwards and backwards (no optimizer step)."""
        ...

    def phases(self, listener: PhaseListener) -> Phases:
        """A phase listener on the chunks telling ``listener`` each phase."""
        ...


class ModelStep:
    """One batch through one model with a model adapter (NOTE [Model adapters]): a plain iteration."""

    def __init__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor] | None = None,
                 where: str = "memo.profiler") -> None:
        """``where``: who refuses a model without a model adapter, in the message."""
        self.chunks = [model]
        self.batch = batch
        self.adapter = model_adapter_for(model, where)

    def chunk_layers(self) -> list[int]:
        return [len(self.adapter.parts(self.chunks[0]).layers)]

    def run(self) -> None:
        batch = self.batch
        internal_assert(batch is not None, "ModelStep.run needs the step's batch")
        self.adapter.loss(self.chunks[0], *batch).backward()

    def phases(self, listener: PhaseListener) -> PhaseTracker:
        parts = self.adapter.parts(self.chunks[0])
        return PhaseTracker(parts.embedding, parts.layers, parts.head, listeners=[listener])

    def prepare(self) -> None:
        """Make memo's runtime's one-time allocations now, as an iteration's first forward would (its
        dry run and rounding buffers; NOTE [Warm-up before logging]); nothing for an unwrapped model."""
        from memo import runtime
        from memo.profiler.record import layer_inputs

        model, batch = self.chunks[0], self.batch
        internal_assert(batch is not None, "ModelStep.prepare needs the step's batch")
        if runtime.is_wrapped(model):
            args, kwargs = layer_inputs(model, *batch)
            runtime.runtime_of(model).allocate(*args, **kwargs)


def split_policy(policy: list[str], counts: list[int]) -> list[list[str]]:
    """A layer policy (the step's layers in order, chunk after chunk) cut into each chunk's."""
    out, first = [], 0
    for n in counts:
        out.append(list(policy[first:first + n]))
        first += n
    return out


def runtime_device_buffers(model: nn.Module) -> list[int]:
    """Bytes of each device buffer memo's runtime holds for ``model`` across iterations (its two
    rounding buffers, NOTE [Rounding buffer reuse]); none when the model is not wrapped."""
    from memo import runtime

    if not runtime.is_wrapped(model):
        return []
    buffers = getattr(runtime.runtime_of(model), "buffers", None)
    return [int(t.untyped_storage().nbytes()) for t in getattr(buffers, "device_buffers", None) or []]


def open_with_kept_buffers(trace: dict[str, Any], sizes: list[int]) -> None:
    """NOTE [Buffers made in the warm-up]: the warm-up iteration (NOTE [Warm-up before logging])
    allocates memo's rounding buffers, so the logged iteration never sees them, yet every iteration
    holds them on the device. They open the trace as unphased allocations live to its end: the
    trace's peak (the plan's device total, NOTE [Device total]) counts them, as a trace of the
    dispatch recorder does (it records the first iteration), and a plan for memo's allocator leaves
    them to its fallback, which serves them at run time (NOTE [One-time allocations inside a
    phase] in memo/allocator/_api.py). Ids are new: above every id the trace uses."""
    if not sizes:
        return
    events = trace["events"]
    top = max((int(e["id"]) for e in events if "id" in e), default=0)
    trace["events"] = [{"op": "malloc", "id": top + 1 + i, "size": n} for i, n in enumerate(sizes)] + events


def record_step(step: Step, device: torch.device, meta: dict[str, Any], *, warmed: bool = False
                ) -> dict[str, Any]:
    """The allocator's trace of one run of ``step`` (memo.allocator.logging: the real requests, in the
    allocator's order), after one run that is not logged (NOTE [Warm-up before logging]); the step's
    one-time device buffers open it (NOTE [Buffers made in the warm-up]). No gradient is left behind.
    ``warmed``: an iteration of this job already ran on ``device`` in this process; on the CPU, a
    :class:`ModelStep` is then only prepared (:meth:`ModelStep.prepare`), not run, before the log.

    This is the trace to plan from when the plan is replayed by (phase, request index): kernels
    allocate scratch the dispatch recorder cannot see (NOTE [Which recorder] in docs/profiling.md).
    """
    from memo import allocator

    params = [p for chunk in step.chunks for p in chunk.parameters()]
    # NOTE [Warm-up before logging]: libraries allocate once, on first use, through the current
    # allocator: cuBLAS its workspace per handle and stream, the runtime its rounding buffers,
    # kernels their lazily built caches. Logged in the first iteration they would take request
    # indices that no later iteration makes, and every later request of that phase would
    # deviate. So one iteration runs unlogged first. On the CPU, once one iteration of the job has
    # run in the process, the only one-time allocations left are memo's runtime's own (the dry run
    # sizing its buffers, and the buffers), which ModelStep.prepare makes without an iteration: the
    # logged iteration is then the same, request for request, as after a warm-up (checked in
    # tests/pipeline/test_setup_cost.py), for half the time. CUDA always warms up (a new wrap may
    # bring new streams, and cuBLAS a workspace per stream).
    if warmed and device.type == "cpu" and isinstance(step, ModelStep):
        step.prepare()
    else:
        step.run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for p in params:
        p.grad = None
    phases = step.phases(allocator.set_phase)
    try:
        with allocator.logging(device=device, meta=meta) as trace, phases.iteration():
            step.run()
    finally:
        phases.remove()
        allocator.set_phase(None)
        # The logged backward's gradients come from memo's allocator. Free them now, not when the
        # model is collected: a model profile() built sits in reference cycles (hooks) until the
        # garbage collector runs, and its gradients would count in the next run's device peak.
        for p in params:
            p.grad = None
    open_with_kept_buffers(trace, [n for chunk in step.chunks for n in runtime_device_buffers(chunk)])
    return trace
