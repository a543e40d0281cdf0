"""One context that runs a model under memo: allocator, wrap, phases, buffers, and undoes them all.

NOTE [One construction path]
Training with memo needs the same sequence everywhere (``memo train``, the examples, the
benchmarks): memo's allocator serving the device (the plan's tables, or only its fallback pool
when there is no plan, so that every strategy's memory is measured alike: NOTE [Measuring device
memory] in memo/train/meter.py), the layers wrapped with the plan's alpha and policy, a phase
tracker on the model adapter's parts telling the allocator which plan table is open, and the
runtime's buffers sized before the first step (DESIGN.md: "fail before training starts with the
numbers"). :class:`Session` is that sequence, once, for any shape of step (NOTE [One step, one
path] in memo/pipeline/step.py: one model, or a pipeline stage's chunks under its schedule); its exit
undoes every part that was done, in reverse order, also when a step (or the set-up itself) raised.

Order matters. The allocator is entered before the buffers are sized so that the buffers come
from it (the plan's device total counts them: NOTE [Buffers made in the warm-up] in
memo/pipeline/step.py); the phase tracker is attached last, so that the forward that finds the first
layer's inputs (NOTE [First layer's inputs] in memo/profiler/record.py) opens no phase.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.adapters.model import ModelAdapter
from memo.errors import MemoError
from memo.pipeline.step import ModelStep, Phases, Step, split_policy
from memo.units import format_mib

if TYPE_CHECKING:
    from memo.planner import Plan
    from memo.runtime import MemoRuntime

__all__ = ["Session"]


def _has_tables(plan: Plan | None) -> bool:
    return plan is not None and hasattr(plan, "phase_tables")


class Session:
    """Run ``model`` under memo inside ``with memo.Session(model, plan) as s:``.

    Args:
        model: a model with a model adapter (NOTE [Model adapters]) on its device, or a
            :class:`memo.pipeline.step.Step` (a pipeline stage's chunks: each chunk is wrapped with its
            share of the policy, and the step's phases tell memo's allocator which table is open).
        plan: a plan from :func:`memo.pipeline.profile` / ``memo profile`` (alpha, policy, host
            bytes and the allocator's tables), or None.
        alpha, policy: wrap the layers with these instead of a plan's (alpha alone: the default
            policy). With neither and no plan the layers are not wrapped (a baseline).
        planned_allocator: memo's allocator serves activations from the plan's tables (when the
            plan has them); False leaves them to its fallback pool.
        allocator: memo's allocator serves the device while the session is open (with
            ``planned_allocator`` off or no plan, its fallback pool only, which measures any
            strategy alike). On CUDA it must have been installed before the first CUDA tensor
            (``memo.allocator.install_cuda()``); when it was not, a plan with tables is refused
            and a baseline runs on PyTorch's own.
        device: the model's device (default: its first parameter's).
        device_budget_bytes: the device budget (NOTE [Device budget]): caps memo's fallback pool
            (the budget less the plan's arena and, on CPU, the parameters), or on CUDA without
            memo's allocator PyTorch's per-process memory fraction.
        example: an example batch ``(ids, labels)``: the runtime's buffers are sized from it on
            entry, before step 1 (without one, at the first forward).
        warm_up: run the step once on entry, before the phases attach and with its gradients
            dropped, and restart the allocator's counters after it: a schedule's one-time buffers
            (megatron's, memo's rounding buffers) are made there, outside every phase, as they were
            when its plan was recorded (NOTE [Buffers made in the warm-up] in memo/pipeline/step.py).
        debug_copy_delay_us: see :class:`memo.runtime.MemoRuntime` (tests).

    ``s.step(ids, labels)`` runs forward + backward and returns the loss, with ``labels`` in the
    model's own convention (NOTE [Labels in the model's convention]); ``with s.iteration():`` wraps
    a forward + backward written out by hand (the optimizer step belongs outside it).
    """

    def __init__(self, model: nn.Module | Step, plan: Plan | None = None, *, alpha: float | None = None,
                 policy: list[str] | None = None, planned_allocator: bool = True, allocator: bool = True,
                 device: torch.device | str | None = None, device_budget_bytes: int | None = None,
                 example: tuple[torch.Tensor, torch.Tensor] | None = None, warm_up: bool = False,
                 debug_copy_delay_us: int | None = None) -> None:
        #: What each iteration runs (NOTE [One step, one path]).
        self.work: Step = ModelStep(model, where="memo.Session") if isinstance(model, nn.Module) else model
        self.model = self.work.chunks[0]
        self.plan = plan
        self.alpha = alpha
        self.policy = policy
        self.planned_allocator = planned_allocator
        self.use_allocator = allocator
        if device is None:
            param = next(self.model.parameters(), None)
            device = param.device if param is not None else "cpu"
        self.device = torch.device(device)
        self.device_budget_bytes = device_budget_bytes
        self.example = example
        self.warm_up = warm_up
        self.debug_copy_delay_us = debug_copy_delay_us
        self.adapter: ModelAdapter | None = self.work.adapter if isinstance(self.work, ModelStep) else None
        self.tracker: Phases | None = None
        #: Whether memo's allocator serves this session's device (its stats are this run's).
        self.allocator_on = False
        #: Whether this session wrapped the model (and so unwraps it).
        self.wrapped = False
        self._stack = contextlib.ExitStack()
        self._entered = False
        self._open = False
        #: Steps whose batch had another shape than the plan's, run outside it (NOTE [A batch of
        #: another length]).
        self.off_plan_steps = 0

    # Entry and exit -----------------------------------------------------------------------------
    def __enter__(self) -> Session:
        if self._entered:
            raise MemoError("memo.Session: this session is already open; a session is entered once")
        self._entered = True
        try:
            self._enter_allocator()
            self._wrap()
            self._size_buffers()
            self._track_phases()
        except BaseException:
            self.close()
            raise
        self._open = True
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Undo what entering did, last part first: phases, wrap, allocator. Safe to call twice."""
        self._open = False
        try:
            if self.tracker is not None:
                self.tracker.remove()
                self.tracker = None
            if self.wrapped:
                from memo import runtime

                self.wrapped = False
                for chunk in self.work.chunks:
                    if runtime.is_wrapped(chunk):
                        runtime.unwrap(chunk, force=True)
        finally:
            self.allocator_on = False
            self._stack.close()

    # Parts --------------------------------------------------------------------------------------
    def _enter_allocator(self) -> None:
        if not self.use_allocator:
            return
        from memo import allocator

        dev = self.device
        use_plan = self.planned_allocator and _has_tables(self.plan)
        if dev.type == "cuda" and not allocator.cuda_installed():
            # PyTorch's own CUDA allocator measures baselines; memo's cannot be installed this late.
            if use_plan:
                raise MemoError(
                    "memo.train: memo's CUDA allocator must be installed before the first CUDA tensor; "
                    "call memo.allocator.install_cuda() first (memo train does this for --strategy memo)"
                )
            if self.device_budget_bytes is not None:
                self._cap_torch_cuda(self.device_budget_bytes)
            return
        table = self.plan if use_plan else {"tables": {}, "peak": 0}
        limit = self.fallback_limit(table)
        if limit is not None:
            # Segments cached by an earlier run would serve requests past the budget: give them back.
            allocator.empty_cache(dev)
        self._stack.enter_context(allocator.planned(table, device=dev, fallback_limit=limit))
        self.allocator_on = True

    def _cap_torch_cuda(self, budget: int) -> None:
        """NOTE [Device budget] with PyTorch's own allocator: its per-process fraction cap."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = budget / total
        if fraction > 1:
            raise MemoError(f"memo.train: --device-mem-gb {budget / 1e9:g} is more than the device's "
                            f"{total / 1e9:.1f} GB")
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        self._stack.callback(torch.cuda.set_per_process_memory_fraction, 1.0, index)

    def fallback_limit(self, table: Plan | dict[str, Any]) -> int | None:
        """NOTE [Device budget]: memo's allocator holds the plan's arena and a fallback pool; the
        budget caps both. On CUDA it also holds the parameters (PyTorch's CUDA allocator for the
        whole process); on CPU they were made before memo's allocator was swapped in, so the
        budget's share for them is set aside here. What is left is the fallback pool's limit."""
        budget = self.device_budget_bytes
        if budget is None:
            return None
        param_bytes = sum(p.numel() * p.element_size() for c in self.work.chunks for p in c.parameters())
        arena = int(table.peak if hasattr(table, "peak") else table.get("peak", 0))
        params = 0 if self.device.type == "cuda" else param_bytes
        limit = budget - arena - params
        if limit <= 0:
            raise MemoError(
                f"memo.train: --device-mem-gb {budget / 1e9:g} ({format_mib(budget)}) cannot hold the "
                f"parameters ({format_mib(param_bytes)}) and the plan's arena ({format_mib(arena)}); this "
                f"run needs more than {format_mib(arena + param_bytes)} before any gradient, optimizer "
                "state or temporary. Give a larger budget, a shorter --seq-len, or a smaller model"
            )
        return limit

    def _wrap(self) -> None:
        if self.plan is None and self.alpha is None and not self.policy:
            return
        from memo import runtime

        chunks = self.work.chunks
        if getattr(self.plan, "pipeline", None) or len(chunks) > 1:
            # NOTE [A stage's address plan]: a stage's plan records the alpha and the policy its chunks
            # run; each chunk is wrapped with its share (the stage's checks were made on its plan).
            alpha = self.plan.alpha if self.plan is not None else self.alpha
            policy = self.plan.policy if self.plan is not None else self.policy
            shares = split_policy(policy, self.work.chunk_layers()) if policy else [None] * len(chunks)
            self.wrapped = True
            for chunk, share in zip(chunks, shares, strict=True):
                runtime.wrap(chunk, alpha=alpha, policy=share, debug_copy_delay_us=self.debug_copy_delay_us)
            return
        policy = None if (self.plan is not None and getattr(self.plan, "policy", None)) else self.policy
        runtime.wrap(self.model, alpha=None if self.plan is not None else self.alpha, plan=self.plan,
                     debug_copy_delay_us=self.debug_copy_delay_us, policy=policy)
        self.wrapped = True

    def _size_buffers(self) -> None:
        """DESIGN.md: host buffers are sized before step 1; short host memory fails here, with the numbers."""
        if self.warm_up:
            self.work.run()
            for chunk in self.work.chunks:
                for p in chunk.parameters():
                    p.grad = None
            if self.allocator_on:
                from memo import allocator

                allocator.reset_stats(self.device)
        if not self.wrapped or self.example is None:
            return
        from memo import runtime
        from memo.profiler.record import layer_inputs

        rt = runtime.runtime_of(self.model)
        if rt.n_offloaded == 0:
            return
        args, kwargs = layer_inputs(self.model, *self.example)
        rt.allocate(*args, **kwargs)

    def _track_phases(self) -> None:
        if not self.allocator_on:
            return  # phases tell memo's allocator which table is open; nothing else listens
        from memo import allocator

        self.tracker = self.work.phases(allocator.set_phase)

    # Steps --------------------------------------------------------------------------------------
    # NOTE [A batch of another length]
    # A plan is made for one batch shape: its tables hold each phase's requests, in order, at that
    # length. A batch of another length (the shorter ones of a variable-length loader, the short
    # last batch) makes other requests: served from the plan request by request, it would deviate
    # at the first one and then go on half planned, a deviation counted for each request after it.
    # So a step whose ids are not the plan's [micro_batch, seq_len] runs outside the plan as a
    # whole: no phase is open and memo's allocator serves every request from its fallback pool
    # (``memo.allocator.unplanned``), which the device budget caps (NOTE [Device budget]). Its cost
    # is stated once and bounded: the batch's own allocations on top of the plan's arena, which
    # stays reserved for the planned length; the steps are counted in ``off_plan_steps``, their
    # requests in the allocator's ``unplanned_requests``, and none is a deviation. Plan for the
    # longest length to keep its steps planned; the runtime sizes its host buffers for each
    # length anyway (NOTE [Sizing the host arena]).
    @contextlib.contextmanager
    def iteration(self, ids: torch.Tensor | None = None) -> Iterator[None]:
        """Wrap one forward + backward (not the optimizer step: it is no layer's work). ``ids``:
        the batch's token ids, so that a batch of another shape than the plan's runs outside it
        (NOTE [A batch of another length])."""
        if self.tracker is None:
            yield
            return
        planned = self._planned_shape()
        if ids is None or planned is None or tuple(ids.shape) == planned:
            with self.tracker.iteration():
                yield
            return
        from memo.allocator import unplanned

        self.off_plan_steps += 1
        if self.off_plan_steps == 1:
            warnings.warn(
                f"memo.Session: this batch is {list(ids.shape)} tokens, the plan was made for "
                f"{list(planned)}; such steps run outside the plan, every allocation from memo's "
                "fallback pool (capped by the device budget): their cost is their own allocations on "
                "top of the plan's arena. Counted in Session.off_plan_steps; this is said once. Plan "
                "for the longest length to keep its steps planned (NOTE [A batch of another length])",
                stacklevel=3)
        with self.tracker.paused(), unplanned():
            yield

    def _planned_shape(self) -> tuple[int, int] | None:
        """``(micro_batch, seq_len)`` of the plan memo's allocator serves, or None without one."""
        meta = getattr(self.plan, "meta", None) or {}
        if not (self.allocator_on and self.planned_allocator and "seq_len" in meta):
            return None
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return None  # a rank's ids may be its shard of the planned sequence (context parallel)
        return int(meta.get("micro_batch", 1)), int(meta["seq_len"])

    # NOTE [Labels in the model's convention]
    # memo's models take, at each position, the token that position predicts (labels already
    # shifted: the data does it). Hugging Face's take the input ids as labels and shift them inside
    # the model (logits[:, :-1] against labels[:, 1:]). Session.step takes the labels of the model it
    # runs, as that model's own call does, so that an HF user's step(ids, ids) trains on the next
    # token and reports HF's own loss; the one place that shifts is the model adapter's ``targets``.
    # Inside memo (profiles, `memo train`, whose data makes the targets) the adapters' ``loss`` takes
    # the targets.
    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch (``ids, labels: [b, s]``, labels as the model's own
        call takes them: NOTE [Labels in the model's convention]); returns the detached loss."""
        if not self._open:
            raise MemoError("memo.Session: step() needs an open session: use `with memo.Session(...) as s:`")
        if self.adapter is None:
            raise MemoError("memo.Session: step() runs one model's batch; a session of a pipeline stage's "
                            "step runs its schedule inside `with s.iteration():`")
        with self.iteration(ids):
            loss = self.adapter.loss(self.model, ids, self.adapter.targets(self.model, labels))
            loss.backward()
        # A copy made outside the iteration: the loss itself sits in a slot of the plan's arena,
        # which a caller keeping the returned value would hold busy into the next step.
        return loss.detach().clone()

    @property
    def runtime(self) -> MemoRuntime | None:
        """The model's :class:`memo.runtime.MemoRuntime` while wrapped (a stage's: its first chunk's)."""
        from memo import runtime

        return runtime.runtime_of(self.model) if runtime.is_wrapped(self.model) else None

    @property
    def runtimes(self) -> list[MemoRuntime]:
        """The runtime of each wrapped chunk, in the step's order."""
        from memo import runtime

        return [runtime.runtime_of(c) for c in self.work.chunks if runtime.is_wrapped(c)]
