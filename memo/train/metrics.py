"""``--metrics FILE.jsonl`` and ``--tensorboard DIR``: what each step measured, one JSON line per step
(written by rank 0, flushed each step so that a run that dies keeps its lines)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from memo.errors import MemoError
from memo.train.run_options import check_tensorboard

if TYPE_CHECKING:
    from memo.train.config import StepMetrics

__all__ = ["METRIC_FIELDS", "MetricsLog", "step_record"]

#: The fields of every line (``eval_loss`` only on the steps that evaluated).
METRIC_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tgs", "mfu", "step_time_s",
                 "peak_memory_bytes")


def step_record(metrics: StepMetrics, world: int) -> dict[str, Any]:
    """One step's line: ``tokens_per_s`` is the job's, ``tgs`` per device."""
    record = {"step": metrics.step, "loss": metrics.loss, "lr": metrics.lr, "grad_norm": metrics.grad_norm,
              "tokens_per_s": metrics.tgs * world, "tgs": metrics.tgs, "mfu": metrics.mfu,
              "step_time_s": metrics.step_time_s, "peak_memory_bytes": metrics.peak_memory_bytes}
    if metrics.eval_loss is not None:
        record["eval_loss"] = metrics.eval_loss
    return record


class MetricsLog:
    """The JSONL file and the TensorBoard writer of a run. A resumed run keeps the lines of the steps
    up to its checkpoint and drops later ones (the steps it runs again)."""

    def __init__(self, path: str | None, tensorboard: str | None, start_step: int) -> None:
        self._file: IO[str] | None = None
        self._writer: Any = None
        if path is not None:
            self._file = self._open(Path(path), start_step)
        if tensorboard is not None:
            check_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(tensorboard, purge_step=start_step + 1 if start_step else None)

    @staticmethod
    def _open(path: Path, start_step: int) -> IO[str]:
        kept = []
        if start_step > 0 and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    if int(json.loads(line)["step"]) <= start_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue
        try:
            f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open for the run, closed by close()
        except OSError as err:
            raise MemoError(f"memo.train: cannot write --metrics {os.fspath(path)!r}: {err}") from None
        f.writelines(line + "\n" for line in kept)
        return f

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._writer.add_scalar(f"train/{key}", value, record["step"])
            self._writer.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
