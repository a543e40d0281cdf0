"""Training reports: the versioned JSON that ``memo train --report`` writes, validated on load.

Schema (version 1; docs/formats.md, "Training report", has the prose)::

    {
      "version": 1, "kind": "memo.report",
      "model": str, "seq_len": int, "micro_batch": int, "device": str, "dtype": str,
      "strategy": "none" | "full-recompute" | "full-offload" | "memo" | "offloaded-checkpoint"
                  | "torchtune-offload",
      "alpha": float | null,                 # null for strategies without memo's wrapper
      "offloaded_layers": int | null,        # layers that offload (alpha applies to them only)
      "steps": [{"step": int, "loss": float, "step_time_s": float, "tgs": float,
                 "mfu": float | null, "peak_device_bytes": int | null}, ...],
      "peak_device_bytes": int | null,       # max over steps
      "peak_device_kind": str,               # what was measured (NOTE [Measuring device memory])
      "host_pinned_bytes": int,              # memo's host arena; the peers: peak of host copies held
      "allocator": {"planned": int, "fallback": int},
      "plan": {"peak": int, "lower_bound": int, "device_total_bytes": int | null} | null,
      "parallel": {"tp": int, "cp": int, "sp": bool, "dp": int, "world": int,   # torchrun, --engine fsdp2
                   "engine": "fsdp2", "offload_states": bool,                 # --engine fsdp2 only
                   "ranks": [{"rank": int, "peak_device_bytes": int | null, "host_pinned_bytes": int,
                              ...}, ...]},
      ...                                    # more keys are allowed and kept
    }
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memo.errors import MemoError
from memo.jsonio import atomic_write, read_json
from memo.train import STRATEGIES

if TYPE_CHECKING:
    from memo.train.config import TrainResult

__all__ = ["REPORT_KIND", "REPORT_VERSION", "build_report", "load_report", "save_report", "validate_report"]

REPORT_VERSION = 1
REPORT_KIND = "memo.report"

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


def build_report(result: TrainResult) -> dict[str, Any]:
    """The versioned ``memo.report`` dict of a finished :class:`memo.train.TrainResult`.

    ``memo train`` and examples/train_gpt.py both write it.
    """
    from memo.models.attention_kernels import describe_kernel
    from memo.train.loop import summarize

    cfg, strategy = result.config, result.strategy
    last = result.steps[-1].extras if result.steps else {}
    steps = [
        {
            "step": s.step,
            "loss": s.loss,
            "step_time_s": s.step_time_s,
            "tgs": s.tgs,
            "mfu": s.mfu,
            "peak_device_bytes": s.peak_memory_bytes,
            "host_pinned_bytes": s.extras.get("host_pinned_bytes", 0),
            "allocator": s.extras.get("allocator", {"planned": 0, "fallback": 0}),
            **{k: s.extras[k] for k in ("bytes_offloaded", "bytes_prefetched", "recomputed_tokens",
                                        "copy_wait_s", "segment_allocs") if k in s.extras},
        }
        for s in result.steps
    ]
    peaks = [s.peak_memory_bytes for s in result.steps if s.peak_memory_bytes is not None]
    plan = strategy.plan
    report = {
        "version": REPORT_VERSION,
        "kind": REPORT_KIND,
        "model": cfg.hf_model if cfg.hf_model is not None else cfg.model,  # the checkpoint fine-tuned
        "model_fingerprint": result.model_fingerprint,
        "seq_len": cfg.seq_len,
        "micro_batch": cfg.micro_batch,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "data": cfg.data if cfg.data is not None else "synthetic",
        "strategy": strategy.name,
        "alpha": strategy.alpha,
        "alpha_binding": strategy.alpha_binding,
        "offloaded_layers": strategy.offloaded_layers,
        "num_parameters": result.num_parameters,
        "flops_per_sample": result.flops_per_sample,
        "peak_flops": result.peak_flops,
        "steps": steps,
        "peak_device_bytes": max(peaks) if peaks else None,
        "peak_device_kind": result.peak_memory_kind,
        "host_pinned_bytes": int(last.get("host_pinned_bytes", 0)),
        "allocator": dict(last.get("allocator", {"planned": 0, "fallback": 0})),
        "segment_allocs": last.get("segment_allocs"),
        # device_total_bytes: NOTE [Device total] in memo/pipeline/device.py (what `memo show` prints as
        # device/rank), to compare with the measured peak; None for a plan that records no total
        "plan": None if plan is None else {"peak": plan.peak, "lower_bound": plan.lower_bound,
                                           "device_total_bytes": (getattr(plan, "device", None) or {}).get(
                                               "total_bytes")},
        # NOTE [Planned and actual offload] in planner/plan.py
        "offload": strategy.offload,
        # NOTE [Choosing the attention kernel] in memo/models/attention_kernels.py
        "attention_kernel": describe_kernel(cfg.device).as_dict(),
    }
    if getattr(result, "parallel", None) is not None:
        # NOTE [Parallel layout] in memo/distributed/layout.py: the loss is the global batch's; the peak
        # and host bytes above are rank 0's, every rank's are in "ranks"
        report["parallel"] = result.parallel
    report["summary"] = summarize(result)
    return report


def save_report(report: dict[str, Any], path: str | Path) -> None:
    """Validate, then write ``report`` as JSON."""
    validate_report(report)
    with atomic_write(path, "memo.report") as f:
        f.write(json.dumps(report, indent=2) + "\n")


def load_report(path: str | Path) -> dict[str, Any]:
    """Read and validate a report written by :func:`save_report`."""
    data = read_json(path, "memo.report", "write one with `memo train --report`")
    try:
        return validate_report(data)
    except MemoError as err:
        raise MemoError(f"{err} (in {path})") from err
