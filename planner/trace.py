"""Allocation traces: the input of the planner.

A trace is the ordered list of allocation events of one training iteration,
as versioned JSON (see docs/formats.md)::

    {"version": 1, "kind": "memo.trace", "meta": {...},
     "events": [{"op": "malloc", "id": 7, "size": 4096, "phase": "layer.fwd[0]"},
                {"op": "free", "id": 7},
                {"op": "end"}]}

Only ``version`` and ``events`` are required, so the planner accepts any trace
in this form, including ones it did not record.

NOTE [Trace time]
Time is the event index. An allocation made by event ``i`` and freed by event
``j`` lives on the half-open interval ``[i, j)``; two allocations conflict
(may not share a byte) when their intervals intersect. An allocation never
freed lives until the end of the trace: the index of the optional
``{"op": "end"}`` marker, or the number of events when there is none. The end
marker, when present, must be the last event.

NOTE [Phase runs]
Only mallocs carry a phase. The *current phase* at an event is the phase of
the most recent malloc (``None`` before the first one and after an unphased
malloc), so a free belongs to the phase whose run it falls in. A *run* is a
maximal stretch of events with the same current phase. An allocation is
*transient* in its phase when it is freed inside the run it was made in, and
*skeletal* when it outlives that run (or is never freed). The request index
of a malloc is its position among the mallocs of its phase instance, in
trace order; the planned allocator looks offsets up by (phase, request index).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from memo.errors import MemoError
from memo.jsonio import atomic_write, read_json
from memo.phase_names import parse_phase
from memo.trace_format import TRACE_KIND, TRACE_VERSION, TraceBuilder
from memo.units import MAX_BYTES

__all__ = [
    "TRACE_KIND",
    "TRACE_VERSION",
    "Allocation",
    "PhaseRun",
    "Trace",
    "TraceBuilder",
    "load_trace",
    "save_trace",
]

# The format's version and kind, and the builder every producer writes traces with, live in the
# torch-free memo.trace_format, so that the profiler and the allocator need not import the planner.

# Known meta keys and the type each must have when present; anything else in meta is kept as is.
_META_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "fingerprint": (str,),
    "seq_len": (int,),
    "micro_batch": (int,),
    "dtype": (str,),
    "device": (str,),
    "recorder": (str,),
    "n_layers": (int,),
    "tensor_parallel": (int,),
    "context_parallel": (int,),
}
_POSITIVE_META = ("seq_len", "micro_batch", "n_layers", "tensor_parallel", "context_parallel")
_LAYER_STATS = ("S_input", "S_attn", "S_others", "rows", "layer_fwd_ms")


@dataclass(frozen=True)
class Allocation:
    """One allocation of a trace.

    Attributes:
        index: position among all mallocs of the trace (0-based, trace order).
        id: the id the trace gave it (ids may be reused once freed).
        size: bytes requested.
        start: event index of the malloc.
        end: event index of the free, or the end of the trace when never freed.
        phase: phase instance it was made in, or ``None``.
        request: its request index inside ``phase`` (or among unphased mallocs).
        transient: freed inside the run of its phase (see NOTE [Phase runs]).
    """

    index: int
    id: int
    size: int
    start: int
    end: int
    phase: str | None
    request: int
    transient: bool


@dataclass(frozen=True)
class PhaseRun:
    """A maximal stretch ``[start, stop)`` of events whose current phase is ``phase``."""

    phase: str | None
    start: int
    stop: int


def _fail(where: str, message: str) -> MemoError:
    return MemoError(f"memo.trace: {where}: {message}")


def _check_int(value: Any, where: str, name: str) -> int:
    # bool is an int subclass in Python; a JSON true is never a valid size or id.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"{name} must be an integer, got {value!r}")
    return value


def validate_meta(meta: Any, subsystem: str = "memo.trace") -> dict[str, Any]:
    """A copy of a trace's (or plan's) ``meta`` after checking the type of every known key;
    raises a MemoError starting with ``subsystem``."""
    if not isinstance(meta, dict):
        raise MemoError(f"{subsystem}: meta: must be an object, got {type(meta).__name__}")
    for key, types in _META_TYPES.items():
        if key not in meta:
            continue
        value = meta[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise MemoError(f"{subsystem}: meta.{key}: must be {types[0].__name__}, got {value!r:.80}")
        # cast: every _POSITIVE_META key is an int one in _META_TYPES, and value is checked above
        if key in _POSITIVE_META and cast(int, value) <= 0:
            raise MemoError(f"{subsystem}: meta.{key}: must be positive, got {value}")
    return dict(meta)


def _validate_layers(layers: Any) -> dict[str, Any]:
    if not isinstance(layers, dict):
        raise _fail("layers", f"must be an object, got {type(layers).__name__}")
    for key in _LAYER_STATS:
        if key not in layers:
            continue
        value = layers[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0:
            raise _fail(f"layers.{key}", f"must be a finite number >= 0, got {value!r}")
    return dict(layers)


@dataclass
class Trace:
    """A parsed, validated allocation trace (see the module docstring and docs/formats.md)."""

    events: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, Any] | None = None
    allocations: list[Allocation] = field(init=False, repr=False)
    runs: list[PhaseRun] = field(init=False, repr=False)
    end_time: int = field(init=False)

    def __post_init__(self) -> None:
        self.meta = validate_meta(self.meta)
        if self.layers is not None:
            self.layers = _validate_layers(self.layers)
        self._parse()

    # ----------------------------------------------------------------- parsing
    def _parse(self) -> None:
        events = self.events
        if not isinstance(events, list):
            raise _fail("events", f"must be a list, got {type(events).__name__}")
        end_time = len(events)
        live: dict[int, tuple[int, int]] = {}  # id -> (malloc index, event index)
        done: dict[int, tuple[int, int]] = {}  # malloc index -> (end, run id at malloc)
        pending: list[tuple[int, int, int, str | None, int, int]] = []  # (index, id, size, phase, start, req)
        requests: dict[str | None, int] = {}
        run_of_malloc: list[int] = []
        runs: list[PhaseRun] = []
        current: str | None = None
        run_start = 0
        total = 0
        for i, ev in enumerate(events):
            if not isinstance(ev, dict):
                raise _fail(f"event {i}", f"must be an object, got {ev!r}")
            op = ev.get("op")
            if op == "end":
                if i != len(events) - 1:
                    raise _fail(f"event {i + 1}", "event after the end marker {\"op\": \"end\"}; "
                                "the end marker must be the last event")
                end_time = i
                continue
            if op not in ("malloc", "free"):
                raise _fail(f"event {i}", f"op must be 'malloc', 'free' or 'end', got {op!r}")
            if "id" not in ev:
                raise _fail(f"event {i}", f"{op} without an id")
            ident = ev["id"]
            if type(ident) is not int:  # the check's message only where it fails: once per event is slow
                _check_int(ident, f"event {i}", "id")
            if op == "malloc":
                size = ev.get("size")
                if type(size) is not int:
                    size = _check_int(size, f"event {i}", "size")
                if size <= 0:
                    raise _fail(f"event {i}", f"malloc of id {ident} has size {size}; sizes must be > 0")
                if size >= MAX_BYTES:  # NOTE [Byte counts are bounded] in memo/units.py
                    raise _fail(f"event {i}", f"malloc of id {ident} has size {size}; sizes must be below "
                                "2**62 bytes (4 EiB): the trace is damaged")
                total += size
                if ident in live:
                    raise _fail(f"event {i}", f"malloc of id {ident}, which is still live (allocated by "
                                f"event {live[ident][1]} and not freed)")
                phase = ev.get("phase")
                if phase is not None and phase not in requests:  # a phase seen before was checked then
                    if not isinstance(phase, str):
                        raise _fail(f"event {i}", f"phase must be a string, got {phase!r}")
                    try:
                        parse_phase(phase)
                    except MemoError as err:
                        raise _fail(f"event {i}", str(err)) from None
                if phase != current or i == 0:
                    if i > run_start or runs:
                        runs.append(PhaseRun(current, run_start, i))
                    current, run_start = phase, i
                index = len(pending)
                request = requests.get(phase, 0)
                requests[phase] = request + 1
                live[ident] = (index, i)
                pending.append((index, ident, size, phase, i, request))
                run_of_malloc.append(len(runs))
            else:
                if ident not in live:
                    raise _fail(f"event {i}", f"free of id {ident}, which is not live "
                                "(never allocated, or already freed: double free)")
                index = live.pop(ident)[0]
                done[index] = (i, len(runs))
        if total >= MAX_BYTES:  # NOTE [Byte counts are bounded]: every offset + size stays below 2**63
            raise _fail("events", f"the mallocs total {total} bytes; a trace must total below 2**62 bytes "
                        "(4 EiB): the trace is damaged")
        runs.append(PhaseRun(current, run_start, end_time))
        allocations = []
        for index, ident, size, phase, start, request in pending:
            end, free_run = done.get(index, (end_time, -1))
            transient = phase is not None and free_run == run_of_malloc[index]
            allocations.append(Allocation(index, ident, size, start, end, phase, request, transient))
        self.allocations = allocations
        self.runs = [r for r in runs if r.stop > r.start]
        self.end_time = end_time

    # -------------------------------------------------------------- (de)serialise
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trace:
        """Build a trace from its JSON object; raises MemoError naming what is wrong."""
        if not isinstance(data, Mapping):
            raise _fail("top level", f"must be a JSON object, got {type(data).__name__}")
        if "version" not in data:
            raise _fail("top level", "no 'version' field; this does not look like a memo trace")
        version = data["version"]
        if type(version) is not int or version != TRACE_VERSION:
            raise _fail("version", f"unknown trace version {version!r}; this memo reads version "
                        f"{TRACE_VERSION}. Re-record the trace with `memo profile`.")
        kind = data.get("kind", TRACE_KIND)
        if kind != TRACE_KIND:
            raise _fail("kind", f"expected {TRACE_KIND!r}, got {kind!r} (is this a plan file?)")
        if "events" not in data:
            raise _fail("top level", "no 'events' list")
        return cls(events=list(data["events"]) if isinstance(data["events"], list) else data["events"],
                   meta=data.get("meta", {}), layers=data.get("layers"))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": TRACE_VERSION, "kind": TRACE_KIND, "meta": dict(self.meta)}
        if self.layers is not None:
            out["layers"] = dict(self.layers)
        out["events"] = [dict(ev) for ev in self.events]
        return out

    # ------------------------------------------------------------------ queries
    @property
    def phases(self) -> list[str]:
        """Phase instances in order of first appearance."""
        seen: dict[str, None] = {}
        for a in self.allocations:
            if a.phase is not None:
                seen.setdefault(a.phase, None)
        return list(seen)

    def phase_allocations(self, phase: str | None) -> list[Allocation]:
        """Allocations made in ``phase``, by request index."""
        return [a for a in self.allocations if a.phase == phase]

    def transient(self, phase: str) -> list[Allocation]:
        """Allocations that die inside the run of ``phase`` they were made in."""
        return [a for a in self.allocations if a.phase == phase and a.transient]

    def skeletal(self, phase: str) -> list[Allocation]:
        """Allocations made in ``phase`` that outlive its run (or the whole trace)."""
        return [a for a in self.allocations if a.phase == phase and not a.transient]

    def ids_unique(self) -> bool:
        """True when no id is used by two allocations (ids may be reused after a free)."""
        return len({a.id for a in self.allocations}) == len(self.allocations)


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace file."""
    return Trace.from_dict(read_json(path, "memo.trace", "record one with `memo profile`"))


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as JSON (one event per line, so diffs and greps stay readable)."""
    data = trace.to_dict()
    events = data.pop("events")
    head = json.dumps(data, sort_keys=False)[:-1]
    with atomic_write(path, "memo.trace") as f:
        f.write(head + ', "events": [\n')
        f.write(",\n".join(json.dumps(ev) for ev in events))
        f.write("\n]}\n")
