"""How every training strategy is measured: the :class:`MemoryMeter` and the :class:`Metered` base.

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
:class:`MemoryMeter` opens that context (a :class:`memo.Session`) and reads it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from memo.profiler.device import local_tensor
from memo.session import Session
from memo.train.plan_checks import TrainRun

__all__ = ["Metered", "MemoryMeter", "Wrapping"]

Log = Callable[[str], None]


@dataclass
class Wrapping:
    """What a strategy's :class:`memo.Session` wraps the model with (all None: a plain model)."""

    plan: Any = None
    alpha: float | None = None
    policy: list[str] | None = None
    planned_allocator: bool = True
    debug_copy_delay_us: int | None = None


class MemoryMeter:
    """Opens the :class:`memo.Session` a strategy's steps run in and reads its device memory
    (NOTE [Measuring device memory]).

    ``device_budget_bytes``: NOTE [Device budget], enforced by the Session (None: the device's own
    memory). A meter with another budget rule (benchmarks/max_seq_len.py) returns its own Session
    from :meth:`make_session`.
    """

    def __init__(self, device_budget_bytes: int | None = None) -> None:
        self.device_budget_bytes = device_budget_bytes
        self.device = torch.device("cpu")
        #: Bytes of the parameters (and what else the device held before the meter opened).
        self.param_bytes = 0
        #: Whether memo's allocator serves the device (its counters are this run's).
        self.allocator_on = False
        self.session: Session | None = None
        self._peak = 0
        self._counts = {"planned": 0, "fallback": 0, "unplanned": 0}

    def make_session(self, model: nn.Module, wrapping: Wrapping, device: torch.device,
                     example: tuple[torch.Tensor, torch.Tensor]) -> Session:
        """The Session (not yet entered) the steps run in (NOTE [One construction path])."""
        return Session(model, wrapping.plan, alpha=wrapping.alpha, policy=wrapping.policy,
                       planned_allocator=wrapping.planned_allocator, device=device,
                       device_budget_bytes=self.device_budget_bytes, example=example,
                       debug_copy_delay_us=wrapping.debug_copy_delay_us)

    def open(self, model: nn.Module, wrapping: Wrapping, device: torch.device,
             example: tuple[torch.Tensor, torch.Tensor]) -> Session:
        """Enter the Session: memo's allocator, the wrapped layers, phases, sized buffers."""
        # a rank's shard of a parameter sharded by FSDP2 (NOTE [Model states] in memo/profiler/device.py)
        resident = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        return self.enter(self.make_session(model, wrapping, device, example), resident)

    def enter(self, session: Session, resident_bytes: int) -> Session:
        """Enter ``session`` (any step's, NOTE [One step, one path]) and measure from here on;
        ``resident_bytes``: what the device held before it (the parameters, and buffers made with them)."""
        self.device = session.device
        self.param_bytes = resident_bytes
        # Garbage of earlier work in this process (a model in a reference cycle, its gradients) may
        # still hold blocks of memo's allocator; they would count in this run's peak until the
        # collector happens to run. Collect now, so that the peak is this run's. On the CPU only
        # where memo's allocator holds blocks at all: its parameters are not its own there, and a full
        # collection of a process that imported torch and transformers takes 0.1-0.3 s.
        from memo import allocator

        if self.device.type != "cpu" or allocator.stats(self.device)["bytes_in_use"] > 0:
            gc.collect()
        self.session = session
        self.session.__enter__()
        self.allocator_on = self.session.allocator_on
        return self.session

    def read(self) -> dict[str, Any]:
        """The running device peak and what it is, and the allocator's counters."""
        from memo import allocator

        out: dict[str, Any] = {}
        if self.allocator_on:
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

    def close(self) -> None:
        """Close the Session: phases, wrap and allocator undone. Safe to call twice."""
        if self.session is not None:
            self.session.close()
        self.allocator_on = False




class Metered:
    """What every strategy shares: the meter's Session around the steps, and the per-step stats.

    A strategy says how the model is wrapped in :meth:`wrapping`; the rest is here.
    """

    name: ClassVar[str]

    def __init__(self, meter: MemoryMeter | None = None) -> None:
        self.meter = meter if meter is not None else MemoryMeter()
        self.model: nn.Module | None = None
        self.alpha: float | None = None
        self.alpha_binding: str | None = None
        self.plan: Any = None
        self.offloaded_layers: int | None = None
        self.offload: dict[str, Any] | None = None
        #: Bytes per offloaded layer the profile counted (NOTE [Planned and actual offload]).
        self.planned_offload_bytes: int | None = None
        self._last_copy: dict[str, int] = {}

    @property
    def device_budget_bytes(self) -> int | None:
        return self.meter.device_budget_bytes

    def wrapping(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: TrainRun,
                 log: Log) -> Wrapping:
        """How this strategy runs ``model`` (called once, before the meter opens)."""
        return Wrapping()

    def prepare(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, run: TrainRun,
                log: Log = print) -> None:
        self.model = model
        wrapping = self.wrapping(model, ids, labels, run, log)
        session = self.meter.open(model, wrapping, ids.device, (ids, labels))
        if session.runtime is not None:
            self.offloaded_layers = session.runtime.n_offloaded

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run one training step's forward and backward inside this strategy's Session."""
        if self.meter.session is None:
            yield
            return
        with self.meter.session.iteration():
            yield

    def step_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"host_pinned_bytes": self.host_pinned_bytes()}
        out.update(self._copy_stats())
        self._note_offload()
        out.update(self.meter.read())
        return out

    def _runtime(self) -> Any:
        from memo import runtime

        if self.model is None or not runtime.is_wrapped(self.model):
            return None
        return runtime.runtime_of(self.model)

    def host_pinned_bytes(self) -> int:
        """Host bytes this strategy holds for the device: memo's host arena (0 without the wrapper)."""
        rt = self._runtime()
        return 0 if rt is None else int(rt.host_bytes)

    def _copy_stats(self) -> dict[str, Any]:
        """This step's rounding-buffer traffic, and how long compute waited for it.

        ``copy_wait_s`` is host time the compute thread spent blocked on copies (CPU backend);
        on CUDA the waits are stream waits on the device and it stays 0.
        """
        rt = self._runtime()
        if rt is None:
            return {}
        st = rt.stats.as_dict()
        last, self._last_copy = self._last_copy, st
        delta = {k: st[k] - last.get(k, 0) for k in ("bytes_offloaded", "bytes_prefetched", "copy_wait_ns",
                                                       "recomputed_tokens")}
        return {"bytes_offloaded": delta["bytes_offloaded"], "bytes_prefetched": delta["bytes_prefetched"],
                "recomputed_tokens": delta["recomputed_tokens"], "copy_wait_s": delta["copy_wait_ns"] / 1e9}

    def _note_offload(self) -> None:
        """Planned vs actual bytes per offloaded layer (NOTE [Planned and actual offload])."""
        rt = self._runtime()
        if self.offload is not None or rt is None or rt.layer_bytes is None:
            return
        self.offload = {"offloaded_layers": rt.n_offloaded,
                        "planned_bytes_per_layer": self.planned_offload_bytes,
                        "actual_bytes_per_layer": int(rt.layer_bytes),
                        "tensors": [list(t) for t in rt.layer_tensors]}

    def close(self) -> None:
        self.meter.close()
