"""The learning-rate schedule of a training run: ``torch.optim.lr_scheduler.LambdaLR`` over a factor of
``--lr`` (NOTE [Learning-rate schedule])."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from memo.train.config import TrainConfig

__all__ = ["lr_factor", "lr_scheduler"]


# NOTE [Learning-rate schedule]
# Step n (1-based) runs at lr · f(n - 1). Warmup: f rises linearly, (i + 1) / W for the first W steps,
# so the first step already learns. Then constant stays at 1 (exactly: lr · 1.0 is lr, so a run without
# a schedule trains as it did before there was one); cosine and linear fall from 1 at step W + 1 to
# min_lr / lr at the last step (--steps), cosine as (1 + cos(pi·p)) / 2 over the progress p in [0, 1].
# The scheduler steps once after each optimizer step; its state (the steps taken) is saved with a
# checkpoint, and the factor is a function of the step and the flags only, so a resumed run continues
# the curve (one resumed with another --steps follows that run's curve from its step on).
def lr_factor(i: int, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """The factor of ``lr`` for the step after ``i`` optimizer steps (NOTE [Learning-rate schedule])."""
    if i < warmup:
        return (i + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup - 1, 1)
    p = min(max(i - warmup, 0) / span, 1.0)
    shape = 0.5 * (1.0 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p
    return min_ratio + (1.0 - min_ratio) * shape


def lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """``config``'s schedule over ``optimizer`` (its ``lr`` the peak; NOTE [Learning-rate schedule])."""
    schedule, warmup, total = config.lr_schedule, config.warmup_steps, config.steps
    min_ratio = config.min_lr / config.lr

    def factor(i: int) -> float:
        return lr_factor(i, schedule, warmup, total, min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
