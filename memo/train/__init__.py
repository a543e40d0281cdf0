"""Training with memo: the loop, the activation-memory strategies, the report and its plots.

* :mod:`memo.train.config` -- what a run is asked for and what it measured (:class:`TrainConfig`,
  :class:`TrainResult`), and the pieces every loop shares.
* :mod:`memo.train.loop` -- one step, the measured loop (:func:`train`).
* :mod:`memo.train.pipelined` -- the loop of megatron's schedules; :mod:`memo.train.schedule` -- a
  pipeline stage's step (NOTE [One step, one path] in memo/pipeline/step.py).
* :mod:`memo.train.data` -- the token sources (synthetic tokens, the bytes of a file).
* :mod:`memo.train.parallel` -- what the loop adds for one rank of a parallel job.
* :mod:`memo.train.strategies` -- one class per strategy behind the :class:`Strategy` protocol.
* :mod:`memo.train.meter` -- the :class:`MemoryMeter` every strategy is measured with.
* :mod:`memo.train.plan_checks` -- a loaded plan checked against the run.
* :mod:`memo.runtime.peers` (below train: memo estimate records them too) -- what the peers are made
  of: offload hooks, ALST's tiled MLP, checkpointed layers.
* :mod:`memo.train.report` -- the versioned JSON report ``memo train --report`` writes.
* :mod:`memo.train.plots` -- loss curves of reports.

The names below are imported from those modules on first use: ``memo train``'s parser needs
only :data:`STRATEGIES`, and the strategies import the planner (and PuLP) when they load.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Activation-memory strategies ``memo train --strategy`` knows, in the order tables list them
#: (memo.planner.vocab.StrategyName: defined once; torch-free).
from memo.planner.vocab import STRATEGIES  # noqa: E402

_EXPORTS = {
    "loop": ("DTYPES", "ByteFileTokens", "StepMetrics", "SyntheticTokens", "TrainConfig", "TrainResult",
             "add_train_arguments", "peak_memory", "reset_peak_memory", "summarize", "train",
             "train_config_from_args", "train_step"),
    "strategies": ("FullOffload", "FullRecompute", "MemoStrategy", "MemoryMeter", "NoStrategy",
                   "OffloadedCheckpoint", "SaveOnCpu", "Strategy", "StrategyOptions", "TorchtuneOffload",
                   "Wrapping", "make_strategy"),
    "report": ("REPORT_KIND", "REPORT_VERSION", "build_report", "load_report", "save_report",
               "validate_report"),
    "plots": ("plot_losses",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["STRATEGIES", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'memo.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"memo.train.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
