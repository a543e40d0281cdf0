"""Copy engines: the copy primitives of each backend under the rounding-buffer protocol.

NOTE [One protocol, two backends] in memo/runtime/buffers.py: the waits live in
:class:`~memo.runtime.buffers.RoundingBuffers` only; an engine supplies ``offload``/``prefetch``
(an asynchronous copy after some events, returning an event), ``wait`` (the compute side waits
for an event) and ``compute_event``. :class:`CudaCopyEngine` maps them onto CUDA streams and
events, :class:`CpuCopyEngine` onto two C++ copy workers (real, concurrent memcpy calls), and
:class:`MetaCopyEngine` onto nothing (the meta device has no data). :func:`make_engine` picks one
for a device.
"""

from __future__ import annotations

from typing import Any

import torch

from memo.allocator.host import PinnedHostBuffer
from memo.errors import MemoError, internal_assert

__all__ = ["CopyEngine", "CpuCopyEngine", "CudaCopyEngine", "MetaCopyEngine", "make_engine"]


class CopyEngine:
    """Copy primitives of one backend (NOTE [One protocol, two backends])."""

    device: torch.device

    def alloc_device_buffer(self, nbytes: int) -> torch.Tensor:
        raise MemoError(f"memo.runtime: {type(self).__name__} cannot allocate device buffers")

    def alloc_host_arena(self, nbytes: int) -> torch.Tensor:
        raise MemoError(f"memo.runtime: {type(self).__name__} cannot allocate a host arena")

    def offload(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy ``src`` (device) to ``dst`` (host) after the compute work issued so far; return an event."""
        raise MemoError(f"memo.runtime: {type(self).__name__} cannot offload")

    def prefetch(self, dst: torch.Tensor, src: torch.Tensor, after: list[Any]) -> Any:
        """Copy ``src`` (host) to ``dst`` (device) once all events in ``after`` are done; return an event."""
        raise MemoError(f"memo.runtime: {type(self).__name__} cannot prefetch")

    def compute_event(self) -> Any:
        """An event marking the compute work issued so far (``None`` where compute is synchronous)."""
        return None

    def wait(self, event: Any) -> int:
        """Make compute wait for ``event``; returns nanoseconds the calling thread blocked."""
        return 0

    def synchronize(self) -> None:
        """Block until every copy issued so far is done."""

    def release(self) -> None:
        """Wait for copies and give back what the engine holds beyond tensors (pinned pages)."""
        self.synchronize()

    def set_debug_delay_us(self, us: int) -> None:
        """Inject a random delay of up to ``us`` microseconds before each copy (CPU backend only)."""


class CpuCopyEngine(CopyEngine):
    """CPU backend: two ``memo._C.rounding.CopyWorker`` threads stand in for the copy streams."""

    def __init__(self, debug_delay_us: int = 0, seed: int = 0) -> None:
        from memo import _C

        self.device = torch.device("cpu")
        self._rounding = _C.rounding
        self.offload_worker = _C.rounding.CopyWorker("offload", debug_delay_us, seed)
        self.prefetch_worker = _C.rounding.CopyWorker("prefetch", debug_delay_us, seed + 1)

    def alloc_device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_host_arena(self, nbytes: int) -> torch.Tensor:
        return self._rounding.host_arena(nbytes)

    def offload(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        return (self.offload_worker, self.offload_worker.submit(dst, src))

    def prefetch(self, dst: torch.Tensor, src: torch.Tensor, after: list[Any]) -> Any:
        deps = [e for e in after if e is not None]
        dep_worker, dep_ticket = None, 0
        for worker, ticket in deps:
            if worker is self.prefetch_worker:
                continue  # FIFO on the same worker already orders it
            internal_assert(dep_worker is None or dep_worker is worker,
                            "CPU prefetch depends on tickets of two other workers")
            dep_worker, dep_ticket = worker, max(dep_ticket, ticket)
        return (self.prefetch_worker, self.prefetch_worker.submit(dst, src, dep_worker, dep_ticket))

    def wait(self, event: Any) -> int:
        if event is None:
            return 0
        worker, ticket = event
        return int(worker.wait(ticket))

    def synchronize(self) -> None:
        self.offload_worker.synchronize()
        self.prefetch_worker.synchronize()

    def set_debug_delay_us(self, us: int) -> None:
        self.offload_worker.max_delay_us = us
        self.prefetch_worker.max_delay_us = us


class CudaCopyEngine(CopyEngine):
    """CUDA backend: an offload stream and a prefetch stream beside the compute (current) stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.offload_stream = torch.cuda.Stream(device=device)
        self.prefetch_stream = torch.cuda.Stream(device=device)

        self._pinned: list[PinnedHostBuffer] = []

    def alloc_device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def alloc_host_arena(self, nbytes: int) -> torch.Tensor:
        # Exactly nbytes, page-locked for this device (NOTE [Exact pinned host memory]).
        buffer = PinnedHostBuffer(nbytes, self.device)
        self._pinned.append(buffer)
        return buffer.tensor

    def release(self) -> None:
        self.synchronize()
        for buffer in self._pinned:
            buffer.release()
        self._pinned.clear()

    def offload(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self.offload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            dst.copy_(src, non_blocking=True)
        return self.offload_stream.record_event()

    def prefetch(self, dst: torch.Tensor, src: torch.Tensor, after: list[Any]) -> Any:
        for event in after:
            if event is not None:
                self.prefetch_stream.wait_event(event)
        with torch.cuda.stream(self.prefetch_stream):
            dst.copy_(src, non_blocking=True)
        return self.prefetch_stream.record_event()

    def compute_event(self) -> Any:
        return torch.cuda.current_stream(self.device).record_event()

    def wait(self, event: Any) -> int:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return 0

    def synchronize(self) -> None:
        self.offload_stream.synchronize()
        self.prefetch_stream.synchronize()


class MetaCopyEngine(CopyEngine):
    """Meta device: shapes without data, so there is nothing to copy.

    It lets ``memo profile --device meta`` trace the *wrapped* model (what the runtime
    allocates at a given alpha) at any length without memory; the protocol and its state
    machine run unchanged, only the copies are empty.
    """

    def __init__(self) -> None:
        self.device = torch.device("meta")

    def alloc_device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    def alloc_host_arena(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    def offload(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        return None

    def prefetch(self, dst: torch.Tensor, src: torch.Tensor, after: list[Any]) -> Any:
        return None


def make_engine(device: torch.device, debug_delay_us: int = 0, seed: int = 0) -> CopyEngine:
    """The copy engine for ``device``: CUDA streams on ``cuda``, C++ copy workers on ``cpu``,
    empty copies on ``meta`` (profiling)."""
    if device.type == "cuda":
        if debug_delay_us:
            raise MemoError(
                "memo.runtime: debug_copy_delay_us injects delays into the CPU copy worker; on CUDA use "
                "torch.cuda._sleep in a test instead (or set it to 0)"
            )
        return CudaCopyEngine(device)
    if device.type == "cpu":
        return CpuCopyEngine(debug_delay_us, seed)
    if device.type == "meta":
        return MetaCopyEngine()
    raise MemoError(
        f"memo.runtime: rounding buffers support cpu, cuda and meta devices; the layer runs on "
        f"{device.type!r}"
    )
