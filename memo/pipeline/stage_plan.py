"""A pipeline stage's address plan: its step recorded as its schedule runs it, planned, and checked.

NOTE [A stage's address plan]
One iteration's plan does not describe a pipeline stage: the stage runs the forward and the backward
of every micro-batch through each of its model chunks, in the order its schedule gives (1F1B: up to
P - i forwards before the first backward; interleaved: chunks taking turns), and the activations that
the forwards of different micro-batches save live side by side until their backwards. So the stage's
step is what is recorded and planned:

- Phases carry the micro-batch (NOTE [Micro-batch phases] in memo/phase_names.py): each chunk's layers
  are numbered on from the chunk before (the stage's layer i), and each phase instance, a layer's
  forward or backward of one micro-batch, is planned on its own. A backward is named for the forward
  it belongs to (:class:`memo.phases.PhaseTracker` takes the micro-batch when the forward runs), so
  the order the schedule chose does not matter.
- The step is recorded by memo's allocator (the requests it will serve, by phase and request index),
  after one warm-up step that is not logged (NOTE [Warm-up before logging] in memo/pipeline/step.py:
  megatron's and memo's one-time buffers). Both run the schedule's forwards and backwards on the first
  batch with every rank of the pipeline, and keep no gradient and take no optimizer step: training then
  starts from the same weights as a run without a plan. memo's rounding buffers, made in the warm-up,
  open the trace as allocations live throughout (NOTE [Buffers made in the warm-up]).
- The plan's device total is the trace's peak plus what lives across steps and is not in it: the
  parameters and the optimizer's states (AdamW: two moments per parameter).
- The ranks of a stage run the same requests (tensor-parallel ranks hold same-shaped shards, data- and
  context-parallel ranks the same shapes): their traces' request fingerprints must agree, checked with
  one gather, or every rank stops with the stages' fingerprints. Each rank then plans its own trace.
- The plan records the stage and the schedule it was made for (``plan.pipeline``), and a plan given for
  another stage, schedule, micro-batch count or chunk layout is refused (:func:`check_stage_plan`), as
  is one made for another model, sequence, batch, dtype or shard (memo.planner.job). A rank whose file
  is missing or wrong must not leave the others waiting in the next collective: every rank checks its
  own, the findings are gathered, and every rank stops with the same message.
- ``--save-plan PATTERN`` writes each stage's plan (``{stage}`` in the pattern: the stage's number,
  ``{rank}``: the rank's; without ``{rank}`` the first rank of each stage writes it) and ``--plan
  PATTERN`` reads them back, the same pattern, one file per stage.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.errors import MemoError

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelLayout, ParallelRun
    from memo.planner import Plan
    from memo.planner.job import JobSpec

__all__ = ["StagePhases", "agree_on_plan", "all_done", "check_stage_plan", "given_stage_plan",
           "save_stage_plan", "stage_plan", "stage_schedule", "stop_together"]


def stage_parts(chunk: nn.Module) -> tuple[nn.Module | None, list[nn.Module], list[nn.Module]]:
    """A stage chunk's embedding (first stage only), layers and loss head (last stage only)."""
    embedding = getattr(chunk, "embedding", None) if getattr(chunk, "pre_process", True) else None
    head: list[nn.Module] = []
    if getattr(chunk, "post_process", True):
        norm = getattr(chunk.decoder, "final_layernorm", None)
        head = [m for m in (norm, getattr(chunk, "output_layer", None)) if m is not None]
    return embedding, list(chunk.decoder.layers), head


class StagePhases:
    """The phases of a pipeline stage's step (NOTE [A stage's address plan]), told to ``listener``
    (``memo.allocator.set_phase``) once per change. Call :meth:`step` around each step."""

    def __init__(self, chunks: list[nn.Module], listener: Callable[[str | None], None]) -> None:
        from memo.phases import PhaseTracker

        self._listener = listener
        self._told: str | None = None
        self._paused = False
        self._forwards = [-1] * len(chunks)  # the micro-batch each chunk's forward runs for
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._trackers: list[PhaseTracker] = []
        first = 0
        for c, chunk in enumerate(chunks):
            # the chunk's pre-hook runs before any of its modules': the count is up when they open
            self._handles.append(chunk.register_forward_pre_hook(functools.partial(self._forward, c)))
            embedding, layers, head = stage_parts(chunk)
            self._trackers.append(PhaseTracker(embedding, layers, head, listeners=[self._tell],
                                               first_layer=first,
                                               micro_batch=functools.partial(self._forwards.__getitem__, c)))
            first += len(layers)

    def _forward(self, c: int, _module: nn.Module, _args: tuple[object, ...]) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside a backward
            self._forwards[c] += 1

    def _tell(self, phase: str | None) -> None:
        if phase is not None and self._paused:
            return
        if phase != self._told:
            self._told = phase
            self._listener(phase)

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        """One step: micro-batches count from 0, and no phase is open before or after it."""
        self._forwards[:] = [-1] * len(self._forwards)
        self._close()
        try:
            yield
        finally:
            self._close()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Open no phase in the body (a step its plan was not made for); none is open before or after."""
        self._close()
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self._close()

    def _close(self) -> None:
        for tracker in self._trackers:
            tracker.set(None)
        self._tell(None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for tracker in self._trackers:
            tracker.remove()


def stage_schedule(layout: ParallelLayout, stage: int, micro_batches: int, chunks: list[nn.Module]
                   ) -> dict[str, Any]:
    """What a stage's plan is made for: the stage, the schedule and the layers of each chunk."""
    p, v = layout.pipeline_parallel, layout.virtual_pipeline
    name = "none" if p == 1 else ("interleaved-1f1b" if v > 1 else "1f1b")
    return {"stage": stage, "stages": p, "virtual_stages": v, "schedule": name,
            "micro_batches": micro_batches, "chunk_layers": [len(c.decoder.layers) for c in chunks]}


def check_stage_plan(plan: Plan, expected: dict[str, Any], where: str = "memo.train") -> None:
    """Refuse a plan made for another stage or schedule (NOTE [A stage's address plan])."""
    made = getattr(plan, "pipeline", None)
    if not made:
        raise MemoError(f"{where}: the plan was made for one iteration of a whole model, not for pipeline "
                        f"stage {expected['stage']} of {expected['stages']} under the {expected['schedule']} "
                        f"schedule with {expected['micro_batches']} micro-batches; let each stage plan "
                        "itself (drop --plan)")
    differ = [f"{k} {made.get(k)!r} (this run: {want!r})" for k, want in expected.items()
              if made.get(k) != want]
    if differ:
        raise MemoError(f"{where}: the plan was made for another stage or schedule: {'; '.join(differ)}. "
                        f"Give stage {expected['stage']} the plan made for it, or let each stage plan itself "
                        "(drop --plan)")


def stage_plan(trace: dict[str, Any], schedule: dict[str, Any], static_bytes: int, *, host_bytes: int,
               time_limit: float = 10.0) -> Plan:
    """The planner's addresses for a stage's recorded step, with its device record (NOTE [Device total]
    in memo/pipeline/device.py) and the schedule it was made for."""
    import warnings

    from memo.pipeline.device import iteration_total
    from memo.planner import Trace, make_plan

    with warnings.catch_warnings():
        # layers that are kept whole (the last stage's tail) differ from the offloaded ones by design
        warnings.filterwarnings("ignore", message=r"memo\.planner: phase layer\.", category=UserWarning)
        plan = make_plan(Trace.from_dict(trace), unphased="fallback", time_limit=time_limit, progress=False)
    iteration = iteration_total(trace, 0)
    plan.device = {"activations_bytes": int(plan.peak), "iteration_peak_bytes": iteration,
                   "model_states_bytes": int(static_bytes), "total_bytes": iteration + int(static_bytes),
                   "host_bytes": int(host_bytes)}
    plan.pipeline = dict(schedule)
    return plan


def _fill(pattern: str, stage: int, rank: int) -> str:
    from memo.paths import fill_stage_pattern  # NOTE [Stage-plan patterns]: {stage} and {rank} only

    return fill_stage_pattern(pattern, stage, rank, "plan pattern")


def stop_together(problem: str | None, parallel: ParallelRun | None) -> None:
    """Raise on every rank when any rank has a problem (a collective; None: this rank has none)."""
    problems = [problem] if parallel is None else parallel.gather(problem)
    found = [(r, p) for r, p in enumerate(problems) if p is not None]
    if found:
        rank, first = found[0]
        more = f" (and {len(found) - 1} other rank(s))" if len(found) > 1 else ""
        raise MemoError(first if parallel is None else f"rank {rank}{more}: {first}")


def all_done(done: bool, parallel: ParallelRun | None) -> bool:
    """Whether every rank is done (a collective; one process: ``done``)."""
    return bool(done) if parallel is None else all(parallel.gather(bool(done)))


def given_stage_plan(pattern: str, schedule: dict[str, Any], job: JobSpec, parallel: ParallelRun | None
                     ) -> Plan:
    """The plan ``--plan PATTERN`` gives this rank's stage, checked against the stage, the schedule and
    the job (NOTE [A stage's address plan]); every rank stops together when any rank's is wrong."""
    from memo.planner import load_plan
    from memo.planner.job import job_mismatch

    rank = 0 if parallel is None else parallel.rank
    path = _fill(pattern, schedule["stage"], rank)
    plan, problem = None, None
    try:
        if not os.path.exists(path):
            raise MemoError(f"memo.train: --plan {pattern}: stage {schedule['stage']}'s plan {path!r} does "
                            "not exist; write the stages' plans with `memo train ... --save-plan` first")
        plan = load_plan(path)
        check_stage_plan(plan, schedule, where=f"memo.train: --plan {path}")
        mismatch = job_mismatch(plan.meta, job)
        if mismatch is not None:
            raise MemoError(f"memo.train: --plan {path}: {mismatch}, or drop --plan")
        if plan.alpha is None:
            raise MemoError(f"memo.train: --plan {path} records no alpha; write it with "
                            "`memo train --save-plan`")
    except MemoError as e:
        problem = str(e)
    stop_together(problem, parallel)
    return plan


def save_stage_plan(plan: Plan, pattern: str, parallel: ParallelRun | None, stage: int) -> None:
    """``--save-plan PATTERN`` (NOTE [A stage's address plan]); a failed write stops every rank."""
    from memo.planner import save_plan

    rank = 0 if parallel is None else parallel.rank
    first = parallel is None or (parallel.tp_rank, parallel.cp_rank, parallel.dp_rank) == (0, 0, 0)
    problem = None
    if "{rank}" in pattern or first:
        try:
            path = _fill(pattern, stage, rank)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            save_plan(plan, path)
        except (MemoError, OSError) as e:
            problem = f"memo.train: --save-plan {pattern}: {e}"
    stop_together(problem, parallel)


def agree_on_plan(plan: Plan, trace: dict[str, Any], parallel: ParallelRun | None, stage: int) -> Plan:
    """The plan this rank runs (a collective): the ranks of a stage that recorded the same requests (each
    phase's sizes; unphased requests, which a copy thread may make a little earlier or later, aside) run
    one plan, the one their lowest rank made (the planner's search stops at a time limit, so two ranks
    may find two plans of one trace); ranks that recorded different requests run their own."""
    import hashlib
    import json

    from memo.distributed.layout import plan_fingerprint

    if parallel is None:
        return plan
    requests: dict[str, list[int]] = {}
    for event in trace["events"]:
        if event["op"] == "malloc" and event.get("phase") is not None:
            requests.setdefault(event["phase"], []).append(int(event["size"]))
    made_from = hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest()[:16]
    votes = parallel.gather((stage, made_from, plan_fingerprint(plan)))
    leaders: dict[tuple[int, str], int] = {}  # (stage, requests) -> the lowest rank that recorded them
    for rank, (st, made, _fp) in enumerate(votes):
        leaders.setdefault((st, made), rank)
    differ = {(st, made) for st, made, fp in votes if fp != votes[leaders[(st, made)]][2]}
    if not differ:
        return plan
    from memo.planner import Plan

    mine = (stage, made_from)
    shared = parallel.gather(plan.to_dict() if leaders[mine] == parallel.rank and mine in differ else None)
    return Plan.from_dict(shared[leaders[mine]]) if mine in differ else plan
