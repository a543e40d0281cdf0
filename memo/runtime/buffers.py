"""Rounding buffers: two device buffers, one host arena, and the protocol that moves layers between them.

NOTE [Rounding buffer reuse]
Layer i writes every tensor it offloads into device buffer ``i % 2`` during its
forward, then the whole used prefix of that buffer is copied to layer i's region
of the host arena on the *offload* stream while layer i+1 computes into the
other buffer. Layer i+2 writes buffer ``i % 2`` again, so before its first write
the compute stream waits for layer i's offload event. Backward mirrors this: when
layer i+1's backward starts (the gradient of its output is ready), layer i's
host region is copied back into buffer ``i % 2`` on the *prefetch* stream; the
prefetch waits for layer i's offload (the host bytes must be complete) and for
the compute stream to have released the buffer (layer i+2's backward read it);
layer i's backward waits for the prefetch event before reading. Three streams:
compute, offload, prefetch.

NOTE [One protocol, two backends]
The waits above live in :class:`RoundingBuffers` only. A :class:`CopyEngine`
(memo/runtime/copy_engines.py) supplies the primitives: ``offload``/``prefetch``
(an asynchronous copy after some events, returning an event), ``wait`` (the
compute side waits for an event) and ``compute_event``. :class:`CudaCopyEngine` maps them onto
``torch.cuda.Stream``/``Event``; :class:`CpuCopyEngine` onto two C++ copy workers
(``memo._C.rounding.CopyWorker``, NOTE [CPU copy worker] in
csrc/runtime/copy_worker.h) whose copies are real, concurrent memcpy calls. So a
wait missing from the protocol corrupts data on CPU as it would on a GPU, and the
CPU tests see it as a wrong gradient.

Each layer's slot goes through the checked lifecycle :class:`BufferState`:
``IDLE -> OFFLOADING -> OFFLOADED -> PREFETCHING -> READY -> IDLE`` (a prefetch
may also start straight from ``OFFLOADING``; it then waits on the offload event).

NOTE [Forwards in flight]
Several forwards may await their backward at once (the chosen and rejected passes of DPO,
two losses summed, a forward kept for later). Each forward in flight is a *flight*: its own
host arena with one region per offloaded layer, and its own slots. The two device buffers
are shared: every forward and every prefetch waits for whoever used the buffer last, whatever
the flight. Backward may visit the flights in any order, even interleaved. A prefetch the
graph starts early never takes a device buffer from another flight's layer that was prefetched
but has not run its backward. The backward that needs the buffer now does take it: the evicted
layer goes back to OFFLOADED (its host region is intact) and is prefetched again when its own
backward comes (``stats.evicted_prefetches``). A new flight is allocated when a forward starts
while every flight holds a forward; when host memory cannot hold another, that forward is
refused with the numbers, and the forwards in flight are untouched.
"""

from __future__ import annotations

import enum
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memo.allocator.host import host_memory_limit
from memo.errors import MemoError, internal_assert

# The copy engines live in copy_engines.py; these names stay importable from here.
from memo.runtime.copy_engines import CopyEngine, CpuCopyEngine, CudaCopyEngine, MetaCopyEngine, make_engine

__all__ = [
    "BufferState",
    "CopyEngine",
    "CpuCopyEngine",
    "CudaCopyEngine",
    "LayerSlot",
    "MetaCopyEngine",
    "RoundingBuffers",
    "RuntimeStats",
    "Slot",
    "SLOT_ALIGNMENT",
    "align_up",
    "available_host_memory",
    "debug_delay_from_env",
    "make_engine",
]


class BufferState(enum.Enum):
    """Where a layer's offloaded bytes are (NOTE [Rounding buffer reuse])."""

    IDLE = "idle"
    """Nothing held: before the layer's forward, after its backward."""
    OFFLOADING = "offloading"
    """Forward done; the device buffer is being copied to the host arena."""
    OFFLOADED = "offloaded"
    """The host arena holds the layer; its device buffer may be reused."""
    PREFETCHING = "prefetching"
    """Backward is near; the host region is being copied back into the device buffer."""
    READY = "ready"
    """The device buffer holds the layer again; its backward may read it."""


_TRANSITIONS: dict[BufferState, frozenset[BufferState]] = {
    BufferState.IDLE: frozenset({BufferState.OFFLOADING}),
    BufferState.OFFLOADING: frozenset({BufferState.OFFLOADED, BufferState.PREFETCHING}),
    BufferState.OFFLOADED: frozenset({BufferState.PREFETCHING}),
    # Back to OFFLOADED: another flight's backward took the device buffer (NOTE [Forwards in flight]).
    BufferState.PREFETCHING: frozenset({BufferState.READY, BufferState.OFFLOADED}),
    BufferState.READY: frozenset({BufferState.IDLE}),
}

#: Waits the test-only switch ``RoundingBuffers.debug_skip_waits`` may remove, to prove the tests catch it.
SKIPPABLE_WAITS = frozenset({"offload", "prefetch"})


#: Every tensor in a rounding buffer starts at a multiple of this many bytes.
#: NOTE [Slot alignment]: the CUDA attention kernels (flash and memory-efficient) read q, k, v, o
#: with vector loads and fault with "misaligned address" on a pointer that is only aligned to
#: its element size; PyTorch's caching allocator hands out 512-byte aligned blocks, so kernels
#: may assume it. 256 bytes covers every vector width they use at a cost of < 256 bytes a tensor.
SLOT_ALIGNMENT = 256


def align_up(offset: int, alignment: int) -> int:
    """Round ``offset`` up to a multiple of ``alignment``."""
    return -(-offset // alignment) * alignment


def available_host_memory() -> int | None:
    """Host bytes this process may pin: ``MemAvailable``, and at most its share of ``MemTotal``
    among the node's ranks (NOTE [Host memory is per node]); ``None`` where it cannot be read."""
    return host_memory_limit()


@dataclass
class RuntimeStats:
    """Counters of one :class:`~memo.runtime.MemoRuntime` (cumulative; ``reset()`` zeroes them)."""

    bytes_offloaded: int = 0
    """Bytes copied device buffer -> host arena."""
    bytes_prefetched: int = 0
    """Bytes copied host arena -> device buffer."""
    offloaded_tokens: int = 0
    """Tokens whose non-input/attention skeletal tensors were offloaded (sum of a over layer passes)."""
    recomputed_tokens: int = 0
    """Tokens recomputed in backward (sum of s - a over layer passes)."""
    copy_wait_ns: int = 0
    """Time the compute thread spent blocked on copies (CPU backend; CUDA waits are on-device)."""
    late_prefetches: int = 0
    """Backward passes whose prefetch had not been started by the next layer's backward."""
    layer_forwards: int = 0
    """Forwards of wrapped layers (every policy)."""
    layer_backwards: int = 0
    """Backwards of wrapped layers (every policy)."""
    recomputed_layers: int = 0
    """Forwards of layers under full recompute (NOTE [Layer policy])."""
    frozen_layers: int = 0
    """Forwards of layers nothing of which needs a gradient, run as they are (NOTE [Frozen layers
    cost what they cost unwrapped] in memo/runtime/wrap.py)."""
    abandoned_iterations: int = 0
    """Forwards whose graph was freed without a backward, dropped by memo (NOTE [Abandoned forward])."""
    failed_iterations: int = 0
    """Forwards or backwards that raised inside a wrapped layer, dropped by memo (NOTE [Failed
    iteration] in memo/runtime/runtime.py)."""
    evicted_prefetches: int = 0
    """Prefetched layers whose device buffer another flight's backward took (NOTE [Forwards in flight])."""
    max_forwards_in_flight: int = 0
    """The most forwards that awaited their backward at once (NOTE [Forwards in flight])."""

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class Slot:
    """One tensor inside a layer's region: ``nbytes`` at byte ``offset``, viewed as ``dtype``/``shape``."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


#: Numbers for the layer forwards a slot holds (LayerSlot.epoch), unique in the process.
_EPOCHS = itertools.count(1)


@dataclass
class LayerSlot:
    """Book-keeping of one offloaded layer in one flight (its state, events and used bytes)."""

    index: int
    flight: int = 0
    state: BufferState = BufferState.IDLE
    used: int = 0
    offload_event: Any = None
    prefetch_event: Any = None
    slots: list[Slot] = field(default_factory=list)
    #: Which layer forward the slot holds: a number no other forward gets, 0 when it holds none. A
    #: backward checks it against its record's (NOTE [Failed iteration] in memo/runtime/runtime.py).
    epoch: int = 0
    #: READY before its own backward: a segment layer's backward read it (:meth:`RoundingBuffers.ready`).
    early: bool = False

    def transition(self, new: BufferState) -> None:
        if new not in _TRANSITIONS[self.state]:
            hint = ""
            if self.state is not BufferState.IDLE and new is BufferState.OFFLOADING:
                hint = (
                    "; the layer ran twice within one forward of the model (a wrapped layer called twice, "
                    "e.g. shared weights, or layers called without the first wrapped layer starting the "
                    "forward). memo runs each wrapped layer once per forward, in order; several forwards "
                    "of the whole model may await their backward (NOTE [Forwards in flight])"
                )
            raise MemoError(
                f"memo.runtime: layer {self.index}'s rounding buffer{self.where} cannot go from "
                f"{self.state.value} to {new.value}{hint}"
            )
        self.state = new

    @property
    def where(self) -> str:
        return f" (forward in flight {self.flight})" if self.flight else ""


def _slot_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RoundingBuffers:
    """Two device buffers, a host arena per forward in flight with one region per offloaded layer,
    and the protocol (NOTE [Rounding buffer reuse], NOTE [Forwards in flight]).

    Every method takes the layer index ``i`` and the flight ``f`` (0 unless several forwards
    await their backward).

    Args:
        engine: the backend's copy primitives.
        n_layers: number of offloaded layers (the policy's "memo" and "input-only" layers, NOTE
            [Layer policy]).
        layer_bytes: offloaded bytes of the largest layer (from a dry run or a plan): each device
            buffer's size.
        stats: counters to update.
        host_memory_limit: bytes the arenas may take together (default: MemAvailable).
        arena_bytes: size of the first flight's host arena (default and minimum:
            the regions' sum; a plan may reserve more).
        region_bytes: each layer's host region (default: ``layer_bytes`` each); an input-only layer
            offloads less than a memo layer (NOTE [Input-only layers] in memo/runtime/layer.py).

    Raises:
        MemoError: if the host arena cannot be had (with the numbers), before any training step.
    """

    def __init__(self, engine: CopyEngine, n_layers: int, layer_bytes: int, stats: RuntimeStats,
                 host_memory_limit: int | None = None, arena_bytes: int | None = None,
                 region_bytes: list[int] | None = None) -> None:
        self.engine = engine
        self.n_layers = n_layers
        self.layer_bytes = layer_bytes
        self.region_bytes = [layer_bytes] * n_layers if region_bytes is None else list(region_bytes)
        internal_assert(len(self.region_bytes) == n_layers
                        and max(self.region_bytes, default=0) <= layer_bytes,
                        "one host region per offloaded layer, none larger than the device buffers")
        #: Where each layer's region starts in a flight's arena.
        self.region_offsets = [sum(self.region_bytes[:i]) for i in range(n_layers)]
        self.stats = stats
        #: Test-only: names in SKIPPABLE_WAITS whose wait is skipped, to prove the tests catch a race.
        self.debug_skip_waits: set[str] = set()
        #: ``layer index -> text`` appended to the error of a layer that offloads more than
        #: ``layer_bytes``: the owner knows what the size was measured at and what changed since.
        self.overflow_hint: Callable[[int], str] | None = None
        host_bytes = self.flight_bytes if arena_bytes is None else arena_bytes
        internal_assert(host_bytes >= self.flight_bytes, "host arena smaller than the layers it holds")
        self.host_memory_limit = host_memory_limit
        limit = host_memory_limit if host_memory_limit is not None else available_host_memory()
        # On meta nothing is allocated: profiling sizes a job for another machine's host memory.
        if limit is not None and host_bytes > limit and engine.device.type != "meta":
            raise MemoError(
                f"memo.runtime: the host arena needs {host_bytes:,} bytes ({n_layers} offloaded layers of up "
                f"to {layer_bytes:,} bytes, or what the plan reserves) but only {limit:,} bytes of host "
                "memory are available; lower alpha "
                "(or solve it with memo.planner.solve_alpha) or free host memory"
            )
        try:
            self.hosts = [self._alloc_arena(host_bytes)]
            self.device_buffers = [engine.alloc_device_buffer(layer_bytes) for _ in range(2)]
        except (RuntimeError, ValueError) as e:
            raise MemoError(
                f"memo.runtime: could not allocate the rounding buffers: host arena {host_bytes:,} bytes, "
                f"two device buffers of {layer_bytes:,} bytes each on {engine.device} ({e})"
            ) from e
        #: ``layers[f][i]``: layer i's slot in flight f.
        self.layers = [[LayerSlot(i) for i in range(n_layers)]]
        # Per device buffer: the slot whose forward wrote it last, the slot prefetched into it whose
        # backward has not run, and the compute event after the backward that read it last.
        self._writer: list[LayerSlot | None] = [None, None]
        self._holder: list[LayerSlot | None] = [None, None]
        self._released: list[Any] = [None, None]

    def _alloc_arena(self, nbytes: int) -> torch.Tensor:
        # NOTE [Device truth]: the host arena is host memory. A profiler tracing device
        # allocations (a dispatch mode, on meta or a device) must not see it, so it is made
        # with every dispatch mode set aside.
        with _disable_current_modes():
            return self.engine.alloc_host_arena(nbytes)

    @property
    def flight_bytes(self) -> int:
        """Host bytes one forward in flight offloads: the layers' regions."""
        return sum(self.region_bytes)

    @property
    def host(self) -> torch.Tensor:
        """The first flight's host arena."""
        return self.hosts[0]

    @property
    def n_flights(self) -> int:
        return len(self.hosts)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arenas the offloaded layers use (``flight_bytes`` per flight)."""
        return self.n_flights * self.flight_bytes

    @property
    def arena_bytes(self) -> int:
        """Bytes of the host arenas (the first one is what a plan reserves)."""
        return sum(h.numel() for h in self.hosts)

    def __del__(self) -> None:
        # Copies in flight read or write these buffers: let them finish before the memory goes.
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.synchronize()
            except Exception:  # noqa: BLE001  (interpreter shutdown: nothing left to protect)
                pass

    # Flights (NOTE [Forwards in flight]) -------------------------------------------------------
    def state(self, i: int, f: int = 0) -> BufferState:
        return self.layers[f][i].state

    def flight_idle(self, f: int) -> bool:
        return all(slot.state is BufferState.IDLE for slot in self.layers[f])

    def busy_flights(self) -> list[int]:
        return [f for f in range(self.n_flights) if not self.flight_idle(f)]

    def free_flight(self) -> int:
        """A flight with no forward in it: an idle one, else a new one if host memory holds it."""
        for f in range(self.n_flights):
            if self.flight_idle(f):
                return f
        need = self.flight_bytes
        if self.host_memory_limit is not None:
            have = self.host_memory_limit - self.arena_bytes
        else:
            have = available_host_memory()
        if have is not None and need > have and self.engine.device.type != "meta":
            raise MemoError(
                f"memo.runtime: a forward started while {self.n_flights} earlier forward(s) still await "
                f"their backward (NOTE [Forwards in flight]); it needs another {need:,} bytes of host "
                f"memory for its {self.n_layers} offloaded layers, but only {max(have, 0):,} are "
                "available. Run the backward of a forward before the next one, free the graph of a "
                "forward you will not back-propagate (del its loss), lower alpha, or free host memory"
            )
        try:
            self.hosts.append(self._alloc_arena(need))
        except (RuntimeError, ValueError) as e:
            raise MemoError(f"memo.runtime: could not allocate a host arena of {need:,} bytes for another "
                            f"forward in flight ({e}); run the backward of a forward before the next one"
                            ) from e
        f = self.n_flights - 1
        self.layers.append([LayerSlot(i, f) for i in range(self.n_layers)])
        return f

    def note_flights(self) -> None:
        """Record how many forwards await their backward now (stats.max_forwards_in_flight)."""
        self.stats.max_forwards_in_flight = max(self.stats.max_forwards_in_flight, len(self.busy_flights()))

    def _skip(self, name: str) -> bool:
        return name in self.debug_skip_waits

    def _wait(self, event: Any) -> None:
        self.stats.copy_wait_ns += self.engine.wait(event)

    def _buffer(self, i: int) -> torch.Tensor:
        return self.device_buffers[i % 2]

    def _region(self, slot: LayerSlot) -> torch.Tensor:
        base = self.region_offsets[slot.index]
        return self.hosts[slot.flight][base:base + slot.used]

    def _offloaded_by(self, writer: LayerSlot | None) -> Any:
        """The offload event of the slot that wrote a device buffer last, if its copy may still read it
        (that slot becomes OFFLOADED: its device copy may be overwritten once the event is done)."""
        if writer is None or writer.state is not BufferState.OFFLOADING:
            return None
        writer.transition(BufferState.OFFLOADED)
        return writer.offload_event

    def _evict(self, k: int, taker: LayerSlot, wait: bool = True) -> None:
        """``taker`` needs device buffer k: a layer prefetched into it goes back to OFFLOADED (its host
        region is intact; it is prefetched again for its backward). With ``wait``, compute waits for
        that prefetch's copy first (a forward is about to write the buffer)."""
        holder = self._holder[k]
        if holder is None:
            return
        if holder.state is not BufferState.PREFETCHING:
            raise MemoError(
                f"memo.runtime: layer {taker.index}{taker.where} needs device buffer {k} while layer "
                f"{holder.index}{holder.where} is {holder.state.value} in it; the forward or backward of "
                "a wrapped layer cannot run inside another one's backward")
        if wait:
            self._wait(holder.prefetch_event)
        holder.transition(BufferState.OFFLOADED)
        self._holder[k] = None
        self.stats.evicted_prefetches += 1

    # Forward ---------------------------------------------------------------------------------
    def begin_forward(self, i: int, f: int = 0) -> None:
        """Layer i starts writing buffer ``i % 2``: wait until the last offload from it is done."""
        layer = self.layers[f][i]
        if layer.state is not BufferState.IDLE:
            layer.transition(BufferState.OFFLOADING)  # raises with the explanation
        k = i % 2
        self._evict(k, layer)
        event = self._offloaded_by(self._writer[k])
        if event is not None and not self._skip("offload"):
            self._wait(event)
        self._wait(self._released[k])
        self._released[k] = None
        self._writer[k] = layer
        layer.used = 0
        layer.slots = []
        layer.epoch = next(_EPOCHS)

    def pack(self, i: int, t: torch.Tensor, f: int = 0) -> int:
        """Copy ``t`` into layer i's buffer (compute stream); returns the slot number."""
        layer = self.layers[f][i]
        internal_assert(layer.state is BufferState.IDLE and self._writer[i % 2] is layer,
                        f"pack into layer {i}'s buffer outside its forward")
        nbytes = _slot_bytes(t)
        offset = align_up(layer.used, SLOT_ALIGNMENT)
        if offset + nbytes > self.region_bytes[i]:
            hint = (self.overflow_hint(i) if self.overflow_hint is not None
                    else "; what it offloads changed since the buffers were sized")
            raise MemoError(
                f"memo.runtime: layer {i} offloads more than the {self.region_bytes[i]:,} bytes its rounding "
                f"buffer was sized for (at {offset + nbytes:,}){hint}"
            )
        view = self._buffer(i)[offset:offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        layer.used = offset + nbytes
        layer.slots.append(Slot(offset, nbytes, t.dtype, tuple(t.shape)))
        return len(layer.slots) - 1

    def end_forward(self, i: int, f: int = 0) -> None:
        """Layer i's forward is done: start its offload (offload stream / worker)."""
        layer = self.layers[f][i]
        layer.offload_event = self.engine.offload(self._region(layer), self._buffer(i)[:layer.used])
        layer.transition(BufferState.OFFLOADING)
        self.stats.bytes_offloaded += layer.used

    # Backward --------------------------------------------------------------------------------
    def prefetch(self, i: int, f: int = 0, *, evict: bool = False) -> bool:
        """Start copying layer i back into buffer ``i % 2``; returns False if it is not offloaded, or
        if the buffer holds another flight's prefetched layer and ``evict`` is off."""
        layer = self.layers[f][i]
        if layer.state not in (BufferState.OFFLOADING, BufferState.OFFLOADED):
            return False
        k = i % 2
        if self._holder[k] is not None and not evict:
            return False
        # An evicted prefetch was issued on the same stream / worker: the new copy runs after it.
        self._evict(k, layer, wait=False)
        after = [layer.offload_event, self._released[k]]
        writer = self._writer[k]
        if writer is not layer:
            after.append(self._offloaded_by(writer))  # another layer's offload still reads the buffer
        self._released[k] = None
        self._writer[k] = None
        self._holder[k] = layer
        layer.prefetch_event = self.engine.prefetch(self._buffer(i)[:layer.used], self._region(layer), after)
        layer.transition(BufferState.PREFETCHING)
        self.stats.bytes_prefetched += layer.used
        return True

    def begin_backward(self, i: int, f: int = 0) -> None:
        """Layer i's backward starts: make sure its prefetch was issued and wait for it."""
        layer = self.layers[f][i]
        if layer.early and layer.state is BufferState.READY:
            layer.early = False  # the segment layer after it waited for its prefetch already
            return
        if layer.state in (BufferState.OFFLOADING, BufferState.OFFLOADED):
            self.stats.late_prefetches += 1
            self.prefetch(i, f, evict=True)
        if layer.state is not BufferState.PREFETCHING:
            raise MemoError(
                f"memo.runtime: backward of layer {i}{layer.where} found its rounding buffer "
                f"{layer.state.value}; each forward of a wrapped layer must be followed by exactly one "
                "backward (retain_graph and double backward are not supported)"
            )
        if not self._skip("prefetch"):
            self._wait(layer.prefetch_event)
        layer.transition(BufferState.READY)

    def ready(self, i: int, f: int = 0) -> None:
        """Layer i's buffer holds its forward again before its own backward: the segment layer after it
        reads its input (NOTE [Segments of two layers] in memo/runtime/segments.py). Its backward then
        finds it READY."""
        layer = self.layers[f][i]
        if layer.state is not BufferState.READY:
            self.begin_backward(i, f)
            layer.early = True

    def scratch(self, i: int, shape: tuple[int, ...], dtype: torch.dtype, f: int = 0) -> torch.Tensor:
        """A tensor of ``shape`` at the start of layer i's device buffer, for layer i's own backward (state
        READY): where a segment layer recomputes its input (NOTE [Segments of two layers])."""
        layer = self.layers[f][i]
        internal_assert(layer.state is BufferState.READY,
                        f"scratch of layer {i}'s buffer in state {layer.state}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.layer_bytes:
            raise MemoError(f"memo.runtime: segment layer {i} recomputes an input of {nbytes:,} bytes, more "
                            f"than the {self.layer_bytes:,} of its rounding buffer; the layer before it "
                            "offloads its input, which is as large: the inputs of the two differ in shape")
        return self._buffer(i)[:nbytes].view(dtype).view(shape)

    def view(self, i: int, slot: int, f: int = 0) -> torch.Tensor:
        """Layer i's tensor number ``slot``, read from its device buffer (state READY)."""
        layer = self.layers[f][i]
        internal_assert(layer.state is BufferState.READY,
                        f"read of layer {i}'s buffer in state {layer.state}")
        s = layer.slots[slot]
        return self._buffer(i)[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)

    def end_backward(self, i: int, f: int = 0) -> None:
        """Layer i's backward is done with buffer ``i % 2``."""
        self.layers[f][i].transition(BufferState.IDLE)
        self._holder[i % 2] = None
        self._released[i % 2] = self.engine.compute_event()

    def reset(self, flights: list[int] | None = None) -> None:
        """Wait for every copy, then drop whatever state an abandoned forward left in ``flights``
        (default: all)."""
        self.engine.synchronize()
        for f in range(self.n_flights) if flights is None else flights:
            for layer in self.layers[f]:
                layer.state = BufferState.IDLE
                layer.early = False
                layer.offload_event = layer.prefetch_event = None
                layer.epoch = 0
        # The compute events in _released stay: a kernel may still read a buffer.
        for k in range(2):
            for owners in (self._writer, self._holder):
                if owners[k] is not None and owners[k].state is BufferState.IDLE:
                    owners[k] = None


def debug_delay_from_env() -> int:
    """``MEMO_DEBUG_COPY_DELAY_US`` as an int (0 when unset)."""
    raw = os.environ.get("MEMO_DEBUG_COPY_DELAY_US", "0").strip() or "0"
    try:
        value = int(raw)
    except ValueError:
        raise MemoError(
            f"memo.runtime: MEMO_DEBUG_COPY_DELAY_US must be an integer (microseconds), got {raw!r}"
        ) from None
    if value < 0:
        raise MemoError(f"memo.runtime: MEMO_DEBUG_COPY_DELAY_US must be >= 0, got {value}")
    return value

