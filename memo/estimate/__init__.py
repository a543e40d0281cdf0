"""memo.estimate: per-GPU memory of a long-context job and the best parallel layout, before any GPU.

- :func:`estimate`: one layout and strategy, by the seed's closed form (``method="formula"``,
  :mod:`memo.estimate.formula`) or memo's meta-device profile of the rank (``method="plan"``,
  :mod:`memo.estimate.plan_method`).
- :func:`search_layouts`, :func:`longest_sequences`: every valid layout of N GPUs that ``memo train``
  launches ranked, and the longest sequence per strategy (:mod:`memo.estimate.search`).
- :func:`launch_command`: the ``torchrun ... -m memo train`` command of an answer
  (:mod:`memo.estimate.command`).

``memo estimate`` is the command line (memo/cli/estimate.py); docs/estimate.md tells the story.
"""

from memo.estimate.command import launch_argv, launch_command
from memo.estimate.core import (
    ESTIMATE_KIND,
    ESTIMATE_VERSION,
    METHODS,
    MODEL_STATES,
    Estimate,
    Estimator,
    estimate,
)
from memo.estimate.formula import (
    FORMULA_STRATEGIES,
    FormulaShape,
    formula_activations,
    formula_layer_parameters,
    formula_model_states,
    formula_parameters,
)
from memo.estimate.layout import Layout, ParallelLayout, valid_layouts
from memo.estimate.plan_method import (
    DEPTHS,
    PLAN_STRATEGIES,
    Machine,
    attention_exchange_bytes,
)
from memo.estimate.rank_numbers import RankNumbers, analyse_trace
from memo.estimate.search import (
    align,
    first_guess,
    gallop,
    longest,
    longest_sequences,
    search_layouts,
    tokens,
)

__all__ = [
    "DEPTHS",
    "ESTIMATE_KIND",
    "ESTIMATE_VERSION",
    "FORMULA_STRATEGIES",
    "METHODS",
    "MODEL_STATES",
    "PLAN_STRATEGIES",
    "Estimate",
    "Estimator",
    "FormulaShape",
    "Layout",
    "Machine",
    "ParallelLayout",
    "RankNumbers",
    "align",
    "analyse_trace",
    "attention_exchange_bytes",
    "estimate",
    "formula_activations",
    "formula_layer_parameters",
    "formula_model_states",
    "formula_parameters",
    "first_guess",
    "gallop",
    "launch_argv",
    "launch_command",
    "longest",
    "longest_sequences",
    "search_layouts",
    "tokens",
    "valid_layouts",
]
