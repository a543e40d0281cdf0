"""``memo train --engine megatron --micro-batches M [--pp P [--vpp V]]``: steps run by megatron-core's
schedules, memo's layers inside each model chunk (NOTE [Pipeline stages] in
memo/distributed/pipeline.py).

NOTE [Pipelined steps]
A step is M micro-batches of ``--micro-batch`` sequences each, their gradients accumulated before one
AdamW step: the loss is the mean of the micro-batches' losses (each the mean over its counted tokens),
as megatron's schedules compute it. Each rank builds its stage's model chunks
(:func:`memo.engines.build_megatron_stages`), each chunk under megatron's ``DistributedDataParallel``
where a reduction is needed (data-parallel replicas, context-parallel ranks, sequence-parallel norms),
and runs one step with
``get_forward_backward_func()``: no pipelining for P = 1 (gradient accumulation in one process: the
single-process run the pipelines are checked against), 1F1B, or the interleaved schedule with V > 1.

memo's part in each chunk: ``--strategy memo`` wraps every chunk with memo's default policy for the
chunk's place (every layer offloaded in a chunk that feeds the next stage) at ``--alpha``, or with
``--alpha auto`` with the layer policy and alpha each stage's planner chooses from a profile of its
first chunk, counting the forwards its schedule keeps in flight on the device and in the host memory
its arenas share (NOTE [A stage's profile] in memo/distributed/pipeline.py; on the slowest link and
layer and the smallest host of the stage's ranks, which run each layer's collectives together), within
``--device-mem-gb`` when given, else within what full recompute would need. ``full-recompute``
wraps every layer under torch's checkpoint (memo's "recompute" policy); ``none`` leaves the chunks
as they are. Each chunk's runtime keeps one host region per forward in flight, which
:func:`memo.distributed.pipeline.in_flight` counts and the report shows per stage.

With memo's allocator (the default; ``--no-planned-allocator`` leaves the fallback alone), each stage
records its schedule's step, plans its addresses and runs every step on that plan (NOTE [A stage's
address plan] in memo/pipeline/stage_plan.py); ``--save-plan`` writes the stages' plans and
``--plan`` runs them again. A stage whose plan needs more than ``--device-mem-gb`` stops every rank.

The stage's step is a :class:`memo.train.schedule.StageStep`, a step like any other (NOTE [One step, one
path] in memo/pipeline/step.py): memo.pipeline.stage_profile profiles it, calibrates its policy with the
one loop and plans it, and a :class:`memo.Session` assembles its run; this module is the loop driver.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memo.errors import MemoError, internal_assert
from memo.planner.vocab import LayerPolicy, StrategyName
from memo.session import Session
from memo.train.config import StepMetrics, TrainConfig, TrainResult, new_result, step_line, token_source
from memo.train.data import Batch
from memo.train.meter import MemoryMeter
from memo.train.run_control import RunControl
from memo.train.schedule import StageStep, initialise, one_process_world, shard

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelLayout, ParallelRun
    from memo.pipeline.stage_profile import StageRequest
    from memo.planner import Plan
    from memo.runtime import MemoRuntime
    from memo.train.strategies import Strategy, StrategyOptions

__all__ = ["PIPELINED_STRATEGIES", "train_pipelined"]

Emit = Callable[[str], None]

#: The strategies a pipelined step runs (NOTE [Pipelined steps]).
PIPELINED_STRATEGIES = ("none", "full-recompute", "memo")


def _check(config: TrainConfig, strategy: Strategy) -> float | None:
    """Refuse what a pipelined run cannot take (NOTE [Pipelined steps]); memo's alpha, else None."""
    what = f"--micro-batches {config.micro_batches}" + (f" --pp {config.pipeline_parallel}"
                                                         if config.pipeline_parallel > 1 else "")
    if config.engine != "megatron" or config.hf_config is not None:
        raise MemoError(f"memo.train: {what} runs megatron-core's schedules; use --engine megatron "
                        "(memo's models and Hugging Face's take one micro-batch per step)")
    if strategy.name not in PIPELINED_STRATEGIES:
        raise MemoError(f"memo.train: {what}: --strategy {strategy.name} is not run under megatron's "
                        f"schedules; use one of {', '.join(PIPELINED_STRATEGIES)}")
    if strategy.name != StrategyName.MEMO:
        return None
    opts = strategy.options
    if (opts.plan is not None or opts.save_plan) and not opts.planned_allocator:
        raise MemoError(f"memo.train: {what}: --plan and --save-plan are the stages' address plans, which "
                        "--no-planned-allocator does not use; drop one or the other")
    if opts.alpha == "auto":
        return None  # each stage solves it (NOTE [A stage's profile]), or its --plan carries it
    from memo.runtime.runtime import validate_alpha

    return validate_alpha(float(opts.alpha))


@dataclass
class _Stage:
    """This rank's place in the run: its stage's step, the layout, the device and the collectives."""

    step: StageStep
    layout: ParallelLayout
    device: torch.device
    parallel: ParallelRun | None
    index: int


def train_pipelined(config: TrainConfig, *, log: Emit | None = None, progress: bool = True,
                    strategy: Strategy | None = None) -> TrainResult:
    """:func:`memo.train.train` for ``micro_batches > 1`` or ``pipeline_parallel > 1`` (NOTE [Pipelined
    steps]): the stage's step profiled and planned (memo.pipeline.stage_profile), then run in a
    :class:`memo.Session` (NOTE [One step, one path])."""
    from tqdm import tqdm

    from memo.models.dtypes import DTYPES
    from memo.train.optim import rank_optimizer
    from memo.train.parallel import start_parallel
    from memo.train.strategies import NoStrategy

    strategy = strategy if strategy is not None else NoStrategy()
    strategy.alpha = _check(config, strategy)  # what the header and the report say
    emit = log if log is not None else tqdm.write
    parallel = start_parallel(config)
    undo: list[Callable[[], None]] = []  # what the run set up (a one-process world, the Session), undone last
    try:
        if parallel is not None and not parallel.is_first:
            emit, progress = (lambda _line: None), False
        control = RunControl(config, strategy, parallel, emit)
        undo.append(control.close)
        stage, model_config, source = _build_stage(config, parallel, undo, control)
        control.reuse_plan(None, per_rank=True)
        strategy.alpha = _check(config, strategy)  # the checkpoint's plan, where it is run on
        # before the stage's profile: its plan counts the optimizer states this rank holds (NOTE
        # [ZeRO-1 under megatron] in memo/train/optim.py)
        optimizer = rank_optimizer([p for c in stage.step.chunks for p in c.parameters()], config.lr,
                                   None if parallel is None else parallel.optimizer_group())
        meter = MemoryMeter()
        # the device held the parameters and DDP's gradient buffers before the Session (NOTE [Measuring
        # device memory] in memo/train/meter.py)
        resident = sum(p.numel() * p.element_size() for c in stage.step.chunks for p in c.parameters())
        meter.enter(_session(stage, config, strategy, emit), resident + stage.step.ddp_buffer_bytes())
        undo.append(meter.close)  # the steps' allocator context ends with the run, or when it fails
        result = new_result(config, stage.step.chunks[0], model_config, stage.device, DTYPES[config.dtype],
                            strategy)
        result.num_parameters = _all_parameters(stage.step.chunks, parallel)
        result.world = stage.layout.world
        emit(_header(config, strategy, stage))
        _steps(stage, meter, optimizer, source, config, result, emit, progress, control)
        if parallel is not None:
            result.parallel = _stages_record(parallel, result, stage.index, config)
    finally:
        if parallel is not None:
            parallel.close()
        for step in reversed(undo):
            step()
    return result


def _header(config: TrainConfig, strategy: Strategy, stage: _Stage) -> str:
    alpha = "" if strategy.alpha is None else f" (alpha {strategy.alpha:.4f})"
    return (f"memo.train: {config.model} (megatron-core GPTModel), seq {config.seq_len} x batch "
            f"{config.micro_batch} x {config.micro_batches} micro-batches, {config.dtype} on {stage.device}, "
            f"strategy {strategy.name}{alpha}, {stage.layout.world} rank(s) ({stage.layout}), schedule "
            f"{_schedule_name(stage.layout)}")


def _build_stage(config: TrainConfig, parallel: ParallelRun | None, undo: list[Callable[[], None]],
                 control: RunControl) -> tuple[_Stage, Any, Any]:
    """This rank's stage: megatron's world (one process: set up here, its undoing added to ``undo``), the
    stage's chunks with the whole model's weights (NOTE [Pipeline initialisation]) and its first step's
    micro-batches (from where ``control`` resumes); the model config and the token source."""
    from memo.engines import build_megatron_stages, init_megatron_world
    from memo.models import DEFAULT_MAX_SEQ_LEN, get_config
    from memo.models.dtypes import DTYPES

    if parallel is None:
        from memo.distributed.layout import ParallelLayout

        undo.extend(one_process_world())
        init_megatron_world()
        layout, device = ParallelLayout(), torch.device(config.device)
    else:
        layout, device = parallel.layout, parallel.device
    torch.manual_seed(config.seed)
    model_config = get_config(config.model)
    max_seq_len = (max(config.seq_len, DEFAULT_MAX_SEQ_LEN) if model_config.arch == "gpt"
                   else config.seq_len)
    chunks = build_megatron_stages(model_config, max_seq_len, device, DTYPES[config.dtype], layout)
    initialise(chunks, config.seed, model_config.n_layers, layout)
    tokens = token_source(config, model_config)
    control.begin(model_config, tokens, layout.as_dict() if parallel is None else parallel.as_dict())
    source = iter(tokens)
    batches = [shard(next(source), parallel, device) for _ in range(config.micro_batches)]
    step = StageStep(chunks, layout, config.seq_len, batches)
    index = 0 if parallel is None else parallel.pp_rank
    return _Stage(step, layout, device, parallel, index), model_config, source


def _session(stage: _Stage, config: TrainConfig, strategy: Strategy, emit: Emit) -> Session:
    """The Session the stage's steps run in (NOTE [One construction path]): the strategy's wrap, and with
    memo's allocator the stage's plan (given, or made from its profile: memo.pipeline.stage_profile)."""
    step = stage.step
    if strategy.name == StrategyName.NONE:
        return Session(step, device=stage.device)
    if strategy.name == StrategyName.FULL_RECOMPUTE:
        return Session(step, alpha=0.0, policy=[LayerPolicy.RECOMPUTE] * sum(step.chunk_layers()),
                       device=stage.device)
    opts = strategy.options
    alpha, policy, plan = _memo_choice(stage, config, opts, strategy.alpha, emit)
    strategy.alpha, strategy.plan = alpha, plan
    return Session(step, plan, alpha=alpha, policy=policy, device=stage.device, warm_up=plan is not None,
                   debug_copy_delay_us=opts.debug_copy_delay_us)


def _memo_choice(stage: _Stage, config: TrainConfig, opts: StrategyOptions, alpha: float | None, emit: Emit
                 ) -> tuple[float | None, list[str] | None, Plan | None]:
    """memo's alpha, layer policy (None: the default for each chunk's place) and the stage's plan (None
    where memo's allocator does not replay one)."""
    from memo.pipeline import stage_profile as prof
    from memo.pipeline.stage_plan import given_stage_plan, stage_schedule
    from memo.planner.job import JobSpec

    request = _stage_request(stage, config, opts)
    planning = opts.planned_allocator and _can_plan(stage.device, emit)
    given, recording = None, None
    if opts.plan is not None:
        schedule = stage_schedule(stage.layout, stage.index, config.micro_batches, stage.step.chunks)
        job = JobSpec(**{k: v for k, v in request.job.items() if k != "recorder"})
        given = given_stage_plan(opts.plan, schedule, job, stage.parallel)
        if not planning:
            return float(given.alpha), given.policy, None
    elif alpha is None:
        inputs, costs = prof.stage_costs(stage.step, request, stage.parallel, emit)
        if not planning:  # the model's choice, unchecked (NOTE [A stage's calibrated policy])
            solution = prof.unchecked_stage_policy(costs, request, emit)
            return float(solution.alpha), list(solution.policy), None
        alpha, recording = prof.calibrated_stage_policy(stage.step, request, inputs, costs, stage.parallel,
                                                        emit)
    elif not planning:
        return alpha, None, None
    plan = prof.plan_stage(stage.step, request, stage.parallel, alpha=float(alpha or 0.0),
                           recording=recording, given=given, given_from=opts.plan, save_plan=opts.save_plan,
                           emit=emit)
    return float(plan.alpha), list(plan.policy), plan


def _stage_request(stage: _Stage, config: TrainConfig, opts: StrategyOptions) -> StageRequest:
    """What the stage's profile is for (memo.pipeline.stage_profile.StageRequest)."""
    from memo.models import fingerprint, get_config
    from memo.pipeline.stage_profile import StageRequest

    layout = stage.layout
    # the job a stage's plan is made for (memo.planner.job): model, sequence, batch, dtype, shards
    job = {"model": config.model, "fingerprint": fingerprint(get_config(config.model)),
           "seq_len": config.seq_len, "micro_batch": config.micro_batch, "dtype": config.dtype,
           "tensor_parallel": layout.tensor_parallel, "context_parallel": layout.context_parallel,
           "sequence_parallel": bool(layout.sequence_parallel), "recorder": "allocator"}
    return StageRequest(layout=layout, stage=stage.index, micro_batches=config.micro_batches,
                        machine=opts.machine(), time_limit=opts.time_limit, seed=config.seed, job=job)


def _can_plan(device: torch.device, emit: Emit) -> bool:
    """Whether memo's allocator can serve this device: the CPU, or CUDA once memo's CUDA allocator is
    PyTorch's (``memo train`` installs it before CUDA starts)."""
    from memo import allocator

    if device.type == "cpu" or (device.type == "cuda" and allocator.cuda_installed()):
        return True
    emit(f"memo: the stages run without a plan: memo's allocator does not serve {device} in this process "
         "(install it with memo.allocator.install_cuda() before CUDA starts, as `memo train` does)")
    return False


def _steps(stage: _Stage, meter: MemoryMeter, optimizer: torch.optim.Optimizer, source: Iterator[Batch],
           config: TrainConfig, result: TrainResult, emit: Emit, progress: bool, control: RunControl) -> None:
    """The training steps, each with its metrics and log line, under the run's ``control`` (schedule,
    clipping, evaluation, metrics, checkpoints: memo/train/run_control.py)."""
    from tqdm import tqdm

    from memo.utils.flops import mfu

    step, parallel, layout = stage.step, stage.parallel, stage.layout
    session = meter.session
    internal_assert(session is not None, "memo.train: the steps run inside the meter's Session")
    first = control.attach(_state_module(step.chunks), optimizer,
                           lambda evals: _eval_loss(stage, evals, session))
    bar = tqdm(range(first + 1, config.steps + 1), desc="train", unit="step", file=sys.stderr,
               disable=not progress or not sys.stderr.isatty())
    for n in bar:
        if n > first + 1:
            step.batches = [shard(next(source), parallel, stage.device) for _ in range(config.micro_batches)]
        start = time.perf_counter()
        loss = step.train(optimizer, session.iteration, control.grad_norm)
        measured = meter.read()
        seconds = time.perf_counter() - start
        loss = _loss_on_every_rank(loss, parallel)
        if not math.isfinite(loss):
            raise MemoError(f"memo.train: loss became {loss} at step {n}; lower --lr")
        tokens = config.seq_len * config.micro_batch * config.micro_batches
        samples = config.micro_batch * config.micro_batches / layout.world
        metrics = StepMetrics(n, loss, seconds, tokens / seconds / layout.world,
                              mfu(result.flops_per_sample, samples, seconds, result.peak_flops),
                              measured["peak_device_bytes"],
                              {**_extras(session.runtimes), "allocator": measured["allocator"]})
        result.peak_memory_kind = measured["peak_device_kind"]
        result.steps.append(metrics)
        bar.set_postfix(loss=f"{loss:.3f}")
        emit(step_line(metrics, result.peak_memory_kind))
        control.end_step(n, metrics)
    bar.close()


def _eval_loss(stage: _Stage, batches: list[Batch], session: Session) -> float:
    """The mean loss of the evaluation's global ``batches`` by the schedule's forwards, off the plan
    (NOTE [Evaluation] in memo/train/evaluation.py), on every rank."""
    from memo.train.evaluation import off_plan

    with off_plan(session, stage.device):
        loss = stage.step.evaluate([shard(b, stage.parallel, stage.device) for b in batches])
    return _loss_on_every_rank(loss, stage.parallel)


def _state_module(chunks: list[torch.nn.Module]) -> torch.nn.Module:
    """What a checkpoint takes the state dict of: the stage's one chunk, or its chunks in a list."""
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)


def _schedule_name(layout: ParallelLayout) -> str:
    if layout.pipeline_parallel == 1:
        return "no pipelining (gradient accumulation)"
    return "interleaved 1F1B" if layout.virtual_pipeline > 1 else "1F1B"


def _loss_on_every_rank(loss: float | None, parallel: ParallelRun | None) -> float:
    """The last stage's loss, on every rank (rank 0, on the first stage, prints it)."""
    if parallel is None:
        return float(loss)
    from megatron.core import parallel_state

    value = torch.tensor(loss if loss is not None else 0.0, dtype=torch.float64)
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(value, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return float(value)


def _extras(runtimes: list[MemoRuntime]) -> dict[str, Any]:
    """Host bytes and forwards in flight of this rank's chunks (memo's runtimes)."""
    if not runtimes:
        return {}
    return {"host_pinned_bytes": sum(rt.host_bytes for rt in runtimes),
            "forwards_in_flight": [rt.buffers.n_flights if rt.buffers is not None else 0 for rt in runtimes],
            "offloaded_layers": [rt.n_offloaded for rt in runtimes],
            "policy": [list(rt.policy) for rt in runtimes]}


def _all_parameters(chunks: list[torch.nn.Module], parallel: ParallelRun | None) -> int:
    """Parameters of the whole model: this rank's chunks summed over the pipeline's stages."""
    mine = torch.tensor(sum(p.numel() for c in chunks for p in c.parameters()), dtype=torch.int64)
    if parallel is not None and parallel.layout.pipeline_parallel > 1:
        from megatron.core import parallel_state

        torch.distributed.all_reduce(mine, group=parallel_state.get_pipeline_model_parallel_group())
    return int(mine)


def _stages_record(parallel: ParallelRun, result: TrainResult, stage: int, config: TrainConfig
                   ) -> dict[str, Any]:
    """The layout and every rank's stage, peak and host bytes, with the forwards its chunks held in
    flight against :func:`memo.distributed.pipeline.in_flight` (a collective)."""
    from memo.distributed.pipeline import in_flight

    layout = parallel.layout
    extras = result.steps[-1].extras if result.steps else {}
    peak = max((s.peak_memory_bytes or 0) for s in result.steps) if result.steps else None
    mine = {"rank": parallel.rank, "pp_rank": stage, "alpha": getattr(result.strategy, "alpha", None),
            "tp_rank": parallel.tp_rank, "cp_rank": parallel.cp_rank,
            "dp_rank": parallel.dp_rank, "peak_device_bytes": peak,
            "peak_device_kind": result.peak_memory_kind,
            "host_pinned_bytes": int(extras.get("host_pinned_bytes", 0)),
            "forwards_in_flight": extras.get("forwards_in_flight"),
            # what in_flight counts for each chunk that offloads (a chunk that offloads nothing holds none)
            "expected_in_flight": [n if k else 0 for n, k in zip(
                in_flight(layout.pipeline_parallel, stage, layout.virtual_pipeline, config.micro_batches),
                extras.get("offloaded_layers") or [0] * layout.virtual_pipeline, strict=True)]
            if layout.pipeline_parallel > 1 else None,
            "offloaded_layers": extras.get("offloaded_layers"),
            "policy": extras.get("policy"),
            # NOTE [A stage's address plan]: what this rank's plan expects, beside what it measured
            "plan_device_total_bytes": _plan_field(result, "total_bytes"),
            "plan_host_bytes": _plan_field(result, "host_bytes"),
            "allocator": extras.get("allocator")}
    return {**parallel.as_dict(), "micro_batches": config.micro_batches, "ranks": parallel.gather(mine)}


def _plan_field(result: TrainResult, key: str) -> int | None:
    plan = getattr(result.strategy, "plan", None)
    device = getattr(plan, "device", None) or {}
    return None if device.get(key) is None else int(device[key])
