"""Public functions of :mod:`memo.allocator`: planned replay, trace logging, stats.

NOTE [Allocator state is process-wide]
PyTorch has one allocator per device type per process (c10's CPU allocator,
the CUDA allocator chosen by ``change_current_allocator``), so the native
allocators behind them are process-lifetime objects and this module keeps a
small registry of them (one per device type) instead of a manager object.
Contexts do not nest on one device (a second ``planned``/``logging`` on the
same device raises), and every context restores what it changed in
``finally``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from memo.allocator._backends import Backend, backend_for, loaded_backends
from memo.allocator._tables import PhaseTables, PlanLike, normalize_plan
from memo.errors import MemoError, internal_assert
from memo.trace_format import TraceBuilder

__all__ = [
    "PlanDeviationWarning",
    "empty_cache",
    "logging",
    "planned",
    "reset_stats",
    "set_phase",
    "stats",
    "unplanned",
]

# The deviation reason of a planned request whose slot is lent to a borrowed block
# (kReasonSlotLent, NOTE [One device pool] in csrc/core/planned_allocator.h).
SLOT_LENT = "arena range lent to an unplanned request"


class PlanDeviationWarning(UserWarning):
    """The running job left the plan; the rest was served by the fallback allocator."""


_lock = threading.Lock()
_active: dict[str, str] = {}  # device ("cpu", "cuda:1") -> "planned" | "logging"


def _claim(backend: Backend, what: str) -> None:
    with _lock:
        key = str(backend.device)
        if key in _active:
            raise MemoError(
                f"memo.allocator: a {_active[key]!r} context is already active on {key}; "
                f"{what} contexts do not nest"
            )
        _active[key] = what


def _release(backend: Backend) -> None:
    with _lock:
        _active.pop(str(backend.device), None)


def _warn_deviation(backend: Backend) -> None:
    dev = backend.take_deviation_report()
    if dev is None:
        return
    expected = "no request" if dev["expected"] == 0 else f"{dev['expected']} bytes"
    if dev["reason"] == SLOT_LENT:  # NOTE [One device pool]: the plan is right, the pool was full
        advice = ("The fallback pool had reached its limit and borrowed that slot's idle arena bytes; a "
                  "larger fallback limit (memo train: --device-mem-gb) leaves the arena to the plan.")
    else:
        advice = "Re-run `memo profile` for this configuration."
    warnings.warn(
        f"memo.allocator: the run left the plan on {backend.device}: phase {dev['phase']!r} request "
        f"{dev['index']} asked for {dev['actual']} bytes, the plan has {expected} ({dev['reason']}). "
        "This and later deviating requests are served by the fallback allocator (results stay correct; "
        f"see memo.allocator.stats()['deviations']). {advice}",
        PlanDeviationWarning,
        stacklevel=3,
    )


_phase: str | None = None


def set_phase(name: str | None) -> None:
    """Tell the allocators which phase is open (``None``: none). Add it to a tracker with
    ``tracker.add_listener(memo.allocator.set_phase)``; each call restarts the request index."""
    global _phase
    _phase = name
    for backend in loaded_backends():
        backend.set_phase(name)
        if _active.get(str(backend.device)) == "planned":
            _warn_deviation(backend)


@contextlib.contextmanager
def unplanned() -> Iterator[None]:
    """Allocations in the body belong to no phase: the fallback serves them and traces log them
    without a phase, so plans never cover them; the open phase is restored afterwards.

    NOTE [One-time allocations inside a phase]
    Work done once, on the first iteration only (memo's runtime sizing and allocating its
    rounding buffers in the first layer's forward), must not take request indices of the
    phase it happens in: the profiled iteration would then differ from every later one, and
    its long-lived buffers would be given arena slots that later iterations need.

    Tell the native allocators directly, not through :func:`set_phase`: the phase resumes
    afterwards where it was, with its request index intact.
    """
    previous = _phase
    backends = loaded_backends()
    for backend in backends:
        backend.suspend_phase()
    try:
        yield
    finally:
        for backend in backends:
            backend.resume_phase()
        internal_assert(_phase == previous, "the phase changed inside memo.allocator.unplanned()")


@contextlib.contextmanager
def planned(
    plan_or_tables: PlanLike | Mapping[str, object],
    *,
    peak: int | None = None,
    poison: bool = False,
    device: str | torch.device = "cpu",
    fallback_limit: int | None = None,
) -> Iterator[None]:
    """Serve allocations of ``device`` from the plan while the ``with`` body runs.

    Args:
        plan_or_tables: a ``memo.planner.Plan`` (``phase_tables()`` and ``peak``), a dict
            ``{"tables": ..., "peak": ...}``, or a dict ``phase -> [(size, offset or None), ...]``
            together with ``peak=``.
        peak: arena bytes, when ``plan_or_tables`` is a plain dict of tables.
        poison: fill freed planned memory (and the idle arena) with 0xFF bytes (NaN in floating
            point), so a reuse bug shows up as wrong results.
        device: ``"cpu"`` (c10's CPU allocator is swapped for the body) or ``"cuda"`` (the CUDA
            allocator must have been installed with :func:`memo.allocator.install_cuda`, or is
            installed here when CUDA is not initialised yet).
        fallback_limit: most bytes the fallback allocator may reserve (``None`` or 0: no limit). A
            request beyond it is served from a range of the plan's arena that is idle at that moment
            (NOTE [One device pool] in csrc/core/planned_allocator.h: the arena and the fallback share
            one device budget, and lending idle arena bytes adds nothing to what the device holds);
            only when no idle range holds it does the allocation fail, with an out-of-memory error
            that gives the numbers. A planned request whose slot is lent goes to the fallback as a
            deviation (reason ``"arena range lent to an unplanned request"``).

    Phases come from :func:`set_phase`. Statistics are reset on entry; read them with
    :func:`stats` inside or after the body. The first deviation from the plan is reported once
    as a :class:`PlanDeviationWarning`.
    """
    tables: PhaseTables
    tables, arena = normalize_plan(plan_or_tables, peak)
    if fallback_limit is not None and (not isinstance(fallback_limit, int) or fallback_limit < 0):
        raise MemoError(f"memo.allocator: fallback_limit must be an int >= 0 or None, got {fallback_limit!r}")
    backend = backend_for(device)
    backend.check_plan(tables, arena)  # before anything changes: the core's check, as load_plan makes it
    _claim(backend, "planned")
    try:
        backend.prepare()
        backend.reset_stats()
        backend.load_plan(tables, arena)
        try:
            backend.set_fallback_limit(fallback_limit or 0)
            backend.set_poison(poison)
            backend.set_phase(None)
            backend.activate()
            try:
                yield
            finally:
                backend.deactivate()
                backend.set_phase(None)
                _warn_deviation(backend)
        finally:
            backend.set_poison(False)
            backend.set_fallback_limit(0)
            backend.unload_plan()
    finally:
        _release(backend)


@contextlib.contextmanager
def logging(
    *, device: str | torch.device = "cpu", meta: dict[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Record every allocation and free of ``device`` with its phase; yields the trace dict,
    filled when the ``with`` ends::

        {"version": 1, "kind": "memo.trace", "meta": {"recorder": "allocator", "device": "cpu"},
         "events": [{"op": "malloc", "id": 7, "size": 4096, "phase": "layer.fwd[0]"},
                    {"op": "free", "id": 7}, ..., {"op": "end"}]}

    ``phase`` is omitted for allocations outside phases. Allocations made before the ``with``
    and freed inside it are not recorded; ones made inside and not freed live until ``end``.
    Requests are served by the fallback caching allocator.
    """
    backend = backend_for(device)
    _claim(backend, "logging")
    builder = TraceBuilder(meta={"recorder": "allocator", "device": backend.device_type, **(meta or {})})
    # The header now, the events when the ``with`` ends.
    trace: dict[str, Any] = {**builder.finish(), "events": []}
    try:
        backend.prepare()
        backend.start_logging()
        try:
            backend.activate()
            try:
                yield trace
            finally:
                backend.deactivate()
        finally:
            raw, names = backend.stop_logging()
        for is_malloc, ident, size, phase in raw:
            if is_malloc:
                builder.malloc(ident, size, names[phase] if phase >= 0 else None)
            else:
                builder.free(ident)
        trace.update(builder.finish())
    finally:
        _release(backend)


def stats(device: str | torch.device = "cpu") -> dict[str, Any]:
    """Counters of the allocator behind ``device``.

    Keys: ``requests``, ``planned_hits``, ``fallback_requests``, ``unplanned_requests``,
    ``deviations`` (with ``slot_busy``, ``slot_lent`` and ``first_deviation``: phase, index, expected,
    actual, reason), ``frees``, ``invalid_frees``, ``bytes_in_use``, ``peak_bytes_in_use``,
    ``borrowed_allocs``, ``borrowed_blocks``, ``borrowed_bytes``, ``peak_borrowed_bytes``,
    ``device_reserved_bytes``, ``peak_device_reserved_bytes``, ``arena_bytes``, ``arena_in_use``,
    ``arena_high_water``, ``arena_reservations``, ``arena_releases``, ``retired_arenas``,
    ``segment_allocs``, ``segment_releases`` and ``fallback`` (allocated/reserved bytes and peaks,
    blocks, segments).

    Borrowed blocks are fallback requests served from an idle range of the plan's arena
    (``borrowed_allocs`` of ``fallback_requests`` since the last reset; blocks and bytes live now).
    ``bytes_in_use`` counts every live block once: planned, borrowed and fallback blocks; a borrowed
    block lies inside the arena, so it is not in ``fallback["allocated_bytes"]`` and adds nothing to
    ``device_reserved_bytes`` (arenas + fallback segments: what memo holds from the device).
    ``peak_bytes_in_use`` is what tensors held at once, ``peak_device_reserved_bytes`` what the
    device held (NOTE [One device pool], "What in use counts").
    """
    return backend_for(device).stats()


def reset_stats(device: str | torch.device = "cpu") -> None:
    """Zero the counters of the allocator behind ``device`` and restart its peak at the bytes in use
    now (what ``torch.cuda.reset_peak_memory_stats`` does for PyTorch's allocator, which a pluggable
    allocator such as memo's does not support)."""
    backend_for(device).reset_stats()


def empty_cache(device: str | torch.device = "cpu") -> int:
    """Return the fallback allocator's wholly free segments to the device; returns bytes released."""
    return backend_for(device).empty_cache()
