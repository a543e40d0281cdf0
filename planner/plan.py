"""Plan files: where every planned allocation of a trace lives in the arena.

The layout is documented in docs/formats.md ("Plan"). A :class:`Plan` keeps a
compact copy of the trace's lifetimes (``allocations``) so a plan file alone is
enough to rebuild every offset, validate it (no two live allocations share a
byte) and plot it. Every plan is validated when it is saved and when it is loaded.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memo.errors import MemoError, PlanMismatchError
from memo.jsonio import atomic_write, read_json
from memo.phase_names import is_backward_phase, phase_kind
from memo.units import ALIGNMENT  # NOTE [Block alignment]

from .dsa import Item, check_placement
from .job import JobSpec, job_mismatch
from .plan_fields import (
    DAMAGED,
    LAYER_KINDS,
    UNPHASED,
    allocation_rows,
    bad_field,
    byte_count,
    json_object,
    optional_offset,
    phase_name,
    summary_fields,
)
from .trace import Allocation, PhaseRun, Trace

__all__ = ["ALIGNMENT", "PLAN_KIND", "PLAN_VERSION", "UNPHASED_MODES", "Plan", "load_plan",
           "offload_difference", "save_plan", "validate_plan", "without_unphased"]

PLAN_VERSION = 1
PLAN_KIND = "memo.plan"
#: ``Plan.unphased``: "plan" places the allocations made outside every phase too; "fallback" (a plan
#: for memo's allocator to replay) leaves them out (NOTE [Unphased allocations are not planned for
#: replay]).
UNPHASED_MODES = ("plan", "fallback")


# NOTE [Planned and actual offload]
# ``Plan.offload`` records, for one offloaded layer, the bytes the alpha LP counted
# (S_input + S_attn + a/s S_others, a = floor(alpha s)) and the bytes memo's runtime copied in
# the profile's wrapped pass, with the tensors it copied. They agree when the profiler and the
# runtime apply the same rule (NOTE [One truth for saved bytes] in memo/profiler/saved.py);
# `memo show` and `memo train` warn, naming the largest tensors, when they differ by over 1%.


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
            trace, the trace is compared without them. A plan file without this field reads
            as "fallback" when its solver record says unphased allocations were left out.
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
        iteration] in planner/outliving.py).
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
                raise MemoError(f"memo.plan: no {name!r} field; {DAMAGED}")
        phases = data["phases"]
        if not isinstance(phases, list) or not all(isinstance(p, str) for p in phases):
            raise bad_field("phases", "a list of phase names", phases)
        for i, p in enumerate(phases):
            phase_name(p, f"phases[{i}]")
        level1 = {}
        for kind, table in json_object(data["level1"], "level1").items():
            if kind not in LAYER_KINDS:
                raise bad_field("a key of level1", f"one of {LAYER_KINDS}", kind)
            if not isinstance(table, list):
                raise bad_field(f"level1.{kind}", "a list of offsets", table)
            level1[kind] = [optional_offset(o, f"level1.{kind}[{r}]") for r, o in enumerate(table)]
        level2 = {}
        for p, o in json_object(data["level2"], "level2").items():
            level2[phase_name(p, "a key of level2")] = byte_count(o, f"level2.{p}")
        items: dict[str, dict[int, int | None]] = {}
        for phase, table in json_object(data["items"], "items").items():
            if phase != UNPHASED:
                phase_name(phase, "a key of items")
            requests = items[phase] = {}
            for r, o in json_object(table, f"items.{phase}").items():
                if not (r.isascii() and r.isdigit()):
                    raise bad_field(f"items.{phase}", "an object keyed by request index", r)
                requests[int(r)] = optional_offset(o, f"items.{phase}.{r}")
        allocations = allocation_rows(data["allocations"], phases)
        offsets = _offsets(allocations, level1, level2, items)
        fields = summary_fields(data)
        detail = data.get("alpha_detail")
        # A plan without the field says so only in its solver record.
        old_default = "fallback" if "unphased_left_to_fallback" in fields["solver"] else "plan"
        unphased = data.get("unphased", old_default)
        if unphased not in UNPHASED_MODES:
            raise bad_field("unphased", "'plan' or 'fallback'", unphased)
        plan = cls(
            allocations=allocations,
            offsets=offsets,
            level1=level1,
            level2=level2,
            alpha_detail=None if detail is None else dict(json_object(detail, "alpha_detail")),
            end_time=byte_count(data.get("end_time", 0), "end_time"),
            unphased=unphased,
            **fields,
        )
        # NOTE [A plan's summary]: what a summary reader takes on trust must be what the rows give
        count, peaks = data.get("allocation_count"), data.get("phase_peaks")
        if count is not None and count != len(allocations):
            raise bad_field("allocation_count", f"the {len(allocations):,} rows' count", count)
        if peaks is not None and peaks != plan.phase_peaks():
            raise bad_field("phase_peaks", "the peaks its allocations reach", peaks)
        return plan



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
                                f"level1 has no block for {phase_kind(a.phase)!r}; {DAMAGED}")
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
            byte_count(getattr(plan, name), name)


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
    gone = [a for a in t.allocations if a.phase is None]
    if not gone:
        return t, 0, 0
    return _dropped(t, gone), len(gone), sum(a.size for a in gone)


def _dropped(t: Trace, gone: list[Allocation]) -> Trace:
    """``t`` without the allocations ``gone`` (their mallocs and frees), parsed from ``t``'s parse.

    NOTE [A trace less its unphased allocations]
    Parsing the events again is the same answer at the cost of a parse (~10 CPU s at 1.5M events),
    and the rest follows from ``t``'s parse: every other event's time moves down by the dropped events
    before it, the others' request indices stay (requests count per phase, and the dropped ones are
    all of phase None), and the runs are those of the remaining mallocs' phases (NOTE [Phase runs] in
    planner/trace.py): a run starts at each malloc whose phase is not the previous malloc's, and an
    allocation is transient when it is freed before the next such malloc.
    tests/planner/test_trace.py compares it with parsing the remaining events.
    """
    dropped_times = sorted([a.start for a in gone] + [a.end for a in gone if a.end < t.end_time])
    dropped = {a.index for a in gone}
    gone_times = set(dropped_times)
    # Built without __post_init__: t's events, meta and layers were validated when t was parsed.
    shift = Trace.__new__(Trace)
    shift.events = [ev for i, ev in enumerate(t.events) if i not in gone_times]
    shift.meta, shift.layers = dict(t.meta), None if t.layers is None else dict(t.layers)
    shift.end_time = t.end_time - len(dropped_times)

    def moved(time: int) -> int:
        return time - bisect.bisect_left(dropped_times, time)

    kept = [a for a in t.allocations if a.index not in dropped]
    starts = [moved(a.start) for a in kept]
    runs: list[PhaseRun] = []
    run_of: list[int] = []  # per kept malloc: runs started before it (its run's number)
    current: str | None = None
    run_start = 0
    for a, start in zip(kept, starts, strict=True):
        if a.phase != current or start == 0:
            if start > run_start or runs:
                runs.append(PhaseRun(current, run_start, start))
            current, run_start = a.phase, start
        run_of.append(len(runs))
    runs.append(PhaseRun(current, run_start, shift.end_time))
    allocations = []
    for k, (a, start) in enumerate(zip(kept, starts, strict=True)):
        freed = a.end < t.end_time
        end = moved(a.end) if freed else shift.end_time
        # The run the free falls in: that of the last malloc before it.
        transient = a.phase is not None and freed and run_of[bisect.bisect_left(starts, end) - 1] == run_of[k]
        allocations.append(Allocation(k, a.id, a.size, start, end, a.phase, a.request, transient))
    shift.allocations = allocations
    shift.runs = [r for r in runs if r.stop > r.start]
    return shift


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
