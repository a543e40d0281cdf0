"""Activation-memory strategies for a training run, one class each, measured the same way side by side.

* :class:`NoStrategy` (``none``) -- plain autograd: every activation stays on the device.
* :class:`FullRecompute` (``full-recompute``) -- each layer recomputed in backward: only layer
  inputs stay.
* :class:`FullOffload` (``full-offload``) -- memo's wrapper with alpha = 1: every skeletal tensor
  goes to pinned host memory, nothing is recomputed (the "full swap" baseline of the paper).
* :class:`MemoStrategy` (``memo``) -- memo's wrapper with a solved (or given) alpha, plus the
  planned allocator.
* :class:`OffloadedCheckpoint` (``offloaded-checkpoint``) -- ALST's recipe with PyTorch's APIs:
  every layer checkpointed, its input offloaded to pinned host memory, its MLP tiled.
* :class:`TorchtuneOffload` (``torchtune-offload``) -- torchtune's activation offloading with its
  activation checkpointing, as its recipes configure them (NOTE [torchtune's activation offloading]).
* :class:`SaveOnCpu` (``save-on-cpu``, benchmarks only) -- PyTorch's
  ``torch.autograd.graph.save_on_cpu`` around forward + backward of the plain model.

Each is a :class:`Strategy` (the protocol :func:`memo.train.train` uses). All but ``save-on-cpu``
are ``memo train --strategy`` (:data:`memo.train.STRATEGIES`); :func:`make_strategy` builds one from
:class:`StrategyOptions`. Every strategy takes its :class:`MemoryMeter` as an object (memo/train/meter.py,
with the :class:`Metered` base they share and NOTE [Measuring device memory]); a plan given to
``memo`` is checked against the run by memo/train/plan_checks.py. The peers
(``offloaded-checkpoint``, ``torchtune-offload``, ``save-on-cpu``, ``full-offload``) are what a user
would pick instead of memo; their pieces are in :mod:`memo.runtime.peers`.

NOTE [save_on_cpu on the CPU backend]
On a CPU device ``save_on_cpu`` moves nothing: ``tensor.cpu()`` of a CPU tensor is the tensor
itself. memo's CPU backend emulates a device whose memory is what memo's allocator serves and a
host whose memory is outside it (memo's host arena). The CPU :class:`SaveOnCpu` therefore keeps
``save_on_cpu``'s data flow (copy every saved tensor to host when it is saved, copy it back
when backward unpacks it) and puts the host copies in memory that is not the device
allocator's, as memo's own offload does. On CUDA it is ``torch.autograd.graph.save_on_cpu``
itself, unchanged (its pack hook is only wrapped to count the host bytes it holds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from memo import pipeline, planner, profiler  # at import time: NOTE [Import PuLP early] in memo.planner
from memo.errors import MemoError
from memo.machine import Machine
from memo.planner.vocab import StrategyName
from memo.runtime.layer import offload_tokens as runtime_offload_tokens
from memo.runtime.peers import CheckpointedLayers, HostBytesMeter, HostOffload
from memo.runtime.peers import host_copy as _host_copy
from memo.train import STRATEGIES
from memo.train.meter import Log, MemoryMeter, Metered, Wrapping
from memo.train.plan_checks import TrainRun
from memo.train.plan_checks import check_plan as _check_plan
from memo.train.plan_checks import check_plan_budget as _check_plan_budget
from memo.units import format_mib

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelRun
    from memo.planner import Plan

__all__ = [
    "STRATEGIES",
    "FullOffload",
    "FullRecompute",
    "HostBytesMeter",
    "MemoStrategy",
    "MemoryMeter",
    "NoStrategy",
    "OffloadedCheckpoint",
    "SaveOnCpu",
    "Strategy",
    "StrategyOptions",
    "TorchtuneOffload",
    "Wrapping",
    "make_strategy",
]



@runtime_checkable
class Strategy(Protocol):
    """What :func:`memo.train.train` needs of a strategy.

    Use::

        strategy.prepare(model, ids, labels, run)   # before the optimizer is built
        try:
            for ...:
                with strategy.step():
                    loss = train_step(...)
                strategy.step_stats()
        finally:
            strategy.close()
    """

    name: str
    """What reports and tables call it (one of :data:`STRATEGIES`, or ``save-on-cpu``)."""
    alpha: float | None
    """memo's alpha while the wrapper runs, else None."""
    alpha_binding: str | None
    plan: Any
    offloaded_layers: int | None
    """Layers memo's wrapper offloads (None without it); alpha means nothing when it is 0."""
    offload: dict[str, Any] | None
    """Planned vs actual offload per layer (NOTE [Planned and actual offload]), once known."""
    device_budget_bytes: int | None
    """NOTE [Device budget]: the budget the run is held to (its meter's), or None."""

    def prepare(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: TrainRun,
                log: Log = print) -> None:
        """Make ``model`` use this strategy and open the meter for ``run`` (the job, and this rank's
        parallel run in a parallel job)."""

    def step(self) -> contextlib.AbstractContextManager[None]:
        """Wraps one forward + backward (not the optimizer step)."""

    def step_stats(self) -> dict[str, Any]:
        """What the last step measured: device peak, host bytes, allocator counters, copies."""

    def close(self) -> None:
        """Undo :meth:`prepare` (safe to call twice, and after a failed :meth:`prepare`)."""


# ---------------------------------------------------------------------------------------- options


@dataclass
class StrategyOptions:
    """How the activation memory of a run is handled (the ``memo train`` flags)."""

    strategy: str = "memo"
    """One of :data:`STRATEGIES`."""
    alpha: float | str = "auto"
    """``"auto"`` solves the alpha LP; a number in [0, 1] (or its text) fixes it (``memo`` only)."""
    plan: str | None = None
    """A plan file from ``memo profile``; checked against the run (model, seq_len, ...). Under a pipeline
    schedule, the stages' plans from ``save_plan`` (NOTE [A stage's address plan])."""
    save_plan: str | None = None
    """Under a pipeline schedule: where each stage writes its plan (``{stage}``, ``{rank}`` filled in)."""
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

    def device_budget_bytes(self) -> int | None:
        """NOTE [Device budget]: ``--device-mem-gb`` in bytes, or None."""
        return None if self.device_mem_gb is None else int(self.device_mem_gb * 1e9)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise MemoError(
                f"memo.train: --strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if isinstance(self.alpha, str) and self.alpha != "auto":
            try:
                self.alpha = float(self.alpha)
            except ValueError:
                raise MemoError(
                    f"memo.train: --alpha must be 'auto' or a number in [0, 1], got {self.alpha!r}"
                ) from None
        if not isinstance(self.alpha, str):
            # The one check of alpha (memo.runtime's), made here so that a bad value fails before training.
            from memo.runtime import validate_alpha

            try:
                self.alpha = validate_alpha(self.alpha)
            except MemoError as err:
                raise MemoError(f"memo.train: --alpha {self.alpha}: {err}") from None
        if self.strategy != StrategyName.MEMO and (self.alpha != "auto" or self.plan is not None):
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


# ---------------------------------------------------------------------------------------- strategies


class NoStrategy(Metered):
    """``none``: plain autograd, measured by the meter like every other strategy."""

    name = StrategyName.NONE.value


class FullRecompute(Metered):
    """``full-recompute``: every layer recomputed in backward.

    memo's models do it themselves (``torch.utils.checkpoint`` per layer, ``model.recompute =
    "full"``); other models through memo's runtime with every layer on the "recompute" policy
    (NOTE [Layer policy]), since their own switches (HF gradient checkpointing, megatron's
    recompute_granularity) are not the same code path.
    """

    name = StrategyName.FULL_RECOMPUTE.value

    def wrapping(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: TrainRun,
                 log: Log) -> Wrapping:
        if isinstance(getattr(model, "recompute", None), str):
            model.recompute = "full"  # memo's models
            return Wrapping()
        from memo.adapters.model import model_adapter_for

        n = len(model_adapter_for(model, "memo.train").parts(model).layers)
        return Wrapping(alpha=0.0, policy=["recompute"] * n)


class FullOffload(Metered):
    """``full-offload``: memo's wrapper with alpha = 1 (every skeletal tensor to host)."""

    name = StrategyName.FULL_OFFLOAD.value

    def wrapping(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: TrainRun,
                 log: Log) -> Wrapping:
        self.alpha = 1.0
        return Wrapping(alpha=1.0)


class MemoStrategy(Metered):
    """``memo``: the plan from ``--plan``, or a profile of this model (alpha solved or given, the
    layer policy, and the planned allocator's tables)."""

    name = StrategyName.MEMO.value

    def __init__(self, options: StrategyOptions, meter: MemoryMeter | None = None) -> None:
        super().__init__(meter)
        self.options = options
        self.policy: list[str] | None = None

    def wrapping(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: TrainRun,
                 log: Log) -> Wrapping:
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
            return Wrapping(plan=plan, planned_allocator=opts.planned_allocator,
                            debug_copy_delay_us=opts.debug_copy_delay_us)
        parallel, job = run.parallel, run.job
        machine = opts.machine() if parallel is None else _agreed_machine(opts, parallel, model, ids, labels)
        sharded: dict[str, Any] = {} if parallel is None else {
            # NOTE [Parallel layout]: this rank's shard, profiled where its collectives run
            "batch": (ids, labels), "tensor_parallel": job.tensor_parallel,
            "context_parallel": job.context_parallel, "agree_max": parallel.agree_max}
        result = pipeline.profile(
            model, None if parallel is not None else job.seq_len, job.micro_batch, device=ids.device,
            machine=machine, **sharded,
            # Without the planned allocator only alpha is needed: the dispatch recorder sizes the
            # layer on a meta copy, and memo's CUDA allocator need not be installed (it could not
            # be, with the model already on the GPU).
            recorder="allocator" if opts.planned_allocator else "dispatch",
            wrap_pass=None if opts.planned_allocator else False,
            time_limit=opts.time_limit, alpha=None if opts.alpha == "auto" else float(opts.alpha),
            plan=opts.planned_allocator, log=lambda line: log(f"memo profile: {line}"),
        )
        for note in result.notes:
            log(f"memo profile: note: {note}")
        for p in model.parameters():  # profiling ran a backward; training starts from no gradients
            p.grad = None
        self.alpha, self.alpha_binding = float(result.alpha.alpha), str(result.alpha.binding)
        self.plan = result.plan if parallel is None else _shared_plan(parallel, result.plan, log)
        self.policy = list(result.policy.policy)
        a = runtime_offload_tokens(self.alpha, job.seq_len)
        self.planned_offload_bytes = profiler.offloaded_bytes(result.plain_trace["layers"], a, job.seq_len,
                                                              self.policy)
        if self.plan is not None:
            log(f"memo: alpha {self.alpha:.4f} ({self.alpha_binding}); "
                f"plan arena {format_mib(self.plan.peak)}, lower bound {format_mib(self.plan.lower_bound)}")
            return Wrapping(plan=self.plan, planned_allocator=opts.planned_allocator,
                            debug_copy_delay_us=opts.debug_copy_delay_us)
        return Wrapping(alpha=self.alpha, policy=self.policy, planned_allocator=opts.planned_allocator,
                        debug_copy_delay_us=opts.debug_copy_delay_us)


def _agreed_machine(opts: StrategyOptions, parallel: ParallelRun | None, model: nn.Module, ids: torch.Tensor,
                    labels: torch.Tensor) -> Machine:
    """The machine every rank of a parallel job plans with: B, T_layer and the node's host memory as
    given, else measured on every rank and agreed (the slowest link and layer, the smallest node),
    so that every rank solves the same alpha LP and records the same iterations (NOTE [Decisions
    every rank shares] in memo/pipeline/policy.py)."""
    from memo.profiler.measure import GB, machine_memory_bytes, measure_bandwidth, time_layer_forward
    from memo.profiler.record import layer_inputs, model_parts

    bandwidth, layer_ms = opts.bandwidth_gbps, opts.layer_ms
    if bandwidth is None:
        bandwidth = float(measure_bandwidth(ids.device).value)
    if layer_ms is None:  # every rank times its first layer together (its collectives pair up)
        args, kwargs = layer_inputs(model, ids, labels)
        layer_ms = float(time_layer_forward(model_parts(model).layers[0], *args, layer_kwargs=kwargs).value)
    host_gb = opts.host_mem_gb if opts.host_mem_gb is not None else machine_memory_bytes() / GB
    bandwidth, layer_ms, host_gb = parallel.agree_machine(bandwidth, layer_ms, host_gb)
    return opts.machine().replace(bandwidth_gbps=bandwidth, layer_ms=layer_ms, host_mem_gb=host_gb)


def _shared_plan(parallel: ParallelRun | None, plan: Plan, log: Log) -> Plan:
    """One plan per recorded iteration: every rank runs the plan of the lowest rank that recorded the
    same iteration (its requests' fingerprint), so that ranks with identical shards run one plan
    whatever the planner's time-limited search found on each, and ParallelRun.agree finds them equal."""
    from memo.distributed.layout import plan_fingerprint, requests_fingerprint

    if plan is None:
        return None
    made_from = parallel.gather(requests_fingerprint(plan))
    leader = made_from.index(made_from[parallel.rank])  # the lowest rank that recorded what this one did
    plans = parallel.gather(plan.to_dict() if parallel.rank == leader else None)
    adopted = plan if leader == parallel.rank else type(plan).from_dict(plans[leader])
    if requests_fingerprint(adopted) != made_from[parallel.rank]:  # internal: the leader sent its own plan
        raise MemoError(f"memo.distributed: rank {leader}'s plan does not describe this rank's iteration; "
                        "re-run")
    groups = len(set(made_from))
    if groups == 1:
        log(f"memo.distributed: every rank runs rank 0's plan {plan_fingerprint(adopted)}")
    else:
        log(f"memo.distributed: the ranks recorded {groups} different iterations; each rank runs the plan of "
            "the first rank that recorded its own")
    return adopted


class SaveOnCpu(Metered):
    """``save-on-cpu``: ``torch.autograd.graph.save_on_cpu`` around forward + backward of the plain
    model (the baseline a PyTorch user would otherwise pick; benchmarks, not ``memo train``).

    The plain model, no wrapper, its steps under the saved-tensor hooks, measured by the same
    meter as every other strategy. ``host_pinned_bytes`` is the peak of host copies held.
    """

    name = "save-on-cpu"

    def __init__(self, meter: MemoryMeter | None = None) -> None:
        super().__init__(meter)
        self.host = HostBytesMeter()

    def _hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        device = self.meter.device
        if device.type == "cuda":
            hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
            pack = hooks.pack_hook

            def counted_pack(tensor: torch.Tensor) -> Any:
                packed = pack(tensor)
                self.host.add(packed[1])
                return packed

            # saved_tensors_hooks.__enter__ pushes self.pack_hook: wrapping it keeps torch's
            # own pack/unpack and only counts what they hold on the host.
            hooks.pack_hook = counted_pack
            return hooks
        if device.type != "cpu":
            raise MemoError(f"memo.train: save-on-cpu runs on cpu or cuda, not {device.type}")

        def pack_to_host(tensor: torch.Tensor) -> torch.Tensor:
            host = _host_copy(tensor)
            self.host.add(host)
            return host

        def unpack_to_device(host: torch.Tensor) -> torch.Tensor:
            # Back into device memory (memo's allocator), as save_on_cpu's tensor.to(device) does.
            return host.clone()

        return torch.autograd.graph.saved_tensors_hooks(pack_to_host, unpack_to_device)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._hooks(), super().step():
            yield

    def host_pinned_bytes(self) -> int:
        return self.host.peak


class _CheckpointPeer(Metered):
    """What the peers that checkpoint every layer share (``offloaded-checkpoint``, ``torchtune-offload``):
    the layers under non-reentrant ``torch.utils.checkpoint``
    (:class:`memo.runtime.peers.CheckpointedLayers`),
    host copies counted by a :class:`HostBytesMeter`, everything undone by :meth:`close`."""

    def __init__(self, meter: MemoryMeter | None = None) -> None:
        super().__init__(meter)
        self.host = HostBytesMeter()
        self.layers: CheckpointedLayers | None = None
        #: Every layer's tiled MLP (empty without one); kept after :meth:`close` for its counts.
        self.mlps: list[Any] = []
        self._recompute: tuple[nn.Module, str] | None = None

    def _checkpoint_layers(self, model: nn.Module, offload: HostOffload | None, tile_mlp: bool) -> Any:
        """Checkpoint every layer of ``model`` (its model adapter's layers); returns the adapter's parts."""
        from memo.adapters.model import model_adapter_for

        parts = model_adapter_for(model, "memo.train").parts(model)
        # Built (and refused, if it must be) before anything is changed.
        layers = CheckpointedLayers(parts.layers, offload=offload, tile_mlp=tile_mlp)
        recompute = getattr(model, "recompute", None)
        if isinstance(recompute, str) and recompute != "none":  # memo's models: this strategy checkpoints
            self._recompute = (model, recompute)
            model.recompute = "none"
        self.layers, self.mlps = layers, list(layers.mlps)
        layers.install()
        return parts

    def host_pinned_bytes(self) -> int:
        """The peak of host copies held (NOTE [Offload hooks] in memo/runtime/peers.py)."""
        return self.host.peak

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.layers is not None:
                self.layers.remove()
                self.layers = None
            if self._recompute is not None:
                model, recompute = self._recompute
                model.recompute = recompute
                self._recompute = None


class OffloadedCheckpoint(_CheckpointPeer):
    """``offloaded-checkpoint``: ALST's recipe (arXiv 2506.13996) with PyTorch's own APIs, on one device.

    Every layer runs under ``torch.utils.checkpoint(..., use_reentrant=False)``; a pair of saved-tensor
    hooks around each checkpointed call moves what checkpoint saves, the layer input, to (pinned) host
    memory (NOTE [Offload hooks] in memo/runtime/peers.py); each layer's MLP runs over ALST's token tiles
    (NOTE [Tiled MLP]). A model whose layers name no MLP is refused (:func:`memo.runtime.peers.find_mlp`).
    Host bytes: n_layers x the layer input's bytes at the end of forward.
    """

    name = StrategyName.OFFLOADED_CHECKPOINT.value

    def wrapping(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: TrainRun,
                 log: Log) -> Wrapping:
        self._checkpoint_layers(model, HostOffload(ids.device, self.host), tile_mlp=True)
        return Wrapping()

    def mlp_tiles(self) -> list[int]:
        """Tiles of each MLP call so far, every layer's, in call order (recomputes included)."""
        return [n for mlp in self.mlps for n in mlp.tiles_run]


class TorchtuneOffload(_CheckpointPeer):
    """``torchtune-offload``: torchtune's activation offloading as its recipes configure it.

    NOTE [torchtune's activation offloading]
    torchtune's docs say activation offloading "should be used alongside activation checkpointing"; its
    recipes take ``enable_activation_checkpointing: True`` and ``enable_activation_offloading: True``:
    every transformer layer under non-reentrant checkpointing (``set_activation_checkpointing``), and
    ``OffloadActivations`` (saved-tensor hooks, torchtune.training) around the model's forward, which
    moves every saved tensor of at least 1024 bytes that is not a parameter or buffer to pinned host
    memory and brings it back in backward. With the layers checkpointed, what it sees inside a layer is
    the checkpoint's input. ``get_act_offloading_ctx_manager`` keeps the output projection out of it
    (``NoOpManager``) and the recipes compute the loss outside the context; here the model's head parts
    (final norm, LM head, loss) are outside it, and backward runs outside it, as in the recipes.

    This is an equivalent written from that behaviour, not torchtune itself: torchtune 0.6.1 installs
    (``--no-deps``) but ``torchtune.training`` does not import without its data stack (``datasets``,
    torchao's ``nf4tensor``, ...), and ``OffloadActivations`` needs CUDA (its ``__init__`` takes
    ``torch.cuda.default_stream()``; its copies are ``pin_memory=True``), so it cannot run on memo's CPU
    backend. The copies here are those of :class:`memo.runtime.peers.HostOffload` (NOTE [Offload hooks]);
    the real one also overlaps them with compute on a second CUDA stream, which changes time, not bytes.
    """

    name = StrategyName.TORCHTUNE_OFFLOAD.value
    #: ``OffloadActivations(min_offload_size=1024)``: smaller saved tensors stay on the device.
    MIN_OFFLOAD_BYTES = 1024

    def __init__(self, meter: MemoryMeter | None = None) -> None:
        super().__init__(meter)
        self.host_offload: HostOffload | None = None
        self._scope: torch.autograd.graph.saved_tensors_hooks | None = None
        self._handles: list[Any] = []

    def wrapping(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: TrainRun,
                 log: Log) -> Wrapping:
        self.host_offload = HostOffload(ids.device, self.host, min_bytes=self.MIN_OFFLOAD_BYTES,
                                        skip_parameters=True)
        parts = self._checkpoint_layers(model, None, tile_mlp=False)
        # The forward from the embedding to the head runs under the hooks (the recipe's context around
        # the model's forward, the head kept out of it).
        self._handles = [parts.embedding.register_forward_pre_hook(self._enter),
                         parts.head[0].register_forward_pre_hook(self._leave)]
        return Wrapping()

    def _enter(self, _module: nn.Module, _args: tuple[object, ...]) -> None:
        if self._scope is None and self.host_offload is not None and torch.is_grad_enabled():
            self._scope = self.host_offload.hooks()
            self._scope.__enter__()

    def _leave(self, _module: nn.Module | None = None, _args: tuple[object, ...] | None = None) -> None:
        if self._scope is not None:
            scope, self._scope = self._scope, None
            scope.__exit__(None, None, None)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        try:
            with super().step():
                yield
        finally:
            self._leave()  # a forward that failed before the head

    def close(self) -> None:
        self._leave()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().close()


_CLASSES: dict[str, type[Metered]] = {c.name: c for c in (NoStrategy, FullRecompute, FullOffload,
                                                            MemoStrategy, OffloadedCheckpoint,
                                                            TorchtuneOffload)}


def make_strategy(options: StrategyOptions, meter: MemoryMeter | None = None) -> Strategy:
    """The strategy ``options.strategy`` names, measured by ``meter`` (default: a
    :class:`MemoryMeter` with ``options``' device budget)."""
    if meter is None:
        meter = MemoryMeter(options.device_budget_bytes())
    if options.strategy == StrategyName.MEMO:
        return MemoStrategy(options, meter)
    return _CLASSES[options.strategy](meter)
