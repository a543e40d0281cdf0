"""What ``memo show`` prints of a plan, read without its allocations (issue 31).

NOTE [A plan's summary]
A plan of 10^7 allocations is a file of some 400 MB, most of it the allocation rows and the offsets
of the requests; loading it builds an object per allocation (10^6 took 16 s, 10^7 over 8 GB). What
``memo show`` prints needs none of that: the plan's scalars and records (alpha, peak, lower bound,
device, solver, policy, warnings), and per phase the highest arena byte its allocations reach. So
:func:`save_plan` writes ``allocation_count`` and ``phase_peaks`` into the plan, and a plan in the
layout it writes (each top-level field on a line of its own, ``"allocations"`` last, a row per line)
is read here from a memory map: each top-level field that is printed is parsed and checked as
:meth:`Plan.from_dict` checks it, ``items``, ``level1``, ``level2``, ``phases`` and the rows are
skipped, and the rows are counted by their lines. Loading the whole plan (``load_plan``) checks that
the count and the peaks are what the rows give. A file in another layout, or one from before these
fields, is loaded whole.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Any

from memo.errors import MemoError

from .plan import _bad, _count, _object, load_plan, summary_fields

__all__ = ["PlanSummary", "read_plan_summary"]

#: A top-level field as save_plan writes it: one space of indent, the key, and its value after it.
_TOP_FIELD = re.compile(rb'^ "([A-Za-z0-9_]+)": ', re.MULTILINE)
#: Where the rows begin: the last top-level field.
_ROWS = b'\n "allocations": [\n'
#: The fields a summary parses; the others (the offsets, the rows) it skips.
_SUMMARY_FIELDS = ("version", "kind", "meta", "alpha", "alpha_binding", "host_bytes", "offload", "policy",
                   "tile_tokens", "device", "pipeline", "peak", "lower_bound", "no_reuse_bytes", "solver",
                   "warnings", "level1_peak", "allocation_count", "phase_peaks")


@dataclass
class PlanSummary:
    """The fields of a :class:`memo.planner.Plan` that ``memo show`` prints (NOTE [A plan's summary])."""

    meta: dict[str, Any]
    alpha: float | None
    alpha_binding: str | None
    peak: int
    lower_bound: int
    no_reuse_bytes: int
    host_bytes: int | None
    offload: dict[str, Any] | None
    policy: list[str] | None
    tile_tokens: int | None
    device: dict[str, Any] | None
    pipeline: dict[str, Any] | None
    solver: dict[str, Any]
    warnings: list[str]
    level1_peak: dict[str, int]
    allocation_count: int
    peaks: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.peak / self.lower_bound if self.lower_bound else 1.0

    def phase_peaks(self) -> dict[str, int]:
        return dict(self.peaks)


def read_plan_summary(path: str | os.PathLike[str]) -> Any:
    """The plan at ``path`` for printing: a :class:`PlanSummary` read from its summary fields where the
    file has them in save_plan's layout, else the whole :class:`memo.planner.Plan` (NOTE [A plan's
    summary])."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            summary = _summary(mm)
    except (OSError, ValueError):
        summary = None  # missing, empty or unreadable: load_plan says which, in its words
    return summary if summary is not None else load_plan(path)


def _summary(mm: mmap.mmap) -> PlanSummary | None:
    rows = mm.rfind(_ROWS)
    if rows < 0 or mm[:1] != b"{":
        return None
    spans: dict[str, tuple[int, int]] = {}
    fields = list(_TOP_FIELD.finditer(mm, 0, rows + 1))
    for k, match in enumerate(fields):
        end = fields[k + 1].start() if k + 1 < len(fields) else rows
        spans[match.group(1).decode()] = (match.end(), end)
    if "phase_peaks" not in spans or "allocation_count" not in spans:
        return None  # written before the summary fields: load the whole plan
    data: dict[str, Any] = {}
    for key in _SUMMARY_FIELDS:
        if key in spans:
            start, end = spans[key]
            try:
                data[key] = json.loads(mm[start:end].rstrip(b",\n "))
            except ValueError:
                return None  # not the layout save_plan writes: load the whole plan and its errors
    tail = mm[max(rows + len(_ROWS), len(mm) - 64):].rstrip()  # the closing brackets, not the rows
    if not tail.endswith(b"]\n}") and not tail.endswith(b"]}"):
        return None
    return _checked(data, _count_rows(mm, rows + len(_ROWS)))


def _count_rows(mm: mmap.mmap, start: int) -> int:
    """Rows of the allocations: one per line, up to the closing bracket."""
    end = mm.rfind(b"\n ]")
    if end < start:
        return 0
    lines, chunk = 0, 64 << 20
    for at in range(start, end, chunk):
        lines += mm[at:min(at + chunk, end)].count(b"\n")
    return lines + 1


def _checked(data: dict[str, Any], rows: int) -> PlanSummary:
    """The summary fields, checked as Plan.from_dict checks them (NOTE [A plan's summary])."""
    from .plan import PLAN_KIND, PLAN_VERSION

    if data.get("kind", PLAN_KIND) != PLAN_KIND or data.get("version") != PLAN_VERSION:
        raise MemoError(f"memo.plan: not a version {PLAN_VERSION} {PLAN_KIND} file (kind "
                        f"{data.get('kind')!r}, version {data.get('version')!r}); make one with `memo plan` "
                        "or `memo profile`")
    count = _count(data.get("allocation_count"), "allocation_count")
    if count != rows:
        raise _bad("allocation_count", f"the {rows:,} rows' count", count)
    peaks = _object(data.get("phase_peaks"), "phase_peaks")
    return PlanSummary(
        **summary_fields(data),
        allocation_count=count,
        peaks={str(k): _count(v, f"phase_peaks.{k}") for k, v in peaks.items()},
    )
