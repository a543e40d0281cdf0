"""What a plan is made for, in one typed description: :class:`JobSpec`, and the one check
of a plan against a job (:func:`job_mismatch`, :meth:`memo.planner.Plan.check_compatible`).

``memo.planner.load_plan``'s keywords and ``memo train``'s plan check both end here, so a plan made
for another model, sequence, batch, dtype or parallel layout is refused with the same words
wherever it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["JobSpec", "job_mismatch"]


@dataclass(frozen=True)
class JobSpec:
    """One job as a plan sees it. A field left ``None`` is not checked."""

    model: str | None = None
    """The model's name (a registered config, a config file's name, or a model class's)."""
    fingerprint: str | None = None
    """The architecture's fingerprint (memo.models.ModelConfig.fingerprint): every planned size
    follows from it, so it decides, and the name only where no fingerprint is known."""
    seq_len: int | None = None
    """The job's whole sequence."""
    micro_batch: int | None = None
    """Sequences per micro-batch of one rank."""
    dtype: str | None = None
    tensor_parallel: int | None = None
    """The tensor-parallel group size the plan's rank belongs to (1: none)."""
    context_parallel: int | None = None
    """The context-parallel group size (1: none)."""
    sequence_parallel: bool | None = None
    """Whether the rank's layers hold seq_len/tp tokens (megatron's sequence parallelism)."""


# A plan without a parallel field was profiled unsharded.
_UNSHARDED: dict[str, Any] = {"tensor_parallel": 1, "context_parallel": 1}
_FLAGS = {"tensor_parallel": "--tensor-parallel", "context_parallel": "--context-parallel"}


def job_mismatch(meta: Mapping[str, Any], job: JobSpec) -> str | None:
    """None when a plan whose trace meta is ``meta`` was made for ``job``; else the first field that
    differs, both values, and what to do, in one sentence."""
    made, this = meta.get("fingerprint"), job.fingerprint
    if made is not None and this is not None:
        # The architecture decides every planned size; the name does not (a renamed copy of a config
        # plans the same, and one name may be given to another config file).
        if str(made) != str(this):
            return (f"the plan was made for model={meta.get('model')} (fingerprint {made}), this run has "
                    f"model={job.model} (fingerprint {this}); their shapes differ. Re-run `memo profile` "
                    "for this model")
    elif meta.get("model") is not None and job.model is not None and str(meta["model"]) != str(job.model):
        # Plans of models memo cannot fingerprint (not a memo ModelConfig) carry the name only.
        return (f"the plan was made for model={meta['model']}, this run has model={job.model}; re-run "
                "`memo profile` for this run")
    for key in ("seq_len", "micro_batch", "dtype"):
        want, have = getattr(job, key), meta.get(key)
        if want is not None and have is not None and str(have) != str(want):
            return (f"the plan was made for {key}={have!r}, this run has {key}={want!r}; re-run "
                    "`memo profile` for this run")
    # A plan for one rank of a tensor- or context-parallel group describes that rank's shard
    # (NOTE [Tensor-parallel rank], NOTE [Context-parallel profile]); a run that is not sharded the
    # same way would replay it on other shapes.
    for key, flag in _FLAGS.items():
        want, have = getattr(job, key), meta.get(key, _UNSHARDED[key])
        if want is not None and str(have) != str(want):
            return (f"the plan was made for one rank of {key}={have!r}, this run has {key}={want!r}; its "
                    f"sizes are that rank's shard. Re-run `memo profile` with {flag} {want} for this run")
    planned_sp, run_sp = meta.get("sequence_parallel"), job.sequence_parallel
    if planned_sp is not None and run_sp is not None and bool(planned_sp) != bool(run_sp):
        return (f"the plan was made for a rank {'with' if planned_sp else 'without'} sequence parallelism "
                f"(its layers hold {'s/tp' if planned_sp else 'all s'} tokens), this run is "
                f"{'with' if run_sp else 'without'} it (--sp); profile this run's layout")
    return None
