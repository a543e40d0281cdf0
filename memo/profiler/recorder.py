"""The dispatch recorder: every storage PyTorch creates and frees during one iteration.

The recorder is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`. It
sees every aten op that runs while it is active, including the ops autograd
runs during ``.backward()`` (the engine carries the mode over to the threads it
runs backward on), and works on any device, ``meta`` included, because it only
looks at storages, never at data.

NOTE [Storage identity and frees]
An op's freshly allocated outputs are the outputs whose schema return carries
no alias annotation (views, in-place and ``out=`` ops annotate theirs). Each
fresh output's ``untyped_storage()`` is one malloc of ``storage.nbytes()``
bytes. A storage is counted once however many views of it exist, because we
key it by the Python storage object: PyTorch keeps the same Python object for a
storage for as long as the storage is alive (checked on torch 2.13, CPU and
meta), so a weak reference to it fires exactly when the memory is released.
That callback is the free. Storages still alive when the iteration ends (saved
for a later step, parameter gradients) get no free event: they live to the end
of the trace. Storages created before the mode (inputs, parameters) are never
recorded; in-place writes into them allocate nothing.

Per-op Python overhead matters (32 layers at a million tokens on meta run
thousands of ops): the set of fresh return positions is computed once per op
overload and cached. On meta, the repeats of a steady tile are not run at all:
the recorder copies the steady tile's events (NOTE [Replicated tiles in a meta
recording] in memo/repeated_tiles.py), which is why a free looks its record id
up in the live entry rather than keeping the one it was made with.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memo import repeated_tiles
from memo.errors import internal_assert
from memo.profiler.replicate import Mark, steady_template

__all__ = ["Allocation", "DispatchRecorder", "RECORDER_NAME"]

#: The ``meta.recorder`` value of traces this recorder writes.
# The planner's Recorder.DISPATCH, spelled out: the profiler records only and imports no planner
# (tests/pipeline/test_pipeline.py), and memo.planner.vocab would load the whole planner package.
RECORDER_NAME = "dispatch"


@dataclass
class Allocation:
    """One storage seen by the recorder.

    ``span`` counts phase changes: two allocations with the same span were made
    inside one uninterrupted opening of the same phase. ``free_span`` is the span
    open when the storage died (``None`` while it is alive). ``tags`` holds
    markers such as ``"attn"`` (made inside a layer's core attention) or
    ``"param_grad"`` (the storage ended up as a parameter's ``.grad``).
    """

    id: int
    size: int
    phase: str | None
    span: int
    op: str
    free_span: int | None = None
    free_phase: str | None = None
    tags: set[str] = field(default_factory=set)

    @property
    def freed(self) -> bool:
        return self.free_span is not None

    @property
    def transient(self) -> bool:
        """Born and freed inside the same opening of its phase."""
        return self.free_span is not None and self.free_span == self.span


_FreshPositions = tuple[bool, ...]


def _fresh_returns(func: torch._ops.OpOverload) -> _FreshPositions:
    """For each schema return: True when it is a fresh allocation (no alias annotation)."""
    return tuple(ret.alias_info is None for ret in func._schema.returns)


def _aliases_argument(storage: torch.UntypedStorage, args: tuple[Any, ...]) -> bool:
    """Whether ``storage`` is the storage of a tensor among ``args`` (top level or in a list)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if arg.untyped_storage() is storage:
                return True
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor) and item.untyped_storage() is storage:
                    return True
    return False


class DispatchRecorder(TorchDispatchMode):
    """Records mallocs and frees of storages while active.

    Args:
        phase: zero-argument callable returning the current phase name (or None).
        device: record only storages on this device (type); None records every device.
    Call :meth:`on_phase` on every phase change (it is a PhaseTracker listener)
    so the recorder can tell transient from skeletal allocations.

    ``events`` is the trace event list: ``{"op": "malloc", "id", "size", "phase"}``
    and ``{"op": "free", "id"}``, in the order they happened.
    """

    def __init__(self, phase: Callable[[], str | None], device: torch.device | str | None = None) -> None:
        super().__init__()
        self._phase = phase
        #: Only storages on this device type are recorded (NOTE [Device truth] in
        #: memo/runtime/buffers.py): a meta trace holds no CPU tensors (RNG states, host copies).
        self._device_type = None if device is None else torch.device(device).type
        self.events: list[dict[str, Any]] = []
        self.allocations: dict[int, Allocation] = {}
        # storage python id -> (record id, weakref). The weakref object must stay
        # referenced for its callback to fire, hence it lives in this dict.
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        #: Bytes of the storages in ``_live``: with their count, what a tile loop checks to skip
        #: repeated tiles (NOTE [Repeated tiles in a meta estimate] in memo/repeated_tiles.py).
        self.live_bytes = 0
        self._skip_span: contextlib.AbstractContextManager | None = None
        self._fresh_cache: dict[torch._ops.OpOverload, _FreshPositions] = {}
        self._next_id = 0
        self._span = 0
        self._in_attn = 0
        self._closed = False
        self.ops = 0
        #: Tiles recorded as copies of a steady one, and the ops they stand for (not in ``ops``).
        self.replicated_tiles = 0
        self.replicated_ops = 0
        self.seconds = 0.0

    # -- phase bookkeeping -------------------------------------------------
    def on_phase(self, _phase: str | None) -> None:
        self._span += 1

    def enter_attn(self) -> None:
        self._in_attn += 1

    def exit_attn(self) -> None:
        self._in_attn -= 1

    @property
    def in_attn(self) -> bool:
        """Whether a layer's core attention is running."""
        return self._in_attn > 0

    def storage_record(self, tensor: torch.Tensor) -> Allocation | None:
        """The allocation that owns ``tensor``'s storage, if the recorder saw it being made."""
        entry = self._live.get(id(tensor.untyped_storage()))
        return None if entry is None else self.allocations[entry[0]]

    def close(self) -> None:
        """Stop recording frees (storages that die later live to the end of the trace)."""
        self._closed = True

    # -- the mode ------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        fresh = self._fresh_cache.get(func)
        if fresh is None:
            fresh = self._fresh_cache[func] = _fresh_returns(func)
        if not any(fresh):
            return out
        if len(fresh) == 1:
            if isinstance(out, torch.Tensor):
                self._record(out, func, args)
            elif isinstance(out, (list, tuple)):  # Tensor[] return
                for item in out:
                    if isinstance(item, torch.Tensor):
                        self._record(item, func, args)
            return out
        for is_fresh, item in zip(fresh, out, strict=False):
            if not is_fresh:
                continue
            if isinstance(item, torch.Tensor):
                self._record(item, func, args)
            elif isinstance(item, (list, tuple)):
                for leaf in tree_flatten(item)[0]:
                    if isinstance(leaf, torch.Tensor):
                        self._record(leaf, func, args)
        return out

    def _record(self, tensor: torch.Tensor, func: torch._ops.OpOverload, args: tuple[Any, ...]) -> None:
        if self._device_type is not None and tensor.device.type != self._device_type:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        if _aliases_argument(storage, args):
            # A few ops return an input's storage without saying so in their schema
            # (aten._unsafe_view); when that input was made outside the recorder it is not ours.
            return
        size = storage.nbytes()
        if size == 0:
            # Empty storages own no memory; a zero-size request would only confuse the planner.
            return
        rid = self._next_id
        self._next_id += 1
        phase = self._phase()
        alloc = Allocation(rid, size, phase, self._span, func.__name__)
        if self._in_attn:
            alloc.tags.add("attn")
        self.allocations[rid] = alloc
        self._live[key] = (rid, weakref.ref(storage, self._make_free(key)))
        self.live_bytes += size
        event: dict[str, Any] = {"op": "malloc", "id": rid, "size": size}
        if phase is not None:
            # Unphased mallocs (e.g. the loss gradient seed autograd makes before the head's
            # backward opens) carry no phase key: the planner plans them individually.
            event["phase"] = phase
        self.events.append(event)

    def _make_free(self, key: int) -> Callable[[weakref.ref], None]:
        def on_free(_ref: weakref.ref) -> None:
            # Dropping the entry first matters: CPython may reuse the id for the next storage. The
            # record id is the entry's, not one fixed here: replicated tiles move it (NOTE [Replicated
            # tiles in a meta recording] in memo/repeated_tiles.py).
            entry = self._live.pop(key, None)
            if entry is None:
                internal_assert(False, f"storage key {key} freed twice")
                return
            rid = entry[0]
            self.live_bytes -= self.allocations[rid].size
            if self._closed:
                return
            alloc = self.allocations[rid]
            alloc.free_span = self._span
            alloc.free_phase = self._phase()
            self.events.append({"op": "free", "id": rid})

        return on_free

    # -- replicated tiles (NOTE [Replicated tiles in a meta recording] in memo/repeated_tiles.py) --
    def mark(self) -> Mark:
        """Where the recording stands now, between two tiles."""
        return Mark(len(self.events), self._next_id, self._span, self.ops)

    def replicate(self, first: Mark, second: Mark, copies: int) -> bool:
        """Record ``copies`` more tiles like the one since ``second`` without running them, when it is
        steady (:func:`~memo.profiler.replicate.steady_template` against the tile from ``first`` to
        ``second``); the storages it left alive then stand for the last copy's. False: not steady,
        nothing recorded."""
        now = self.mark()
        lo = first.next_id
        tags = {rid: (self.allocations[rid].op, self.allocations[rid].tags) for rid in range(lo, now.next_id)}
        template = steady_template(self.events, tags, first, second, now)
        if template is None or copies <= 0 or self._closed:
            return False
        m = template.mallocs
        tile = [self.allocations[rid] for rid in range(second.next_id, now.next_id)]
        phase = self._phase()
        for k in range(copies):
            base = now.next_id + k * m
            events = template.events(base)
            for a in tile:
                self.allocations[a.id - second.next_id + base] = Allocation(
                    a.id - second.next_id + base, a.size, a.phase, a.span, a.op, tags=set(a.tags))
            for ev in events:
                if ev["op"] == "free":
                    freed = self.allocations[ev["id"]]
                    freed.free_span, freed.free_phase = self._span, phase
            self.events += events
        shift = copies * m
        for key, (rid, ref) in list(self._live.items()):
            if second.next_id <= rid < now.next_id:
                self._live[key] = (rid + shift, ref)
        self._next_id += shift
        self.replicated_tiles += copies
        self.replicated_ops += copies * template.ops
        return True

    def live_state(self) -> tuple[int, int]:
        """(storages, bytes) recorded and alive now."""
        return len(self._live), self.live_bytes

    def __enter__(self) -> DispatchRecorder:
        self._t0 = time.perf_counter()
        if self._device_type == "meta":  # only meta recordings may skip repeated tiles
            self._skip_span = repeated_tiles.recording(self.live_state, self)
            self._skip_span.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._t0
        super().__exit__(*exc)
        if self._skip_span is not None:
            self._skip_span.__exit__(None, None, None)
            self._skip_span = None
