"""Plan files: where every planned allocation of a trace lives in the arena.

The layout is documented in docs/formats.md ("Plan"). A :class:`Plan` keeps a
compact copy of the trace's lifetimes (``allocations``) so a plan file alone is
enough to rebuild every offset, validate it (no two live allocations share a
byte) and plot it. Every plan is validated when it is saved and when it is loaded.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from memo.errors import MemoError, PlanMismatchError
from memo.jsonio import atomic_write, read_json
from memo.phase_names import is_backward_phase, parse_phase, phase_kind
from memo.units import ALIGNMENT, MAX_BYTES  # NOTE [Block alignment]

from .dsa import Item, check_placement
from .job import JobSpec, job_mismatch
from .trace import Allocation, Trace, validate_meta

__all__ = ["ALIGNMENT", "PLAN_KIND", "PLAN_VERSION", "UNPHASED_MODES", "Plan", "load_plan",
           "offload_difference", "save_plan", "validate_plan", "without_unphased"]

PLAN_VERSION = 1
PLAN_KIND = "memo.plan"
# The unphased "phase" key in plan files (phase tables leave it out unless asked).
UNPHASED = ""
#: ``Plan.unphased``: "plan" places the allocations made outside every phase too; "fallback" (a plan
#: for memo's allocator to replay) leaves them out (NOTE [Unphased allocations are not planned for
#: replay]).
UNPHASED_MODES = ("plan", "fallback")
#: The phase kinds a level-1 layer block is planned for (planner/core.py).
LAYER_KINDS = ("layer.fwd", "layer.bwd")


# NOTE [Planned and actual offload]
# ``Plan.offload`` records, for one offloaded layer, the bytes the alpha LP counted
# (S_input + S_attn + a/s S_others, a = floor(alpha s)) and the bytes memo's runtime copied in
# the profile's wrapped pass, with the tensors it copied. They agree when the profiler and the
# runtime apply the same rule (NOTE [One truth for saved bytes] in memo/profiler/saved.py);
# `memo show` and `memo train` warn, naming the largest tensors, when they differ by over 1%.
OFFLOAD_KEYS = ("offloaded_layers", "planned_bytes_per_layer", "actual_bytes_per_layer")
_DAMAGED = "the file is damaged or edited by hand: re-run `memo profile` (or `memo plan`)"


def _bad(where: str, expected: str, value: Any) -> MemoError:
    return MemoError(f"memo.plan: {where} must be {expected}, got {value!r:.80}; {_DAMAGED}")


def _count(value: Any, where: str, low: int = 0) -> int:
    """``value`` when it is an integer in [low, 2**62) (NOTE [Byte counts are bounded])."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(where, f"an integer >= {low}", value)
    if value >= MAX_BYTES:
        raise MemoError(f"memo.plan: {where} is {value}, not below 2**62 (4 EiB); {_DAMAGED}")
    return value


def _offset(value: Any, where: str) -> int | None:
    return None if value is None else _count(value, where)


def _phase(name: Any, where: str) -> str:
    try:
        parse_phase(name)
    except MemoError as err:
        raise MemoError(f"memo.plan: {where}: {err}") from None
    return cast(str, name)  # parse_phase refuses anything but a str


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(where, "an object", value)
    return value


def _optional_object(value: Any, name: str) -> Mapping[str, Any] | None:
    """An optional object field of a plan: None, or a mapping (else the field is named)."""
    if value is not None and not isinstance(value, Mapping):
        raise MemoError(f"memo.plan: {name!r} must be an object, got {type(value).__name__}")
    return value


def _check_offload(value: Any) -> dict[str, Any] | None:
    if _optional_object(value, "offload") is None:
        return None
    out: dict[str, Any] = {}
    for key in OFFLOAD_KEYS:
        out[key] = _count(value.get(key), f"offload.{key}")
    tensors = value.get("tensors", [])
    if not isinstance(tensors, list) or not all(
            isinstance(t, (list, tuple)) and len(t) == 2 and isinstance(t[0], str)
            and isinstance(t[1], int) and not isinstance(t[1], bool) and 0 <= t[1] < MAX_BYTES
            for t in tensors):
        raise MemoError("memo.plan: offload.tensors must be a list of [description, bytes]; "
                        "re-run `memo profile`")
    out["tensors"] = [[str(t[0]), int(t[1])] for t in tensors]
    return out


def _check_policy(value: Any) -> list[str] | None:
    if value is None:
        return None
    from .policy import validate_policy

    try:
        return validate_policy(value)
    except MemoError as err:
        raise MemoError(f"memo.plan: bad 'policy' ({err}); re-run `memo profile`") from None


def _check_tile(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemoError(f"memo.plan: bad 'tile_tokens' (a positive number of tokens or null), got {value!r}; "
                        "re-run `memo profile`")
    return value


def _check_device(value: Any) -> dict[str, Any] | None:
    if _optional_object(value, "device") is None:
        return None
    budget = value.get("budget_bytes")
    if budget is not None:
        _count(budget, "device.budget_bytes", low=1)
    for key in ("activations_bytes", "total_bytes"):
        _count(value.get(key), f"device.{key}")
    if value.get("iteration_peak_bytes") is not None:
        _count(value["iteration_peak_bytes"], "device.iteration_peak_bytes")
    states = value.get("model_states")  # null: not known (`memo plan` of a trace that records none)
    for part in ("parameters", "gradients", "optimizer") if states is not None else ():
        entry = states.get(part) if isinstance(states, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype", ""), str):
            raise MemoError("memo.plan: device.model_states must give parameters, gradients and optimizer "
                            "bytes, or be null; re-run `memo profile`")
        _count(entry.get("bytes"), f"device.model_states.{part}.bytes")
    estimate = value.get("estimate")
    if estimate is not None:
        _object(estimate, "device.estimate")
        if "full_recompute_bytes" in estimate:
            _count(estimate["full_recompute_bytes"], "device.estimate.full_recompute_bytes")
    if value.get("binding") is not None and not isinstance(value["binding"], str):
        raise _bad("device.binding", "a string or null", value["binding"])
    return dict(value)


#: What a pipeline stage's plan records of the stage and schedule it was made for (NOTE [A stage's
#: address plan] in memo/pipeline/stage_plan.py): field -> its type.
PIPELINE_FIELDS = {"stage": int, "stages": int, "virtual_stages": int, "schedule": str, "micro_batches": int,
                   "chunk_layers": list}


def _check_pipeline(value: Any) -> dict[str, Any] | None:
    if _optional_object(value, "pipeline") is None:
        return None
    for key, kind in PIPELINE_FIELDS.items():
        got = value.get(key)
        if kind is list:
            if not isinstance(got, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                    for n in got):
                raise _bad(f"pipeline.{key}", "a list of layer counts", got)
        elif kind is int:
            _count(got, f"pipeline.{key}")
        elif not isinstance(got, kind):
            raise _bad(f"pipeline.{key}", f"a {kind.__name__}", got)
    return dict(value)


def _check_solver(value: Any) -> dict[str, Any]:
    """The solver record: free-form, but what `memo show` prints has the type it prints."""
    solver = _object(value, "solver")
    if not isinstance(solver.get("seconds", 0), (int, float)) or isinstance(solver.get("seconds"), bool):
        raise _bad("solver.seconds", "a number", solver["seconds"])
    stages = solver.get("stages") or ({"total": solver["total"]} if "total" in solver else {})
    for name, stage in _object(stages, "solver.stages").items():
        _object(stage, f"solver.stages[{name!r:.40}]")
        gap = stage.get("gap_to_lower_bound", 0)
        if isinstance(gap, bool) or not isinstance(gap, (int, float)):
            raise _bad(f"solver.stages[{name!r:.40}].gap_to_lower_bound", "a number", gap)
    return dict(solver)


def offload_difference(offload: Mapping[str, Any] | None) -> str | None:
    """A warning when the runtime copies over 1% more or less than planned, naming the largest
    tensors; None when they agree (or nothing is known)."""
    if not offload:
        return None
    planned, actual = offload["planned_bytes_per_layer"], offload["actual_bytes_per_layer"]
    if abs(actual - planned) <= 0.01 * max(planned, 1):
        return None
    largest = sorted(offload.get("tensors", []), key=lambda t: -t[1])[:5]
    names = "; ".join(f"{what} ({nbytes:,} B)" for what, nbytes in largest)
    return (f"memo: the runtime copies {actual:,} bytes per offloaded layer, the plan counted {planned:,} "
            f"({100 * (actual - planned) / max(planned, 1):+.1f}%); the largest copied tensors: {names}")


@dataclass
class Plan:
    """A memory plan for one trace.

    Attributes:
        meta: the trace's meta (model, fingerprint, seq_len, micro_batch, dtype, ...).
        allocations: the trace's allocations (lifetimes, sizes, phases, request indices).
        offsets: absolute arena offset (bytes) of each allocation, or None when unplanned.
        peak: arena size in bytes (max offset + size, rounded up to ALIGNMENT).
        lower_bound: most bytes live at one instant of the trace.
        no_reuse_bytes: arena needed without any reuse (sum of all planned sizes).
        level1: layer phase kind -> offsets relative to the layer block, by request index
            (None for requests the block does not hold: skeletal tensors, planned in ``items``).
        level1_peak: layer phase kind -> block height in bytes.
        level2: phase instance -> block offset, for the layer phases that reuse ``level1``.
        alpha, alpha_binding, alpha_detail: the alpha LP solution (None when not solved).
        host_bytes: pinned host memory the runtime needs (None when unknown).
        offload: per offloaded layer, what the profiler counted and what the wrapped pass really
            copied (NOTE [Planned and actual offload]); None when the plan did not wrap the model.
        policy: per layer "memo", "input-only", "recompute" or "keep" (NOTE [Layer policy]); None:
            the runtime's default.
        tile_tokens: tokens per tile of the memo and input-only layers' token-wise parts, as the
            policy chose them (NOTE [Tiles bounded by memory]); None: the runtime's default.
        pipeline: the pipeline stage and schedule the plan was made for (NOTE [A stage's address plan]
            in memo/pipeline/stage_plan.py); None: one iteration of a whole model.
        device: one rank's device memory (NOTE [Model states]): ``budget_bytes`` (None: no budget),
            ``model_states`` (None: not known, the total is the iteration's alone), ``activations_bytes``
            (= ``peak``), ``total_bytes``, the policy's ``estimate`` and the ``binding`` constraint
            (these two only from ``memo profile``).
        solver: how the plan was found (method, status, seconds, gap, heuristic_fallback, ...); a
            record for people, which no check branches on.
        unphased: "plan" when the allocations outside every phase are planned (and are in
            ``allocations``); "fallback" when the plan is for memo's allocator to replay and leaves
            them out (NOTE [Unphased allocations are not planned for replay]): checked against a
            trace, the trace is compared without them. Plan files written before this field read
            as "fallback" when their solver record says unphased allocations were left out.
        warnings: what the planner noticed (e.g. a layer phase that differs from the others).
    """

    meta: dict[str, Any]
    allocations: list[Allocation]
    offsets: list[int | None]
    peak: int
    lower_bound: int
    no_reuse_bytes: int
    level1: dict[str, list[int | None]] = field(default_factory=dict)
    level1_peak: dict[str, int] = field(default_factory=dict)
    level2: dict[str, int] = field(default_factory=dict)
    alpha: float | None = None
    alpha_binding: str | None = None
    alpha_detail: dict[str, Any] | None = None
    host_bytes: int | None = None
    offload: dict[str, Any] | None = None
    policy: list[str] | None = None
    tile_tokens: int | None = None
    device: dict[str, Any] | None = None
    pipeline: dict[str, Any] | None = None
    solver: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    end_time: int = 0
    unphased: str = "plan"

    # ------------------------------------------------------------- contract
    def phase_tables(self, include_unphased: bool = False) -> dict[str, list[tuple[int, int | None]]]:
        """For every phase instance, ``[(size, absolute offset or None), ...]`` by request index.

        This is what the planned allocator replays: the k-th request inside phase P gets
        ``phase_tables()[P][k]``'s offset when its size matches, the fallback allocator
        otherwise. Unphased allocations are planned (the peak accounts for them) but are
        served by the fallback allocator, so they are listed only with
        ``include_unphased=True``, under the key ``""``. In a plan made for replay, a phased
        allocation that outlives the traced iteration (a parameter gradient) keeps its request
        index with offset None: the fallback serves it (NOTE [Allocations that outlive the
        iteration] in planner/core.py).
        """
        tables: dict[str, list[tuple[int, int | None]]] = {}
        for a, off in zip(self.allocations, self.offsets, strict=True):
            key = a.phase if a.phase is not None else UNPHASED
            if a.phase is None and not include_unphased:
                continue
            tables.setdefault(key, []).append((a.size, off))
        return tables

    def addresses(self) -> dict[int, int]:
        """Trace id -> absolute offset, for every planned allocation.

        Raises MemoError when the trace reuses ids (then use :meth:`expanded`).
        """
        out: dict[int, int] = {}
        seen: set[int] = set()
        for a, off in zip(self.allocations, self.offsets, strict=True):
            if a.id in seen:
                raise MemoError(f"memo.plan: trace id {a.id} is used by more than one allocation; "
                                "addresses by id are ambiguous, use Plan.expanded() instead")
            seen.add(a.id)
            if off is not None:
                out[a.id] = off
        return out

    def expanded(self) -> dict[str, int | None]:
        """Offsets keyed ``"<id>"`` for an id's first allocation and ``"<id>.<n>"`` for its n-th reuse."""
        uses: dict[int, int] = {}
        out: dict[str, int | None] = {}
        for a, off in zip(self.allocations, self.offsets, strict=True):
            n = uses.get(a.id, 0)
            uses[a.id] = n + 1
            out[str(a.id) if n == 0 else f"{a.id}.{n}"] = off
        return out

    def phase_peaks(self) -> dict[str, int]:
        """Per phase instance: highest arena byte its allocations reach."""
        peaks: dict[str, int] = {}
        for a, off in zip(self.allocations, self.offsets, strict=True):
            if off is None:
                continue
            key = a.phase if a.phase is not None else "(unphased)"
            peaks[key] = max(peaks.get(key, 0), off + a.size)
        return peaks

    @property
    def ratio(self) -> float:
        return self.peak / self.lower_bound if self.lower_bound else 1.0

    # -------------------------------------------------------- (de)serialise
    def check_compatible(self, job: JobSpec, *, who: str = "memo.plan", hint: str = "") -> None:
        """PlanMismatchError unless this plan was made for ``job`` (:func:`memo.planner.job.job_mismatch`:
        the field that differs, both values, what to do; ``hint`` is added, e.g. "or drop --plan")."""
        problem = job_mismatch(self.meta, job)
        if problem is not None:
            raise PlanMismatchError(f"{who}: {problem}{', ' + hint if hint else ''}")

    def to_dict(self) -> dict[str, Any]:
        phases = list(dict.fromkeys(a.phase for a in self.allocations if a.phase is not None))
        phase_index: dict[str | None, int] = {p: i for i, p in enumerate(phases)}
        items: dict[str, dict[str, int | None]] = {}
        for a, off in zip(self.allocations, self.offsets, strict=True):
            if a.phase in self.level2:
                kind = phase_kind(a.phase)
                table = self.level1[kind]
                if a.request < len(table) and table[a.request] is not None:
                    continue
            key = a.phase if a.phase is not None else UNPHASED
            items.setdefault(key, {})[str(a.request)] = off
        return {
            "version": PLAN_VERSION,
            "kind": PLAN_KIND,
            "meta": dict(self.meta),
            "alignment": ALIGNMENT,
            "alpha": self.alpha,
            "alpha_binding": self.alpha_binding,
            "alpha_detail": self.alpha_detail,
            "host_bytes": self.host_bytes,
            "offload": self.offload,
            "policy": self.policy,
            "tile_tokens": self.tile_tokens,
            "device": self.device,
            "pipeline": self.pipeline,
            "peak": self.peak,
            "lower_bound": self.lower_bound,
            "no_reuse_bytes": self.no_reuse_bytes,
            "solver": self.solver,
            "warnings": list(self.warnings),
            "level1": {k: list(v) for k, v in self.level1.items()},
            "level1_peak": dict(self.level1_peak),
            "level2": dict(self.level2),
            "items": items,
            "phases": phases,
            "end_time": self.end_time,
            "unphased": self.unphased,
            # NOTE [A plan's summary] in planner/summary.py: what `memo show` prints without the rows
            "allocation_count": len(self.allocations),
            "phase_peaks": self.phase_peaks(),
            # [phase index or -1, request index, size, start, end, trace id], in malloc order.
            "allocations": [[phase_index.get(a.phase, -1), a.request, a.size, a.start, a.end, a.id]
                            for a in self.allocations],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from its JSON object and validate it; raises MemoError on any defect."""
        if not isinstance(data, Mapping):
            raise MemoError("memo.plan: a plan file must hold a JSON object")
        if data.get("kind", PLAN_KIND) != PLAN_KIND:
            raise MemoError(f"memo.plan: expected kind {PLAN_KIND!r}, got {data.get('kind')!r} "
                            "(is this a trace? plan it with `memo plan`)")
        if type(data.get("version")) is not int or data.get("version") != PLAN_VERSION:
            raise MemoError(f"memo.plan: unknown plan version {data.get('version')!r}; this memo reads "
                            f"version {PLAN_VERSION}. Re-run `memo profile` (or `memo plan`).")
        if data.get("alignment", ALIGNMENT) != ALIGNMENT:
            raise MemoError(f"memo.plan: plan alignment {data.get('alignment')!r:.80} != {ALIGNMENT}")
        try:
            plan = cls._from_checked(data)
        except MemoError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            raise MemoError(f"memo.plan: malformed plan file ({type(err).__name__}: {err}); "
                            "re-run `memo profile` or `memo plan`") from None
        validate_plan(plan)
        return plan

    @classmethod
    def _from_checked(cls, data: Mapping[str, Any]) -> Plan:
        """The plan of ``data``, every field checked for its type and range (a MemoError naming the
        field); what no check here foresaw is a KeyError or TypeError that from_dict reports."""
        for name in ("phases", "level1", "level2", "items", "allocations", "peak", "lower_bound",
                     "no_reuse_bytes"):
            if name not in data:
                raise MemoError(f"memo.plan: no {name!r} field; {_DAMAGED}")
        phases = data["phases"]
        if not isinstance(phases, list) or not all(isinstance(p, str) for p in phases):
            raise _bad("phases", "a list of phase names", phases)
        for i, p in enumerate(phases):
            _phase(p, f"phases[{i}]")
        level1 = {}
        for kind, table in _object(data["level1"], "level1").items():
            if kind not in LAYER_KINDS:
                raise _bad("a key of level1", f"one of {LAYER_KINDS}", kind)
            if not isinstance(table, list):
                raise _bad(f"level1.{kind}", "a list of offsets", table)
            level1[kind] = [_offset(o, f"level1.{kind}[{r}]") for r, o in enumerate(table)]
        level2 = {}
        for p, o in _object(data["level2"], "level2").items():
            level2[_phase(p, "a key of level2")] = _count(o, f"level2.{p}")
        items: dict[str, dict[int, int | None]] = {}
        for phase, table in _object(data["items"], "items").items():
            if phase != UNPHASED:
                _phase(phase, "a key of items")
            requests = items[phase] = {}
            for r, o in _object(table, f"items.{phase}").items():
                if not (r.isascii() and r.isdigit()):
                    raise _bad(f"items.{phase}", "an object keyed by request index", r)
                requests[int(r)] = _offset(o, f"items.{phase}.{r}")
        allocations = _allocations(data["allocations"], phases)
        offsets = _offsets(allocations, level1, level2, items)
        fields = summary_fields(data)
        detail = data.get("alpha_detail")
        # Plans written before the field said so only in their solver record.
        old_default = "fallback" if "unphased_left_to_fallback" in fields["solver"] else "plan"
        unphased = data.get("unphased", old_default)
        if unphased not in UNPHASED_MODES:
            raise _bad("unphased", "'plan' or 'fallback'", unphased)
        plan = cls(
            allocations=allocations,
            offsets=offsets,
            level1=level1,
            level2=level2,
            alpha_detail=None if detail is None else dict(_object(detail, "alpha_detail")),
            end_time=_count(data.get("end_time", 0), "end_time"),
            unphased=unphased,
            **fields,
        )
        # NOTE [A plan's summary]: what a summary reader takes on trust must be what the rows give
        count, peaks = data.get("allocation_count"), data.get("phase_peaks")
        if count is not None and count != len(allocations):
            raise _bad("allocation_count", f"the {len(allocations):,} rows' count", count)
        if peaks is not None and peaks != plan.phase_peaks():
            raise _bad("phase_peaks", "the peaks its allocations reach", peaks)
        return plan


def summary_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a plan dict that describe it rather than place its allocations, checked: what
    :meth:`Plan.from_dict` and a plan's summary (NOTE [A plan's summary] in planner/summary.py) share."""
    level1_peak = {}
    for kind, height in _object(data.get("level1_peak", {}), "level1_peak").items():
        if kind not in LAYER_KINDS:
            raise _bad("a key of level1_peak", f"one of {LAYER_KINDS}", kind)
        level1_peak[kind] = _count(height, f"level1_peak.{kind}")
    alpha = data.get("alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise MemoError(f"memo.plan: alpha must be a number in [0, 1], got {alpha!r:.80}; {_DAMAGED}")
    binding = data.get("alpha_binding")
    if binding is not None and not isinstance(binding, str):
        raise _bad("alpha_binding", "a string or null", binding)
    warnings = data.get("warnings") or []
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        raise _bad("warnings", "a list of strings", warnings)
    return {
        "meta": validate_meta(data.get("meta") or {}, "memo.plan"),
        "peak": _count(data.get("peak"), "peak"),
        "lower_bound": _count(data.get("lower_bound"), "lower_bound"),
        "no_reuse_bytes": _count(data.get("no_reuse_bytes"), "no_reuse_bytes"),
        "level1_peak": level1_peak,
        "alpha": None if alpha is None else float(alpha),
        "alpha_binding": binding,
        "host_bytes": None if data.get("host_bytes") is None else _count(data["host_bytes"], "host_bytes"),
        "offload": _check_offload(data.get("offload")),
        "policy": _check_policy(data.get("policy")),
        "tile_tokens": _check_tile(data.get("tile_tokens")),
        "device": _check_device(data.get("device")),
        "pipeline": _check_pipeline(data.get("pipeline")),
        "solver": _check_solver(data.get("solver") or {}),
        "warnings": list(warnings),
    }


def _allocations(rows: Any, phases: list[str]) -> list[Allocation]:
    """A plan's ``allocations`` rows, ``[phase index or -1, request, size, start, end, id]``, checked."""
    if not isinstance(rows, list):
        raise _bad("allocations", "a list", rows)
    checked = _checked_rows(rows, len(phases))
    if checked is not None:
        names: list[str | None] = [*phases, None]  # index -1: unphased
        return [Allocation(i, ident, size, start, end, names[pi], request, False)
                for i, (pi, request, size, start, end, ident) in enumerate(checked)]
    allocations = []
    for index, row in enumerate(rows):
        where = f"allocations[{index}]"
        if not isinstance(row, list) or len(row) != 6:
            raise _bad(where, "[phase index, request, size, start, end, id]", row)
        # -1 is "unphased"; below it Python's negative indexing would pick another phase.
        pi = _count(row[0], f"{where}[0] (phase index)", low=-1)
        if pi >= len(phases):
            raise _bad(f"{where}[0] (phase index)", f"below the {len(phases)} phases", pi)
        request, start, end = (_count(row[i], f"{where}[{i}]") for i in (1, 3, 4))
        size = _count(row[2], f"{where}[2] (size)", low=1)
        if isinstance(row[5], bool) or not isinstance(row[5], int):
            raise _bad(f"{where}[5] (id)", "an integer", row[5])
        allocations.append(Allocation(index, row[5], size, start, end, phases[pi] if pi >= 0 else None,
                                      request, False))
    return allocations


def _checked_rows(rows: list[Any], n_phases: int) -> list[list[int]] | None:
    """The rows as ints when every one is valid, checked a column at a time (a plan of a million
    allocations took 20 s checked row by row); None when any is not, and the row-by-row check then
    names the first bad one."""
    if not rows:
        return []
    if set(map(type, rows)) != {list} or set(map(len, rows)) != {6}:
        return None
    if set(map(type, itertools.chain.from_iterable(rows))) != {int}:  # no bool, float, None, str
        return None
    try:
        table = np.array(rows, dtype=np.int64)
    except OverflowError:
        return None
    low = np.array([-1, 0, 1, 0, 0, np.iinfo(np.int64).min])
    high = np.array([n_phases, MAX_BYTES, MAX_BYTES, MAX_BYTES, MAX_BYTES, np.iinfo(np.int64).max])
    if not ((table >= low).all() and (table[:, :5] < high[:5]).all()):
        return None
    return table.tolist()  # type: ignore[no-any-return]


def _offsets(allocations: list[Allocation], level1: dict[str, list[int | None]], level2: dict[str, int],
             items: dict[str, dict[int, int | None]]) -> list[int | None]:
    """Every allocation's absolute offset: its layer block's plus its level-1 offset, or its own."""
    offsets: list[int | None] = []
    for a in allocations:
        key = a.phase if a.phase is not None else UNPHASED
        off = None
        if a.phase in level2:
            if phase_kind(a.phase) not in level1:
                raise MemoError(f"memo.plan: level2 places phase {a.phase!r} as a layer block, but "
                                f"level1 has no block for {phase_kind(a.phase)!r}; {_DAMAGED}")
            table = level1[phase_kind(a.phase)]
            inner = table[a.request] if a.request < len(table) else None
            if inner is not None:
                off = level2[a.phase] + inner
        if off is None:
            if a.request not in items.get(key, {}):
                raise MemoError(f"memo.plan: no offset for request {a.request} of phase "
                                f"{key or '(unphased)'!r}")
            off = items[key][a.request]
        offsets.append(off)
    return offsets


def _validate_numbers(plan: Plan) -> None:
    """alpha a finite number in [0, 1], the byte counts and the end time integers >= 0 and below
    2**62 (NOTE [Byte counts are bounded] in memo/units.py)."""
    a = plan.alpha
    if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a)
                          or not 0 <= a <= 1):
        raise MemoError(f"memo.plan: alpha must be a number in [0, 1], got {a!r}; the file is damaged or "
                        "edited by hand: re-run `memo profile`")
    for name in ("peak", "lower_bound", "no_reuse_bytes", "host_bytes", "end_time"):
        if getattr(plan, name) is not None:
            _count(getattr(plan, name), name)


def validate_plan(plan: Plan, trace: Trace | None = None) -> None:
    """Check a plan: offsets aligned, inside the arena, and no two live allocations share a byte.

    With ``trace``, also check the plan was made for exactly these allocations.
    Raises MemoError naming the first violation.
    """
    if plan.unphased not in UNPHASED_MODES:
        raise MemoError(f"memo.plan: unphased must be 'plan' or 'fallback', got {plan.unphased!r}")
    if trace is not None:
        if plan.unphased == "fallback":
            # NOTE [Unphased allocations are not planned for replay].
            trace = without_unphased(trace)[0]
        mine = [(a.size, a.start, a.end, a.phase, a.request) for a in plan.allocations]
        theirs = [(a.size, a.start, a.end, a.phase, a.request) for a in trace.allocations]
        if mine != theirs:
            first = next((i for i, (m, t) in enumerate(zip(mine, theirs, strict=False)) if m != t),
                         min(len(mine), len(theirs)))
            raise PlanMismatchError(f"memo.plan: the plan does not match the trace (allocation {first} "
                                    f"differs; plan has {len(mine)} allocations, trace {len(theirs)}); "
                                    "re-run `memo plan` on this trace")
        if "persistent_left_to_fallback" in plan.solver and plan.end_time != trace.end_time:
            raise PlanMismatchError(f"memo.plan: the plan's trace ends at event {plan.end_time}, this trace "
                                    f"at event {trace.end_time}; re-run `memo plan` on this trace")
    _validate_numbers(plan)
    if len(plan.offsets) != len(plan.allocations):
        raise MemoError(f"memo.plan: {len(plan.offsets)} offsets for {len(plan.allocations)} allocations")
    if "persistent_left_to_fallback" in plan.solver:
        _validate_left_out(plan)
    if plan.peak % ALIGNMENT:
        raise MemoError(f"memo.plan: arena size {plan.peak} is not a multiple of {ALIGNMENT}")
    planned = [(a, off) for a, off in zip(plan.allocations, plan.offsets, strict=True) if off is not None]
    for a, off in planned:
        if off % ALIGNMENT:
            raise MemoError(f"memo.plan: allocation {a.index} (id {a.id}, phase {a.phase}) has offset {off}, "
                            f"not a multiple of {ALIGNMENT}")
    problem = check_placement([Item(a.size, a.start, a.end) for a, _ in planned],
                              [off for _, off in planned], plan.peak)
    if problem is not None:
        raise MemoError(f"memo.plan: invalid plan: {problem} (allocations indexed among planned ones)")
    if planned and plan.lower_bound > plan.peak:
        raise MemoError(f"memo.plan: peak {plan.peak} is below the lower bound {plan.lower_bound}")


def _validate_left_out(plan: Plan) -> None:
    """A replay plan leaves exactly the phased allocations that outlive the iteration to the
    fallback (but for the gradients of a plan that places them in the arena), and records their
    count and bytes (NOTE [Allocations that outlive the iteration])."""
    record = plan.solver["persistent_left_to_fallback"]
    in_arena = plan.solver.get("gradients_in_arena")
    count, nbytes, placed, placed_bytes = 0, 0, 0, 0
    for a, off in zip(plan.allocations, plan.offsets, strict=True):
        outlives = a.phase is not None and a.end == plan.end_time
        planned_here = outlives and in_arena is not None and is_backward_phase(a.phase)
        if off is None and not outlives:
            where = f"freed at event {a.end}" if a.end != plan.end_time else "unphased"
            raise MemoError(f"memo.plan: allocation {a.index} (phase {a.phase}, request {a.request}) has no "
                            f"offset but is {where}; a replay plan leaves only allocations that outlive "
                            "the iteration to the fallback allocator")
        if off is not None and outlives and not planned_here:
            raise MemoError(f"memo.plan: allocation {a.index} (phase {a.phase}, request {a.request}) is "
                            "never freed in the trace but has an arena offset in a replay plan")
        if off is None and planned_here:
            raise MemoError(f"memo.plan: allocation {a.index} (phase {a.phase}, request {a.request}) is a "
                            "gradient of a plan that places them in the arena, but has no offset")
        if off is None:
            count, nbytes = count + 1, nbytes + a.size
        elif planned_here:
            placed, placed_bytes = placed + 1, placed_bytes + a.size
    if not isinstance(record, Mapping) or record.get("allocations") != count or record.get("bytes") != nbytes:
        raise MemoError(f"memo.plan: solver.persistent_left_to_fallback is {record!r}, but the plan leaves "
                        f"{count} allocations ({nbytes} bytes) to the fallback allocator")
    if in_arena is not None and (not isinstance(in_arena, Mapping) or in_arena.get("allocations") != placed
                                 or in_arena.get("bytes") != placed_bytes):
        raise MemoError(f"memo.plan: solver.gradients_in_arena is {in_arena!r}, but the plan places "
                        f"{placed} gradients ({placed_bytes} bytes) in the arena")


def without_unphased(trace: Trace | Mapping[str, Any]) -> tuple[Trace, int, int]:
    """The trace without allocations made outside every phase; also their count and bytes.

    NOTE [Unphased allocations are not planned for replay]
    memo's allocator serves a request from the arena only inside a phase (it selects the
    offset by phase and request index); everything else (parameters, optimizer state, data,
    the runtime's one-time buffers) goes to its fallback. Placing those in the plan would only
    make the arena bigger than anything it ever hands out.
    """
    t = trace if isinstance(trace, Trace) else Trace.from_dict(trace)
    data = t.to_dict()
    dropped: set[Any] = set()
    events, count, nbytes = [], 0, 0
    for ev in data["events"]:
        if ev["op"] == "malloc" and ev.get("phase") is None:
            dropped.add(ev["id"])
            count, nbytes = count + 1, nbytes + int(ev["size"])
            continue
        if ev["op"] == "free" and ev["id"] in dropped:
            dropped.discard(ev["id"])
            continue
        events.append(ev)
    data["events"] = events
    return Trace.from_dict(data), count, nbytes


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Validate ``plan`` and write it as JSON."""
    validate_plan(plan)
    data = plan.to_dict()
    allocations = data.pop("allocations")
    head = json.dumps(data, indent=1)[:-2]
    with atomic_write(path, "memo.plan") as f:
        f.write(head + ',\n "allocations": [\n')
        f.write(",\n".join(json.dumps(row) for row in allocations))
        f.write("\n ]\n}\n")


def load_plan(path: str | os.PathLike[str], *, fingerprint: str | None = None, seq_len: int | None = None,
              micro_batch: int | None = None, dtype: str | None = None, tensor_parallel: int | None = None,
              context_parallel: int | None = None) -> Plan:
    """Read, rebuild and validate a plan; check it was made for the caller's job.

    Every keyword that is not None must equal the plan's meta value, otherwise
    PlanMismatchError names the field and both values. ``seq_len`` is the job's whole sequence;
    ``tensor_parallel`` and ``context_parallel`` are the group sizes the plan's rank belongs to
    (1 for a plan that does not record them).
    """
    plan = Plan.from_dict(read_json(path, "memo.plan", "make one with `memo profile`"))
    job = JobSpec(fingerprint=fingerprint, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                  tensor_parallel=tensor_parallel, context_parallel=context_parallel)
    plan.check_compatible(job, who=f"memo.plan: plan {os.fspath(path)!r}")
    return plan
