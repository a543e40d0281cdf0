"""``--eval-data FILE --eval-every N --eval-batches K``: the mean loss over K fixed batches of held-out
tokens, without gradients (NOTE [Evaluation])."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from memo.train.data import Batch

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelRun
    from memo.models import ModelConfig
    from memo.train.config import TrainConfig

__all__ = ["eval_batches", "eval_loss", "off_plan"]


# NOTE [Evaluation]
# The batches are drawn once, at the start, from ``--eval-data`` read as ``--data`` is (the run's token
# source, seeded by ``--seed``): every evaluation sees the same K batches, so the numbers compare. Each
# batch's loss is the mean over its counted tokens, as a step's; the evaluation is their mean. The
# forward runs under torch.no_grad(): memo's wrapped layers then run their own forward (no offload, no
# recompute: memo/runtime/wrap.py), outside the strategy's iteration and with its Session's phases paused
# (memo's allocator serves it from its fallback pool, as a batch the plan was not made for: NOTE [A batch of
# another length] in memo/session.py), and FSDP2 reshards what it gathered. The generators are left as
# they were (torch.random.fork_rng), so a run with evaluations draws what one without them draws.
def eval_batches(config: TrainConfig, model_config: ModelConfig) -> list[Batch]:
    """The K fixed global batches of ``config.eval_data`` (NOTE [Evaluation])."""
    from memo.train.config import token_source

    source = iter(token_source(dataclasses.replace(config, data=config.eval_data), model_config))
    return [next(source) for _ in range(config.eval_batches)]


@contextlib.contextmanager
def off_plan(session: Any, device: torch.device) -> Iterator[None]:
    """No phase open and memo's allocator off its plan (``session``: the strategy's Session, or None), no
    gradients, and the generators as they were afterwards (NOTE [Evaluation])."""
    tracker = getattr(session, "tracker", None)
    with contextlib.ExitStack() as stack:
        if tracker is not None:
            from memo.allocator import unplanned

            stack.enter_context(tracker.paused())
            stack.enter_context(unplanned())
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        stack.enter_context(torch.no_grad())
        yield


def eval_loss(model: torch.nn.Module, batches: list[Batch], parallel: ParallelRun | None,
              device: torch.device, session: Any = None) -> float:
    """The mean loss of ``batches`` (global ``(ids, labels[, document positions])``, NOTE [Packed documents]
    in memo/train/corpus.py; each rank takes its share) off the plan of ``session`` (NOTE [Evaluation])."""
    losses = []
    with off_plan(session, device):
        for ids, labels, *documents in batches:
            losses.append(float(_batch_loss(model, ids, labels, documents[0] if documents else None, parallel,
                                            device)))
    _reshard(parallel)
    return sum(losses) / len(losses)


def _batch_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                documents: torch.Tensor | None, parallel: ParallelRun | None,
                device: torch.device) -> torch.Tensor:
    if parallel is None:
        from memo.adapters.model import adapter_loss, model_adapter_for

        return adapter_loss(model_adapter_for(model, "memo.train"), model, ids.to(device), labels.to(device),
                            None if documents is None else documents.to(device))
    from memo.train.parallel import shard_batch

    count = int((labels != -100).sum())
    mine = [t.to(device) for t in shard_batch(parallel, (ids, labels) if documents is None
                                               else (ids, labels, documents))]
    return parallel.loss(model, mine[0], mine[1], mine[2], count, *mine[3:])[1]


def _reshard(parallel: Any) -> None:
    """FSDP2 keeps its root's parameters gathered after a forward without backward: shard them again, so
    the optimizer and the checkpoint see the shards (NOTE [Evaluation])."""
    root = getattr(parallel, "root", None)
    if root is None:
        return
    from memo.distributed.fsdp2 import fsdp_modules

    for module in fsdp_modules(root):
        module.reshard()
