"""The fields of a plan file (docs/formats.md, "Plan"), each checked for its type and range as it is
read: a MemoError names the field, what it must be and what it holds. :class:`~memo.planner.plan.Plan`
and a plan's summary (NOTE [A plan's summary] in planner/summary.py) read their fields through these.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from memo.errors import MemoError
from memo.phase_names import parse_phase
from memo.units import MAX_BYTES

from .trace import Allocation, validate_meta

__all__ = ["DAMAGED", "LAYER_KINDS", "OFFLOAD_KEYS", "PIPELINE_FIELDS", "UNPHASED", "allocation_rows",
           "bad_field", "byte_count", "json_object", "optional_offset", "phase_name", "summary_fields"]

# The unphased "phase" key in plan files (phase tables leave it out unless asked).
UNPHASED = ""
#: The phase kinds a level-1 layer block is planned for (planner/bilevel.py).
LAYER_KINDS = ("layer.fwd", "layer.bwd")
#: What ``Plan.offload`` records of one offloaded layer (NOTE [Planned and actual offload] in
#: planner/plan.py), besides the tensors the runtime copied.
OFFLOAD_KEYS = ("offloaded_layers", "planned_bytes_per_layer", "actual_bytes_per_layer")
DAMAGED = "the file is damaged or edited by hand: re-run `memo profile` (or `memo plan`)"


def bad_field(where: str, expected: str, value: object) -> MemoError:
    """The error for a field that does not hold what it must."""
    return MemoError(f"memo.plan: {where} must be {expected}, got {value!r:.80}; {DAMAGED}")


def byte_count(value: object, where: str, low: int = 0) -> int:
    """``value`` when it is an integer in [low, 2**62) (NOTE [Byte counts are bounded])."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad_field(where, f"an integer >= {low}", value)
    if value >= MAX_BYTES:
        raise MemoError(f"memo.plan: {where} is {value}, not below 2**62 (4 EiB); {DAMAGED}")
    return value


def optional_offset(value: object, where: str) -> int | None:
    """An offset or None (a request its table does not place)."""
    return None if value is None else byte_count(value, where)


def phase_name(name: object, where: str) -> str:
    """``name`` when it is a phase instance's name."""
    try:
        parse_phase(name)  # type: ignore[arg-type]  # it refuses anything but a str by name
    except MemoError as err:
        raise MemoError(f"memo.plan: {where}: {err}") from None
    return cast(str, name)


def json_object(value: object, where: str) -> dict[str, Any]:
    """``value`` when it is a JSON object."""
    if not isinstance(value, dict):
        raise bad_field(where, "an object", value)
    return value


def _optional_object(value: object, name: str) -> Mapping[str, Any] | None:
    """An optional object field of a plan: None, or a mapping (else the field is named)."""
    if value is not None and not isinstance(value, Mapping):
        raise MemoError(f"memo.plan: {name!r} must be an object, got {type(value).__name__}")
    return value


def _check_offload(field: object) -> dict[str, Any] | None:
    value = _optional_object(field, "offload")
    if value is None:
        return None
    out: dict[str, Any] = {}
    for key in OFFLOAD_KEYS:
        out[key] = byte_count(value.get(key), f"offload.{key}")
    tensors = value.get("tensors", [])
    if not isinstance(tensors, list) or not all(
            isinstance(t, (list, tuple)) and len(t) == 2 and isinstance(t[0], str)
            and isinstance(t[1], int) and not isinstance(t[1], bool) and 0 <= t[1] < MAX_BYTES
            for t in tensors):
        raise MemoError("memo.plan: offload.tensors must be a list of [description, bytes]; "
                        "re-run `memo profile`")
    out["tensors"] = [[str(t[0]), int(t[1])] for t in tensors]
    return out


def _check_policy(value: object) -> list[str] | None:
    if value is None:
        return None
    from .policy import validate_policy

    try:
        return validate_policy(value)
    except MemoError as err:
        raise MemoError(f"memo.plan: bad 'policy' ({err}); re-run `memo profile`") from None


def _check_tile(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemoError(f"memo.plan: bad 'tile_tokens' (a positive number of tokens or null), got {value!r}; "
                        "re-run `memo profile`")
    return value


def _check_device(field: object) -> dict[str, Any] | None:
    value = _optional_object(field, "device")
    if value is None:
        return None
    budget = value.get("budget_bytes")
    if budget is not None:
        byte_count(budget, "device.budget_bytes", low=1)
    for key in ("activations_bytes", "total_bytes"):
        byte_count(value.get(key), f"device.{key}")
    if value.get("iteration_peak_bytes") is not None:
        byte_count(value["iteration_peak_bytes"], "device.iteration_peak_bytes")
    states = value.get("model_states")  # null: not known (`memo plan` of a trace that records none)
    for part in ("parameters", "gradients", "optimizer") if states is not None else ():
        entry = states.get(part) if isinstance(states, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype", ""), str):
            raise MemoError("memo.plan: device.model_states must give parameters, gradients and optimizer "
                            "bytes, or be null; re-run `memo profile`")
        byte_count(entry.get("bytes"), f"device.model_states.{part}.bytes")
    estimate = value.get("estimate")
    if estimate is not None:
        json_object(estimate, "device.estimate")
        if "full_recompute_bytes" in estimate:
            byte_count(estimate["full_recompute_bytes"], "device.estimate.full_recompute_bytes")
    if value.get("binding") is not None and not isinstance(value["binding"], str):
        raise bad_field("device.binding", "a string or null", value["binding"])
    return dict(value)


#: What a pipeline stage's plan records of the stage and schedule it was made for (NOTE [A stage's
#: address plan] in memo/pipeline/stage_plan.py): field -> its type.
PIPELINE_FIELDS = {"stage": int, "stages": int, "virtual_stages": int, "schedule": str, "micro_batches": int,
                   "chunk_layers": list}


def _check_pipeline(field: object) -> dict[str, Any] | None:
    value = _optional_object(field, "pipeline")
    if value is None:
        return None
    for key, kind in PIPELINE_FIELDS.items():
        got = value.get(key)
        if kind is list:
            if not isinstance(got, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                    for n in got):
                raise bad_field(f"pipeline.{key}", "a list of layer counts", got)
        elif kind is int:
            byte_count(got, f"pipeline.{key}")
        elif not isinstance(got, kind):
            raise bad_field(f"pipeline.{key}", f"a {kind.__name__}", got)
    return dict(value)


def _check_solver(value: object) -> dict[str, Any]:
    """The solver record: free-form, but what `memo show` prints has the type it prints."""
    solver = json_object(value, "solver")
    if not isinstance(solver.get("seconds", 0), (int, float)) or isinstance(solver.get("seconds"), bool):
        raise bad_field("solver.seconds", "a number", solver["seconds"])
    stages = solver.get("stages") or ({"total": solver["total"]} if "total" in solver else {})
    for name, stage in json_object(stages, "solver.stages").items():
        json_object(stage, f"solver.stages[{name!r:.40}]")
        gap = stage.get("gap_to_lower_bound", 0)
        if isinstance(gap, bool) or not isinstance(gap, (int, float)):
            raise bad_field(f"solver.stages[{name!r:.40}].gap_to_lower_bound", "a number", gap)
    return dict(solver)


def summary_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a plan dict that describe it rather than place its allocations, checked: what
    :meth:`Plan.from_dict` and a plan's summary (NOTE [A plan's summary] in planner/summary.py) share."""
    level1_peak = {}
    for kind, height in json_object(data.get("level1_peak", {}), "level1_peak").items():
        if kind not in LAYER_KINDS:
            raise bad_field("a key of level1_peak", f"one of {LAYER_KINDS}", kind)
        level1_peak[kind] = byte_count(height, f"level1_peak.{kind}")
    alpha = data.get("alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise MemoError(f"memo.plan: alpha must be a number in [0, 1], got {alpha!r:.80}; {DAMAGED}")
    binding = data.get("alpha_binding")
    if binding is not None and not isinstance(binding, str):
        raise bad_field("alpha_binding", "a string or null", binding)
    warnings = data.get("warnings") or []
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        raise bad_field("warnings", "a list of strings", warnings)
    return {
        "meta": validate_meta(data.get("meta") or {}, "memo.plan"),
        "peak": byte_count(data.get("peak"), "peak"),
        "lower_bound": byte_count(data.get("lower_bound"), "lower_bound"),
        "no_reuse_bytes": byte_count(data.get("no_reuse_bytes"), "no_reuse_bytes"),
        "level1_peak": level1_peak,
        "alpha": None if alpha is None else float(alpha),
        "alpha_binding": binding,
        "host_bytes": None if data.get("host_bytes") is None else byte_count(data["host_bytes"],
                                                                             "host_bytes"),
        "offload": _check_offload(data.get("offload")),
        "policy": _check_policy(data.get("policy")),
        "tile_tokens": _check_tile(data.get("tile_tokens")),
        "device": _check_device(data.get("device")),
        "pipeline": _check_pipeline(data.get("pipeline")),
        "solver": _check_solver(data.get("solver") or {}),
        "warnings": list(warnings),
    }


def allocation_rows(rows: object, phases: list[str]) -> list[Allocation]:
    """A plan's ``allocations`` rows, ``[phase index or -1, request, size, start, end, id]``, checked."""
    if not isinstance(rows, list):
        raise bad_field("allocations", "a list", rows)
    checked = _checked_rows(rows, len(phases))
    if checked is not None:
        names: list[str | None] = [*phases, None]  # index -1: unphased
        return [Allocation(i, ident, size, start, end, names[pi], request, False)
                for i, (pi, request, size, start, end, ident) in enumerate(checked)]
    allocations = []
    for index, row in enumerate(rows):
        where = f"allocations[{index}]"
        if not isinstance(row, list) or len(row) != 6:
            raise bad_field(where, "[phase index, request, size, start, end, id]", row)
        # -1 is "unphased"; below it Python's negative indexing would pick another phase.
        pi = byte_count(row[0], f"{where}[0] (phase index)", low=-1)
        if pi >= len(phases):
            raise bad_field(f"{where}[0] (phase index)", f"below the {len(phases)} phases", pi)
        request, start, end = (byte_count(row[i], f"{where}[{i}]") for i in (1, 3, 4))
        size = byte_count(row[2], f"{where}[2] (size)", low=1)
        if isinstance(row[5], bool) or not isinstance(row[5], int):
            raise bad_field(f"{where}[5] (id)", "an integer", row[5])
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


