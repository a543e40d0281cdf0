"""The profile flow: trace the plain model, solve alpha, trace the wrapped model, plan.

NOTE [Two-pass profiling]
The plan used at run time must describe what runs. Memo's runtime wraps every
layer for a given alpha (``memo.runtime.wrap``), which changes the layer's
allocations: skeletal tensors move to rounding buffers, the recomputed part is
not kept, and so on. So:

1. pass 1 records the plain model and measures S_input, S_attn, S_others;
2. alpha is solved from those sizes and the machine numbers;
3. pass 2 records the model wrapped with that alpha, and the plan is made
   from pass 2's trace.

Pass 2 needs ``memo.runtime.wrap`` and a device the runtime can run on (its
rounding buffers need cpu or cuda, so not meta). ``wrap_pass=True`` requires
it (any failure is raised); ``False`` skips it; ``None`` (the default) tries
it and, when the runtime is missing or refuses the model with a MemoError,
plans from the plain model and says so in ``ProfileResult.notes``. The model
is unwrapped after pass 2 either way. With ``recorder="allocator"`` pass 2
always runs, on the plain model when it cannot wrap, because the planned
trace must be the allocator's own requests. S_* always come from pass 1.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import itertools
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
from memo.errors import MemoError
from memo.phases import PhaseTracker
from memo.profiler.bounds import check_least_memory, least_memory
from memo.profiler.context_parallel import context_parallel_note, rank_tokens
from memo.profiler.device import model_states
from memo.profiler.measure import (
    Quantity,
    estimate_layer_ms,
    gpu_peak_flops,
    machine_memory_bytes,
    measure_bandwidth,
    time_layer_forward,
)
from memo.profiler.record import Recording, model_parts, quiet_backward_hook_warning, record
from memo.profiler.stats import LayerStats, offloaded_bytes, summarise_layers
from memo.units import format_bytes

__all__ = ["DTYPES", "ProfileResult", "build_profile_model", "meta_copy", "profile", "runtime_wrap"]

GB = 10**9

#: dtype names accepted by :func:`profile` and ``memo profile --dtype``.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


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
    # Size it as training does (memo.utils.training), so the profiled requests are the ones a
    # training step makes: the table's gradient is one of them.
    kw = {"max_seq_len": max(seq_len, DEFAULT_MAX_SEQ_LEN)} if config.arch == "gpt" else {}
    return build_model(config, device=device, dtype=dtype, tensor_parallel=tensor_parallel, **kw)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device.

    No parameter or buffer data is copied (NOTE [Sizes from meta]): each one is replaced by a
    meta tensor of the same shape, dtype and ``requires_grad`` before the module tree is deep-
    copied, so even a model that fills a GPU can be copied for sizing.
    """
    replacements: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) in replacements:
            continue
        fake = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
        replacements[id(t)] = fake
    return copy.deepcopy(model, replacements)


def runtime_wrap() -> Callable[..., Any] | None:
    """``memo.runtime.wrap`` when the runtime provides it, else None."""
    try:
        runtime = importlib.import_module("memo.runtime")
    except ImportError:
        return None
    return getattr(runtime, "wrap", None)


def _inputs(
    model: nn.Module, seq_len: int, micro_batch: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 2))
    if device.type == "meta":
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
        return ids, ids
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
    embedding, layers, head = model_parts(model)
    tracker = PhaseTracker(embedding, layers, head)
    try:
        with _progress(progress, 2 * len(layers) + 4, desc) as listener:
            if listener is not None:
                tracker.add_listener(listener)
            return record(model, ids, labels, tracker=tracker, meta=meta)
    finally:
        tracker.remove()


def _check_machine_args(
    device: torch.device,
    dtype: torch.dtype,
    bandwidth_gbps: float | None,
    layer_ms: float | None,
    gpu: str | None,
) -> None:
    """Refuse missing machine numbers before the (possibly long) recording, not after it."""
    if gpu is not None:
        gpu_peak_flops(gpu, dtype)
    if device.type != "meta":
        return  # cuda and cpu measure what is not given
    missing = []  # every missing number at once, not one per try
    if bandwidth_gbps is None:
        missing.append(
            "the host<->device bandwidth: pass --bandwidth-gbps (e.g. 25 for PCIe 4.0 x16, 50 for PCIe 5.0 "
            "x16; `memo env` measures it on a GPU)"
        )
    if layer_ms is None and gpu is None:
        missing.append(
            "a layer's forward time: pass --layer-ms, or --gpu (h100, a100, ...) with --efficiency to "
            "estimate it from FLOPs"
        )
    if missing:
        raise MemoError("memo.profiler: the meta device cannot measure " + "; and ".join(missing))


def _machine(
    model: nn.Module,
    device: torch.device,
    ids: torch.Tensor,
    seq_len: int,
    micro_batch: int,
    dtype: torch.dtype,
    bandwidth_gbps: float | None,
    layer_ms: float | None,
    gpu: str | None,
    efficiency: float,
    host_mem_gb: float | None,
) -> dict[str, Quantity]:
    """B, T_layer and the node's host memory: given, measured on CUDA, or estimated."""
    q: dict[str, Quantity] = {}
    if bandwidth_gbps is not None:
        if not bandwidth_gbps > 0:
            raise MemoError(f"memo.profiler: bandwidth must be > 0 GB/s, got {bandwidth_gbps}")
        q["bandwidth_gbps"] = Quantity(float(bandwidth_gbps), "given")
    elif device.type in ("cuda", "cpu"):
        q["bandwidth_gbps"] = measure_bandwidth(device)
    else:
        raise MemoError(
            f"memo.profiler: the host<->device bandwidth cannot be measured on {device.type}; pass "
            "--bandwidth-gbps (e.g. 25 for PCIe 4.0 x16, 50 for PCIe 5.0 x16; `memo env` measures it "
            "on a GPU)"
        )
    if layer_ms is not None:
        if not layer_ms > 0:
            raise MemoError(f"memo.profiler: layer time must be > 0 ms, got {layer_ms}")
        q["layer_ms"] = Quantity(float(layer_ms), "given")
    elif gpu is not None:
        q["layer_ms"] = estimate_layer_ms(model.config, seq_len, micro_batch, gpu, dtype, efficiency)
    elif device.type in ("cuda", "cpu"):
        with torch.no_grad():
            x = model.embedding(ids)
        q["layer_ms"] = time_layer_forward(model.layers[0], x)
        del x
    else:
        raise MemoError(
            f"memo.profiler: a layer's forward time cannot be measured on {device.type}; pass --layer-ms, "
            "or --gpu (h100, a100, ...) with --efficiency to estimate it from FLOPs"
        )
    if host_mem_gb is not None:
        if not host_mem_gb > 0:
            raise MemoError(f"memo.profiler: host memory must be > 0 GB, got {host_mem_gb}")
        q["host_memory_bytes"] = Quantity(float(host_mem_gb) * GB, "given")
    else:
        q["host_memory_bytes"] = Quantity(float(machine_memory_bytes()), "measured", "this machine's RAM")
    return q


def _record_allocator(
    model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, meta: dict[str, Any]
) -> dict[str, Any]:
    """One iteration traced by memo.allocator.logging: the real requests, in the allocator's order.

    This is the trace to plan from when the plan is replayed by (phase, request index):
    kernels allocate scratch the dispatch recorder cannot see (NOTE [Which recorder] in
    docs/profiling.md).
    """
    from memo import allocator

    embedding, layers, head = model_parts(model)
    # NOTE [Warm-up before logging]: libraries allocate once, on first use, through the current
    # allocator: cuBLAS its workspace per handle and stream, the runtime its rounding buffers,
    # kernels their lazily built caches. Logged in the first iteration they would take request
    # indices that no later iteration makes, and every later request of that phase would
    # deviate. So one iteration runs unlogged first.
    with quiet_backward_hook_warning():
        model(ids, labels).backward()
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    tracker = PhaseTracker(embedding, layers, head, listeners=[allocator.set_phase])
    for p in model.parameters():
        p.grad = None
    try:
        with (
            allocator.logging(device=ids.device, meta=meta) as trace,
            tracker.iteration(),
            quiet_backward_hook_warning(),
        ):
            model(ids, labels).backward()
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


def profile(
    model: str | nn.Module,
    seq_len: int,
    micro_batch: int = 1,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "meta",
    *,
    bandwidth_gbps: float | None = None,
    layer_ms: float | None = None,
    gpu: str | None = None,
    efficiency: float = 0.5,
    host_mem_gb: float | None = None,
    gpus_per_node: int = 1,
    host_safety: float = 0.8,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
    alpha: float | None = None,
    device_mem_gb: float | None = None,
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
) -> ProfileResult:
    """Profile one training iteration and plan it (NOTE [Two-pass profiling]).

    Args:
        model: a registered config name (built on ``device`` in ``dtype``) or a model with
            ``.embedding``, ``.layers``, ``.head`` already on ``device``.
        seq_len, micro_batch: tokens per sequence and sequences per micro-batch.
        dtype, device: for a model built by name. ``"meta"`` allocates nothing.
        bandwidth_gbps: host<->device GB/s (10^9 B/s); measured on CUDA when None.
        layer_ms: forward ms of one layer; measured on CUDA, or estimated from ``gpu``
            and ``efficiency`` when None.
        host_mem_gb: host memory of the node in GB (default: this machine's).
        gpus_per_node, host_safety: how the node's memory is shared (planner's
            ``host_memory_per_process``).
        tensor_parallel: ranks one layer is split over with Megatron tensor + sequence
            parallelism (NOTE [Per-rank sizes]); alpha and host bytes are per rank.
        context_parallel: ranks the sequence is split over with megatron-core's context
            parallelism (NOTE [Context-parallel profile]): the rank model runs ``seq_len / c``
            tokens; ``seq_len`` must be a multiple of ``2·c`` (and of ``c·t`` with tensor parallelism).
        alpha: use this alpha instead of solving the LP (checked against host memory).
        device_mem_gb: memory of one GPU in GB (10^9 bytes): the per-rank device budget the layer
            policy must fit, model states included (NOTE [Policy cost model]). None: no budget
            beyond full recompute's own need.
        optimizer_states: how model states are counted (NOTE [Model states]): "same" or "mixed".
        policy: a fixed layer policy (NOTE [Layer policy]) instead of the planner's choice.
        recorder: ``"dispatch"`` (every storage torch creates; any device) or ``"allocator"``
            (memo.allocator.logging: the real requests; cpu/cuda) for the trace the plan is
            made from. The S_* sizes always come from the dispatch recorder.
        wrap_pass: run pass 2 on the wrapped model (None: when ``memo.runtime.wrap`` exists).
        solve, plan: stop after pass 1 (``solve=False``) or after alpha (``plan=False``).
        time_limit, solver: passed to the planner's ``make_plan``.
        progress: show a progress bar per recorded pass on stderr.
        log: called with one line per stage (e.g. ``print``).
    """
    say = log or (lambda _line: None)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise MemoError(f"memo.profiler: seq_len must be a positive integer, got {seq_len!r}")
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise MemoError(f"memo.profiler: micro_batch must be a positive integer, got {micro_batch!r}")
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise MemoError(f"memo.profiler: tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    if recorder not in ("dispatch", "allocator"):
        raise MemoError(f"memo.profiler: recorder must be 'dispatch' or 'allocator', got {recorder!r}")
    # NOTE [Context-parallel profile]: from here on seq_len is the tokens one context-parallel rank
    # runs; job_seq_len is the job's whole sequence (the plan's meta, GPT's position table).
    job_seq_len = seq_len
    seq_len = rank_tokens(seq_len, tensor_parallel, context_parallel)
    budget = _device_budget(device_mem_gb)
    dt = _dtype(dtype)
    timings: dict[str, float] = {}
    notes: list[str] = []
    t0 = time.perf_counter()
    if isinstance(model, str):
        from memo.models import get_config

        net = None
        dev = torch.device(device)
        source = model  # a registered name or a CONFIG.json path
        name = get_config(model).name  # what plans and traces call it
    else:
        if tensor_parallel > 1 and getattr(model, "tensor_parallel", 1) != tensor_parallel:
            raise MemoError(
                f"memo.profiler: tensor_parallel={tensor_parallel} needs the model as one rank runs it; give "
                "a registered name or CONFIG.json (memo builds the rank model), or a model built with "
                f"memo.models.build_model(..., tensor_parallel={tensor_parallel})")
        net = model
        param = next(net.parameters(), None)
        dev = param.device if param is not None else torch.device(device)
        dt = param.dtype if param is not None else dt
        name = str(getattr(getattr(net, "config", None), "name", type(net).__name__))
    # Refuse bad arguments before building or recording anything (a 1M-token pass takes a while).
    if solve:
        _check_machine_args(dev, dt, bandwidth_gbps, layer_ms, gpu)
    if recorder == "allocator":
        _check_allocator_device(dev)
    # NOTE [Sizes from meta]: pass 1 runs the plain model on the meta device, a model given by
    # name built there and a given model copied there (meta_copy; no data is copied). The plain
    # model at the target length is exactly what does not fit the GPU (gpt-7b at 1M tokens
    # keeps 4 TiB for backward), the sizes the dispatch recorder sees do not depend on the
    # device, and meta costs seconds.
    sized_on = torch.device("meta")
    sizing = (build_profile_model(source, job_seq_len, dt, sized_on, tensor_parallel) if net is None
              else meta_copy(net))
    timings["build"] = time.perf_counter() - t0
    # NOTE [Least memory, checked first]: a length the device cannot hold is refused before recording.
    check_least_memory(least_memory(sizing, seq_len // tensor_parallel, micro_batch), dev, budget,
                       "memo.profiler", job_seq_len)
    meta = {"model": name, "seq_len": job_seq_len, "context_parallel": context_parallel}
    if context_parallel > 1:
        notes.append(context_parallel_note(context_parallel, layer_ms is None))

    say(f"pass 1 ({sized_on.type}): recording one iteration of the plain model ...")
    t0 = time.perf_counter()
    try:
        plain = _record(
            sizing, *_inputs(sizing, seq_len, micro_batch, sized_on), progress, "pass 1 (plain model)", meta
        )
    except NotImplementedError as err:
        if net is None or dev.type == "meta":
            raise
        # An op of a user's model without a meta kernel: size it where it runs, and say so.
        notes.append(f"pass 1 ran on {dev.type}, not meta: an op has no meta kernel ({err})")
        sized_on, sizing = dev, net
        plain = _record(sizing, *_inputs(sizing, seq_len, micro_batch, dev), progress,
                        "pass 1 (plain model)", meta)
    states = model_states(sizing, optimizer_states)
    layers = model_parts(sizing)[1]
    layer_params = sum(p.numel() for p in layers[0].parameters()) if layers else 0
    del sizing
    timings["pass1"] = time.perf_counter() - t0
    stats = plain.layer_stats
    n_events = len(plain.trace["events"])
    ops = plain.recorder.ops
    say(f"pass 1 ({sized_on.type}): {n_events:,} events, {ops:,} ops in {timings['pass1']:.1f} s")
    result = ProfileResult(
        trace=plain.trace, layer_stats=stats, plain_trace=plain.trace, timings=timings, notes=notes
    )
    if not solve:
        return result
    if net is None:
        t0 = time.perf_counter()
        net = build_profile_model(source, job_seq_len, dt, dev, tensor_parallel)
        timings["build"] += time.perf_counter() - t0
    ids, labels = _inputs(net, seq_len, micro_batch, dev)

    t0 = time.perf_counter()
    q = _machine(
        net, dev, ids, seq_len, micro_batch, dt, bandwidth_gbps, layer_ms, gpu, efficiency, host_mem_gb
    )
    timings["measure"] = time.perf_counter() - t0
    result.quantities = q
    if q["layer_ms"].source == "measured":
        stats[0].forward_ms = q["layer_ms"].value
    plain.trace["layers"] = summarise_layers(stats)
    plain.trace["layers"]["layer_fwd_ms"] = q["layer_ms"].value

    from memo.planner import (
        choose_policy,
        describe_policy,
        evaluate_alpha,
        full_recompute_need,
        given_policy,
        host_memory_per_process,
    )

    host = host_memory_per_process(int(q["host_memory_bytes"].value), gpus_per_node, host_safety)
    summary = plain.trace["layers"]
    # NOTE [Per-rank sizes]: with Megatron tensor + sequence parallelism over tp ranks, the
    # profiled model is one rank (NOTE [Tensor-parallel rank] in memo/models/parallel.py), so the
    # S_*, the alpha LP, the layer policy and the address plan all describe that rank. A T_layer
    # estimated from FLOPs is the whole layer's and is split; a given or measured one is a rank's.
    tp = tensor_parallel
    layer_s = q["layer_ms"].value / 1e3
    if tp > 1 and q["layer_ms"].source == "estimated":
        layer_s /= tp
    t0 = time.perf_counter()
    lp_inputs = (
        summary["S_input"],
        summary["S_attn"],
        summary["S_others"],
        q["bandwidth_gbps"].value * GB,
        layer_s,
        len(stats),
        host,
    )
    costs = _layer_costs(plain.trace, lp_inputs, seq_len, micro_batch, dt.itemsize, layer_params, states)
    wrap = runtime_wrap()
    can_wrap = wrap is not None and wrap_pass is not False
    static = states["parameters"]["bytes"] + states["optimizer"]["bytes"]
    if policy is not None:
        from memo.runtime import validate_policy

        chosen = given_policy(costs, validate_policy(policy, len(stats)), alpha, budget)
    else:
        if can_wrap:
            # NOTE [Calibrated policy]: the cost model's full-recompute need is checked against a
            # recorded full-recompute iteration, and its constant part corrected by the difference,
            # so that "never more than full recompute" compares memo with a measured figure; then
            # its memo need likewise, against a recorded iteration of every layer under memo at
            # alpha = 0 (_calibrate_memo). The chosen policy is recorded once more below.
            fr_trace, _ = _wrapped_pass(net, ids, labels, 0.0, recorder, False, meta, plain,
                                        ["recompute"] * len(stats))
            fr_total = _iteration_total(fr_trace, static)
            estimate = full_recompute_need(costs)
            costs = dataclasses.replace(costs, base_bytes=max(0, costs.base_bytes + fr_total - estimate))
            costs = _calibrate_memo(costs, net, ids, labels, meta, plain, static, recorder)
        chosen = choose_policy(costs, budget, alpha, FALLBACK_HEADROOM)
    result.policy = chosen
    result.model_states = states
    timings["alpha"] = time.perf_counter() - t0

    # Pass 2 (NOTE [Two-pass profiling]): the trace the plan is made from.
    for attempt in range(5):
        result.alpha = _alpha_of(chosen, lp_inputs, alpha, evaluate_alpha)
        say(f"policy: {describe_policy(chosen.policy)}; alpha = {result.alpha.alpha:.4f} "
            f"(binding: {result.alpha.binding}); device need {format_bytes(chosen.device_bytes)} per rank, "
            f"estimated (full recompute {format_bytes(chosen.full_recompute_bytes)})")
        if not can_wrap or policy is not None or not chosen.counts.get("memo"):
            break
        probe, _ = _wrapped_pass(net, ids, labels, result.alpha.alpha, recorder, False, meta, plain,
                                 chosen.policy)
        total = _iteration_total(probe, static)
        if total <= chosen.device_cap:
            break
        if attempt == 4:
            raise MemoError(
                f"memo.profiler: the chosen policy ({describe_policy(chosen.policy)}, alpha "
                f"{result.alpha.alpha:.4f}) needs {format_bytes(total)} per rank when recorded, over the cap "
                f"of {format_bytes(chosen.device_cap)}, after every correction of the estimate; give a fixed "
                "--alpha, or more --device-mem-gb")
        # The estimate was short. At alpha = 0 it was measured (_calibrate_memo), so the error is in
        # its slope in alpha: correct that (or, at alpha = 0, its constant part) and choose again.
        # The recorded peak moves in steps of whole allocations, so a correction that lands exactly
        # on the cap tends to miss it by part of one: overshoot by a quarter. Where three
        # corrections did not land, alpha > 0 is given up: memo at alpha = 0 was recorded.
        error = (total - chosen.device_bytes) * 5 // 4
        if attempt == 2:
            costs = dataclasses.replace(costs, memo_alpha_bytes=1 << 62)
        elif chosen.alpha > 1e-6:
            costs = dataclasses.replace(costs, memo_alpha_bytes=costs.memo_alpha_bytes + int(
                math.ceil(error / chosen.alpha)))
        else:
            costs = dataclasses.replace(costs, memo_overhead=costs.memo_overhead + error)
        say(f"policy: the recorded iteration needs {format_bytes(total)}, over the cap of "
            f"{format_bytes(chosen.device_cap)}; choosing again")
        chosen = choose_policy(costs, budget, alpha, FALLBACK_HEADROOM)
        result.policy = chosen
    if wrap_pass is True and wrap is None:
        raise MemoError(
            "memo.profiler: pass 2 (the model wrapped with alpha) was asked for, but memo.runtime has no "
            "wrap(); install a memo with the runtime, or profile with wrap_pass=False (--no-wrap-pass)"
        )
    second: dict[str, Any] | None = None
    wrapped: dict[str, Any] | None = None
    if wrap is not None and wrap_pass is not False:
        say(f"pass 2 ({dev.type}): recording one iteration of the model wrapped with alpha "
            f"{result.alpha.alpha:.4f} ...")
    t0 = time.perf_counter()
    if wrap is not None and wrap_pass is not False:
        try:
            second, wrapped = _wrapped_pass(net, ids, labels, result.alpha.alpha, recorder, progress, meta,
                                            plain, chosen.policy)
            result.wrapped = True
        except MemoError as err:
            if wrap_pass:
                raise
            notes.append(
                f"pass 2 could not run the wrapped model ({err}); the plan comes from the plain model"
            )
    elif wrap is None and wrap_pass is None:
        notes.append("memo.runtime.wrap is not available; the plan comes from the plain model")
    if second is None and plan and (recorder == "allocator" or sized_on != dev):
        # The planned trace must come from the device that will run (and, for the allocator
        # recorder, from the allocator's own requests), even when the model cannot be wrapped.
        if recorder == "allocator":
            second = _record_allocator(net, ids, labels, _target_meta(plain, dev, "allocator"))
        else:
            second = _record(net, ids, labels, progress, "pass 2 (plain model)", meta).trace
    if second is not None:
        second["layers"] = plain.trace["layers"]
        result.trace = second
        timings["pass2"] = time.perf_counter() - t0
        what = f"wrapped, alpha {result.alpha.alpha:.4f}" if result.wrapped else "plain model"
        n_events = len(second["events"])
        say(f"pass 2 ({what}, {recorder} recorder): {n_events:,} events in {timings['pass2']:.1f} s")
    result.trace["meta"]["alpha"] = float(result.alpha.alpha)
    result.trace["meta"]["tensor_parallel"] = tp
    result.trace["meta"]["policy"] = list(chosen.policy)
    # `memo plan --device-mem-gb` re-plans this trace: the rank's total needs the model states.
    result.trace["meta"]["model_states"] = states
    if not plan:
        return result

    from memo.planner import Trace, make_plan, offload_difference
    from memo.runtime import offload_tokens

    t0 = time.perf_counter()
    # The plan is for memo's allocator, which serves only phased requests from the arena.
    kwargs: dict[str, Any] = {"alpha_solution": result.alpha, "time_limit": time_limit, "progress": progress,
                              "unphased": "fallback"}
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
        local = seq_len // tp  # a rank's layer input holds seq_len / tp tokens
        a = offload_tokens(result.alpha.alpha, local)
        result.plan.offload = {
            "offloaded_layers": wrapped["offloaded_layers"],
            "planned_bytes_per_layer": offloaded_bytes(summary, a, local),
            "actual_bytes_per_layer": wrapped["layer_bytes"],
            "tensors": [list(t) for t in wrapped["tensors"]],
        }
        warning = offload_difference(result.plan.offload)
        if warning is not None:
            notes.append(warning)
    result.plan.policy = list(chosen.policy)
    iteration = _iteration_total(result.trace, 0)
    result.plan.device = {
        "budget_bytes": budget,
        "model_states": states,
        "activations_bytes": int(result.plan.peak),
        "iteration_peak_bytes": iteration,
        "total_bytes": iteration + static,
        "estimate": {"bytes": int(chosen.device_bytes), "parts": dict(chosen.parts),
                     "full_recompute_bytes": int(chosen.full_recompute_bytes)},
        "binding": chosen.binding,
    }
    timings["plan"] = time.perf_counter() - t0
    say(f"plan made in {timings['plan']:.1f} s")
    return result


# NOTE [Fallback headroom]
# Under a device budget the plan's total (iteration peak + model states) is the bytes in use at
# the worst moment, but memo's allocator serves what the plan does not place (gradients,
# optimizer states, temporaries) from a caching pool whose segments fragment, and the plan's
# arena can lend it only whole idle ranges (NOTE [One device pool]). A plan that fills the
# budget to the byte can thus fail on a later step, once the optimizer states live through the
# iteration. The policy is therefore chosen within the budget less this share of it, as a user
# of PyTorch's allocator leaves room between "allocated" and "reserved"; the plan still records
# the whole budget, which `memo train` enforces.
FALLBACK_HEADROOM = 0.05


def _calibrate_memo(costs: Any, net: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                    meta: dict[str, Any], plain: Recording, static: int, recorder: str) -> Any:
    """NOTE [Calibrated policy]: ``costs`` with memo_overhead set so that the estimate of every
    layer under memo at alpha = 0 is what a recorded iteration of exactly that needs.

    The cost model leaves out what a memo layer's backward holds besides its recomputed share
    (gradients of q, k, v and o, the prefetched layer's rounding buffer in flight) and may count
    more than the runtime holds at once; the correction is added to, or taken from, every split
    with memo layers. Skipped where the host memory cannot hold even alpha = 0.
    """
    from memo.planner import device_need

    n = costs.n_layers
    if n * costs.copy_bytes(0.0) > costs.host_memory:
        return costs
    try:
        memo_trace, _ = _wrapped_pass(net, ids, labels, 0.0, recorder, False, meta, plain, ["memo"] * n)
    except MemoError:
        return costs  # the chosen policy's probe (below) still checks what is chosen
    measured = _iteration_total(memo_trace, static)
    estimate = sum(device_need(costs, n, 0, 0, 0.0).values())
    return dataclasses.replace(costs, memo_overhead=costs.memo_overhead + measured - estimate)


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
    if alpha is None or not n_memo:
        solution = dataclasses.replace(solution, binding=chosen.binding)
    return solution


def _device_budget(device_mem_gb: float | None) -> int | None:
    """``--device-mem-gb`` in bytes, or a clear error for a bad value."""
    if device_mem_gb is None:
        return None
    if (isinstance(device_mem_gb, bool) or not isinstance(device_mem_gb, (int, float))
            or not math.isfinite(device_mem_gb) or device_mem_gb <= 0):
        raise MemoError("memo.profiler: the device memory (--device-mem-gb) must be a positive number of GB, "
                        f"got {device_mem_gb!r}")
    return int(device_mem_gb * GB)


def _layer_costs(trace: dict[str, Any], lp_inputs: tuple, seq_len: int, micro_batch: int, elem_size: int,
                 layer_params: int, states: dict[str, Any]) -> Any:
    """The per-rank numbers of NOTE [Policy cost model] from pass 1 (the plain model)."""
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
    # NOTE [Chunked recompute] (memo/runtime/layer.py): how many chunks a memo layer recomputes in.
    from memo.runtime.layer import token_chunks

    layers = trace["layers"]
    chunks = max(1, len(token_chunks(int(layers.get("rows", 0)))))
    return LayerCosts(n_layers=n_layers, s_input=int(s_input), s_attn=int(s_attn), s_others=int(s_others),
                      layer_time=float(layer_s), attn_fraction=float(min(max(fraction, 0.0), 1.0)),
                      base_bytes=int(base + static), bandwidth=float(bandwidth), host_memory=int(host),
                      recompute_chunks=chunks)


def _wrapped_pass(
    model: nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    recorder: str,
    progress: bool,
    meta: dict[str, Any],
    plain: Recording,
    policy: list[str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trace one iteration of ``model`` wrapped by memo's runtime with ``alpha``; unwrap afterwards.
    Returns the trace and what the runtime allocated and copied: ``host_bytes``, ``layer_bytes``,
    ``offloaded_layers`` and ``tensors`` (``(what, bytes)`` per copied tensor of one layer).

    The model is wrapped in place (NOTE [Wrapping in place] in memo/runtime/wrap.py) and
    restored whatever happens, so a model the caller passed comes back as it was given.
    """
    from memo import runtime

    runtime.wrap(model, alpha=alpha, policy=policy)
    try:
        if recorder == "allocator":
            trace = _record_allocator(model, ids, labels, _target_meta(plain, ids.device, "allocator"))
        else:
            trace = _record(model, ids, labels, progress, f"pass 2 (alpha={alpha:.3f})", meta).trace
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
