"""The ``memo.trace`` format's version and kind, and :class:`TraceBuilder`, which every producer of
traces (the dispatch recorder in memo/profiler/record.py, memo's allocator's logging in
memo/allocator/_api.py, the synthetic traces in planner/synthetic.py) writes them with, so that a
trace's header and events are spelt out in one place (the format: docs/formats.md). Nothing here
imports torch or the planner; :class:`memo.planner.Trace` reads and validates what is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TRACE_KIND", "TRACE_VERSION", "TraceBuilder"]

TRACE_VERSION = 1
TRACE_KIND = "memo.trace"


class TraceBuilder:
    """Writes a ``memo.trace`` dict event by event: the one place a trace's header and events are
    spelt out, for whatever produces one (the synthetic traces here; the format: docs/formats.md)::

        b = TraceBuilder(meta={"model": "synthetic"})
        b.malloc(7, 4096, "layer.fwd[0]")
        b.free(7)
        b.finish()  # {"version": 1, "kind": "memo.trace", "meta": {...}, "events": [..., {"op": "end"}]}

    It checks nothing: :meth:`Trace.from_dict` validates what is read.
    """

    def __init__(self, meta: Mapping[str, Any] | None = None) -> None:
        self.meta: dict[str, Any] = dict(meta or {})
        self.events: list[dict[str, Any]] = []

    def malloc(self, ident: int, size: int, phase: str | None = None) -> None:
        """An allocation of ``size`` bytes with id ``ident``; ``phase`` None outside every phase."""
        event: dict[str, Any] = {"op": "malloc", "id": ident, "size": size}
        if phase is not None:
            event["phase"] = phase
        self.events.append(event)

    def free(self, ident: int) -> None:
        """The free of the live allocation ``ident``."""
        self.events.append({"op": "free", "id": ident})

    def finish(self, layers: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The trace dict, its events closed by the end marker (NOTE [Trace time]); ``layers``: the
        per-layer statistics the profiler adds (docs/formats.md)."""
        out: dict[str, Any] = {"version": TRACE_VERSION, "kind": TRACE_KIND, "meta": self.meta}
        if layers is not None:
            out["layers"] = dict(layers)
        out["events"] = [*self.events, {"op": "end"}]
        return out
