"""One pipeline: (model, example batch, machine) -> plan, in the order DESIGN.md draws it.

1. pass 1: the profiler records the plain model (on meta when it can: NOTE [Sizes from meta]) and
   measures S_input, S_attn, S_others per layer;
2. the machine: B, T_layer and the host memory, given or measured (:class:`memo.machine.Machine`);
3. the policy: the alpha LP and the layer policy within the device budget, calibrated against
   recorded iterations (NOTE [Calibrated policy]);
4. pass 2: the profiler records the model wrapped by memo's runtime with that policy;
5. the planner: bi-level addresses for pass 2's trace.

The profiler (:mod:`memo.profiler`) only records traces and measures; this package is where the
runtime, the allocator and the planner meet it. :class:`memo.Session` then runs the plan. This module
holds :func:`profile`, the order of the steps and pass 1; each step's work lives in a module named for
what it does: ``job`` (the resolved arguments, the model built by name), ``passes`` (the recorders, the
wrapped pass, pass 2), ``policy`` (step 3's cost model and the recordings it is calibrated and probed
against; the torch-free rest is :mod:`memo.planner.calibrate`), ``device`` (the device budget, totals
and model states) and ``addresses`` (step 5).

NOTE [Two-pass profiling]
The plan used at run time must describe what runs. Memo's runtime wraps every
layer for a given alpha (``memo.runtime.wrap``), which changes the layer's
allocations: skeletal tensors move to rounding buffers, the recomputed part is
not kept, and so on. So:

1. pass 1 records the plain model and measures S_input, S_attn, S_others;
2. alpha is solved from those sizes and the machine numbers;
3. pass 2 records the model wrapped with that alpha, and the plan is made
   from pass 2's trace.

Pass 2 runs on the device the job runs on, or on meta (the runtime's meta copy engine moves
nothing). ``wrap_pass=True`` requires it (any failure is raised); ``False`` skips it; ``None``
(the default) tries it and, when the runtime refuses the model with a MemoError, plans from the
plain model and says so in ``ProfileResult.notes``. The model is unwrapped after pass 2 either
way. With ``recorder="allocator"`` pass 2 always runs, on the plain model when it cannot wrap,
because the planned trace must be the allocator's own requests. S_* always come from pass 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import memo.planner  # noqa: F401  NOTE [Import PuLP early]: imported first inside profile(), it pins the model
from memo.adapters.model import model_adapter_for
from memo.errors import MemoError
from memo.machine import Machine
from memo.models.dtypes import DTYPES_AND_ALIASES
from memo.planner import PolicySolution
from memo.planner.calibrate import PROBES as PROBES
from memo.planner.vocab import RECORDERS, Recorder
from memo.profiler.bounds import check_least_memory, least_memory
from memo.profiler.context_parallel import context_parallel_note, rank_tokens
from memo.profiler.device import model_states
from memo.profiler.measure import check_machine, measure_machine
from memo.profiler.meta_cache import MetaKernelCache, reused
from memo.profiler.record import Recording, meta_copy, model_parts
from memo.profiler.stats import summarise_layers

# The steps, one module each by what it does. Pass 1 calls the recorder through this module's
# ``record_pass``, so that a test can watch it (tests/allocator/test_cuda_path.py).
from .addresses import plan_addresses
from .device import FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES, iteration_total, usable_device_bytes
from .job import ProfileJob, ProfileState, ResolvedRequest, build_profile_model, example_batch
from .passes import check_allocator_device, pass2, record_pass, time_first_layer
from .policy import choose_profile_policy
from .request import ProfileRequest
from .result import ProfileResult
from .step import ModelStep

__all__ = ["DTYPES", "FALLBACK_HEADROOM", "FALLBACK_SEGMENT_BYTES", "ProfileRequest", "ProfileResult",
           "build_profile_model", "example_batch", "iteration_total", "profile", "profile_step",
           "usable_device_bytes"]

#: dtype names accepted by :func:`profile` and ``memo profile --dtype`` (memo/models/dtypes.py).
DTYPES = DTYPES_AND_ALIASES


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise MemoError(f"memo.profiler: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None


def profile(
    model: str | nn.Module,
    seq_len: int | None = None,
    micro_batch: int = 1,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "meta",
    *,
    batch: tuple[torch.Tensor, torch.Tensor] | None = None,
    machine: Machine | None = None,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
    alpha: float | None = None,
    optimizer_states: str = "same",
    gradients: str = "arena",
    policy: list[str] | None = None,
    recorder: str | None = None,
    wrap_pass: bool | None = None,
    solve: bool = True,
    plan: bool = True,
    time_limit: float = 30.0,
    solver: str | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    agree_max: Callable[[int], int] | None = None,
    **machine_fields: Any,
) -> ProfileResult:
    """Profile one training iteration and plan it (the steps of the module docstring).

    Args:
        model: a registered config name (built on ``device`` in ``dtype``) or a model with a model
            adapter (NOTE [Model adapters]) already on its device.
        seq_len, micro_batch: tokens per sequence and sequences per micro-batch; or
        batch: an example ``(ids, labels)``, ``[b, s]`` on the model's device (its shape gives both).
        dtype, device: for a model built by name. ``"meta"`` allocates nothing.
        machine: the :class:`~memo.machine.Machine` (its ``None`` fields are measured here). Its
            fields may be given as keywords instead (``bandwidth_gbps=25, layer_ms=3.0, ...``).
        tensor_parallel: ranks one layer is split over with Megatron tensor + sequence
            parallelism (NOTE [Per-rank sizes]); alpha and host bytes are per rank.
        context_parallel: ranks the sequence is split over with megatron-core's context
            parallelism (NOTE [Context-parallel profile]): the rank model runs ``seq_len / c``
            tokens; ``seq_len`` must be a multiple of ``2·c`` (and of ``c·t`` with tensor parallelism).
        alpha: use this alpha instead of solving the LP (checked against host memory).
        optimizer_states: how model states are counted (NOTE [Model states]): "same" or "mixed".
        gradients: where the plan puts the parameter gradients (make_plan's ``gradients``):
            "arena" (default), sharing the arena's bytes with the activations freed before them,
            for training that sets the gradients to None after each optimizer step; "fallback" for
            gradient accumulation (NOTE [Allocations that outlive the iteration] in planner/outliving.py).
        policy: a fixed layer policy (NOTE [Layer policy]) instead of the planner's choice.
        recorder: ``"dispatch"`` (every storage torch creates; any device) or ``"allocator"``
            (memo.allocator.logging: the real requests; cpu/cuda) for the trace the plan is
            made from. The S_* sizes always come from the dispatch recorder. None: the allocator
            recorder where memo's allocator will replay the plan, else the dispatch recorder
            (NOTE [The default recorder]).
        wrap_pass: run pass 2 on the wrapped model (None: try, and plan from the plain model when
            the runtime refuses it).
        solve, plan: stop after pass 1 (``solve=False``) or after alpha (``plan=False``).
        time_limit, solver: passed to the planner's ``make_plan``.
        progress: show a progress bar per recorded pass on stderr.
        log: called with one line per stage (e.g. ``print``).
        agree_max: for ranks that profile their shards together: the largest of a number over the
            ranks, a collective (NOTE [Decisions every rank shares]); None in one process.

    A given model's gradients come back as they were (NOTE [The profile keeps the user's gradients]):
    the same ``.grad`` tensors with the same values, or None; the profile's own backward passes leave
    none behind.
    """
    return profile_step(model if isinstance(model, str) else ModelStep(model, batch), ProfileRequest(
        seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, device=device,
        tensor_parallel=tensor_parallel, context_parallel=context_parallel,
        machine=_machine(machine, machine_fields), alpha=alpha,
        policy=None if policy is None else tuple(policy), optimizer_states=optimizer_states,
        gradients=gradients, recorder=_recorder(recorder), wrap_pass=wrap_pass,
        solve=solve, plan=plan, time_limit=time_limit, solver=solver, progress=progress, log=log,
        agree_max=agree_max))


def profile_step(step: str | ModelStep, request: ProfileRequest) -> ProfileResult:
    """Profile one training iteration of ``step`` and plan it (the steps of the module docstring):
    a registered config name (built on ``request.device`` in ``request.dtype``) or a
    :class:`~memo.pipeline.step.ModelStep` (a model with a model adapter on its device, and optionally
    its example batch). A pipeline stage's step is profiled by memo.pipeline.stage_profile with the
    same calibration (NOTE [One step, one path])."""
    model = step if isinstance(step, str) else step.chunks[0]
    batch = None if isinstance(step, str) else step.batch
    r = request
    with _gradients_kept(model), contextlib.ExitStack() as kernels:
        recorder, why = _default_recorder(r.recorder, model, torch.device(r.device), r.solve and r.plan)
        seq_len, micro_batch = _checked_sizes(r.seq_len, r.micro_batch, batch, r.tensor_parallel,
                                              r.context_parallel, recorder)
        if r.gradients not in ("arena", "fallback"):
            raise MemoError(f"memo.profiler: gradients must be 'arena' or 'fallback', got {r.gradients!r}")
        resolved, net = _request(model, seq_len, micro_batch, _dtype(r.dtype), torch.device(r.device),
                                 r.machine, r.tensor_parallel, r.context_parallel, recorder)
        resolved = dataclasses.replace(resolved, progress=r.progress, say=r.log or (lambda _line: None),
                                       agree_max=r.agree_max or int, gradients=r.gradients)
        job = ProfileJob(resolved, ProfileState(net=net, batch=batch, notes=[] if why is None else [why]))
        if resolved.device.type == "meta":
            # NOTE [Meta kernels by their inputs' shapes] in memo/profiler/meta_cache.py: a profile on meta
            # records the same ops on the same shapes over and over (layers, tiles, policy probes); its
            # trace, and so its plan, is the same event for event (tests/profiler/test_meta_cache_profile.py).
            # Only there: a dispatch mode over real tensors can change what they allocate.
            kernels.enter_context(reused(MetaKernelCache()))
        # Refuse bad arguments before building or recording anything (a 1M-token pass takes a while).
        if r.solve:
            check_machine(r.machine, resolved.device, resolved.dtype)
        if recorder == Recorder.ALLOCATOR:
            check_allocator_device(resolved.device)
        plain, states, layer_params = _pass1(job, net, r.optimizer_states)
        result = ProfileResult(trace=plain.trace, layer_stats=plain.layer_stats, plain_trace=plain.trace,
                               timings=job.state.timings, notes=job.state.notes)
        if not r.solve:
            return result
        _measure(job, plain, result)
        policy = None if r.policy is None else [getattr(kind, "value", kind) for kind in r.policy]
        chosen = choose_profile_policy(job, plain, states, layer_params, r.alpha, policy, r.wrap_pass, result)
        wrapped = pass2(job, plain, chosen, r.wrap_pass, r.plan, result)
        _record_choice(job, result, chosen, states)
        if r.plan:
            plan_addresses(job, result, chosen, states, wrapped, r.time_limit, r.solver)
        return result


# NOTE [The profile keeps the user's gradients]
# Every recorded pass runs a backward on the given model (pass 1 when it cannot run on meta, the
# policy's probes, pass 2, the allocator recorder's warm-up), and each leaves gradients in ``.grad``.
# A user who profiles and then trains (zero_grad after the optimizer step, as most loops do) would
# start step 1 from the profile's gradients added to the first batch's; one who profiles in the
# middle of accumulating would lose what was accumulated, or, through the warm-up, which
# accumulates into the tensors it finds, have it changed in place. So the profile takes the
# gradients off the parameters before its first pass (no backward of it can then touch the user's
# tensors) and puts the very same tensors back when it ends, raised or not.
@contextlib.contextmanager
def _gradients_kept(model: str | nn.Module) -> Iterator[None]:
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, kept, strict=True):
            p.grad = grad


# NOTE [The default recorder]
# memo's allocator replays a plan by (phase, request index), so the plan must come from the requests
# the allocator will see. The dispatch recorder sees the storages torch creates, not what kernels
# allocate below the dispatcher: on CPU the flash-attention kernel's scratch inside every layer
# forward, the embedding's index copy. Planned from its trace, every request after the first unseen
# one in a phase deviates: tiny at 512 tokens on CPU runs 80 requests a step from the plan and 712
# from the fallback. So profile()'s default is ``memo profile``'s: the allocator recorder on cpu and
# cuda when a plan is made, the dispatch recorder on meta (it is all there is) or when only alpha
# is wanted. On CUDA the allocator recorder needs memo's CUDA allocator, installed before the first
# CUDA tensor; when that is too late the dispatch recorder runs and the result's notes say why.
def _default_recorder(recorder: str | None, model: str | nn.Module, device: torch.device, plan: bool
                      ) -> tuple[str, str | None]:
    """The recorder to use (``plan``: whether a plan is made) and, when the default could not be the
    allocator's, why (a note)."""
    if recorder is not None:
        return recorder, None
    if isinstance(model, nn.Module):
        param = next(model.parameters(), None)
        device = param.device if param is not None else device
    if device.type not in ("cpu", "cuda") or not plan:
        return "dispatch", None
    if device.type == "cuda":
        from memo import allocator

        if not allocator.cuda_installed() and torch.cuda.is_initialized():
            return "dispatch", ("the plan comes from the dispatch recorder: memo's CUDA allocator was not "
                                "installed before the first CUDA tensor, so its requests cannot be recorded "
                                "and a Session cannot replay this plan; call memo.allocator.install_cuda() "
                                "first (NOTE [The default recorder])")
    return "allocator", None


def _recorder(name: str | None) -> Recorder | None:
    if name is None:
        return None
    try:
        return Recorder(name)
    except ValueError:
        raise MemoError(f"memo.profiler: unknown recorder {name!r}; use one of "
                        f"{', '.join(r.value for r in Recorder)}") from None


def _machine(machine: Machine | None, machine_fields: dict[str, Any]) -> Machine:
    """The machine given, with any fields given as keywords replaced (or made of those alone)."""
    if machine is None:
        return Machine(**machine_fields)
    if machine_fields:
        return machine.replace(**machine_fields)
    return machine


def _checked_sizes(seq_len: int | None, micro_batch: int, batch: tuple[torch.Tensor, torch.Tensor] | None,
                   tensor_parallel: int, context_parallel: int, recorder: str) -> tuple[int, int]:
    """``seq_len`` and ``micro_batch`` (from the example batch's shape when one is given), with
    the arguments :func:`profile` takes checked before anything is built or recorded."""
    if batch is not None:
        ids, labels = batch
        if ids.dim() != 2 or labels.shape != ids.shape:
            raise MemoError(f"memo.profiler: the example batch must be ids, labels of one shape [b, s], got "
                            f"{tuple(ids.shape)} and {tuple(labels.shape)}")
        micro_batch, seq_len = int(ids.shape[0]), int(ids.shape[1]) * context_parallel
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise MemoError(f"memo.profiler: seq_len must be a positive integer, got {seq_len!r}")
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise MemoError(f"memo.profiler: micro_batch must be a positive integer, got {micro_batch!r}")
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise MemoError(f"memo.profiler: tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    if recorder not in RECORDERS:
        raise MemoError(f"memo.profiler: recorder must be 'dispatch' or 'allocator', got {recorder!r}")
    return seq_len, micro_batch


def _sequence_parallel(job: ProfileJob) -> bool:
    """Whether the profiled rank's layers hold s/t tokens: memo's rank model always does (NOTE
    [Tensor-parallel rank]); a given model says so in its config (megatron-core's ``sequence_parallel``)."""
    req, st = job.request, job.state
    config = getattr(st.net, "config", None) if st.net is not None else None
    given = getattr(config, "sequence_parallel", None)
    return bool(given) if isinstance(given, bool) else req.tp > 1


def _record_choice(job: ProfileJob, result: ProfileResult, chosen: PolicySolution, states: dict[str, Any]
                   ) -> None:
    """The chosen alpha, tensor parallelism, policy and model states in the trace's meta."""
    req = job.request
    result.trace["meta"]["alpha"] = float(result.alpha.alpha)
    result.trace["meta"]["tensor_parallel"] = req.tp
    result.trace["meta"]["sequence_parallel"] = _sequence_parallel(job)
    result.trace["meta"]["policy"] = list(chosen.policy)
    # the tile pass 2 ran (NOTE [Tiles of the device a plan is for] in memo/pipeline/job.py)
    result.trace["meta"]["tile_tokens"] = job.tile_tokens(chosen.tile_tokens)
    # `memo plan --device-mem-gb` re-plans this trace: the rank's total needs the model states.
    result.trace["meta"]["model_states"] = states


def _request(model: str | nn.Module, seq_len: int, micro_batch: int, dt: torch.dtype, device: torch.device,
             machine: Machine, tp: int, cp: int, recorder: str) -> tuple[ResolvedRequest, nn.Module | None]:
    """The request for ``model`` (its name, device and dtype), and the given model (None: built by name)."""
    # NOTE [Context-parallel profile]: from here on seq_len is the tokens one context-parallel rank
    # runs; job_seq_len is the job's whole sequence (the plan's meta, GPT's position table).
    rank_seq = rank_tokens(seq_len, tp, cp)
    fixed = {"seq_len": rank_seq, "job_seq_len": seq_len, "micro_batch": micro_batch, "tp": tp, "cp": cp,
             "machine": machine, "recorder": Recorder(recorder), "progress": False, "say": print}
    if isinstance(model, str):
        from memo.models import get_config

        # a registered name or a CONFIG.json path; plans and traces call it by the config's name
        name = get_config(model).name
        return ResolvedRequest(source=model, name=name, device=device, dtype=dt, **fixed), None
    if tp > 1 and getattr(model, "tensor_parallel", 1) != tp:
        raise MemoError(
            f"memo.profiler: tensor_parallel={tp} needs the model as one rank runs it; give "
            "a registered name or CONFIG.json (memo builds the rank model), or a model built with "
            f"memo.models.build_model(..., tensor_parallel={tp})")
    model_adapter_for(model, "memo.profiler")  # a model memo cannot profile is refused before any work
    param = next(model.parameters(), None)
    dev = param.device if param is not None else device
    dt = param.dtype if param is not None else dt
    name = getattr(getattr(model, "config", None), "name", None)
    name = name if isinstance(name, str) else type(model).__name__
    return ResolvedRequest(source=None, name=name, device=dev, dtype=dt, **fixed), model


def _exchanges(model: nn.Module | None) -> bool:
    """Whether ``model`` is a context-parallel rank whose attention exchanges with its group (megatron's
    core attention with a CP group, a Ulysses rank of memo/distributed/ulysses.py)."""
    if model is None:
        return False
    return any(getattr(m, "cp_group", None) is not None or hasattr(m, "memo_sequence_shard")
               or getattr(m, "sequence_shard", None) is not None for m in model.modules())


def _pass1(job: ProfileJob, given: nn.Module | None, optimizer_states: str
           ) -> tuple[Recording, dict[str, Any], int]:
    """Pass 1: the plain model's trace and layer sizes, its model states and one layer's parameters."""
    req, st = job.request, job.state
    t0 = time.perf_counter()
    # NOTE [Sizes from meta]: pass 1 runs the plain model on the meta device, a model given by
    # name built there and a given model copied there (meta_copy; no data is copied). The plain
    # model at the target length is exactly what does not fit the GPU (gpt-7b at 1M tokens
    # keeps 4 TiB for backward), the sizes the dispatch recorder sees do not depend on the
    # device, and meta costs seconds.
    sized_on = torch.device("meta")
    try:
        sizing = (build_profile_model(req.source, req.job_seq_len, req.dtype, sized_on, req.tp)
                  if given is None else meta_copy(given))
    except (TypeError, RuntimeError) as err:
        if given is None:
            raise
        # A model holding what cannot be copied (megatron-core's process groups): sized where it runs.
        st.notes.append(f"pass 1 ran on {req.device.type}, not meta: the model cannot be copied to meta "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})")
        sized_on, sizing = req.device, given
    st.timings["build"] = time.perf_counter() - t0
    # NOTE [Least memory, checked first]: a length the device cannot hold is refused before recording.
    check_least_memory(least_memory(sizing, req.seq_len // req.tp, req.micro_batch), req.device,
                       req.machine.device_budget_bytes, "memo.profiler", req.job_seq_len)
    st.meta = {"model": req.name, "seq_len": req.job_seq_len,
                      "context_parallel": req.cp}
    if req.cp > 1:
        st.notes.append(context_parallel_note(req.cp, req.machine.layer_ms is None, _exchanges(given)))
    req.say(f"pass 1 ({sized_on.type}): recording one iteration of the plain model ...")
    t0 = time.perf_counter()
    try:
        ids, labels = job.inputs() if sizing is given else example_batch(sizing, req.seq_len, req.micro_batch,
                                                                         sized_on)
        # NOTE [Meta kernels by their inputs' shapes]: on meta, also where the rest of the profile runs on
        # the device (each layer repeats the first one's ops on the same shapes)
        with reused(MetaKernelCache() if sized_on.type == "meta" else None):
            plain = record_pass(sizing, ids, labels, req.progress, "pass 1 (plain model)", st.meta)
    except (NotImplementedError, RuntimeError) as err:
        if given is None or req.device.type == "meta" or sizing is given:
            raise
        # An op of a user's model without a meta kernel (or a library that insists on a real device
        # on the way): size it where it runs, and say so.
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        st.notes.append(f"pass 1 ran on {req.device.type}, not meta: the model cannot run on meta "
                         f"({reason})")
        sized_on, sizing = req.device, given
        plain = record_pass(sizing, *job.inputs(), req.progress, "pass 1 (plain model)", st.meta)
    states = model_states(sizing, optimizer_states, req.device)
    layers = model_parts(sizing).layers
    layer_params = sum(p.numel() for p in layers[0].parameters()) if layers else 0
    del sizing
    st.timings["pass1"] = time.perf_counter() - t0
    req.say(f"pass 1 ({sized_on.type}): {len(plain.trace['events']):,} events, {plain.recorder.ops:,} ops in "
            f"{st.timings['pass1']:.1f} s")
    return plain, states, layer_params


def _measure(job: ProfileJob, plain: Recording, result: ProfileResult) -> None:
    """The machine numbers (given, measured on the job's device, or estimated from FLOPs)."""
    req, st = job.request, job.state
    net = job.built()
    t0 = time.perf_counter()
    q = measure_machine(req.machine, req.device, req.dtype,
                        time_layer=lambda: time_first_layer(net, *job.inputs()),
                        config=getattr(net, "config", None), seq_len=req.seq_len, micro_batch=req.micro_batch)
    st.timings["measure"] = time.perf_counter() - t0
    result.quantities = q
    stats = plain.layer_stats
    if q["layer_ms"].source == "measured":
        stats[0].forward_ms = q["layer_ms"].value
    plain.trace["layers"] = summarise_layers(stats)
    plain.trace["layers"]["layer_fwd_ms"] = q["layer_ms"].value
