"""What the checks of a real run's flags (``TrainConfig._check_run_options`` in memo/train/config.py)
need: the learning-rate schedules and whether TensorBoard can be written."""

from __future__ import annotations

from memo.errors import MemoError

__all__ = ["LR_SCHEDULES", "check_tensorboard"]

#: ``--lr-schedule`` choices (memo/train/lr.py).
LR_SCHEDULES = ("constant", "cosine", "linear")


def check_tensorboard() -> None:
    """Refuse ``--tensorboard`` where its package is not importable, before any work."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as err:
        raise MemoError(f"memo.train: --tensorboard needs the tensorboard package, which is not importable "
                        f"here ({err}); install it (pip install tensorboard) or use --metrics FILE.jsonl"
                        ) from None
