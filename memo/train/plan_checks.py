"""A loaded plan checked against the run it is given to: a plan made for another job is refused."""

from __future__ import annotations

from typing import Any

from memo.errors import PlanMismatchError

__all__ = ["check_plan", "check_plan_budget"]


def check_plan(plan: Any, run: dict[str, Any]) -> None:
    """A plan made for another job is refused with the field that differs."""
    meta = getattr(plan, "meta", {}) or {}
    made, this = meta.get("fingerprint"), run.get("fingerprint")
    if made is not None and this is not None:
        # The architecture decides every planned size; the name does not (a renamed copy of a config
        # plans the same, and one name may be given to another config file).
        if str(made) != str(this):
            raise PlanMismatchError(
                f"memo.train: the plan was made for model={meta.get('model')} (fingerprint {made}), this run "
                f"has model={run.get('model')} (fingerprint {this}); their shapes differ. Re-run `memo "
                "profile` for this model, or drop --plan"
            )
    elif meta.get("model") is not None and run.get("model") is not None \
            and str(meta["model"]) != str(run["model"]):
        # Plans of models memo cannot fingerprint (not a memo ModelConfig) carry the name only.
        raise PlanMismatchError(
            f"memo.train: the plan was made for model={meta['model']}, this run has model={run['model']}; "
            "re-run `memo profile` for this run, or drop --plan"
        )
    for key in ("seq_len", "micro_batch", "dtype"):
        expected, actual = run.get(key), meta.get(key)
        if actual is not None and expected is not None and str(actual) != str(expected):
            raise PlanMismatchError(
                f"memo.train: the plan was made for {key}={actual}, this run has {key}={expected}; "
                "re-run `memo profile` for this run, or drop --plan"
            )
    # A plan for one rank of a tensor- or context-parallel group describes that rank's shard
    # (NOTE [Tensor-parallel rank], NOTE [Context-parallel profile]); a run that is not sharded the
    # same way would replay it on other shapes. Plans without the field are from unsharded profiles.
    for key, flag in (("tensor_parallel", "--tensor-parallel"), ("context_parallel", "--context-parallel")):
        expected, actual = run.get(key, 1), meta.get(key, 1)
        if str(actual) != str(expected):
            raise PlanMismatchError(
                f"memo.train: the plan was made for one rank of {key}={actual}, this run has {key}="
                f"{expected}; its sizes are that rank's shard. Re-run `memo profile` with {flag} "
                f"{expected} for this run, or drop --plan"
            )
    planned_sp, run_sp = meta.get("sequence_parallel"), bool(run.get("sequence_parallel", False))
    if planned_sp is not None and bool(planned_sp) != run_sp:
        raise PlanMismatchError(
            f"memo.train: the plan was made for a rank {'with' if planned_sp else 'without'} sequence "
            f"parallelism (its layers hold {'s/tp' if planned_sp else 'all s'} tokens), this run is "
            f"{'with' if run_sp else 'without'} it (--sp); profile this run's layout, or drop --plan")


def check_plan_budget(plan: Any, device_mem_gb: float | None) -> None:
    """A plan chosen for another device budget is refused: its layer policy fits that budget only."""
    if device_mem_gb is None:
        return
    device = getattr(plan, "device", None) or {}
    planned = device.get("budget_bytes")
    wanted = int(device_mem_gb * 1e9)
    if planned is None or abs(int(planned) - wanted) > 0.001 * wanted:
        made = "no device budget" if planned is None else f"--device-mem-gb {int(planned) / 1e9:g}"
        raise PlanMismatchError(
            f"memo.train: the plan was made for {made}, this run has --device-mem-gb {device_mem_gb:g}; its "
            "layer policy and alpha were chosen to fit that budget. Re-run `memo profile --device-mem-gb "
            f"{device_mem_gb:g}` for this run, or drop --device-mem-gb"
        )
