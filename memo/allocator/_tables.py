"""Turn what callers pass to :func:`memo.allocator.planned` into (tables, peak).

Only the shape is handled here: which object holds the tables and the peak, and the tables as plain
Python ints and ``None``, which is what the native allocators can take. Whether the values make a plan
(sizes > 0, aligned offsets within the peak, byte counts below 2**62) is checked in one place, the
native core (NOTE [Plan tables are checked in the core] in csrc/core/planned_allocator.h), whose
message memo.allocator raises as a :class:`~memo.errors.MemoError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeGuard

from memo.errors import MemoError

__all__ = ["PhaseTables", "PlanLike", "normalize_plan"]

#: phase instance name -> [(size bytes, arena offset or None), ...] over request index k.
PhaseTables = dict[str, list[tuple[int, int | None]]]


class PlanLike(Protocol):
    """What :func:`normalize_plan` reads of a ``memo.planner.Plan``."""

    peak: int

    def phase_tables(self) -> PhaseTables: ...


_INT64 = 1 << 63  # what the native allocators take: signed 64-bit byte counts


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_tables(tables: object) -> PhaseTables:
    """The tables as a dict of lists of (int, int-or-None), every int within 64 bits."""
    if not isinstance(tables, Mapping):
        raise MemoError(
            f"memo.allocator: phase tables must be a dict of phase -> list, got {type(tables).__name__}"
        )
    out: PhaseTables = {}
    for phase, entries in tables.items():
        if not isinstance(phase, str):
            raise MemoError(f"memo.allocator: phase table keys must be phase names (str), got {phase!r}")
        rows: list[tuple[int, int | None]] = []
        for k, entry in enumerate(entries):
            try:
                size, offset = entry
            except (TypeError, ValueError):
                raise MemoError(
                    f"memo.allocator: table {phase!r} entry {k} must be (size, offset-or-None), got {entry!r}"
                ) from None
            if not _is_int(size) or not -_INT64 <= size < _INT64:
                raise MemoError(f"memo.allocator: table {phase!r} entry {k}: size must be a positive int "
                                f"below 2**62 (bytes), got {size!r}")
            if offset is not None and (not _is_int(offset) or not -_INT64 <= offset < _INT64):
                raise MemoError(f"memo.allocator: table {phase!r} entry {k}: offset must be an int >= 0 "
                                f"below 2**62 (bytes) or None, got {offset!r}")
            rows.append((size, offset))
        out[phase] = rows
    return out


def normalize_plan(
    plan_or_tables: PlanLike | Mapping[str, object], peak: int | None = None
) -> tuple[PhaseTables, int]:
    """Accept a ``memo.planner.Plan`` (``phase_tables()`` and ``peak``), a dict
    ``{"tables": ..., "peak": ...}``, or a dict of tables with ``peak=``."""
    given: object = peak
    tables: object
    if hasattr(plan_or_tables, "phase_tables") and hasattr(plan_or_tables, "peak"):
        tables, plan_peak = plan_or_tables.phase_tables(), plan_or_tables.peak
        if peak is not None and peak != plan_peak:
            raise MemoError(f"memo.allocator: peak={peak} given, but the plan's peak is {plan_peak}")
        given = plan_peak
    elif isinstance(plan_or_tables, Mapping) and "tables" in plan_or_tables:
        tables = plan_or_tables["tables"]
        if peak is None:
            given = plan_or_tables.get("peak")
    elif isinstance(plan_or_tables, Mapping):
        tables = plan_or_tables
    else:
        raise MemoError(
            "memo.allocator: expected a memo.planner.Plan or a dict of phase tables, "
            f"got {type(plan_or_tables).__name__}"
        )
    if given is None:
        raise MemoError("memo.allocator: phase tables need the arena size: pass peak=<bytes>")
    if not _is_int(given) or not -_INT64 <= given < _INT64:
        raise MemoError(f"memo.allocator: peak must be an int >= 0 and below 2**62 (bytes), got {given!r}")
    return _as_tables(tables), given
