"""SIGTERM and Ctrl-C during the steps of a run that saves checkpoints: the step finishes, a checkpoint is
written, and the run exits with 143 (SIGTERM) or 130 (SIGINT) (NOTE [Stopping at a step])."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch

__all__ = ["StopRequested", "StopSignals"]


class StopRequested(KeyboardInterrupt):
    """A run stopped by a signal after a checkpoint; ``exit_status`` is 128 + the signal's number (memo's
    command line exits with it)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_status = 128 + signum


# NOTE [Stopping at a step]
# A scheduler ends a job with SIGTERM (then SIGKILL after a grace period), a user with Ctrl-C. Raising
# where the signal lands would leave the step half done and nothing saved, so while the steps run these
# signals only set a flag; after each step every rank takes the largest flag of all ranks (an
# all-reduce: a signal reaches the ranks at different steps, and a rank that stopped alone would leave
# the others waiting in a collective), and all of them save and stop at that step. A second signal while
# the flag is set stops at once, as before. Handlers are Python's, so they are installed in the main
# thread only (elsewhere the signals keep their previous handling).
class StopSignals:
    """The flag SIGTERM and SIGINT set while installed (NOTE [Stopping at a step])."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum:
            raise KeyboardInterrupt  # the second signal: stop now
        self.signum = signum

    def agreed(self, distributed: bool) -> int:
        """The signal any rank got (0: none); every rank of a distributed run calls it after each step."""
        if not distributed or not torch.distributed.is_initialized():
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64)
        if torch.distributed.get_backend() == "nccl":
            flag = flag.cuda()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
