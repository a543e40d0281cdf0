"""What :func:`memo.pipeline.profile_step` is asked for: one frozen :class:`ProfileRequest`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memo.machine import Machine
from memo.planner.vocab import LayerPolicy, Recorder

__all__ = ["ProfileRequest"]


@dataclass(frozen=True)
class ProfileRequest:
    """The job, its parallel layout, the machine and the profile's options (the arguments of
    :func:`memo.pipeline.profile`, whose docstring says what each does)."""

    # The job: tokens per sequence and sequences per micro-batch (or a step's batch gives both), and
    # for a model built by name its dtype and device.
    seq_len: int | None = None
    micro_batch: int = 1
    dtype: str | torch.dtype = "bfloat16"
    device: str | torch.device = "meta"
    # The parallel layout: ranks one layer is split over, ranks the sequence is split over.
    tensor_parallel: int = 1
    context_parallel: int = 1
    #: Its ``None`` fields are measured.
    machine: Machine = field(default_factory=Machine)
    # The options.
    alpha: float | None = None
    policy: tuple[LayerPolicy | str, ...] | None = None
    optimizer_states: str = "same"
    gradients: str = "arena"
    #: None: the allocator's where memo's allocator will replay the plan (NOTE [The default recorder]).
    recorder: Recorder | None = None
    wrap_pass: bool | None = None
    solve: bool = True
    plan: bool = True
    time_limit: float = 30.0
    solver: str | None = None
    progress: bool = False
    log: Callable[[str], None] | None = None
    agree_max: Callable[[int], int] | None = None
