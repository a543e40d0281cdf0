"""What ``memo show`` prints of a plan, read without its allocations.

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
the count and the peaks are what the rows give. A file without these fields is scanned (NOTE [A
plan without its summary]); a file in another layout is loaded whole up to :data:`MAX_WHOLE_BYTES`,
and refused above it.

NOTE [A plan without its summary]
Plans without ``allocation_count`` and ``phase_peaks`` (from a memo that lacks them, or edited by
hand) have the layout but not the fields: loading one whole took over 60 s and 1.6 GiB at 3.5M
allocations. The two fields are what the rows give, so they are computed from the rows here, without
an object per row: the rows are read a block of lines at a time, as numbers (numpy parses them;
every line must hold six integers and nothing else), each row's offset comes from the plan's tables
(its layer block's ``level2`` offset plus the ``level1`` offset of its request index, or its own
entry in ``items``, as :meth:`Plan.from_dict` places it) and the highest byte per phase is kept, in
the order the phases first appear, as :meth:`Plan.phase_peaks` orders them. The tables are parsed as
JSON, so they are bounded (:data:`MAX_TABLE_BYTES`): a plan that places millions of allocations one
by one in ``items`` is refused with the way to a summary. A file that does not have the layout (one
line, say) is loaded whole when it is small and refused when it is large, once its size is seen,
before it is parsed.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memo.errors import MemoError
from memo.phase_names import phase_kind
from memo.units import MAX_BYTES

from .plan import load_plan
from .plan_fields import LAYER_KINDS, UNPHASED, bad_field, byte_count, json_object, phase_name, summary_fields

__all__ = ["PlanSummary", "read_plan_summary"]

#: A top-level field as save_plan writes it: one space of indent, the key, and its value after it.
_TOP_FIELD = re.compile(rb'^ "([A-Za-z0-9_]+)": ', re.MULTILINE)
#: Where the rows begin: the last top-level field.
_ROWS = b'\n "allocations": [\n'
#: The largest plan file without the summary fields, in another layout than save_plan's, that ``memo show``
#: loads whole (NOTE [A plan without its summary]): some 400,000 rows, 12 s and 0.4 GiB on two cores.
MAX_WHOLE_BYTES = 16 << 20
#: The most bytes of tables (``phases``, ``level1``, ``level2``, ``items``) a scan parses as JSON.
MAX_TABLE_BYTES = 32 << 20
#: Bytes of rows read at a time by a scan; its copies, masks and numbers take some six times as much.
_BLOCK_BYTES = 16 << 20
#: The tables a scan places the rows with.
_TABLES = ("phases", "level1", "level2", "items")
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
    file has them in save_plan's layout, or computed from its rows where it has the layout without
    them, else the whole :class:`memo.planner.Plan` (NOTE [A plan's summary], NOTE [A plan without its
    summary]). A file of neither kind over :data:`MAX_WHOLE_BYTES` is refused."""
    size = 0
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            size = len(mm)
            summary = _summary(mm, f.fileno())
    except (OSError, ValueError):
        summary = None  # missing, empty or unreadable: load_plan says which, in its words
    if summary is not None:
        return summary
    if size > MAX_WHOLE_BYTES:
        raise MemoError(
            f"memo show: {os.fspath(path)!r} ({size / 2**20:,.0f} MiB) has no summary (allocation_count, "
            "phase_peaks) and is not in the layout memo writes, whose rows `memo show` summarises; read "
            f"whole, a plan of over {MAX_WHOLE_BYTES >> 20} MiB takes minutes and GBs. Write it again with "
            "this memo (`memo profile` or `memo plan`, or save_plan(load_plan(path), new_path) from Python), "
            "which records the summary `memo show` reads")
    return load_plan(path)


def _summary(mm: mmap.mmap, fd: int) -> PlanSummary | None:
    # The first match is the field: JSON strings hold no newline, and a nested field is indented deeper.
    rows = mm.find(_ROWS)
    if rows < 0 or mm[:1] != b"{":
        return None
    spans: dict[str, tuple[int, int]] = {}
    fields = list(_TOP_FIELD.finditer(mm, 0, rows + 1))
    for k, match in enumerate(fields):
        end = fields[k + 1].start() if k + 1 < len(fields) else rows
        spans[match.group(1).decode()] = (match.end(), end)
    tail = mm[max(rows + len(_ROWS), len(mm) - 64):].rstrip()  # the closing brackets, not the rows
    if not tail.endswith(b"]\n}") and not tail.endswith(b"]}"):
        return None
    if "phase_peaks" not in spans or "allocation_count" not in spans:
        return _scanned(mm, fd, spans, rows + len(_ROWS))  # NOTE [A plan without its summary]
    data = _parsed(mm, spans, _SUMMARY_FIELDS)
    if data is None:
        return None  # not the layout save_plan writes: load the whole plan and its errors
    return _checked(data, _count_rows(mm, rows + len(_ROWS)))


def _parsed(mm: mmap.mmap, spans: dict[str, tuple[int, int]], keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The top-level fields ``keys`` that the file has, each parsed from its span; None when one is not
    JSON (the file is not in save_plan's layout)."""
    data: dict[str, Any] = {}
    for key in keys:
        if key in spans:
            start, end = spans[key]
            try:
                data[key] = json.loads(mm[start:end].rstrip(b",\n "))
            except ValueError:
                return None
    return data


def _scanned(mm: mmap.mmap, fd: int, spans: dict[str, tuple[int, int]], start: int) -> PlanSummary | None:
    """The summary of a plan in save_plan's layout without its summary fields, computed from its rows
    (NOTE [A plan without its summary]); None when the file is not in that layout (or its rows are not
    six integers a line), for the caller to load whole or refuse."""
    if any(key not in spans for key in _TABLES):
        return None
    table_bytes = sum(spans[key][1] - spans[key][0] for key in _TABLES)
    if table_bytes > MAX_TABLE_BYTES:
        return None
    data = _parsed(mm, spans, (*_SUMMARY_FIELDS, *_TABLES))
    if data is None:
        return None
    _check_kind(data)
    places = _Places(data)
    end = mm.rfind(b"\n ]")
    count, at = 0, start
    while at < end:
        # Read, not sliced from the map: the pages of a map stay resident, a whole 400 MB file of them.
        block = os.pread(fd, min(_BLOCK_BYTES, end - at), at)
        if at + len(block) < end:
            block = block[:block.rfind(b"\n") + 1]
            if not block:  # a line longer than a block: not a row per line
                return None
        rows = _rows(block)
        if rows is None:
            return None
        places.add(rows, count)
        count += len(rows)
        at += len(block)
    return PlanSummary(**summary_fields(data), allocation_count=count, peaks=places.peaks())


#: What a block of rows may hold besides digits and minus signs: the brackets, commas and white space of
#: save_plan's ``[p, r, size, start, end, id],`` lines.
_ROW_BYTES = bytes.maketrans(b"[],", b"   ")


def _rows(block: bytes) -> np.ndarray | None:
    """The rows of ``block`` (whole lines) as an ``[n, 6]`` int64 array; None unless every line holds
    one bracketed row of six integers."""
    lines = block.count(b"\n") + (not block.endswith(b"\n"))
    if block.count(b"[") != lines or block.count(b"]") != lines:
        return None
    text = block.translate(_ROW_BYTES)
    if text.translate(None, b"0123456789- \n"):
        return None  # a float, a string, null, true: not a row memo writes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns, and stops, at what it cannot read
        try:
            numbers = np.fromstring(text, dtype=np.int64, sep=" ")
        except (ValueError, DeprecationWarning):
            return None
    if numbers.size != 6 * lines:
        return None
    # Six numbers a line in all, and six on each line. Only digits, minus signs, spaces and newlines
    # are left, so a number begins at a byte above the space that follows one not above it.
    raw = np.frombuffer(text, dtype=np.uint8)
    inside = raw > ord(" ")
    begins = np.empty_like(inside)
    begins[0] = inside[0]
    np.greater(inside[1:], inside[:-1], out=begins[1:])
    starts = np.concatenate(([0], np.flatnonzero(raw == ord("\n")) + 1))[:lines]
    if np.any(np.add.reduceat(begins, starts, dtype=np.int64) != 6):
        return None
    return numbers.reshape(lines, 6)


class _Places:
    """Where a plan's rows lie, as :meth:`Plan.from_dict` places them, folded into the highest byte per
    phase block by block of rows (NOTE [A plan without its summary])."""

    def __init__(self, data: dict[str, Any]) -> None:
        phases = data["phases"]
        if not isinstance(phases, list):
            raise bad_field("phases", "a list of phase names", phases)
        self.phases = [phase_name(p, f"phases[{i}]") for i, p in enumerate(phases)]
        index = {p: i for i, p in enumerate(self.phases)}
        level1 = json_object(data["level1"], "level1")
        level2 = json_object(data["level2"], "level2")
        n = len(self.phases)
        # per phase index + 1 (0: unphased): its layer block's offset (-1: none) and level-1 kind
        self.block = np.full(n + 1, -1, dtype=np.int64)
        self.kind = np.full(n + 1, -1, dtype=np.int64)
        self.tables = []
        for kind in LAYER_KINDS:
            table = level1.get(kind, [])
            if not isinstance(table, list):
                raise bad_field(f"level1.{kind}", "a list of offsets", table)
            self.tables.append(np.array([-1 if o is None else byte_count(o, f"level1.{kind}[{r}]")
                                         for r, o in enumerate(table)], dtype=np.int64))
        for p, base in level2.items():
            i = index.get(phase_name(p, "a key of level2"))
            if i is not None:
                kind_name = phase_kind(p)
                if kind_name not in LAYER_KINDS or kind_name not in level1:
                    raise MemoError(f"memo.plan: level2 places phase {p!r} as a layer block, but level1 has "
                                    f"no block for {kind_name!r}")
                self.block[i + 1] = byte_count(base, f"level2.{p}")
                self.kind[i + 1] = LAYER_KINDS.index(kind_name)
        keys, offsets = [], []
        for p, table in json_object(data["items"], "items").items():
            i = -1 if p == UNPHASED else index.get(phase_name(p, "a key of items"))
            for r, o in json_object(table, f"items.{p}").items():
                if not (r.isascii() and r.isdigit()) or int(r) >= 1 << 40:
                    raise bad_field(f"items.{p}", "an object keyed by request index", r)
                if i is not None:
                    keys.append(((i + 1) << 40) + int(r))
                    offsets.append(-1 if o is None else byte_count(o, f"items.{p}.{r}"))
        order = np.argsort(np.array(keys, dtype=np.int64), kind="stable")
        self.item_keys = np.array(keys, dtype=np.int64)[order]
        self.item_offsets = np.array(offsets, dtype=np.int64)[order]
        self.top = np.zeros(n + 1, dtype=np.int64)
        self.first = np.full(n + 1, np.iinfo(np.int64).max, dtype=np.int64)

    def add(self, rows: np.ndarray, before: int) -> None:
        """Fold ``rows`` (the plan's rows from index ``before`` on) into the phases' highest bytes."""
        n = len(self.phases)
        low = np.array([-1, 0, 1, 0, 0])
        high = np.array([n, MAX_BYTES, MAX_BYTES, MAX_BYTES, MAX_BYTES])
        cols = rows[:, :5]
        if not ((cols >= low).all() and (cols < high).all()):
            bad = int(np.flatnonzero(((cols < low) | (cols >= high)).any(axis=1))[0])
            raise bad_field(f"allocations[{before + bad}]", "[phase index, request, size, start, end, id] "
                            "within their ranges", rows[bad].tolist())
        slot, request, size = rows[:, 0] + 1, rows[:, 1], rows[:, 2]
        offset = np.full(len(rows), -2, dtype=np.int64)  # -2: not placed by a block, -1: not planned
        base, kind = self.block[slot], self.kind[slot]
        for k, table in enumerate(self.tables):
            here = np.flatnonzero((kind == k) & (request < len(table)))
            inner = table[request[here]]
            placed = inner >= 0
            offset[here[placed]] = base[here[placed]] + inner[placed]
        own = np.flatnonzero(offset == -2)
        if own.size:
            wanted = (slot[own] << 40) + request[own]
            at = np.minimum(np.searchsorted(self.item_keys, wanted), max(len(self.item_keys) - 1, 0))
            found = self.item_keys[at] == wanted if len(self.item_keys) else np.zeros(own.size, dtype=bool)
            if not found.all():
                miss = own[int(np.flatnonzero(~found)[0])]
                phase = self.phases[slot[miss] - 1] if slot[miss] else "(unphased)"
                raise MemoError(f"memo.plan: no offset for request {int(request[miss])} of phase {phase!r}")
            offset[own] = self.item_offsets[at]
        planned = np.flatnonzero(offset >= 0)
        np.maximum.at(self.top, slot[planned], offset[planned] + size[planned])
        np.minimum.at(self.first, slot[planned], planned + before)

    def peaks(self) -> dict[str, int]:
        """Per phase instance, as :meth:`Plan.phase_peaks` gives them: in the order of their first planned
        allocation."""
        seen = np.flatnonzero(self.first < np.iinfo(np.int64).max)
        names = ["(unphased)", *self.phases]
        return {names[s]: int(self.top[s]) for s in seen[np.argsort(self.first[seen], kind="stable")]}


def _count_rows(mm: mmap.mmap, start: int) -> int:
    """Rows of the allocations: one per line, up to the closing bracket."""
    end = mm.rfind(b"\n ]")
    if end <= start:  # "[\n\n ]": no row
        return 0
    lines, chunk = 0, 64 << 20
    for at in range(start, end, chunk):
        lines += mm[at:min(at + chunk, end)].count(b"\n")
    return lines + 1


def _check_kind(data: dict[str, Any]) -> None:
    from .plan import PLAN_KIND, PLAN_VERSION

    if data.get("kind", PLAN_KIND) != PLAN_KIND or data.get("version") != PLAN_VERSION:
        raise MemoError(f"memo.plan: not a version {PLAN_VERSION} {PLAN_KIND} file (kind "
                        f"{data.get('kind')!r}, version {data.get('version')!r}); make one with `memo plan` "
                        "or `memo profile`")


def _checked(data: dict[str, Any], rows: int) -> PlanSummary:
    """The summary fields, checked as Plan.from_dict checks them (NOTE [A plan's summary])."""
    _check_kind(data)
    count = byte_count(data.get("allocation_count"), "allocation_count")
    if count != rows:
        raise bad_field("allocation_count", f"the {rows:,} rows' count", count)
    peaks = json_object(data.get("phase_peaks"), "phase_peaks")
    return PlanSummary(
        **summary_fields(data),
        allocation_count=count,
        peaks={str(k): byte_count(v, f"phase_peaks.{k}") for k, v in peaks.items()},
    )
