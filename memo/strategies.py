"""Activation-memory strategies for a training run, measured the same way side by side.

* ``none`` -- plain autograd: every activation stays on the device.
* ``full-recompute`` -- each layer under ``torch.utils.checkpoint``: only layer inputs stay.
* ``full-offload`` -- memo's wrapper with alpha = 1: every skeletal tensor goes to pinned
  host memory, nothing is recomputed (the "full swap" baseline of the paper).
* ``memo`` -- memo's wrapper with a solved (or given) alpha, plus the planned allocator.

NOTE [Measuring device memory]
Every strategy runs its steps inside one memo.allocator context on the model's device, so
device bytes are measured by the same allocator for all of them: ``memo`` replays its plan,
the others use an empty plan (everything through the fallback caching allocator). The peak
reported is the allocator's peak of bytes in use during the steps (activations, gradients,
optimizer state, temporaries and memo's two device rounding buffers) plus the parameters,
which exist before the first step. On CUDA memo's allocator, once installed, is PyTorch's CUDA
allocator for the whole process (NOTE [Allocator state is process-wide]), so it has served the
parameters too and its peak already counts them. On CUDA with PyTorch's own allocator
(baselines run without memo), torch's ``max_memory_allocated`` is the same quantity; with a
pluggable allocator torch's counters raise, so memo's are read instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memo import pipeline, planner, profiler  # at import time: NOTE [Import PuLP early] in memo.planner
from memo.errors import MemoError, PlanMismatchError
from memo.machine import Machine
from memo.phases import PhaseTracker
from memo.report import STRATEGIES
from memo.runtime.layer import offload_tokens as runtime_offload_tokens
from memo.session import Session
from memo.units import format_mib

__all__ = ["STRATEGIES", "Strategy", "StrategyOptions", "make_strategy"]


@dataclass
class StrategyOptions:
    """How the activation memory of a run is handled (the ``memo train`` flags)."""

    strategy: str = "memo"
    """One of :data:`STRATEGIES`."""
    alpha: float | str = "auto"
    """``"auto"`` solves the alpha LP; a number in [0, 1] fixes it (``memo`` strategy only)."""
    plan: str | None = None
    """A plan file from ``memo profile``; checked against the run (model, seq_len, ...)."""
    planned_allocator: bool = True
    """Replay the plan with memo's allocator (``memo`` strategy); off keeps the fallback only."""
    bandwidth_gbps: float | None = None
    """Host<->device GB/s for alpha; measured when None (CPU backend: the memcpy rate)."""
    layer_ms: float | None = None
    """Forward ms of one layer for alpha; measured when None."""
    host_mem_gb: float | None = None
    """Host memory of the node in GB for alpha; this machine's when None."""
    gpus_per_node: int = 1
    """Processes sharing the node's host memory."""
    host_safety: float = 0.8
    """Fraction of a process's share of host memory it may pin."""
    time_limit: float = 5.0
    """Seconds the planner's MIP stages may take in all (the greedy plan is ready at once)."""
    device_mem_gb: float | None = None
    """Device memory budget in GB (10^9 bytes), enforced by memo's allocator: a request beyond it is
    a real out-of-memory error (NOTE [Device budget]). None: the device's own memory."""
    debug_copy_delay_us: int | None = None
    """CPU backend: random delay before each copy (tests)."""
    notes: list[str] = field(default_factory=list)

    def machine(self) -> Machine:
        """The :class:`~memo.machine.Machine` these options describe (its ``None`` fields are measured)."""
        return Machine(bandwidth_gbps=self.bandwidth_gbps, layer_ms=self.layer_ms,
                       host_mem_gb=self.host_mem_gb, gpus_per_node=self.gpus_per_node,
                       host_safety=self.host_safety, device_mem_gb=self.device_mem_gb)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise MemoError(
                f"memo.train: --strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if isinstance(self.alpha, str):
            if self.alpha != "auto":
                try:
                    self.alpha = float(self.alpha)
                except ValueError:
                    raise MemoError(
                        f"memo.train: --alpha must be 'auto' or a number in [0, 1], got {self.alpha!r}"
                    ) from None
        if not isinstance(self.alpha, str):
            from memo.runtime import validate_alpha

            try:
                self.alpha = validate_alpha(self.alpha)
            except MemoError as err:
                raise MemoError(f"memo.train: --alpha {self.alpha}: {err}") from None
        if self.strategy != "memo" and (self.alpha != "auto" or self.plan is not None):
            raise MemoError(
                f"memo.train: --alpha and --plan apply to --strategy memo only, not to {self.strategy!r}"
            )
        if self.plan is not None and self.alpha != "auto":
            raise MemoError("memo.train: give --plan (which carries alpha) or --alpha, not both")
        if self.gpus_per_node < 1:
            raise MemoError(f"memo.train: --gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.device_mem_gb is not None and not (isinstance(self.device_mem_gb, (int, float))
                                                   and 0 < self.device_mem_gb < float("inf")):
            raise MemoError(
                f"memo.train: --device-mem-gb must be a positive number of GB, got {self.device_mem_gb!r}")
        if not 0 < self.host_safety <= 1:
            raise MemoError(f"memo.train: --host-safety must be in (0, 1], got {self.host_safety}")


class Strategy:
    """Prepares a model for one strategy, runs each step inside the right contexts, measures.

    Use::

        strategy = make_strategy(options)
        strategy.prepare(model, ids, labels, run)   # before the optimizer is built
        for ...:
            with strategy.step():
                loss = train_step(...)
            strategy.step_stats()
        strategy.close()
    """

    def __init__(self, options: StrategyOptions) -> None:
        self.options = options
        self.name = options.strategy
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")
        self.alpha: float | None = None
        self.alpha_binding: str | None = None
        self.plan: Any = None
        self.policy: list[str] | None = None
        #: Layers memo's wrapper offloads (None without it); alpha means nothing when it is 0.
        self.offloaded_layers: int | None = None
        self.tracker: PhaseTracker | None = None
        self.session: Session | None = None
        self.param_bytes = 0
        self._example: tuple[torch.Tensor, torch.Tensor] | None = None
        self._recompute_policy: list[str] | None = None
        self._allocator_on = False
        self._peak = 0
        self._counts = {"planned": 0, "fallback": 0, "unplanned": 0}
        self._last_copy: dict[str, int] = {}
        #: Bytes per offloaded layer the profile counted (NOTE [Planned and actual offload]).
        self.planned_offload_bytes: int | None = None
        #: Planned vs actual offload per layer, filled once the wrapped model ran (None otherwise).
        self.offload: dict[str, Any] | None = None

    # Set-up -------------------------------------------------------------------------------------
    #: The :class:`memo.Session` class the steps run in (benchmarks cap its fallback pool).
    session_class: type[Session] = Session

    def prepare(
        self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: dict[str, Any],
        log: Callable[[str], None] = print,
    ) -> None:
        """Make ``model`` use this strategy. ``run``: model name, seq_len, micro_batch, dtype."""
        self.model = model
        self.device = ids.device
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._example = (ids, labels)
        if self.name == "full-recompute":
            self._recompute_policy = _full_recompute(model)
        elif self.name == "full-offload":
            self.alpha = 1.0
        elif self.name == "memo":
            self._prepare_memo(model, ids, labels, run, log)
        self._start_meter()

    def _prepare_memo(
        self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: dict[str, Any],
        log: Callable[[str], None],
    ) -> None:
        opts = self.options
        if opts.plan is not None:
            plan = planner.load_plan(opts.plan)
            _check_plan(plan, run)
            _check_plan_budget(plan, opts.device_mem_gb)
            self.plan = plan
            self.alpha, self.alpha_binding = float(plan.alpha), getattr(plan, "alpha_binding", None)
            if plan.offload:
                self.planned_offload_bytes = int(plan.offload["planned_bytes_per_layer"])
            log(f"memo: plan {opts.plan}: alpha {self.alpha:.4f}, arena {format_mib(plan.peak)}")
            return
        fixed = None if opts.alpha == "auto" else float(opts.alpha)
        result = pipeline.profile(
            model, run["seq_len"], run["micro_batch"], device=ids.device,
            machine=opts.machine(),
            # Without the planned allocator only alpha is needed: the dispatch recorder sizes the
            # layer on a meta copy, and memo's CUDA allocator need not be installed (it could not
            # be, with the model already on the GPU).
            recorder="allocator" if opts.planned_allocator else "dispatch",
            wrap_pass=None if opts.planned_allocator else False,
            time_limit=opts.time_limit, alpha=fixed,
            plan=opts.planned_allocator, log=lambda line: log(f"memo profile: {line}"),
        )
        for note in result.notes:
            log(f"memo profile: note: {note}")
        for p in model.parameters():  # profiling ran a backward; training starts from no gradients
            p.grad = None
        self.alpha, self.alpha_binding = float(result.alpha.alpha), str(result.alpha.binding)
        self.plan = result.plan
        self.policy = list(result.policy.policy)
        a = runtime_offload_tokens(self.alpha, run["seq_len"])
        self.planned_offload_bytes = profiler.offloaded_bytes(result.plain_trace["layers"], a, run["seq_len"])
        if self.plan is not None:
            log(f"memo: alpha {self.alpha:.4f} ({self.alpha_binding}); "
                f"plan arena {format_mib(self.plan.peak)}, lower bound {format_mib(self.plan.lower_bound)}")

    # Steps --------------------------------------------------------------------------------------
    def _device_budget(self) -> int | None:
        """NOTE [Device budget]: ``--device-mem-gb`` in bytes, which the Session enforces."""
        gb = self.options.device_mem_gb
        return None if gb is None else int(gb * 1e9)

    def _start_meter(self) -> None:
        """Open the Session all steps run in (NOTE [Measuring device memory], NOTE [One construction
        path] in memo/session.py): memo's allocator, the wrapped layers, phases, sized buffers."""
        opts = self.options
        plan = self.plan
        recompute = self._recompute_policy
        self.session = self.session_class(
            self.model, plan, alpha=None if plan is not None else (0.0 if recompute else self.alpha),
            policy=None if plan is not None else (recompute or self.policy),
            planned_allocator=opts.planned_allocator, device=self.device,
            device_budget_bytes=self._device_budget(),
            example=self._example, debug_copy_delay_us=opts.debug_copy_delay_us)
        self.session.__enter__()
        self.tracker = self.session.tracker
        self._allocator_on = self.session.allocator_on
        if self.session.wrapped:
            from memo import runtime

            self.offloaded_layers = runtime.runtime_of(self.model).n_offloaded

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run one training step's forward and backward inside this strategy's Session."""
        if self.session is None:
            yield
            return
        with self.session.iteration():
            yield

    def step_stats(self) -> dict[str, Any]:
        """Counters after the last step: running device peak, host pinned bytes, allocator hits."""
        from memo import allocator

        out: dict[str, Any] = {"host_pinned_bytes": self.host_pinned_bytes()}
        out.update(self._copy_stats())
        self._note_offload()
        if self._allocator_on:
            st = allocator.stats(self.device)
            self._peak = max(self._peak, int(st["peak_bytes_in_use"]))
            # "fallback": requests the plan covered but could not serve (deviations, busy slots);
            # "unplanned": requests outside planned phases (optimizer, data), fallback by design.
            self._counts = {"planned": int(st["planned_hits"]),
                            "fallback": int(st["fallback_requests"]) - int(st["unplanned_requests"]),
                            "unplanned": int(st["unplanned_requests"])}
            out["segment_allocs"] = int(st["segment_allocs"])
            if self.device.type == "cuda":  # the allocator served the parameters too
                out["peak_device_bytes"] = self._peak
                out["peak_device_kind"] = "memo_allocator_peak_in_use"
            else:
                out["peak_device_bytes"] = self.param_bytes + self._peak
                out["peak_device_kind"] = "memo_allocator_peak_in_use+params"
        elif self.device.type == "cuda":
            out["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            out["peak_device_kind"] = "cuda_max_memory_allocated"
        else:
            out["peak_device_bytes"], out["peak_device_kind"] = None, "unavailable"
        out["allocator"] = dict(self._counts)
        return out

    def _copy_stats(self) -> dict[str, Any]:
        """This step's rounding-buffer traffic, and how long compute waited for it.

        ``copy_wait_s`` is host time the compute thread spent blocked on copies (CPU backend);
        on CUDA the waits are stream waits on the device and it stays 0.
        """
        from memo import runtime

        if self.model is None or not runtime.is_wrapped(self.model):
            return {}
        st = runtime.runtime_of(self.model).stats.as_dict()
        last, self._last_copy = self._last_copy, st
        delta = {k: st[k] - last.get(k, 0) for k in ("bytes_offloaded", "bytes_prefetched", "copy_wait_ns",
                                                       "recomputed_tokens")}
        return {"bytes_offloaded": delta["bytes_offloaded"], "bytes_prefetched": delta["bytes_prefetched"],
                "recomputed_tokens": delta["recomputed_tokens"], "copy_wait_s": delta["copy_wait_ns"] / 1e9}

    def _note_offload(self) -> None:
        """Planned vs actual bytes per offloaded layer (NOTE [Planned and actual offload])."""
        from memo import runtime

        if self.offload is not None or self.model is None or not runtime.is_wrapped(self.model):
            return
        rt = runtime.runtime_of(self.model)
        if rt.layer_bytes is None:
            return
        planned = self.planned_offload_bytes
        self.offload = {"offloaded_layers": rt.n_offloaded,
                        "planned_bytes_per_layer": planned,
                        "actual_bytes_per_layer": int(rt.layer_bytes),
                        "tensors": [list(t) for t in rt.layer_tensors]}

    def host_pinned_bytes(self) -> int:
        from memo import runtime

        if self.model is None or not runtime.is_wrapped(self.model):
            return 0
        return int(runtime.runtime_of(self.model).host_bytes)

    def close(self) -> None:
        """Close the Session: phases, wrap and allocator undone."""
        if self.session is not None:
            self.session.close()
        self.tracker = None
        self._allocator_on = False


def make_strategy(options: StrategyOptions) -> Strategy:
    return Strategy(options)


def _full_recompute(model: nn.Module) -> list[str] | None:
    """Every layer recomputed in backward. memo's models do it themselves (``torch.utils.checkpoint``
    per layer: returns None); other models through memo's runtime with every layer on the
    "recompute" policy (NOTE [Layer policy]; returns that policy), since their own switches (HF
    gradient checkpointing, megatron's recompute_granularity) are not the same code path."""
    if isinstance(getattr(model, "recompute", None), str):
        model.recompute = "full"  # memo's models
        return None
    from memo.adapters.model import model_adapter_for

    n = len(model_adapter_for(model, "memo.train").parts(model).layers)
    return ["recompute"] * n




def _check_plan(plan: Any, run: dict[str, Any]) -> None:
    """A plan made for another job is refused with the field that differs."""
    meta = getattr(plan, "meta", {}) or {}
    for key in ("model", "seq_len", "micro_batch", "dtype"):
        expected, actual = run.get(key), meta.get(key)
        if actual is not None and expected is not None and str(actual) != str(expected):
            raise PlanMismatchError(
                f"memo.train: the plan was made for {key}={actual}, this run has {key}={expected}; "
                "re-run `memo profile` for this run, or drop --plan"
            )
    # A plan for one rank of a tensor- or context-parallel group describes that rank's shard
    # (NOTE [Tensor-parallel rank], NOTE [Context-parallel profile]); a run that is not sharded the
    # same way would replay it on other shapes. Plans without the field are from unsharded profiles.
    for key, flag in (("tensor_parallel", "--tensor-parallel"), ("context_parallel", "--context-parallel")):
        expected, actual = run.get(key, 1), meta.get(key, 1)
        if str(actual) != str(expected):
            raise PlanMismatchError(
                f"memo.train: the plan was made for one rank of {key}={actual}, this run has {key}="
                f"{expected}; its sizes are that rank's shard. Re-run `memo profile` with {flag} "
                f"{expected} for this run, or drop --plan"
            )


def _check_plan_budget(plan: Any, device_mem_gb: float | None) -> None:
    """A plan chosen for another device budget is refused: its layer policy fits that budget only."""
    if device_mem_gb is None:
        return
    device = getattr(plan, "device", None) or {}
    planned = device.get("budget_bytes")
    wanted = int(device_mem_gb * 1e9)
    if planned is None or abs(int(planned) - wanted) > 0.001 * wanted:
        made = "no device budget" if planned is None else f"--device-mem-gb {int(planned) / 1e9:g}"
        raise PlanMismatchError(
            f"memo.train: the plan was made for {made}, this run has --device-mem-gb {device_mem_gb:g}; its "
            "layer policy and alpha were chosen to fit that budget. Re-run `memo profile --device-mem-gb "
            f"{device_mem_gb:g}` for this run, or drop --device-mem-gb"
        )
