"""Training reports: the versioned JSON that ``memo train --report`` writes, validated on load.

Schema (version 1; docs/report.md has the prose)::

    {
      "version": 1, "kind": "memo.report",
      "model": str, "seq_len": int, "micro_batch": int, "device": str, "dtype": str,
      "strategy": "none" | "full-recompute" | "full-offload" | "memo",
      "alpha": float | null,                 # null for strategies without memo's wrapper
      "steps": [{"step": int, "loss": float, "step_time_s": float, "tgs": float,
                 "mfu": float | null, "peak_device_bytes": int | null}, ...],
      "peak_device_bytes": int | null,       # max over steps
      "peak_device_kind": str,               # what was measured (see memo.train)
      "host_pinned_bytes": int,              # rounding-buffer host arena (0 without memo)
      "allocator": {"planned": int, "fallback": int},
      ...                                    # more keys are allowed and kept
    }
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memo.errors import MemoError
from memo.jsonio import read_json

__all__ = ["REPORT_KIND", "REPORT_VERSION", "STRATEGIES", "load_report", "save_report", "validate_report"]

REPORT_VERSION = 1
REPORT_KIND = "memo.report"
#: Activation-memory strategies ``memo train`` knows, in the order tables list them.
STRATEGIES = ("none", "full-recompute", "full-offload", "memo")

_INT = (int,)
_NUM = (int, float)

# field -> (types, nullable)
_TOP = {
    "model": ((str,), False),
    "seq_len": (_INT, False),
    "micro_batch": (_INT, False),
    "device": ((str,), False),
    "dtype": ((str,), False),
    "strategy": ((str,), False),
    "alpha": (_NUM, True),
    "steps": ((list,), False),
    "peak_device_bytes": (_INT, True),
    "peak_device_kind": ((str,), False),
    "host_pinned_bytes": (_INT, False),
    "allocator": ((dict,), False),
}
_STEP = {
    "step": (_INT, False),
    "loss": (_NUM, False),
    "step_time_s": (_NUM, False),
    "tgs": (_NUM, False),
    "mfu": (_NUM, True),
    "peak_device_bytes": (_INT, True),
}


def _check_fields(
    obj: Mapping[str, Any], fields: Mapping[str, tuple[tuple[type, ...], bool]], where: str
) -> None:
    for name, (types, nullable) in fields.items():
        if name not in obj:
            raise MemoError(f"memo.report: {where} has no {name!r} field; was it written by `memo train`?")
        value = obj[name]
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            kind = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
            raise MemoError(f"memo.report: {where}.{name} must be {kind}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise MemoError(f"memo.report: {where}.{name} must be finite, got {value!r}")


def validate_report(report: Any) -> dict[str, Any]:
    """Check ``report`` against the version-1 schema; return it, or raise :class:`MemoError`."""
    if not isinstance(report, dict):
        raise MemoError(f"memo.report: a report is a JSON object, got {type(report).__name__}")
    if report.get("version") != REPORT_VERSION:
        raise MemoError(
            f"memo.report: unknown report version {report.get('version')!r}; this memo reads version "
            f"{REPORT_VERSION}. Re-run `memo train --report` with this version of memo"
        )
    if report.get("kind") != REPORT_KIND:
        raise MemoError(f"memo.report: kind must be {REPORT_KIND!r}, got {report.get('kind')!r}")
    _check_fields(report, _TOP, "report")
    if report["strategy"] not in STRATEGIES:
        raise MemoError(f"memo.report: strategy must be one of {STRATEGIES}, got {report['strategy']!r}")
    if report["seq_len"] < 1 or report["micro_batch"] < 1:
        raise MemoError("memo.report: seq_len and micro_batch must be >= 1")
    alpha = report["alpha"]
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise MemoError(f"memo.report: alpha must be in [0, 1] or null, got {alpha}")
    if not report["steps"]:
        raise MemoError("memo.report: steps is empty; a report holds at least one step")
    for i, step in enumerate(report["steps"]):
        if not isinstance(step, dict):
            raise MemoError(f"memo.report: steps[{i}] must be an object, got {step!r}")
        _check_fields(step, _STEP, f"steps[{i}]")
        if step["step_time_s"] <= 0 or step["tgs"] <= 0:
            raise MemoError(f"memo.report: steps[{i}] step_time_s and tgs must be > 0")
    _check_fields(report["allocator"], {"planned": (_INT, False), "fallback": (_INT, False)}, "allocator")
    return report


def save_report(report: dict[str, Any], path: str | Path) -> None:
    """Validate, then write ``report`` as JSON."""
    validate_report(report)
    Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def load_report(path: str | Path) -> dict[str, Any]:
    """Read and validate a report written by :func:`save_report`."""
    data = read_json(path, "memo.report", "write one with `memo train --report`")
    try:
        return validate_report(data)
    except MemoError as err:
        raise MemoError(f"{err} (in {path})") from err
