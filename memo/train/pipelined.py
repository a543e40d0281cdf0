"""``memo train --engine megatron --micro-batches M [--pp P [--vpp V]]``: steps run by megatron-core's
schedules (issue 29), memo's layers inside each model chunk (NOTE [Pipeline stages] in
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
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from memo.errors import MemoError

__all__ = ["train_pipelined"]

#: The strategies a pipelined step runs (NOTE [Pipelined steps]).
PIPELINED_STRATEGIES = ("none", "full-recompute", "memo")


def _check(config: Any, strategy: Any) -> float | None:
    """Refuse what a pipelined run cannot take (NOTE [Pipelined steps]); memo's alpha, else None."""
    what = f"--micro-batches {config.micro_batches}" + (f" --pp {config.pipeline_parallel}"
                                                         if config.pipeline_parallel > 1 else "")
    if config.engine != "megatron" or config.hf_config is not None:
        raise MemoError(f"memo.train: {what} runs megatron-core's schedules; use --engine megatron "
                        "(memo's models and Hugging Face's take one micro-batch per step)")
    if strategy.name not in PIPELINED_STRATEGIES:
        raise MemoError(f"memo.train: {what}: --strategy {strategy.name} is not run under megatron's "
                        f"schedules; use one of {', '.join(PIPELINED_STRATEGIES)}")
    if strategy.name != "memo":
        return None
    opts = strategy.options
    if (opts.plan is not None or opts.save_plan) and not opts.planned_allocator:
        raise MemoError(f"memo.train: {what}: --plan and --save-plan are the stages' address plans, which "
                        "--no-planned-allocator does not use; drop one or the other")
    if opts.alpha == "auto":
        return None  # each stage solves it (NOTE [A stage's profile]), or its --plan carries it
    from memo.runtime.runtime import validate_alpha

    return validate_alpha(float(opts.alpha))


def train_pipelined(config: Any, *, log: Callable[[str], None] | None = None, progress: bool = True,
                    strategy: Any = None) -> Any:
    """:func:`memo.train.train` for ``micro_batches > 1`` or ``pipeline_parallel > 1`` (NOTE [Pipelined
    steps])."""
    from tqdm import tqdm

    from memo.engines import build_megatron_stages, init_megatron_world
    from memo.models import DEFAULT_MAX_SEQ_LEN, get_config
    from memo.models.dtypes import DTYPES
    from memo.train.loop import StepMetrics, _new_result, _step_line, _token_source
    from memo.train.optim import rank_optimizer
    from memo.train.parallel import start_parallel
    from memo.utils.flops import mfu

    if strategy is None:
        from memo.train.strategies import NoStrategy

        strategy = NoStrategy()
    alpha = _check(config, strategy)
    strategy.alpha = alpha  # what the header and the report say
    emit = log if log is not None else tqdm.write
    dtype = DTYPES[config.dtype]
    parallel = start_parallel(config)
    undo: list[Callable[[], None]] = []  # what the run set up (a one-process world, the meter), undone last
    try:
        if parallel is None:
            from memo.distributed.layout import ParallelLayout

            undo = _one_process_world()
            init_megatron_world()
            layout, device, first_rank = ParallelLayout(), torch.device(config.device), True
        else:
            layout, device, first_rank = parallel.layout, parallel.device, parallel.is_first
        if not first_rank:
            emit, progress = (lambda _line: None), False
        torch.manual_seed(config.seed)
        model_config = get_config(config.model)
        max_seq_len = (max(config.seq_len, DEFAULT_MAX_SEQ_LEN) if model_config.arch == "gpt"
                       else config.seq_len)
        chunks = build_megatron_stages(model_config, max_seq_len, device, dtype, layout)
        _initialise(chunks, config.seed, model_config.n_layers, layout)
        source = iter(_token_source(config, model_config))
        batches = [_shard(next(source), parallel, device) for _ in range(config.micro_batches)]
        stage = 0 if parallel is None else parallel.pp_rank
        given, policies = None, None  # policies: the default for each chunk's place
        if strategy.name == "memo" and strategy.options.plan is not None:
            from memo.pipeline.stage_plan import given_stage_plan, stage_schedule
            from memo.planner.job import JobSpec

            meta = _stage_meta(config, layout)
            job = JobSpec(**{k: v for k, v in meta.items() if k != "recorder"})
            schedule = stage_schedule(layout, stage, config.micro_batches, chunks)
            given = given_stage_plan(strategy.options.plan, schedule, job, parallel)
            alpha = float(given.alpha)
            strategy.alpha = alpha
            policies = _per_chunk(given.policy, chunks) if given.policy is not None else None
        planning = strategy.name == "memo" and strategy.options.planned_allocator and _can_plan(device, emit)
        costs = None  # the stage's cost model, where its policy is chosen (alpha auto)
        if strategy.name == "memo" and given is None and alpha is None:
            costs = _stage_costs(chunks, batches[0], strategy.options, layout, parallel, config, emit)
            if not planning:  # the model's choice, unchecked (NOTE [A stage's calibrated policy])
                solution = _choose(costs, strategy.options, stage, emit)
                alpha, policies = float(solution.alpha), _per_chunk(solution.policy, chunks)
        runtimes = [] if costs is not None and planning else _apply(strategy.name, chunks, alpha, policies)
        ddp = _data_parallel(chunks, layout)
        # before the stage's profile: its plan counts the optimizer states this rank holds (NOTE
        # [ZeRO-1 under megatron] in memo/train/optim.py)
        optimizer = rank_optimizer([p for c in chunks for p in c.parameters()], config.lr,
                                   None if parallel is None else parallel.optimizer_group())
        trace = None
        if costs is not None and planning:
            alpha, policies, runtimes, trace = _calibrated_policy(
                chunks, ddp, batches, layout, parallel, config, stage, costs, strategy.options, emit)
        strategy.alpha = alpha
        plan = None
        if planning:
            plan = _stage_plan(chunks, ddp, batches, layout, parallel, config, stage, runtimes, alpha, given,
                               strategy.options, emit, trace)
            strategy.plan = plan
        result = _new_result(config, chunks[0], model_config, device, dtype, strategy)
        result.num_parameters = _all_parameters(chunks, parallel)
        result.world = layout.world
        emit(f"memo.train: {config.model} (megatron-core GPTModel), seq {config.seq_len} x batch "
             f"{config.micro_batch} x {config.micro_batches} micro-batches, {config.dtype} on {device}, "
             f"strategy {strategy.name}" + ("" if alpha is None else f" (alpha {alpha:.4f})")
             + f", {layout.world} rank(s) ({layout}), schedule {_schedule_name(layout)}")
        bar = tqdm(range(1, config.steps + 1), desc="train", unit="step", file=sys.stderr,
                   disable=not progress or not sys.stderr.isatty())
        meter = _DeviceMeter(device, chunks, ddp, plan)
        undo.append(meter.close)  # the steps' allocator context ends with the run, or when it fails
        for step in bar:
            if step > 1:
                batches = [_shard(next(source), parallel, device) for _ in range(config.micro_batches)]
            start = time.perf_counter()
            loss = _step(chunks, ddp, optimizer, batches, layout, config, meter.phases)
            meter.read()
            seconds = time.perf_counter() - start
            loss = _loss_on_every_rank(loss, parallel)
            if not math.isfinite(loss):
                raise MemoError(f"memo.train: loss became {loss} at step {step}; lower --lr")
            peak = meter.peak
            tokens = config.seq_len * config.micro_batch * config.micro_batches
            tgs = tokens / seconds / layout.world
            samples = config.micro_batch * config.micro_batches / layout.world
            metrics = StepMetrics(step, loss, seconds, tgs,
                                  mfu(result.flops_per_sample, samples, seconds, result.peak_flops),
                                  peak, {**_extras(runtimes), "allocator": dict(meter.counts)})
            result.peak_memory_kind = meter.kind
            result.steps.append(metrics)
            bar.set_postfix(loss=f"{loss:.3f}")
            emit(_step_line(metrics, result.peak_memory_kind))
        bar.close()
        if parallel is not None:
            result.parallel = _stages_record(parallel, result, runtimes, stage, config)
        for chunk in chunks:
            _unwrap(chunk)
    finally:
        if parallel is not None:
            parallel.close()
        for step in reversed(undo):
            step()
    return result


def _one_process_world() -> list[Callable[[], None]]:
    """Install what megatron's schedules need in one process (the CPU shims; megatron's parallel state
    and a process group of one come with ``init_megatron_world``) and return how to undo what was not
    there before, so that the process is left as it was found."""
    from megatron.core import parallel_state

    from memo.distributed.cpu_shims import cpu_shims_installed, install_cpu_shims, remove_cpu_shims

    undo: list[Callable[[], None]] = []
    if not cpu_shims_installed():
        install_cpu_shims()  # megatron's schedules on the CPU (nothing where CUDA is usable)
        undo.append(remove_cpu_shims)
    if not torch.distributed.is_initialized():
        undo.append(torch.distributed.destroy_process_group)
    if not parallel_state.model_parallel_is_initialized():
        undo.append(parallel_state.destroy_model_parallel)
    return undo


# NOTE [Pipeline initialisation]
# megatron draws each stage's weights from the generator of the process that builds it, so a stage
# built for PP = 2 does not hold the weights of the same layers built in one process, and a pipelined
# run could not be checked against the single-process one. Each random weight (every matrix: the
# embeddings, the projections, the LM head) is drawn again from a generator seeded by the run's seed and
# the weight's name in the whole model (layers by their global number), with megatron's init: normal,
# std 0.02, the two projections into the residual stream scaled by 1/sqrt(2L). A tensor-parallel rank
# draws the whole tensor and keeps its slice, as megatron's CPU init does. Norms and biases keep the
# constants megatron gave them. Any --pp, --vpp and --tp then start from one model.
INIT_STD = 0.02


def _initialise(chunks: list[torch.nn.Module], seed: int, n_layers: int, layout: Any) -> None:
    """NOTE [Pipeline initialisation]."""
    import zlib

    from memo.distributed.pipeline import whole_model_name

    tp = layout.tensor_parallel
    rank = 0
    if tp > 1:
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if p.dim() < 2:
                    continue
                whole = whole_model_name(chunk, name)
                std = INIT_STD / math.sqrt(2 * n_layers) if whole.endswith(
                    ("linear_proj.weight", "linear_fc2.weight")) else INIT_STD
                sliced = getattr(p, "tensor_model_parallel", False) and tp > 1
                dim, stride = (p.partition_dim, getattr(p, "partition_stride", 1)) if sliced else (0, 1)
                shape = list(p.shape)
                if sliced:
                    shape[dim] *= tp
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{whole}".encode()))
                full = torch.randn(shape, generator=g, dtype=torch.float32) * std
                if sliced:
                    full = torch.cat(full.chunk(tp * stride, dim=dim)[rank::tp], dim=dim)
                p.copy_(full)


def _stage_costs(chunks: list[torch.nn.Module], batch: tuple[torch.Tensor, ...], options: Any, layout: Any,
                 parallel: Any, config: Any, emit: Callable[[str], None]) -> Any:
    """The layer policy's cost model of this rank's stage (NOTE [A stage's profile], NOTE [Policy cost
    model]): a profile of the stage's first chunk, for all the stage's layers and the forwards its
    schedule keeps in flight (NOTE [Forwards in flight in the policy]), on the machine numbers its ranks
    agree on."""
    import dataclasses
    import warnings

    from memo import pipeline
    from memo.distributed.pipeline import StageModel, in_flight
    from memo.pipeline.policy import _layer_costs
    from memo.planner.calibrate import AlphaInputs
    from memo.profiler.measure import GB, machine_memory_bytes, measure_bandwidth, time_layer_forward
    from memo.profiler.record import layer_inputs

    p, v = layout.pipeline_parallel, layout.virtual_pipeline
    stage = 0 if parallel is None else parallel.pp_rank
    flights = in_flight(p, stage, v, config.micro_batches) if p > 1 else [1] * len(chunks)
    ids, labels, positions, _count = batch
    chunk = chunks[0]
    tokens = ids.shape[1] // (layout.tensor_parallel if layout.sequence_parallel else 1)
    model = StageModel(chunk, positions, (tokens, ids.shape[0], chunk.config.hidden_size), seed=config.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = pipeline.profile(model, batch=(ids, labels), tensor_parallel=layout.tensor_parallel,
                                 context_parallel=layout.context_parallel, solve=False)
        layer_ms = options.layer_ms
        if layer_ms is None:  # the stage's ranks time their first layer together (collectives pair up)
            args, kwargs = layer_inputs(model, ids, labels)
            layer_ms = float(time_layer_forward(chunk.decoder.layers[0], *args, layer_kwargs=kwargs).value)
    for p_ in chunk.parameters():  # the profile ran a backward; the step starts from no gradients
        p_.grad = None
    bandwidth = options.bandwidth_gbps or float(measure_bandwidth(ids.device).value)
    host_gb = options.host_mem_gb if options.host_mem_gb is not None else machine_memory_bytes() / GB
    host = options.machine().replace(host_mem_gb=host_gb).host_per_process()
    bandwidth, layer_ms, host = _stage_machine((bandwidth, layer_ms, host), parallel, stage)
    sizes = plain.trace["layers"]
    lp = AlphaInputs(sizes["S_input"], sizes["S_attn"], sizes["S_others"], bandwidth * GB, layer_ms / 1e3,
                     len(chunk.decoder.layers), host)
    params = sum(x.numel() * x.element_size() for c in chunks for x in c.parameters())
    states = {"parameters": {"bytes": params}, "optimizer": {"bytes": 2 * params}}
    layer_params = sum(x.numel() for x in chunk.decoder.layers[0].parameters())
    elem = next(chunk.parameters()).element_size()
    costs = _layer_costs(plain.trace, lp, tokens, ids.shape[0], elem, layer_params, states, ids.device.type)
    # the whole stage's layers, each holding what it keeps once per forward in flight (the most any of
    # the stage's chunks holds: the interleaved schedule's first chunk)
    emit(f"memo: stage {stage}: {max(flights)} forward(s) in flight; S_input {sizes['S_input']:,} B, "
         f"S_attn {sizes['S_attn']:,} B, S_others {sizes['S_others']:,} B per layer")
    return dataclasses.replace(costs, n_layers=sum(len(c.decoder.layers) for c in chunks),
                               in_flight=max(flights))


def _choose(costs: Any, options: Any, stage: int, emit: Callable[[str], None]) -> Any:
    """The stage's layer policy from its cost model, within --device-mem-gb or full recompute's need."""
    from memo.pipeline.device import FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES
    from memo.planner import choose_policy, describe_policy

    budget = options.device_budget_bytes()
    solution = choose_policy(costs, budget, headroom=FALLBACK_HEADROOM if budget else 0.0,
                             headroom_bytes=FALLBACK_SEGMENT_BYTES if budget else 0)
    emit(f"memo: stage {stage}: {describe_policy(solution.policy)} at alpha {solution.alpha:.4f} "
         f"({solution.binding})")
    return solution


# NOTE [A stage's calibrated policy]
# The cost model of a stage comes from one micro-batch through its first chunk; what the stage's step
# really holds (the schedule's p2p buffers, the embedding's or the head's share, memo's runtime beyond
# the model) it does not see, and a policy it says fits may not: on gpt-mini at 2K tokens its choice
# needed 108 MiB where full recompute needed 68. So, where memo's allocator records the stage, the
# choice is checked as the single iteration's is (NOTE [Calibrated policy] in memo/pipeline/policy.py):
# the stage records its step under full recompute (the device cap without --device-mem-gb, and the
# cost model's base is corrected to give that total), then under the policy chosen within the cap;
# where the recorded total exceeds the cap, the excess is added to the model's memo correction and
# the policy is chosen again, at most CALIBRATION_ROUNDS times, full recompute being the fallback that
# fits (a miss of a split without memo layers corrects the model's base instead, which every split
# shares). The ranks of a stage agree on each total (the largest), and every stage records in every round
# (a schedule runs every stage), a stage that is done running its accepted policy again. The last
# recording of the accepted policy is the trace its address plan is made from.
CALIBRATION_ROUNDS = 3


def _calibrated_policy(chunks: list[torch.nn.Module], ddp: list[Any] | None,
                       batches: list[tuple[torch.Tensor, ...]], layout: Any, parallel: Any, config: Any,
                       stage: int, costs: Any, options: Any, emit: Callable[[str], None]
                       ) -> tuple[float, list[list[str]], list[Any], dict[str, Any]]:
    """NOTE [A stage's calibrated policy]: alpha, the policy per chunk, the runtimes and the trace of the
    step recorded with them."""
    import dataclasses
    import functools

    from memo.pipeline import stage_plan as sp
    from memo.pipeline.device import _iteration_total, usable_device_bytes
    from memo.planner import describe_policy, full_recompute_need
    from memo.planner.policy import choose_policy

    static = _state_bytes(chunks, ddp)
    meta = _stage_meta(config, layout)
    step = functools.partial(_no_update_step, chunks, ddp, batches, layout, config)

    def record(policies: list[list[str]], alpha: float) -> tuple[dict[str, Any], int, list[Any]]:
        for chunk in chunks:
            _unwrap(chunk)
        runtimes = _apply("memo", chunks, alpha, policies)
        trace = sp.record_stage(step, chunks, batches[0][0].device, meta)
        return trace, _stage_max(_iteration_total(trace, static), parallel, stage), runtimes

    full = [["recompute"] * len(c.decoder.layers) for c in chunks]
    budget = options.device_budget_bytes()
    trace, fr_total, runtimes = record(full, 0.0)
    wrapped: tuple[float, list[list[str]]] = (0.0, full)
    cap = usable_device_bytes(budget) if budget is not None else fr_total
    base = costs.base_bytes + fr_total - full_recompute_need(costs)  # the model's full recompute: recorded
    costs = dataclasses.replace(costs, base_bytes=max(0, base))
    accepted = (0.0, full, runtimes, trace) if fr_total <= cap else None
    done = False
    for _round in range(CALIBRATION_ROUNDS):
        if not done:
            try:
                solution = choose_policy(costs, device_budget=cap)
            except MemoError:  # no policy fits by the model: full recompute, where it fits, is all there is
                solution = None
            done = solution is None or all(kind == "recompute" for kind in solution.policy)
        if sp.all_done(done, parallel):
            break
        if done:  # a schedule runs every stage: this one runs its accepted policy again
            alpha, policies = (accepted[0], accepted[1]) if accepted is not None else wrapped
        else:
            alpha, policies = float(solution.alpha), _per_chunk(solution.policy, chunks)
        trace, total, runtimes = record(policies, alpha)
        wrapped = (alpha, policies)
        if done:
            if accepted is not None:
                accepted = (alpha, policies, runtimes, trace)
        elif total <= cap:
            accepted, done = (alpha, policies, runtimes, trace), True
            emit(f"memo: stage {stage}: {describe_policy(solution.policy)} at alpha {alpha:.4f} recorded "
                 f"{total / 2**20:.1f} MiB, within {cap / 2**20:.1f} MiB")
        else:  # the model missed by this much: the next choice counts it (in what the split had)
            missed = total - solution.device_bytes
            if any(kind in ("memo", "input-only") for kind in solution.policy):
                costs = dataclasses.replace(costs, memo_overhead=costs.memo_overhead + missed)
            else:  # kept and recomputed layers only: the model's base was short for every split
                costs = dataclasses.replace(costs, base_bytes=costs.base_bytes + missed)
            emit(f"memo: stage {stage}: {describe_policy(solution.policy)} at alpha {alpha:.4f} recorded "
                 f"{total / 2**20:.1f} MiB, over {cap / 2**20:.1f} MiB: choosing again")
    sp.stop_together(None if accepted is not None else (
        f"memo.train: stage {stage}: no layer policy fits --device-mem-gb {options.device_mem_gb:g}: full "
        f"recompute alone records {fr_total / 2**20:.1f} MiB; give more device memory, more pipeline stages "
        "or tensor parallelism, or a shorter sequence"), parallel)
    assert accepted is not None  # stop_together raised otherwise
    alpha, policies, runtimes, trace = accepted
    if wrapped != (alpha, policies):  # the chunks run the accepted policy (its trace was recorded earlier)
        for chunk in chunks:
            _unwrap(chunk)
        runtimes = _apply("memo", chunks, alpha, policies)
    return alpha, policies, runtimes, trace


def _no_update_step(chunks: list[torch.nn.Module], ddp: list[Any] | None,
                    batches: list[tuple[torch.Tensor, ...]], layout: Any, config: Any) -> None:
    """The schedule's forwards and backwards, and no gradient kept: a recorded step (NOTE [A stage's
    address plan]) leaves the model as it found it."""
    _forward_backward(chunks, ddp, batches, layout, config)
    for chunk in chunks:
        for p in chunk.parameters():
            p.grad = None
    for d in ddp or ():
        d.zero_grad_buffer()


def _stage_votes(value: Any, parallel: Any, stage: int) -> list[Any]:
    """``value`` of every rank of this rank's stage (a collective; one process: its own)."""
    if parallel is None:
        return [value]
    return [v for st, v in parallel.gather((stage, value)) if st == stage]


def _stage_max(value: int, parallel: Any, stage: int) -> int:
    """The largest ``value`` over the ranks of this rank's stage (a collective)."""
    return int(max(_stage_votes(int(value), parallel, stage)))


def _per_chunk(policy: list[str], chunks: list[torch.nn.Module]) -> list[list[str]]:
    """A stage's layer policy (its layers in order, chunk after chunk) cut into each chunk's."""
    out, first = [], 0
    for chunk in chunks:
        out.append(list(policy[first:first + len(chunk.decoder.layers)]))
        first += len(chunk.decoder.layers)
    return out


def _stage_machine(mine: tuple[float, float, int], parallel: Any, stage: int) -> tuple[float, float, int]:
    """The slowest link, the slowest layer and the smallest host share over the ranks of this rank's stage
    (a collective): every rank of a stage then solves the same policy (NOTE [Decisions every rank
    shares] in memo/pipeline/policy.py)."""
    votes = _stage_votes(mine, parallel, stage)
    return (min(m[0] for m in votes), max(m[1] for m in votes), min(m[2] for m in votes))


def _stage_plan(chunks: list[torch.nn.Module], ddp: list[Any] | None, batches: list[tuple[torch.Tensor, ...]],
                layout: Any, parallel: Any, config: Any, stage: int, runtimes: list[Any], alpha: float,
                given: Any, options: Any, emit: Callable[[str], None], trace: dict[str, Any] | None = None
                ) -> Any:
    """This rank's plan of its stage's step (NOTE [A stage's address plan] in
    memo/pipeline/stage_plan.py): ``given`` (from --plan), else made from ``trace`` (the step recorded
    already) or a step recorded here, planned and agreed on by the stage's ranks; written to --save-plan
    when asked."""
    import functools

    from memo.pipeline import stage_plan as sp

    run = functools.partial(_no_update_step, chunks, ddp, batches, layout, config)
    schedule = sp.stage_schedule(layout, stage, config.micro_batches, chunks)
    if given is not None:
        run()  # the warm-up a recorded plan had: one-time buffers made before the planned steps
        plan = given
    else:
        if trace is None:
            trace = sp.record_stage(run, chunks, batches[0][0].device, _stage_meta(config, layout))
        plan = sp.stage_plan(trace, schedule, _state_bytes(chunks, ddp),
                             host_bytes=_schedule_host_bytes(runtimes, layout, stage, config.micro_batches),
                             time_limit=options.time_limit)
        plan.alpha = alpha
        plan.policy = [kind for rt in runtimes for kind in rt.policy]  # what each chunk runs
        plan = sp.agree_on_plan(plan, trace, parallel, stage)
    budget = options.device_budget_bytes()
    need = int(plan.device["total_bytes"])
    sp.stop_together(None if budget is None or need <= budget else (
        f"memo.train: stage {stage}'s plan needs {need / 2**20:.1f} MiB of device memory, more than "
        f"--device-mem-gb {options.device_mem_gb:g} ({budget / 2**20:.1f} MiB); give more device memory, "
        "more pipeline stages or tensor parallelism, or a shorter sequence"), parallel)
    if options.save_plan:
        sp.save_stage_plan(plan, options.save_plan, parallel, stage)
    emit(f"memo: stage {stage}: plan of its step ({schedule['schedule']}, {config.micro_batches} "
         f"micro-batches, {len(plan.allocations):,} allocations): arena {plan.peak / 2**20:.1f} MiB, "
         f"device total {plan.device['total_bytes'] / 2**20:.1f} MiB, host "
         f"{plan.device['host_bytes'] / 2**20:.1f} MiB"
         + ("" if given is None else f" (from {options.plan})"))
    return plan


def _can_plan(device: torch.device, emit: Callable[[str], None]) -> bool:
    """Whether memo's allocator can serve this device: the CPU, or CUDA once memo's CUDA allocator is
    PyTorch's (``memo train`` installs it before CUDA starts)."""
    from memo import allocator

    if device.type == "cpu" or (device.type == "cuda" and allocator.cuda_installed()):
        return True
    emit(f"memo: the stages run without a plan: memo's allocator does not serve {device} in this process "
         "(install it with memo.allocator.install_cuda() before CUDA starts, as `memo train` does)")
    return False


def _stage_meta(config: Any, layout: Any) -> dict[str, Any]:
    """The job a stage's plan is made for (memo.planner.job): model, sequence, batch, dtype, shards."""
    from memo.models import fingerprint, get_config

    return {"model": config.model, "fingerprint": fingerprint(get_config(config.model)),
            "seq_len": config.seq_len, "micro_batch": config.micro_batch, "dtype": config.dtype,
            "tensor_parallel": layout.tensor_parallel, "context_parallel": layout.context_parallel,
            "sequence_parallel": bool(layout.sequence_parallel), "recorder": "allocator"}


def _schedule_host_bytes(runtimes: list[Any], layout: Any, stage: int, micro_batches: int) -> int:
    """The host arenas this rank's schedule needs: per chunk, one forward's offloaded bytes times the
    forwards :func:`memo.distributed.pipeline.in_flight` says the chunk holds at once (a chunk that
    offloads nothing holds none)."""
    from memo.distributed.pipeline import in_flight

    p, v = layout.pipeline_parallel, layout.virtual_pipeline
    flights = in_flight(p, stage, v, micro_batches) if p > 1 else [1] * len(runtimes)
    return sum(f * rt.buffers.flight_bytes for f, rt in zip(flights, runtimes, strict=True)
               if rt.buffers is not None and rt.n_offloaded)


def _state_bytes(chunks: list[torch.nn.Module], ddp: list[Any] | None) -> int:
    """What lives across steps and is not in a step's trace: the parameters, AdamW's two moments of
    each, and megatron DDP's gradient buffers (made when the chunks were wrapped)."""
    params = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    return 3 * params + _ddp_buffer_bytes(ddp)


def _ddp_buffer_bytes(ddp: list[Any] | None) -> int:
    """Bytes of megatron DDP's contiguous gradient buffers."""
    total = 0
    for d in ddp or ():
        for buffer in list(getattr(d, "buffers", [])) + list(getattr(d, "expert_parallel_buffers", [])):
            grad = getattr(buffer, "grad_data", None)
            if grad is not None:
                total += grad.numel() * grad.element_size()
    return total


def _schedule_name(layout: Any) -> str:
    if layout.pipeline_parallel == 1:
        return "no pipelining (gradient accumulation)"
    return "interleaved 1F1B" if layout.virtual_pipeline > 1 else "1F1B"


def _apply(name: str, chunks: list[torch.nn.Module], alpha: float | None,
           policies: list[list[str]] | None = None) -> list[Any]:
    """Wrap each chunk for the strategy (NOTE [Pipelined steps]), memo's with its layer policy (None: the
    default for the chunk's place); the runtimes (empty for ``none``)."""
    import memo.runtime as mr

    if name == "none":
        return []
    for c, chunk in enumerate(chunks):
        n = len(chunk.decoder.layers)
        if name == "memo":
            mr.wrap(chunk, alpha=alpha, policy=None if policies is None else policies[c])
        else:
            mr.wrap(chunk, alpha=0.0, policy=["recompute"] * n)
    return [mr.runtime_of(c) for c in chunks]


def _unwrap(chunk: torch.nn.Module) -> None:
    import memo.runtime as mr

    if mr.is_wrapped(chunk):
        mr.unwrap(chunk)


def _data_parallel(chunks: list[torch.nn.Module], layout: Any) -> list[Any] | None:
    """megatron's DDP around each chunk where gradients need a reduction (context-parallel ranks, the
    sequence-parallel norms): finalize_model_grads then reduces them (NOTE [Parallel layout])."""
    if layout.context_parallel == 1 and not layout.sequence_parallel and layout.data_parallel == 1:
        return None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    return [DistributedDataParallel(c.config, DistributedDataParallelConfig(), c) for c in chunks]


def _shard(batch: tuple[torch.Tensor, torch.Tensor], parallel: Any, device: torch.device
           ) -> tuple[torch.Tensor, ...]:
    """This rank's ``(ids, labels, positions, global counted tokens)`` of a global micro-batch."""
    ids, labels = batch
    count = torch.tensor(int((labels != -100).sum()))
    if parallel is None:
        b, s = ids.shape
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        return ids.to(device), labels.to(device), positions.to(device), count
    ids, labels, positions = parallel.shard(ids, labels)
    return ids.to(device), labels.to(device), positions.to(device), count


def _step(chunks: list[torch.nn.Module], ddp: list[Any] | None, optimizer: torch.optim.Optimizer,
          batches: list[tuple[torch.Tensor, ...]], layout: Any, config: Any,
          phases: Callable[[], contextlib.AbstractContextManager[None]]) -> float | None:
    """One step under megatron's schedule, its forwards and backwards inside ``phases`` (the stage
    plan's, NOTE [A stage's address plan]); the mean of the micro-batches' losses on the last stage
    (None on the others)."""
    optimizer.zero_grad(set_to_none=True)
    with phases():
        out = _forward_backward(chunks, ddp, batches, layout, config)
    if ddp is not None:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(ddp)
        for chunk in chunks:
            for p in chunk.parameters():
                if getattr(p, "main_grad", None) is not None:
                    p.grad = p.main_grad
    optimizer.step()
    if not out:
        return None
    return float(torch.stack([d["loss"] for d in out]).mean())


def _forward_step(layout: Any) -> Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Any]]:
    """megatron's ``forward_step_func``: one micro-batch through a chunk, and the last stage's loss."""
    from megatron.core import parallel_state

    # DDP averages the gradients of the DP x CP ranks, each of which holds 1/(d·c) of the tokens
    scale = layout.context_parallel * layout.data_parallel

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        ids, labels, positions, count = next(data_iterator)
        counted = labels != -100
        per_token = model(ids, positions, None, labels=torch.where(counted, labels, 0))

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            local = (out * counted.to(out.dtype)).sum()
            total = local.detach().clone()
            if scale > 1:
                torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(
                    with_context_parallel=True))
            n = max(int(count), 1)
            # megatron divides what this returns by the micro-batch count, in place: a copy is reported
            return local * (scale / n), {"loss": (total / n).clone()}

        return per_token, loss_func

    return forward_step


def _forward_backward(chunks: list[torch.nn.Module], ddp: list[Any] | None,
                      batches: list[tuple[torch.Tensor, ...]], layout: Any, config: Any
                      ) -> list[dict[str, torch.Tensor]]:
    """The schedule's forwards and backwards of ``batches`` from zero gradients; what the last stage's
    loss functions reported."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected here
        from megatron.core.pipeline_parallel import get_forward_backward_func

    if ddp is not None:
        for d in ddp:
            d.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=_forward_step(layout), data_iterator=[iter(batches) for _ in chunks],
        model=ddp if ddp is not None else chunks, num_microbatches=len(batches),
        seq_length=config.seq_len,  # megatron divides by CP (and TP under SP)
        micro_batch_size=batches[0][0].shape[0])


def _loss_on_every_rank(loss: float | None, parallel: Any) -> float:
    """The last stage's loss, on every rank (rank 0, on the first stage, prints it)."""
    if parallel is None:
        return float(loss)
    from megatron.core import parallel_state

    value = torch.tensor(loss if loss is not None else 0.0, dtype=torch.float64)
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(value, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return float(value)


class _DeviceMeter:
    """The device peak of the steps (NOTE [Measuring device memory] in memo/train/meter.py): on the CPU,
    memo's allocator serves the steps (the stage's plan, NOTE [A stage's address plan], else its fallback
    alone) from one context opened here, and its running peak in use, plus what the device held before
    (the chunks' parameters, DDP's gradient buffers, memo's rounding buffers), is the emulated device's;
    on CUDA, torch's ``max_memory_allocated`` or memo's CUDA allocator's peak."""

    def __init__(self, device: torch.device, chunks: list[torch.nn.Module], ddp: list[Any] | None = None,
                 plan: Any = None) -> None:
        import gc

        from memo import allocator
        from memo.pipeline.passes import runtime_device_buffers

        self.device = device
        self.before = (sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
                       + _ddp_buffer_bytes(ddp) + sum(sum(runtime_device_buffers(c)) for c in chunks))
        self.peak = 0
        self.kind = ("cuda_max_memory_allocated" if device.type == "cuda"
                     else "memo_allocator_peak_in_use+params")
        self.counts: dict[str, int] = {}
        self._phases: Any = None
        self._served: Any = None
        if device.type != "cpu" and not (device.type == "cuda" and allocator.cuda_installed()):
            return  # torch's allocator serves the steps: read() takes its peak
        gc.collect()  # blocks earlier work left to the collector would count in this run's peak
        tables = plan if plan is not None else {"tables": {}, "peak": 0}  # none: the fallback serves all
        self._served = allocator.planned(tables, device=device)
        self._served.__enter__()
        if plan is not None:
            from memo.pipeline.stage_plan import StagePhases

            self._phases = StagePhases(chunks, allocator.set_phase)

    def phases(self) -> contextlib.AbstractContextManager[None]:
        """Where the stage plan's phases are open: the schedule's forwards and backwards of a step."""
        return self._phases.step() if self._phases is not None else contextlib.nullcontext()

    def read(self) -> None:
        """The running peak and the allocator's counters, after a step."""
        from memo import allocator

        if self._served is None:
            self.peak = max(self.peak, int(torch.cuda.max_memory_allocated(self.device)))
            return
        st = allocator.stats(self.device)
        if self.device.type == "cuda":  # memo's CUDA allocator served the parameters too
            self.kind = "memo_allocator_peak_in_use"
            self.peak = max(self.peak, int(st["peak_bytes_in_use"]))
        else:
            self.peak = max(self.peak, self.before + int(st["peak_bytes_in_use"]))
        # "fallback": requests the plan covered but could not serve (a slot still busy); "unplanned":
        # requests outside its phases (without a plan, all of them), the fallback's by design
        self.counts = {"planned": int(st["planned_hits"]), "fallback": int(st["fallback_requests"])
                       - int(st["unplanned_requests"]), "unplanned": int(st["unplanned_requests"])}

    def close(self) -> None:
        if self._phases is not None:
            self._phases.remove()
            self._phases = None
        if self._served is not None:
            served, self._served = self._served, None
            served.__exit__(None, None, None)


def _extras(runtimes: list[Any]) -> dict[str, Any]:
    """Host bytes and forwards in flight of this rank's chunks (memo's runtimes)."""
    if not runtimes:
        return {}
    return {"host_pinned_bytes": sum(rt.host_bytes for rt in runtimes),
            "forwards_in_flight": [rt.buffers.n_flights if rt.buffers is not None else 0 for rt in runtimes],
            "offloaded_layers": [rt.n_offloaded for rt in runtimes],
            "policy": [list(rt.policy) for rt in runtimes]}


def _all_parameters(chunks: list[torch.nn.Module], parallel: Any) -> int:
    """Parameters of the whole model: this rank's chunks summed over the pipeline's stages."""
    mine = torch.tensor(sum(p.numel() for c in chunks for p in c.parameters()), dtype=torch.int64)
    if parallel is not None and parallel.layout.pipeline_parallel > 1:
        from megatron.core import parallel_state

        torch.distributed.all_reduce(mine, group=parallel_state.get_pipeline_model_parallel_group())
    return int(mine)


def _stages_record(parallel: Any, result: Any, runtimes: list[Any], stage: int,
                   config: Any) -> dict[str, Any]:
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


def _plan_field(result: Any, key: str) -> int | None:
    plan = getattr(result.strategy, "plan", None)
    device = getattr(plan, "device", None) or {}
    return None if device.get(key) is None else int(device[key])
