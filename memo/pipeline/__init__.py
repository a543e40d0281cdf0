"""One pipeline: (model, example batch, machine) -> plan, in the order DESIGN.md draws it.

1. pass 1: the profiler records the plain model (on meta when it can: NOTE [Sizes from meta]) and
   measures S_input, S_attn, S_others per layer;
2. the machine: B, T_layer and the host memory, given or measured (:class:`memo.machine.Machine`);
3. the policy: the alpha LP and the layer policy within the device budget, calibrated against
   recorded iterations (NOTE [Calibrated policy]);
4. pass 2: the profiler records the model wrapped by memo's runtime with that policy;
5. the planner: bi-level addresses for pass 2's trace.

The profiler (:mod:`memo.profiler`) only records traces and measures; this module is where the
runtime, the allocator and the planner meet it. :class:`memo.Session` then runs the plan.

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
import functools
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import memo.planner  # noqa: F401  NOTE [Import PuLP early]: imported first inside profile(), it pins the model
from memo.adapters.model import model_adapter_for
from memo.errors import DeviceBudgetError, MemoError
from memo.machine import GB, Machine
from memo.profiler.bounds import check_least_memory, least_memory
from memo.profiler.context_parallel import context_parallel_note, rank_tokens
from memo.profiler.device import model_states
from memo.profiler.measure import Quantity, check_machine, measure_machine, time_layer_forward
from memo.profiler.record import (
    Recording,
    layer_inputs,
    meta_copy,
    model_parts,
    phase_tracker,
    record,
)
from memo.profiler.stats import LayerStats, offloaded_bytes, summarise_layers
from memo.units import format_bytes

__all__ = ["DTYPES", "FALLBACK_HEADROOM", "FALLBACK_SEGMENT_BYTES", "ProfileResult", "build_profile_model",
           "example_batch", "profile", "usable_device_bytes"]

#: dtype names accepted by :func:`profile` and ``memo profile --dtype``.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}

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
#: (tests/test_layer_policy.py reads it there).
FALLBACK_SEGMENT_BYTES = 2 << 20


def usable_device_bytes(budget_bytes: int) -> int:
    """The part of a device budget the policy plans within (NOTE [Fallback headroom]): the policy's
    own rule, ``usable_budget`` with FALLBACK_HEADROOM and FALLBACK_SEGMENT_BYTES."""
    from memo.planner.policy import usable_budget

    return usable_budget(budget_bytes, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)


@dataclass
class ProfileResult:
    """What :func:`profile` found.

    Attributes:
        trace: the trace the plan was made from (pass 2 when it ran, else pass 1), a ``memo.trace`` dict.
        layer_stats: pass 1's per-layer sizes (the alpha LP's S_input, S_attn, S_others).
        plain_trace: pass 1's trace (the unwrapped model).
        quantities: ``bandwidth_gbps``, ``layer_ms``, ``host_memory_bytes`` and where each came from.
        alpha: the planner's AlphaSolution (None when ``solve=False``).
        policy: the planner's PolicySolution: the layer policy and its device need estimate.
        model_states: parameters, gradients and optimizer states of one rank (NOTE [Model states]).
        plan: the planner's Plan (None when ``plan=False``).
        wrapped: whether ``trace`` comes from the wrapped model (pass 2).
        timings: seconds spent per stage.
        notes: what a user should know (assumed values, a skipped pass).
    """

    trace: dict[str, Any]
    layer_stats: list[LayerStats]
    plain_trace: dict[str, Any]
    quantities: dict[str, Quantity] = field(default_factory=dict)
    alpha: Any = None
    plan: Any = None
    policy: Any = None
    model_states: dict[str, Any] | None = None
    wrapped: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise MemoError(f"memo.profiler: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None


def build_profile_model(name: str, seq_len: int, dtype: torch.dtype, device: torch.device,
                        tensor_parallel: int = 1) -> nn.Module:
    """Build a registered reference model able to run ``seq_len`` tokens on ``device``, as one rank of
    a ``tensor_parallel``-way Megatron tensor + sequence parallel group (NOTE [Tensor-parallel rank]
    in memo/models/parallel.py).

    ``seq_len`` is the job's whole sequence, also under context parallelism: a context-parallel rank
    runs fewer tokens but holds the same parameters (GPT's position table covers every position;
    NOTE [Context-parallel profile])."""
    from memo.models import DEFAULT_MAX_SEQ_LEN, build_model, get_config

    config = get_config(name)
    # GPT's learned position table bounds the length (NOTE [GPT position table] in memo.models.model).
    # Size it as training does (memo.train.loop), so the profiled requests are the ones a
    # training step makes: the table's gradient is one of them.
    kw = {"max_seq_len": max(seq_len, DEFAULT_MAX_SEQ_LEN)} if config.arch == "gpt" else {}
    return build_model(config, device=device, dtype=dtype, tensor_parallel=tensor_parallel, **kw)


def example_batch(model: nn.Module, seq_len: int, micro_batch: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``ids, labels: [micro_batch, seq_len]`` in the model's vocabulary (zeros on meta)."""
    if device.type == "meta":
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
        return ids, ids
    vocab = model_adapter_for(model, "memo.profiler").vocab_size(model)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    labels = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    return ids, labels


@contextlib.contextmanager
def _progress(enabled: bool, total: int, desc: str) -> Iterator[Callable[[str | None], None] | None]:
    """A tqdm bar that advances on every phase change (a PhaseTracker listener)."""
    if not enabled or not sys.stderr.isatty():  # a redirected log gets the plain stage lines only
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="phase", file=sys.stderr, leave=False)

    def on_phase(phase: str | None) -> None:
        if phase is not None:
            bar.set_postfix_str(phase, refresh=False)
            bar.update(1)

    try:
        yield on_phase
    finally:
        bar.close()


def _record(
    model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, progress: bool, desc: str, meta: dict[str, Any]
) -> Recording:
    tracker = phase_tracker(model)
    try:
        with _progress(progress, 2 * len(model_parts(model).layers) + 4, desc) as listener:
            if listener is not None:
                tracker.add_listener(listener)
            return record(model, ids, labels, tracker=tracker, meta=meta)
    finally:
        tracker.remove()


def _record_allocator(
    model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, meta: dict[str, Any]
) -> dict[str, Any]:
    """One iteration traced by memo.allocator.logging: the real requests, in the allocator's order.

    This is the trace to plan from when the plan is replayed by (phase, request index):
    kernels allocate scratch the dispatch recorder cannot see (NOTE [Which recorder] in
    docs/profiling.md).
    """
    from memo import allocator

    adapter = model_adapter_for(model, "memo.profiler")
    # NOTE [Warm-up before logging]: libraries allocate once, on first use, through the current
    # allocator: cuBLAS its workspace per handle and stream, the runtime its rounding buffers,
    # kernels their lazily built caches. Logged in the first iteration they would take request
    # indices that no later iteration makes, and every later request of that phase would
    # deviate. So one iteration runs unlogged first.
    adapter.loss(model, ids, labels).backward()
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    tracker = phase_tracker(model, listeners=[allocator.set_phase])
    for p in model.parameters():
        p.grad = None
    try:
        with (
            allocator.logging(device=ids.device, meta=meta) as trace,
            tracker.iteration(),
        ):
            adapter.loss(model, ids, labels).backward()
    finally:
        tracker.remove()
        allocator.set_phase(None)
        # The logged backward's gradients come from memo's allocator. Free them now, not when the
        # model is collected: a model profile() built sits in reference cycles (hooks) until the
        # garbage collector runs, and its gradients would count in the next run's device peak.
        for p in model.parameters():
            p.grad = None
    _open_with_kept_buffers(trace, _runtime_device_buffers(model))
    return trace


def _runtime_device_buffers(model: nn.Module) -> list[int]:
    """Bytes of each device buffer memo's runtime holds for ``model`` across iterations (its two
    rounding buffers, NOTE [Rounding buffer reuse]); none when the model is not wrapped."""
    from memo import runtime

    if not runtime.is_wrapped(model):
        return []
    buffers = getattr(runtime.runtime_of(model), "buffers", None)
    return [int(t.untyped_storage().nbytes()) for t in getattr(buffers, "device_buffers", None) or []]


def _open_with_kept_buffers(trace: dict[str, Any], sizes: list[int]) -> None:
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


def _time_first_layer(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> Quantity:
    """T_layer measured: the first layer's forward on the inputs the model gives it (NOTE [First
    layer's inputs] in memo/profiler/record.py)."""
    args, kwargs = layer_inputs(model, ids, labels)
    layer = model_parts(model).layers[0]
    return time_layer_forward(layer, *args, layer_kwargs=kwargs)


@dataclass
class _Job:
    """What one run of the pipeline works on (the arguments of :func:`profile`, resolved)."""

    net: nn.Module | None  # the model on its device (None until a named model is built there)
    source: str | None  # a registered name or CONFIG.json when memo builds the model
    name: str
    device: torch.device
    dtype: torch.dtype
    seq_len: int  # tokens one context-parallel rank runs (NOTE [Context-parallel profile])
    job_seq_len: int  # the job's whole sequence
    micro_batch: int
    tp: int
    cp: int
    machine: Machine
    recorder: str
    progress: bool
    say: Callable[[str], None]
    meta: dict[str, Any] = field(default_factory=dict)
    batch: tuple[torch.Tensor, torch.Tensor] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: The largest of a number over the ranks profiling together (NOTE [Decisions every rank shares]).
    agree_max: Callable[[int], int] = int
    #: The last wrapped iteration a policy probe recorded, by (alpha, policy, tile): pass 2 of the
    #: same choice takes it instead of recording it again (NOTE [Pass 2 is the last probe]).
    last_probe: tuple[tuple, dict[str, Any], dict[str, Any]] | None = None

    def recorded_total(self, trace: dict[str, Any], static: int) -> int:
        """:func:`_iteration_total` of a recorded iteration, the same on every rank."""
        return self.agree_max(_iteration_total(trace, static))

    def built(self) -> nn.Module:
        """The model on its device, built there the first time for a model given by name."""
        if self.net is None:
            t0 = time.perf_counter()
            assert self.source is not None
            self.net = build_profile_model(self.source, self.job_seq_len, self.dtype, self.device, self.tp)
            self.timings["build"] = self.timings.get("build", 0.0) + time.perf_counter() - t0
        return self.net

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch is None:
            self.batch = example_batch(self.built(), self.seq_len, self.micro_batch, self.device)
        return self.batch


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
    policy: list[str] | None = None,
    recorder: str = "dispatch",
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
        policy: a fixed layer policy (NOTE [Layer policy]) instead of the planner's choice.
        recorder: ``"dispatch"`` (every storage torch creates; any device) or ``"allocator"``
            (memo.allocator.logging: the real requests; cpu/cuda) for the trace the plan is
            made from. The S_* sizes always come from the dispatch recorder.
        wrap_pass: run pass 2 on the wrapped model (None: try, and plan from the plain model when
            the runtime refuses it).
        solve, plan: stop after pass 1 (``solve=False``) or after alpha (``plan=False``).
        time_limit, solver: passed to the planner's ``make_plan``.
        progress: show a progress bar per recorded pass on stderr.
        log: called with one line per stage (e.g. ``print``).
        agree_max: for ranks that profile their shards together: the largest of a number over the
            ranks, a collective (NOTE [Decisions every rank shares]); None in one process.
    """
    machine = _machine(machine, machine_fields)
    seq_len, micro_batch = _checked_sizes(seq_len, micro_batch, batch, tensor_parallel, context_parallel,
                                          recorder)
    job = _job(model, seq_len, micro_batch, _dtype(dtype), torch.device(device), machine, tensor_parallel,
               context_parallel, recorder, progress, log or (lambda _line: None))
    job.batch = batch
    if agree_max is not None:
        job.agree_max = agree_max
    # Refuse bad arguments before building or recording anything (a 1M-token pass takes a while).
    if solve:
        check_machine(machine, job.device, job.dtype)
    if recorder == "allocator":
        _check_allocator_device(job.device)
    given = model if isinstance(model, nn.Module) else None
    plain, states, layer_params = _pass1(job, given, optimizer_states)
    result = ProfileResult(trace=plain.trace, layer_stats=plain.layer_stats, plain_trace=plain.trace,
                           timings=job.timings, notes=job.notes)
    if not solve:
        return result
    _measure(job, plain, result)
    chosen, lp_inputs, evaluate_alpha = _choose_policy(job, plain, states, layer_params, alpha, policy,
                                                       wrap_pass, result)
    wrapped = _pass2(job, plain, chosen, wrap_pass, plan, result)
    _record_choice(job, result, chosen, states)
    if plan:
        _plan(job, result, chosen, states, wrapped, time_limit, solver)
    return result


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
    if recorder not in ("dispatch", "allocator"):
        raise MemoError(f"memo.profiler: recorder must be 'dispatch' or 'allocator', got {recorder!r}")
    return seq_len, micro_batch


def _sequence_parallel(job: _Job) -> bool:
    """Whether the profiled rank's layers hold s/t tokens: memo's rank model always does (NOTE
    [Tensor-parallel rank]); a given model says so in its config (megatron-core's ``sequence_parallel``)."""
    config = getattr(job.net, "config", None) if job.net is not None else None
    given = getattr(config, "sequence_parallel", None)
    return bool(given) if isinstance(given, bool) else job.tp > 1


def _record_choice(job: _Job, result: ProfileResult, chosen: Any, states: dict[str, Any]) -> None:
    """The chosen alpha, tensor parallelism, policy and model states in the trace's meta."""
    result.trace["meta"]["alpha"] = float(result.alpha.alpha)
    result.trace["meta"]["tensor_parallel"] = job.tp
    result.trace["meta"]["sequence_parallel"] = _sequence_parallel(job)
    result.trace["meta"]["policy"] = list(chosen.policy)
    result.trace["meta"]["tile_tokens"] = chosen.tile_tokens
    # `memo plan --device-mem-gb` re-plans this trace: the rank's total needs the model states.
    result.trace["meta"]["model_states"] = states


def _job(model: str | nn.Module, seq_len: int, micro_batch: int, dt: torch.dtype, device: torch.device,
         machine: Machine, tp: int, cp: int, recorder: str, progress: bool, say: Callable[[str], None]
         ) -> _Job:
    # NOTE [Context-parallel profile]: from here on seq_len is the tokens one context-parallel rank
    # runs; job_seq_len is the job's whole sequence (the plan's meta, GPT's position table).
    rank_seq = rank_tokens(seq_len, tp, cp)
    if isinstance(model, str):
        from memo.models import get_config

        # a registered name or a CONFIG.json path; plans and traces call it by the config's name
        return _Job(None, model, get_config(model).name, device, dt, rank_seq, seq_len, micro_batch, tp, cp,
                    machine, recorder, progress, say)
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
    return _Job(model, None, name, dev, dt, rank_seq, seq_len, micro_batch, tp, cp, machine, recorder,
                progress, say)


def _pass1(job: _Job, given: nn.Module | None, optimizer_states: str
           ) -> tuple[Recording, dict[str, Any], int]:
    """Pass 1: the plain model's trace and layer sizes, its model states and one layer's parameters."""
    t0 = time.perf_counter()
    # NOTE [Sizes from meta]: pass 1 runs the plain model on the meta device, a model given by
    # name built there and a given model copied there (meta_copy; no data is copied). The plain
    # model at the target length is exactly what does not fit the GPU (gpt-7b at 1M tokens
    # keeps 4 TiB for backward), the sizes the dispatch recorder sees do not depend on the
    # device, and meta costs seconds.
    sized_on = torch.device("meta")
    try:
        sizing = (build_profile_model(job.source, job.job_seq_len, job.dtype, sized_on, job.tp)
                  if given is None else meta_copy(given))
    except (TypeError, RuntimeError) as err:
        if given is None:
            raise
        # A model holding what cannot be copied (megatron-core's process groups): sized where it runs.
        job.notes.append(f"pass 1 ran on {job.device.type}, not meta: the model cannot be copied to meta "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})")
        sized_on, sizing = job.device, given
    job.timings["build"] = time.perf_counter() - t0
    # NOTE [Least memory, checked first]: a length the device cannot hold is refused before recording.
    check_least_memory(least_memory(sizing, job.seq_len // job.tp, job.micro_batch), job.device,
                       job.machine.device_budget_bytes, "memo.profiler", job.job_seq_len)
    job.meta = {"model": job.name, "seq_len": job.job_seq_len, "context_parallel": job.cp}
    if job.cp > 1:
        job.notes.append(context_parallel_note(job.cp, job.machine.layer_ms is None))
    job.say(f"pass 1 ({sized_on.type}): recording one iteration of the plain model ...")
    t0 = time.perf_counter()
    try:
        ids, labels = job.inputs() if sizing is given else example_batch(sizing, job.seq_len, job.micro_batch,
                                                                         sized_on)
        plain = _record(sizing, ids, labels, job.progress, "pass 1 (plain model)", job.meta)
    except (NotImplementedError, RuntimeError) as err:
        if given is None or job.device.type == "meta" or sizing is given:
            raise
        # An op of a user's model without a meta kernel (or a library that insists on a real device
        # on the way): size it where it runs, and say so.
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        job.notes.append(f"pass 1 ran on {job.device.type}, not meta: the model cannot run on meta "
                         f"({reason})")
        sized_on, sizing = job.device, given
        plain = _record(sizing, *job.inputs(), job.progress, "pass 1 (plain model)", job.meta)
    states = model_states(sizing, optimizer_states)
    layers = model_parts(sizing).layers
    layer_params = sum(p.numel() for p in layers[0].parameters()) if layers else 0
    del sizing
    job.timings["pass1"] = time.perf_counter() - t0
    job.say(f"pass 1 ({sized_on.type}): {len(plain.trace['events']):,} events, {plain.recorder.ops:,} ops in "
            f"{job.timings['pass1']:.1f} s")
    return plain, states, layer_params


def _measure(job: _Job, plain: Recording, result: ProfileResult) -> None:
    """The machine numbers (given, measured on the job's device, or estimated from FLOPs)."""
    net = job.built()
    t0 = time.perf_counter()
    q = measure_machine(job.machine, job.device, job.dtype,
                        time_layer=lambda: _time_first_layer(net, *job.inputs()),
                        config=getattr(net, "config", None), seq_len=job.seq_len, micro_batch=job.micro_batch)
    job.timings["measure"] = time.perf_counter() - t0
    result.quantities = q
    stats = plain.layer_stats
    if q["layer_ms"].source == "measured":
        stats[0].forward_ms = q["layer_ms"].value
    plain.trace["layers"] = summarise_layers(stats)
    plain.trace["layers"]["layer_fwd_ms"] = q["layer_ms"].value


def _choose_policy(job: _Job, plain: Recording, states: dict[str, Any], layer_params: int,
                   alpha: float | None, policy: list[str] | None, wrap_pass: bool | None,
                   result: ProfileResult) -> tuple[Any, tuple, Any]:
    """The layer policy and alpha (NOTE [Calibrated policy]), probed against a recorded iteration."""
    from memo.planner import choose_policy, evaluate_alpha

    n_layers = len(plain.layer_stats)
    t0 = time.perf_counter()
    lp_inputs, costs = _policy_costs(job, plain, states, layer_params, result.quantities)
    can_wrap = wrap_pass is not False
    static = states["parameters"]["bytes"] + states["optimizer"]["bytes"]
    net = job.built()
    budget = job.machine.device_budget_bytes
    ids, labels = job.inputs()
    if policy is not None:
        from memo.planner import given_policy
        from memo.runtime import validate_policy

        chosen = given_policy(costs, validate_policy(policy, n_layers), alpha, budget)
    else:
        if can_wrap:
            costs, can_wrap = _calibrated_costs(job, costs, net, ids, labels, plain, static, wrap_pass)
        chosen = choose_policy(costs, budget, alpha, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)
    result.policy = chosen
    result.model_states = states
    job.timings["alpha"] = time.perf_counter() - t0
    probe = _ProbeContext(net, ids, labels, plain, static, alpha, lp_inputs, evaluate_alpha)
    chosen = _recorded_choice(job, chosen, costs, probe, can_wrap and policy is None, result)
    return chosen, lp_inputs, evaluate_alpha


def _policy_costs(job: _Job, plain: Recording, states: dict[str, Any], layer_params: int,
                  q: dict[str, Any]) -> tuple[tuple, Any]:
    """The alpha LP's inputs and the layer policy's cost model, from pass 1 and the machine."""
    stats = plain.layer_stats
    summary = plain.trace["layers"]
    # The runtime starts every tensor it offloads at a SLOT_ALIGNMENT boundary (NOTE [Slot alignment]
    # in memo/runtime/buffers.py), which the S_* do not count: a few dozen tensors per tile of every
    # offloaded layer. Leave that room, so that an arena the LP filled to the byte still fits.
    from memo.runtime.buffers import SLOT_ALIGNMENT
    from memo.runtime.layer import min_chunk_tokens

    rows = int(summary.get("rows", 0))
    hidden = int(summary["S_input"]) // max(1, rows * job.micro_batch * job.dtype.itemsize)
    most_tiles = 1 + rows // min_chunk_tokens(job.micro_batch, hidden, job.device.type)
    slack = len(stats) * SLOT_ALIGNMENT * 32 * most_tiles
    host = max(0, job.machine.host_per_process(int(q["host_memory_bytes"].value)) - slack)
    # NOTE [Per-rank sizes]: with Megatron tensor + sequence parallelism over tp ranks, the
    # profiled model is one rank (NOTE [Tensor-parallel rank] in memo/models/parallel.py), so the
    # S_*, the alpha LP, the layer policy and the address plan all describe that rank. A T_layer
    # estimated from FLOPs is the whole layer's and is split; a given or measured one is a rank's.
    layer_s = q["layer_ms"].value / 1e3
    if job.tp > 1 and q["layer_ms"].source == "estimated":
        layer_s /= job.tp
    lp_inputs = (summary["S_input"], summary["S_attn"], summary["S_others"], q["bandwidth_gbps"].value * GB,
                 layer_s, len(stats), host)
    costs = _layer_costs(plain.trace, lp_inputs, job.seq_len, job.micro_batch, job.dtype.itemsize,
                         layer_params, states, job.device.type)
    return lp_inputs, costs


# NOTE [Decisions every rank shares]
# Under tensor, context or data parallelism every rank profiles its own shard, and the ranks' passes
# run collectives (the all-gathers of sequence and context parallelism), so every rank must record
# the same iterations: the same layer policies and alphas, in the same order. The policy is chosen
# from a cost model calibrated against recorded peaks (NOTE [Calibrated policy]), and a recorded
# peak is not the same on every rank: the allocator recorder sees every allocation of the process,
# the communication library's own buffers included, at whatever moment its threads make them. A
# rank that chose differently would wait in a collective the others never join. So every recorded
# peak that feeds a decision is replaced by the largest over the ranks (``agree_max``, a collective
# every rank reaches at the same point): every rank then holds the same costs, makes the same
# (deterministic) choice, and the largest need is the one planned for.
def _calibrated_costs(job: _Job, costs: Any, net: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                      plain: Recording, static: int, wrap_pass: bool | None) -> tuple[Any, bool]:
    """The cost model calibrated against recorded iterations, and whether the runtime can wrap the
    model (False: it refused, and ``costs`` is returned as it came).

    NOTE [Calibrated policy]: the cost model's full-recompute need is checked against a
    recorded full-recompute iteration, and its constant part corrected by the difference,
    so that "never more than full recompute" compares memo with a measured figure; then
    its memo need likewise, against a recorded iteration of every layer under memo at
    alpha = 0 (_calibrate_memo). The chosen policy is recorded once more (_recorded_choice).
    """
    from memo.planner import full_recompute_need

    try:
        fr_trace, _ = _wrapped_pass(job, net, ids, labels, 0.0, False, plain,
                                    ["recompute"] * len(plain.layer_stats))
    except MemoError:
        if wrap_pass:
            raise
        return costs, False  # the runtime refuses this model: pass 2 says so, in a note
    fr_total = job.recorded_total(fr_trace, static)
    estimate = full_recompute_need(costs)
    costs = dataclasses.replace(costs, base_bytes=max(0, costs.base_bytes + fr_total - estimate))
    return _calibrate_memo(job, costs, net, ids, labels, plain, static), True


@dataclass
class _ProbeContext:
    """What :func:`_recorded_choice` needs to record an iteration and to say the alpha."""

    net: nn.Module
    ids: torch.Tensor
    labels: torch.Tensor
    plain: Recording
    #: Bytes of parameters and optimizer state, added to a recorded iteration's peak.
    static: int
    #: The alpha given by the caller (None: solved).
    alpha: float | None
    lp_inputs: tuple
    evaluate_alpha: Any


#: Recordings of a chosen policy before the profile gives up (NOTE [Calibrated policy]).
PROBES = 7


def _recorded_choice(job: _Job, chosen: Any, costs: Any, probe: _ProbeContext, may_probe: bool,
                     result: ProfileResult) -> Any:
    """The chosen policy recorded once (when ``may_probe`` and it has memo or input-only layers): an
    estimate short of the cap is corrected (:func:`_corrected_costs`) and chosen again, PROBES times
    at most (alpha, then memo at alpha = 0, then input-only layers alone, then what is left)."""
    from memo.planner import choose_policy, describe_policy

    for attempt in range(PROBES):
        result.alpha = _alpha_of(chosen, probe.lp_inputs, probe.alpha, probe.evaluate_alpha)
        job.say(f"policy: {describe_policy(chosen.policy)}; alpha = {result.alpha.alpha:.4f} "
                f"(binding: {result.alpha.binding}); device need {format_bytes(chosen.device_bytes)} per "
                f"rank, estimated (full recompute {format_bytes(chosen.full_recompute_bytes)})")
        if not may_probe or not (chosen.counts.get("memo") or chosen.counts.get("input-only")):
            break
        trace, wrapped = _wrapped_pass(job, probe.net, probe.ids, probe.labels, result.alpha.alpha, False,
                                       probe.plain, chosen.policy, chosen.tile_tokens)
        job.last_probe = (_probe_key(result.alpha.alpha, chosen), trace, wrapped)
        total = job.recorded_total(trace, probe.static)
        if job.machine.device_budget_bytes is not None:  # NOTE [The optimizer's moment]
            total = max(total, job.agree_max(_optimizer_moment(trace, probe.static)))
        if total <= chosen.device_cap:
            break
        if attempt == PROBES - 1:
            raise DeviceBudgetError(
                f"memo.profiler: the chosen policy ({describe_policy(chosen.policy)}, alpha "
                f"{result.alpha.alpha:.4f}) needs {format_bytes(total)} per rank when recorded, over the cap "
                f"of {format_bytes(chosen.device_cap)}, after every correction of the estimate; give a fixed "
                "--alpha, or more --device-mem-gb")
        costs = _corrected_costs(costs, chosen, total, attempt)
        job.say(f"policy: the recorded iteration needs {format_bytes(total)}, over the cap of "
                f"{format_bytes(chosen.device_cap)}; choosing again")
        budget = job.machine.device_budget_bytes
        chosen = choose_policy(costs, budget, probe.alpha, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)
        result.policy = chosen
    return chosen


def _corrected_costs(costs: Any, chosen: Any, total: int, attempt: int) -> Any:
    """The cost model corrected after a recorded iteration of ``chosen`` needed ``total`` bytes,
    over the cap.

    The estimate was short. At alpha = 0 it was measured (_calibrate_memo), so the error is in
    its slope in alpha: correct that (or, at alpha = 0, its constant part) and choose again.
    The recorded peak moves in steps of whole allocations, so a correction that lands exactly
    on the cap tends to miss it by part of one: overshoot by a quarter. Where three
    corrections did not land, alpha > 0 is given up: memo at alpha = 0 was recorded.
    """
    from memo.planner.policy import ALPHA_GIVEN_UP

    error = (total - chosen.device_bytes) * 5 // 4
    if not chosen.counts.get("memo"):  # input-only layers alone: their own correction
        return dataclasses.replace(costs, input_only_overhead=costs.input_overhead + error)
    # A memo split's error is memo's: input-only splits keep the correction they had (they hold
    # less, and are chosen again when memo no longer fits).
    costs = dataclasses.replace(costs, input_only_overhead=costs.input_overhead)
    if attempt == 2:
        return dataclasses.replace(costs, memo_alpha_bytes=ALPHA_GIVEN_UP)
    if chosen.alpha > 1e-6 and costs.memo_alpha_bytes < ALPHA_GIVEN_UP:
        return dataclasses.replace(costs, memo_alpha_bytes=costs.memo_alpha_bytes + int(
            math.ceil(error / chosen.alpha)))
    return dataclasses.replace(costs, memo_overhead=costs.memo_overhead + error)


def _pass2(job: _Job, plain: Recording, chosen: Any, wrap_pass: bool | None, plan: bool,
           result: ProfileResult) -> dict[str, Any] | None:
    """Pass 2 (NOTE [Two-pass profiling]): the trace the plan is made from. Returns what the runtime
    allocated and copied when the wrapped model ran (None when it did not)."""
    net = job.built()
    ids, labels = job.inputs()
    second: dict[str, Any] | None = None
    wrapped: dict[str, Any] | None = None
    t0 = time.perf_counter()
    probed = job.last_probe
    if wrap_pass is not False and probed is not None and probed[0] == _probe_key(result.alpha.alpha, chosen):
        _, second, wrapped = probed  # NOTE [Pass 2 is the last probe]
        result.wrapped = True
    elif wrap_pass is not False:
        job.say(f"pass 2 ({job.device.type}): recording one iteration of the model wrapped with alpha "
                f"{result.alpha.alpha:.4f} ...")
        try:
            second, wrapped = _wrapped_pass(job, net, ids, labels, result.alpha.alpha, job.progress, plain,
                                            chosen.policy, chosen.tile_tokens)
            result.wrapped = True
        except MemoError as err:
            if wrap_pass:
                raise
            job.notes.append(
                f"pass 2 could not run the wrapped model ({err}); the plan comes from the plain model"
            )
    sized_elsewhere = plain.trace["meta"]["device"] != job.device.type
    if second is None and plan and (job.recorder == "allocator" or sized_elsewhere):
        # The planned trace must come from the device that will run (and, for the allocator
        # recorder, from the allocator's own requests), even when the model cannot be wrapped.
        if job.recorder == "allocator":
            second = _record_allocator(net, ids, labels, _target_meta(plain, job.device, "allocator"))
        else:
            second = _record(net, ids, labels, job.progress, "pass 2 (plain model)", job.meta).trace
    if second is not None:
        second["layers"] = plain.trace["layers"]
        result.trace = second
        job.timings["pass2"] = time.perf_counter() - t0
        what = f"wrapped, alpha {result.alpha.alpha:.4f}" if result.wrapped else "plain model"
        how = ("the policy's last probe, not recorded again" if second is (probed or (None, None))[1]
               else f"in {job.timings['pass2']:.1f} s")
        job.say(f"pass 2 ({what}, {job.recorder} recorder): {len(second['events']):,} events, {how}")
    return wrapped


# NOTE [Pass 2 is the last probe]
# The policy's last probe (_recorded_choice) recorded the very iteration pass 2 would: the same model,
# batch, alpha, layer policy and tile, wrapped the same way, by the same recorder. Recording it again
# only cost time (a third of a profile of gpt-125m at 8K on meta, minutes at scale), so pass 2 takes
# it. Any other choice (a given alpha, a policy that was not probed) is recorded as before.
def _probe_key(alpha: float, chosen: Any) -> tuple:
    return (float(alpha), tuple(chosen.policy), chosen.tile_tokens)


def _plan(job: _Job, result: ProfileResult, chosen: Any, states: dict[str, Any],
          wrapped: dict[str, Any] | None, time_limit: float, solver: str | None) -> None:
    """The planner's bi-level addresses for the planned trace, with the device record."""
    from memo.planner import Trace, make_plan, offload_difference
    from memo.runtime import offload_tokens

    t0 = time.perf_counter()
    # The plan is for memo's allocator, which serves only phased requests from the arena.
    kwargs: dict[str, Any] = {"alpha_solution": result.alpha, "time_limit": time_limit,
                              "progress": job.progress, "unphased": "fallback"}
    if solver is not None:
        kwargs["solver"] = solver
    if wrapped is not None:
        # The host arena the wrapped pass really needed, to the byte (slots included, NOTE [Slot
        # alignment] in memo/runtime/buffers.py): what the runtime will check the plan against.
        kwargs["host_bytes"] = wrapped["host_bytes"]
    with warnings.catch_warnings():
        # memo's last two layers are never offloaded, so their passes differ from the others by
        # design; the planner plans them on their own and keeps its notes in plan.warnings
        # (`memo show` prints them).
        warnings.filterwarnings("ignore", message=r"memo\.planner: phase layer\.", category=UserWarning)
        result.plan = make_plan(Trace.from_dict(result.trace), **kwargs)
    if wrapped is not None and wrapped["offloaded_layers"]:
        # NOTE [Planned and actual offload] in memo/planner/plan.py
        local = job.seq_len // job.tp  # a rank's layer input holds seq_len / tp tokens
        a = offload_tokens(result.alpha.alpha, local)
        result.plan.offload = {
            "offloaded_layers": wrapped["offloaded_layers"],
            "planned_bytes_per_layer": offloaded_bytes(result.plain_trace["layers"], a, local),
            "actual_bytes_per_layer": wrapped["layer_bytes"],
            "tensors": [list(t) for t in wrapped["tensors"]],
        }
        warning = offload_difference(result.plan.offload)
        if warning is not None:
            job.notes.append(warning)
    result.plan.policy = list(chosen.policy)
    result.plan.tile_tokens = chosen.tile_tokens
    static = states["parameters"]["bytes"] + states["optimizer"]["bytes"]
    iteration = _iteration_total(result.trace, 0)
    result.plan.device = {
        "budget_bytes": job.machine.device_budget_bytes,
        "model_states": states,
        "activations_bytes": int(result.plan.peak),
        "iteration_peak_bytes": iteration,
        "total_bytes": iteration + static,
        "estimate": {"bytes": int(chosen.device_bytes), "parts": dict(chosen.parts),
                     "full_recompute_bytes": int(chosen.full_recompute_bytes)},
        "binding": chosen.binding,
    }
    job.timings["plan"] = time.perf_counter() - t0
    job.say(f"plan made in {job.timings['plan']:.1f} s")


def _calibrate_memo(job: _Job, costs: Any, net: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                    plain: Recording, static: int) -> Any:
    """NOTE [Calibrated policy]: ``costs`` with memo_overhead set so that the estimate of every
    layer under memo at alpha = 0 is what a recorded iteration of exactly that needs.

    The cost model leaves out what a memo layer's backward holds besides its recomputed share
    (gradients of q, k, v and o, the prefetched layer's rounding buffer in flight) and may count
    more than the runtime holds at once; the correction is added to, or taken from, every split
    with memo or input-only layers. Where the host memory cannot hold every layer at alpha = 0 but
    can hold every layer's input, the recording is of every layer input-only (NOTE [Input-only
    layers]) instead: the estimate of the policies the host allows is then the one checked (without
    it, an estimate far above what the runtime holds went uncorrected: Llama-3.1-8B at 336K on meta
    was estimated at 73.4 GB, recorded at 55.7 GB). Skipped where the host holds neither.
    """
    from memo.planner import device_need

    n = costs.n_layers
    if n * costs.copy_bytes(0.0) <= costs.host_memory:
        policy, estimate = ["memo"] * n, sum(device_need(costs, n, 0, 0, 0.0).values())
    elif n * costs.s_input <= costs.host_memory:
        policy, estimate = ["input-only"] * n, sum(device_need(costs, 0, 0, 0, 0.0, n).values())
    else:
        return costs
    try:
        memo_trace, _ = _wrapped_pass(job, net, ids, labels, 0.0, False, plain, policy)
    except MemoError:
        return costs  # the chosen policy's probe (below) still checks what is chosen
    measured = job.recorded_total(memo_trace, static)
    return dataclasses.replace(costs, memo_overhead=costs.memo_overhead + measured - estimate)


# NOTE [The optimizer's moment]
# The plan's arena is reserved for the whole run, also while the optimizer steps, when none of it is
# in use: then the fallback pool holds every gradient, the rounding buffers and the optimizer's states
# (made at the end of step 1) beside it. A policy whose recorded iteration fits the cap can still
# not fit that moment (its peak came early in backward, with few gradients yet): the optimizer's
# states then borrow the arena's idle bytes and the next iteration leaves the plan (a 16-layer Llama at
# 2,048 tokens under 40 MiB ran out of memory in step 2). So the chosen policy must fit both: the
# iteration's peak, and the arena (the most bytes live at once of the allocations the iteration frees)
# beside what outlives the iteration, plus the model states. Under a budget only: without one, the cap
# is full recompute's iteration need, and an iteration is compared with an iteration.
def _optimizer_moment(trace: dict[str, Any], static: int) -> int:
    """NOTE [The optimizer's moment]: the arena's bytes, what outlives the iteration, and ``static``."""
    sizes: dict[int, int] = {}
    freed: set[int] = set()
    phased: set[int] = set()
    for ev in trace["events"]:
        if ev["op"] == "malloc":
            sizes[ev["id"]] = ev["size"]
            if ev.get("phase") is not None:
                phased.add(ev["id"])
        elif ev["op"] == "free":
            freed.add(ev["id"])
    live = arena = 0
    for ev in trace["events"]:
        ident = ev.get("id")
        if ident not in freed or ident not in phased:  # the arena serves phased requests only
            continue
        if ev["op"] == "malloc":
            live += sizes[ident]
            arena = max(arena, live)
        elif ev["op"] == "free":
            live -= sizes[ident]
    outliving = sum(n for ident, n in sizes.items() if ident not in freed)
    return arena + outliving + int(static)


def _iteration_total(trace: dict[str, Any], static: int) -> int:
    """NOTE [Device total]: the most bytes live at once in a recorded iteration (activations, memo's
    rounding buffers, gradients as they appear, temporaries) plus ``static`` (parameters and
    optimizer states, which live across iterations and are not in the trace)."""
    from memo.planner import Trace, lower_bound

    return int(lower_bound(Trace.from_dict(trace))) + int(static)


def _alpha_of(chosen: Any, lp_inputs: tuple, alpha: float | None, evaluate_alpha: Any) -> Any:
    """The AlphaSolution of a chosen policy (its binding is the policy's)."""
    n_memo = chosen.counts["memo"]
    solution = evaluate_alpha(chosen.alpha, *lp_inputs, offloaded_layers=n_memo)
    if chosen.counts.get("input-only") and not n_memo:
        solution = dataclasses.replace(solution, alpha=0.0)
    if alpha is None or not n_memo:
        solution = dataclasses.replace(solution, binding=chosen.binding)
    return solution


def _layer_costs(trace: dict[str, Any], lp_inputs: tuple, seq_len: int, micro_batch: int, elem_size: int,
                 layer_params: int, states: dict[str, Any], device_type: str) -> Any:
    """The per-rank numbers of NOTE [Policy cost model] from pass 1 (the plain model); the recompute
    chunks are those memo's runtime makes on ``device_type``, pass 2's device."""
    from memo.planner import LayerCosts, Trace, lower_bound

    s_input, s_attn, s_others, bandwidth, layer_s, n_layers, host = lp_inputs
    keep = s_input + s_attn + s_others
    # The plain model keeps every layer: what its peak holds beyond the layers' activations does
    # not depend on the policy (embedding, head, gradients as they appear).
    peak_plain = lower_bound(Trace.from_dict(trace))
    base = max(0, peak_plain - n_layers * keep)
    # Attention's share of a layer's forward FLOPs: 2 s^2 w (causal) against 2 s P_layer, with w the
    # attention width per token, read off the attention output's bytes.
    width = s_attn / max(1, seq_len * micro_batch * elem_size)
    attn = seq_len * width
    fraction = attn / (attn + layer_params) if attn + layer_params > 0 else 0.0
    static = states["parameters"]["bytes"] + states["optimizer"]["bytes"]
    # NOTE [Tiles bounded by memory] (memo/runtime/layer.py): how many tiles a memo layer runs in, by
    # the runtime's default and for each smaller tile the policy may choose (halving, down to the
    # work floor of NOTE [How small a chunk]).
    from memo.runtime.layer import min_chunk_tokens, token_chunks

    # The layer input is [rows, micro_batch, hidden]: its width per token gives the hidden size.
    rows = int(trace["layers"].get("rows", 0))
    hidden = int(s_input) // max(1, rows * micro_batch * elem_size)
    tiles = functools.partial(token_chunks, rows, batch=micro_batch, hidden=hidden, device_type=device_type,
                              token_bytes=(layer_params // max(1, hidden)) * elem_size)
    chunks = max(1, len(tiles()))
    floor = min_chunk_tokens(micro_batch, hidden, device_type)
    choices = []
    size = -(-rows // chunks) // 2
    while size >= floor:
        choices.append((size, len(tiles(size))))
        size //= 2
    return LayerCosts(n_layers=n_layers, s_input=int(s_input), s_attn=int(s_attn), s_others=int(s_others),
                      layer_time=float(layer_s), attn_fraction=float(min(max(fraction, 0.0), 1.0)),
                      base_bytes=int(base + static), bandwidth=float(bandwidth), host_memory=int(host),
                      recompute_chunks=chunks, tile_choices=tuple(choices),
                      buffer_rounding=FALLBACK_SEGMENT_BYTES)


def _wrapped_pass(job: _Job, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, alpha: float,
                  progress: bool, plain: Recording, policy: list[str] | None = None,
                  tile_tokens: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trace one iteration of ``model`` wrapped by memo's runtime with ``alpha``; unwrap afterwards.
    Returns the trace and what the runtime allocated and copied: ``host_bytes``, ``layer_bytes``,
    ``offloaded_layers`` and ``tensors`` (``(what, bytes)`` per copied tensor of one layer).

    The model is wrapped in place (NOTE [Wrapping in place] in memo/runtime/wrap.py) and
    restored whatever happens, so a model the caller passed comes back as it was given.
    """
    from memo import runtime

    runtime.wrap(model, alpha=alpha, policy=policy, recompute_chunk_tokens=tile_tokens)
    try:
        if job.recorder == "allocator":
            trace = _record_allocator(model, ids, labels, _target_meta(plain, ids.device, "allocator"))
        else:
            trace = _record(model, ids, labels, progress, f"pass 2 (alpha={alpha:.3f})", job.meta).trace
        rt = runtime.runtime_of(model)
        return trace, {"host_bytes": int(rt.host_bytes), "layer_bytes": int(rt.layer_bytes or 0),
                       "offloaded_layers": int(rt.n_offloaded), "tensors": list(rt.layer_tensors)}
    finally:
        runtime.unwrap(model)


def _target_meta(plain: Recording, device: torch.device, recorder: str) -> dict[str, Any]:
    """Pass 1's trace meta, for a trace recorded on ``device`` by ``recorder``."""
    return {**plain.trace["meta"], "device": device.type, "recorder": recorder}


def _check_allocator_device(device: torch.device) -> None:
    """The allocator recorder sees real allocations: refuse meta, and install memo's CUDA allocator."""
    if device.type == "meta":
        raise MemoError(
            "memo.profiler: the allocator recorder records real allocations, which the meta device never "
            "makes; use recorder='dispatch' (--recorder dispatch) on meta, or a cpu/cuda device"
        )
    if device.type == "cuda":
        from memo import allocator

        # memo's CUDA allocator must be PyTorch's before the first CUDA tensor exists.
        if not allocator.cuda_installed():
            allocator.install_cuda()
