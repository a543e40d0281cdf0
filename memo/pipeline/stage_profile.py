"""A pipeline stage's profile: the cost model of its step, its layer policy calibrated by the one loop
(NOTE [One step, one path] in memo/pipeline/step.py) and the address plan of its step (NOTE [A stage's
address plan] in memo/pipeline/stage_plan.py). The schedule's step itself is memo.train.schedule's."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from memo.errors import MemoError, internal_assert
from memo.machine import Machine
from memo.planner import LayerCosts, PolicySolution
from memo.planner.calibrate import AlphaInputs

from . import stage_plan as sp
from .device import FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES, iteration_total
from .policy import StepProbe, calibrated_choice, layer_costs
from .step import ModelStep, Step, record_step, split_policy

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelLayout, ParallelRun
    from memo.planner import Plan

__all__ = ["ScheduleStep", "StageRequest", "calibrated_stage_policy", "plan_stage", "stage_costs",
           "unchecked_stage_policy"]

Emit = Callable[[str], None]


class ScheduleStep(Step, Protocol):
    """A pipeline stage's step under its schedule (memo.train.schedule.StageStep)."""

    #: This rank's ``(ids, labels, positions, counted tokens)`` of each micro-batch.
    batches: list[tuple[torch.Tensor, ...]]

    def state_bytes(self) -> int:
        """What lives across steps and is not in a step's trace (parameters, optimizer states, DDP's
        gradient buffers)."""
        ...


@dataclass(frozen=True)
class StageRequest:
    """What a stage's profile is for: the layout and this rank's stage, the schedule's micro-batches,
    the machine and the planner's time."""

    layout: ParallelLayout
    #: This rank's pipeline stage.
    stage: int
    micro_batches: int
    #: Its ``None`` fields are measured (the stage's ranks agree on the numbers).
    machine: Machine
    #: Seconds the planner's MIP stages may take.
    time_limit: float
    #: Seeds the stage model's stand-ins for the tensors other stages send (NOTE [A stage's profile]).
    seed: int
    #: The job the stage's plan is made for (memo.planner.job): model, sequence, batch, dtype, shards.
    job: dict[str, Any]

    def in_flight(self, chunks: int) -> list[int]:
        """Forwards each of the stage's chunks holds at once (:func:`memo.distributed.pipeline.in_flight`)."""
        from memo.distributed.pipeline import in_flight

        p, v = self.layout.pipeline_parallel, self.layout.virtual_pipeline
        return in_flight(p, self.stage, v, self.micro_batches) if p > 1 else [1] * chunks


def stage_votes(value: Any, parallel: ParallelRun | None, stage: int) -> list[Any]:
    """``value`` of every rank of this rank's stage (a collective; one process: its own)."""
    if parallel is None:
        return [value]
    return [v for st, v in parallel.gather((stage, value)) if st == stage]


def _stage_machine(mine: tuple[float, float, int], parallel: ParallelRun | None, stage: int
                   ) -> tuple[float, float, int]:
    """The slowest link, the slowest layer and the smallest host share over the ranks of this rank's stage
    (a collective): every rank of a stage then solves the same policy (NOTE [Decisions every rank
    shares] in memo/pipeline/policy.py)."""
    votes = stage_votes(mine, parallel, stage)
    return (min(m[0] for m in votes), max(m[1] for m in votes), min(m[2] for m in votes))


def stage_costs(step: ScheduleStep, request: StageRequest, parallel: ParallelRun | None, emit: Emit
                ) -> tuple[AlphaInputs, LayerCosts]:
    """The layer policy's cost model of this rank's stage (NOTE [A stage's profile], NOTE [Policy cost
    model]): a profile of the stage's first chunk, for all the stage's layers and the forwards its
    schedule keeps in flight (NOTE [Forwards in flight in the policy]), on the machine numbers its ranks
    agree on."""
    from memo import pipeline
    from memo.distributed.pipeline import StageModel
    from memo.profiler.measure import GB, machine_memory_bytes, measure_bandwidth, time_layer_forward
    from memo.profiler.record import layer_inputs

    layout, machine, chunks = request.layout, request.machine, step.chunks
    flights = request.in_flight(len(chunks))
    ids, labels, positions, _count = step.batches[0]
    chunk = chunks[0]
    tokens = ids.shape[1] // (layout.tensor_parallel if layout.sequence_parallel else 1)
    model = StageModel(chunk, positions, (tokens, ids.shape[0], chunk.config.hidden_size), seed=request.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = pipeline.profile_step(ModelStep(model, (ids, labels)), pipeline.ProfileRequest(
            tensor_parallel=layout.tensor_parallel, context_parallel=layout.context_parallel, solve=False))
        layer_ms = machine.layer_ms
        if layer_ms is None:  # the stage's ranks time their first layer together (collectives pair up)
            args, kwargs = layer_inputs(model, ids, labels)
            layer_ms = float(time_layer_forward(chunk.decoder.layers[0], *args, layer_kwargs=kwargs).value)
    for p in chunk.parameters():  # the profile ran a backward; the step starts from no gradients
        p.grad = None
    bandwidth = machine.bandwidth_gbps or float(measure_bandwidth(ids.device).value)
    host_gb = machine.host_mem_gb if machine.host_mem_gb is not None else machine_memory_bytes() / GB
    host = machine.replace(host_mem_gb=host_gb).host_per_process()
    bandwidth, layer_ms, host = _stage_machine((bandwidth, layer_ms, host), parallel, request.stage)
    sizes = plain.trace["layers"]
    n_layers = sum(step.chunk_layers())
    lp = AlphaInputs(sizes["S_input"], sizes["S_attn"], sizes["S_others"], bandwidth * GB, layer_ms / 1e3,
                     n_layers, host)
    params = sum(x.numel() * x.element_size() for c in chunks for x in c.parameters())
    states = {"parameters": {"bytes": params}, "optimizer": {"bytes": 2 * params}}
    layer_params = sum(x.numel() for x in chunk.decoder.layers[0].parameters())
    elem = next(chunk.parameters()).element_size()
    costs = layer_costs(plain.trace, lp, tokens, ids.shape[0], elem, layer_params, states, ids.device.type)
    # the whole stage's layers, each holding what it keeps once per forward in flight (the most any of
    # the stage's chunks holds: the interleaved schedule's first chunk)
    emit(f"memo: stage {request.stage}: {max(flights)} forward(s) in flight; S_input {sizes['S_input']:,} B, "
         f"S_attn {sizes['S_attn']:,} B, S_others {sizes['S_others']:,} B per layer")
    return lp, dataclasses.replace(costs, n_layers=n_layers, in_flight=max(flights))


def unchecked_stage_policy(costs: LayerCosts, request: StageRequest, emit: Emit) -> PolicySolution:
    """The stage's layer policy from its cost model alone (no recorder: memo's allocator does not serve
    this device), within --device-mem-gb or full recompute's need."""
    from memo.planner import choose_policy, describe_policy

    budget = request.machine.device_budget_bytes
    solution = choose_policy(costs, budget, headroom=FALLBACK_HEADROOM if budget else 0.0,
                             headroom_bytes=FALLBACK_SEGMENT_BYTES if budget else 0)
    emit(f"memo: stage {request.stage}: {describe_policy(solution.policy)} at alpha {solution.alpha:.4f} "
         f"({solution.binding})")
    return solution


class StageRecording(NamedTuple):
    """A recorded step of the stage with a layer policy: the trace, the host arenas its schedule needs and
    the policy its chunks ran (the runtime's default where none was given)."""

    key: tuple[float, tuple[str, ...] | None]
    trace: dict[str, Any]
    host_bytes: int
    policy: list[str]


class _StageRecorder:
    """Records the stage's step wrapped with a layer policy (the chunks unwrapped after it), in step with
    every other stage: a schedule runs every stage, so every stage records in every round."""

    def __init__(self, step: ScheduleStep, request: StageRequest, parallel: ParallelRun | None) -> None:
        self.step, self.request, self.parallel = step, request, parallel
        self.last: StageRecording | None = None

    def record(self, policy: list[str] | None, alpha: float) -> StageRecording:
        from memo import runtime

        step = self.step
        shares = split_policy(policy, step.chunk_layers()) if policy else [None] * len(step.chunks)
        for chunk, share in zip(step.chunks, shares, strict=True):
            runtime.wrap(chunk, alpha=alpha, policy=share)
        try:
            trace = record_step(step, step.batches[0][0].device, self.request.job)
            runtimes = [runtime.runtime_of(c) for c in step.chunks]
            flights = self.request.in_flight(len(runtimes))
            host = sum(f * rt.buffers.flight_bytes for f, rt in zip(flights, runtimes, strict=True)
                       if rt.buffers is not None and rt.n_offloaded)
            ran = [kind for rt in runtimes for kind in rt.policy]
        finally:
            for chunk in step.chunks:
                runtime.unwrap(chunk, force=True)
        key = (float(alpha), None if policy is None else tuple(policy))
        self.last = StageRecording(key, trace, host, ran)
        return self.last

    def in_round(self, policy: list[str], alpha: float, _tile_tokens: int | None) -> dict[str, Any]:
        """One round's recording (the calibration's :class:`~memo.pipeline.policy.StepProbe`)."""
        sp.all_done(False, self.parallel)  # this stage records: so does every other
        return self.record(policy, alpha).trace

    def finish(self, policy: list[str], alpha: float, probe: StepProbe) -> StageRecording:
        """Record ``policy`` (measured as ``probe`` measures, with the same collectives) while any stage
        still records, and once at least unless the last recording was of it; the recording of ``policy``."""
        key = (float(alpha), tuple(policy))
        while not sp.all_done(self.last is not None and self.last.key == key, self.parallel):
            probe.measure(self.record(policy, alpha).trace)
        last = self.last
        internal_assert(last is not None, "memo.pipeline: a stage left its rounds without a recording")
        return last


# NOTE [A stage's calibrated policy]
# The cost model of a stage comes from one micro-batch through its first chunk; what the stage's step
# really holds (the schedule's p2p buffers, the embedding's or the head's share, memo's runtime beyond
# the model) it does not see, and a policy it says fits may not. So, where memo's allocator records the
# stage, its policy is calibrated and probed by the one loop every step shares (calibrated_choice in
# memo/pipeline/policy.py, NOTE [Calibrated policy]; NOTE [One step, one path]): each recording is of
# the stage's whole step under its schedule. A schedule runs every stage, so the stages record in
# rounds: before each recording every rank says whether it is done, and a stage that is done records
# its accepted policy again while any other still records; the ranks of a stage agree on each total
# (the largest). The last recording of the accepted policy is the trace its address plan is made from.
# A stage that no policy fits records full recompute with the others until they are done, and then
# every rank stops, with what full recompute recorded.
def calibrated_stage_policy(step: ScheduleStep, request: StageRequest, inputs: AlphaInputs, costs: LayerCosts,
                            parallel: ParallelRun | None, emit: Emit) -> tuple[float, StageRecording]:
    """NOTE [A stage's calibrated policy]: alpha and the recorded step of the accepted policy."""
    recorder = _StageRecorder(step, request, parallel)
    probe = StepProbe(recorder.in_round, step.state_bytes(),
                      lambda value: int(max(stage_votes(int(value), parallel, request.stage))), "fallback")
    say = lambda line: emit(f"memo: stage {request.stage}: {line}")  # noqa: E731
    failed = None
    try:
        probed = calibrated_choice(probe, costs, inputs, alpha=None, policy=None,
                                   budget=request.machine.device_budget_bytes, wrap_pass=True, say=say)
        alpha, policy = float(probed.alpha.alpha), list(probed.policy.policy)
    except MemoError as e:  # no policy fits this stage; the other stages finish their rounds first
        failed, alpha, policy = e, 0.0, ["recompute"] * costs.n_layers
    recording = recorder.finish(policy, alpha, probe)
    problem = None
    if failed is not None:
        budget = request.machine.device_budget_bytes
        within = "full recompute's need" if budget is None else f"--device-mem-gb {budget / 1e9:g}"
        recorded = iteration_total(recording.trace, probe.static)
        problem = (f"memo.train: stage {request.stage}: no layer policy fits {within}: full recompute alone "
                   f"records {recorded / 2**20:.1f} MiB; give more device memory, more pipeline stages or "
                   f"tensor parallelism, or a shorter sequence ({failed})")
    sp.stop_together(problem, parallel)
    return alpha, recording


def plan_stage(step: ScheduleStep, request: StageRequest, parallel: ParallelRun | None, *, alpha: float,
               recording: StageRecording | None, given: Plan | None, given_from: str | None = None,
               save_plan: str | None, emit: Emit) -> Plan:
    """This rank's plan of its stage's step (NOTE [A stage's address plan] in memo/pipeline/stage_plan.py):
    ``given`` (from --plan ``given_from``), else made from ``recording`` (the step recorded with the
    policy it runs) or, without one, from the step recorded here with the runtime's default policy at
    ``alpha``; planned and agreed on by the stage's ranks; written to ``save_plan`` when asked."""
    schedule = sp.stage_schedule(request.layout, request.stage, request.micro_batches, step.chunks)
    if given is not None:
        plan = given
    else:
        if recording is None:
            recording = _StageRecorder(step, request, parallel).record(None, alpha)
        plan = sp.stage_plan(recording.trace, schedule, step.state_bytes(), host_bytes=recording.host_bytes,
                             time_limit=request.time_limit)
        plan.alpha = alpha
        plan.policy = list(recording.policy)  # what each chunk runs
        plan = sp.agree_on_plan(plan, recording.trace, parallel, request.stage)
    budget = request.machine.device_budget_bytes
    need = int(plan.device["total_bytes"])
    stage = request.stage
    sp.stop_together(None if budget is None or need <= budget else (
        f"memo.train: stage {stage}'s plan needs {need / 2**20:.1f} MiB of device memory, more than "
        f"--device-mem-gb {budget / 1e9:g} ({budget / 2**20:.1f} MiB); give more device memory, "
        "more pipeline stages or tensor parallelism, or a shorter sequence"), parallel)
    if save_plan:
        sp.save_stage_plan(plan, save_plan, parallel, stage)
    emit(f"memo: stage {stage}: plan of its step ({schedule['schedule']}, {request.micro_batches} "
         f"micro-batches, {len(plan.allocations):,} allocations): arena {plan.peak / 2**20:.1f} MiB, "
         f"device total {plan.device['total_bytes'] / 2**20:.1f} MiB, host "
         f"{plan.device['host_bytes'] / 2**20:.1f} MiB" + ("" if given is None else f" (from {given_from})"))
    return plan
