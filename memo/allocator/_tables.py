"""Turn what callers pass to :func:`memo.allocator.planned` into (tables, peak)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memo.errors import MemoError
from memo.units import ALIGNMENT as BLOCK_ALIGNMENT  # NOTE [Block alignment]
from memo.units import MAX_BYTES

__all__ = ["PhaseTables", "normalize_plan"]

#: phase instance name -> [(size bytes, arena offset or None), ...] over request index k.
PhaseTables = dict[str, list[tuple[int, int | None]]]


def _check_tables(tables: Any, peak: int) -> PhaseTables:
    if not isinstance(tables, Mapping):
        raise MemoError(
            f"memo.allocator: phase tables must be a dict of phase -> list, got {type(tables).__name__}"
        )
    out: PhaseTables = {}
    for phase, entries in tables.items():
        if not isinstance(phase, str) or not phase:
            raise MemoError(f"memo.allocator: phase table keys must be non-empty phase names, got {phase!r}")
        rows: list[tuple[int, int | None]] = []
        for k, entry in enumerate(entries):
            try:
                size, offset = entry
            except (TypeError, ValueError):
                raise MemoError(
                    f"memo.allocator: table {phase!r} entry {k} must be (size, offset-or-None), got {entry!r}"
                ) from None
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise MemoError(
                    f"memo.allocator: table {phase!r} entry {k}: size must be a positive int, got {size!r}"
                )
            if size >= MAX_BYTES or (offset is not None and not isinstance(offset, bool)
                                     and isinstance(offset, int) and offset >= MAX_BYTES):
                # NOTE [Byte counts are bounded] (memo/units.py): the native allocator adds them in 64 bits.
                raise MemoError(f"memo.allocator: table {phase!r} entry {k}: size {size} or offset {offset} "
                                "is not below 2**62 bytes (4 EiB)")
            if offset is not None:
                if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                    raise MemoError(
                        f"memo.allocator: table {phase!r} entry {k}: "
                        f"offset must be an int >= 0 or None, got {offset!r}"
                    )
                if offset % BLOCK_ALIGNMENT:
                    raise MemoError(
                        f"memo.allocator: table {phase!r} entry {k}: offset {offset} is not a multiple of "
                        f"{BLOCK_ALIGNMENT} bytes; re-plan with alignment {BLOCK_ALIGNMENT}"
                    )
                if offset + size > peak:
                    raise MemoError(
                        f"memo.allocator: table {phase!r} entry {k}: offset {offset} + size {size} = "
                        f"{offset + size} exceeds the plan's peak of {peak} bytes"
                    )
            rows.append((size, offset))
        out[phase] = rows
    return out


def normalize_plan(plan_or_tables: Any, peak: int | None = None) -> tuple[PhaseTables, int]:
    """Accept a ``memo.planner.Plan`` (``phase_tables()`` and ``peak``), a dict
    ``{"tables": ..., "peak": ...}``, or a dict of tables with ``peak=``."""
    if hasattr(plan_or_tables, "phase_tables") and hasattr(plan_or_tables, "peak"):
        tables, plan_peak = plan_or_tables.phase_tables(), plan_or_tables.peak
        if peak is not None and peak != plan_peak:
            raise MemoError(f"memo.allocator: peak={peak} given, but the plan's peak is {plan_peak}")
        peak = plan_peak
    elif isinstance(plan_or_tables, Mapping) and "tables" in plan_or_tables:
        tables = plan_or_tables["tables"]
        if peak is None:
            peak = plan_or_tables.get("peak")
    elif isinstance(plan_or_tables, Mapping):
        tables = plan_or_tables
    else:
        raise MemoError(
            "memo.allocator: expected a memo.planner.Plan or a dict of phase tables, "
            f"got {type(plan_or_tables).__name__}"
        )
    if peak is None:
        raise MemoError("memo.allocator: phase tables need the arena size: pass peak=<bytes>")
    if isinstance(peak, bool) or not isinstance(peak, int) or not 0 <= peak < MAX_BYTES:
        raise MemoError(f"memo.allocator: peak must be an int >= 0 and below 2**62 (bytes), got {peak!r}")
    return _check_tables(tables, peak), peak
