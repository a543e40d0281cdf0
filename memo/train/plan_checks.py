"""A loaded plan checked against the run it is given to: a plan made for another job is refused."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memo.errors import PlanMismatchError
from memo.planner.job import JobSpec, job_mismatch
from memo.units import GB

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelRun
    from memo.planner import Plan

__all__ = ["TrainRun", "check_plan", "check_plan_budget"]


@dataclass(frozen=True)
class TrainRun:
    """What a strategy prepares for: the job (:class:`memo.planner.job.JobSpec`: model, sequence,
    batch, dtype, this rank's layout) and, in a parallel job, this rank's
    :class:`memo.distributed.layout.ParallelRun` (None in one process)."""

    job: JobSpec = field(default_factory=JobSpec)
    parallel: ParallelRun | None = None


def check_plan(plan: Plan, run: TrainRun) -> None:
    """A plan made for another job is refused with the field that differs (the planner's one check,
    :func:`memo.planner.job.job_mismatch`, as :meth:`memo.planner.Plan.check_compatible` runs it)."""
    problem = job_mismatch(getattr(plan, "meta", {}) or {}, run.job)
    if problem is not None:
        raise PlanMismatchError(f"memo.train: {problem}, or drop --plan")


def check_plan_budget(plan: Plan, device_mem_gb: float | None) -> None:
    """A plan chosen for another device budget is refused: its layer policy fits that budget only."""
    if device_mem_gb is None:
        return
    device = getattr(plan, "device", None) or {}
    planned = device.get("budget_bytes")
    wanted = int(device_mem_gb * GB)
    if planned is None or abs(int(planned) - wanted) > 0.001 * wanted:
        made = "no device budget" if planned is None else f"--device-mem-gb {int(planned) / GB:g}"
        raise PlanMismatchError(
            f"memo.train: the plan was made for {made}, this run has --device-mem-gb {device_mem_gb:g}; its "
            "layer policy and alpha were chosen to fit that budget. Re-run `memo profile --device-mem-gb "
            f"{device_mem_gb:g}` for this run, or drop --device-mem-gb"
        )
