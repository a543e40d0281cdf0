"""The optimizer every training loop steps: fused AdamW, its states sharded over the data-parallel ranks
of a megatron job (ZeRO-1)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from memo.profiler.device import OPTIMIZER_STATES_ELSEWHERE

__all__ = ["adamw", "rank_optimizer"]


# NOTE [Fused AdamW]
# torch's default AdamW on CUDA is the foreach one, whose step makes a temporary the size of every
# parameter at once (the list exp_avg_sq.sqrt()), and on the CPU the for-loop one, two per tensor.
# Neither is in the profiled iteration, so a plan's device total missed them: on an H200,
# llama-3.2-1b at 32K peaked 12.5% above its plan, at the optimizer step. The fused step updates in
# place (one kernel per group, no temporaries) and is the faster one besides; every strategy trains
# with it, so their peaks stay comparable. Where it is not offered (a parameter off CUDA and CPU, or
# of an integer or complex dtype) the default is kept.
def _fused(params: list[torch.nn.Parameter]) -> bool | None:
    fused = bool(params) and all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in params)
    return fused or None


def adamw(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """AdamW over the trainable ``params``, fused where torch offers it (NOTE [Fused AdamW])."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, fused=_fused(params))


# NOTE [ZeRO-1 under megatron]
# A megatron job's data-parallel and context-parallel ranks hold the same weights and, after
# megatron's DistributedDataParallel, the same averaged gradients. Its layouts are counted with the
# optimizer states sharded over those ranks (the "optimizer" sharding of planner/vocab.py, megatron's
# distributed optimizer), so memo train runs it that way: torch's ZeroRedundancyOptimizer gives each
# rank whole parameters to step (a greedy split by size), and broadcasts every updated parameter from
# its owner. The same AdamW runs on every parameter, so the weights are those of one optimizer. The
# parameters another rank steps carry OPTIMIZER_STATES_ELSEWHERE, so the plan's model states count
# only the optimizer states this rank holds (NOTE [Model states] in memo/profiler/device.py); the
# optimizer is built before the profile for that reason (it allocates its states at the first step).
def rank_optimizer(params: Iterable[torch.nn.Parameter], lr: float,
                   group: Any = None) -> torch.optim.Optimizer:
    """This rank's AdamW: over all ``params``, or with ``group`` (the ranks that hold the same weights
    and gradients) ZeRO-1 over it (NOTE [ZeRO-1 under megatron])."""
    params = [p for p in params if p.requires_grad]
    if group is None or torch.distributed.get_world_size(group) == 1:
        return adamw(params, lr)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=group,
                                        lr=lr, fused=_fused(params))
    mine = {id(p) for g in optimizer.optim.param_groups for p in g["params"]}
    for p in params:
        if id(p) not in mine:
            setattr(p, OPTIMIZER_STATES_ELSEWHERE, True)
    return optimizer
