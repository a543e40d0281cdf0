"""The layer policy checked against recorded iterations: the torch-free half of NOTE [Calibrated
policy] (memo/pipeline/policy.py).

The cost model (NOTE [Policy cost model] in policy.py) estimates what a policy needs; only a recorded
iteration says what it does need. Recording is the torch side's work (memo.pipeline wraps the model
with memo's runtime and traces one iteration); what the recordings mean is decided here, without
torch:

* :func:`with_recorded_full_recompute` and :func:`with_recorded_memo` correct the cost model by a
  recorded full-recompute iteration and a recorded iteration of every layer under memo (or
  input-only) at alpha = 0, the one :func:`memo_calibration` names;
* :func:`probe_policy` records the chosen policy through a callback (:data:`RecordPolicy`) and,
  while the recording needs more than the cap, corrects the estimate (:func:`corrected_costs`) and
  chooses again, PROBES times at most.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from memo.errors import DeviceBudgetError
from memo.units import format_bytes

from .alpha import AlphaSolution, evaluate_alpha
from .policy import (
    ALPHA_GIVEN_UP,
    LayerCosts,
    PolicySolution,
    choose_policy,
    describe_policy,
    device_need,
    full_recompute_need,
)

__all__ = ["PROBES", "AlphaInputs", "PolicyRecording", "ProbedPolicy", "RecordPolicy", "alpha_of",
           "corrected_costs", "memo_calibration", "probe_policy", "with_recorded_full_recompute",
           "with_recorded_memo"]

#: Recordings of a chosen policy before the profile gives up (NOTE [Calibrated policy]).
PROBES = 7


class AlphaInputs(NamedTuple):
    """The alpha LP's inputs for one rank, in :func:`~memo.planner.evaluate_alpha`'s order."""

    #: S_input, S_attn, S_others: bytes per layer (pass 1).
    s_input: float
    s_attn: float
    s_others: float
    #: B: host <-> device bytes per second.
    bandwidth: float
    #: T_layer: one layer's forward, seconds.
    layer_time: float
    n_layers: int
    #: M_CPU: host bytes this process may pin.
    host_memory: float


@dataclass(frozen=True)
class PolicyRecording:
    """What one recorded iteration of a chosen policy needed, bytes per rank, the same on every rank
    (NOTE [Decisions every rank shares] in memo/pipeline/policy.py)."""

    #: The iteration's device total: its peak plus parameters and optimizer states (NOTE [Device
    #: total] in memo/pipeline/device.py).
    iteration_bytes: int
    #: The optimizer's moment (NOTE [The optimizer's moment] in memo/pipeline/device.py); None where
    #: it is not checked (no device budget).
    optimizer_moment_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """What the recording needs: the larger of the iteration and the optimizer's moment."""
        if self.optimizer_moment_bytes is None:
            return self.iteration_bytes
        return max(self.iteration_bytes, self.optimizer_moment_bytes)


#: Records one iteration of the model wrapped with ``(policy, alpha)`` and says what it needed.
RecordPolicy = Callable[[PolicySolution, float], PolicyRecording]


@dataclass(frozen=True)
class ProbedPolicy:
    """The policy :func:`probe_policy` settled on and its alpha."""

    policy: PolicySolution
    alpha: AlphaSolution


def with_recorded_full_recompute(costs: LayerCosts, recorded_bytes: int) -> LayerCosts:
    """``costs`` with its constant part corrected so that its full-recompute need is
    ``recorded_bytes``, what a recorded full-recompute iteration needed (NOTE [Calibrated policy])."""
    estimate = full_recompute_need(costs)
    return dataclasses.replace(costs, base_bytes=max(0, costs.base_bytes + recorded_bytes - estimate))


def memo_calibration(costs: LayerCosts) -> tuple[list[str], int] | None:
    """The layer policy to record at alpha = 0 to calibrate memo's need, and its estimate: every
    layer under memo, or every layer input-only where the host memory cannot hold every layer at
    alpha = 0 but can hold every layer's input (NOTE [Input-only layers]); None where it holds
    neither (NOTE [Calibrated policy])."""
    n = costs.n_layers
    if n * costs.copy_bytes(0.0) <= costs.host_memory:
        return ["memo"] * n, sum(device_need(costs, n, 0, 0, 0.0).values())
    if n * costs.s_input <= costs.host_memory:
        return ["input-only"] * n, sum(device_need(costs, 0, 0, 0, 0.0, n).values())
    return None


def with_recorded_memo(costs: LayerCosts, recorded_bytes: int, estimate: int) -> LayerCosts:
    """``costs`` with memo_overhead set so that the policy :func:`memo_calibration` named, estimated
    at ``estimate``, needs ``recorded_bytes``, what its recorded iteration needed."""
    return dataclasses.replace(costs, memo_overhead=costs.memo_overhead + recorded_bytes - estimate)


def alpha_of(chosen: PolicySolution, inputs: AlphaInputs, alpha: float | None) -> AlphaSolution:
    """The AlphaSolution of a chosen policy (its binding is the policy's); ``alpha``: the alpha the
    caller gave (None: solved)."""
    n_memo = chosen.counts["memo"]
    solution = evaluate_alpha(chosen.alpha, *inputs, offloaded_layers=n_memo)
    if chosen.counts.get("input-only") and not n_memo:
        solution = dataclasses.replace(solution, alpha=0.0)
    if alpha is None or not n_memo:
        solution = dataclasses.replace(solution, binding=chosen.binding)
    return solution


def corrected_costs(costs: LayerCosts, chosen: PolicySolution, total: int, attempt: int) -> LayerCosts:
    """The cost model corrected after a recorded iteration of ``chosen`` needed ``total`` bytes,
    over the cap.

    The estimate was short. At alpha = 0 it was measured (with_recorded_memo), so the error is in
    its slope in alpha: correct that (or, at alpha = 0, its constant part) and choose again.
    The recorded peak moves in steps of whole allocations, so a correction that lands exactly
    on the cap tends to miss it by part of one: overshoot by a quarter. Where three
    corrections did not land, alpha > 0 is given up: memo at alpha = 0 was recorded.
    """
    error = (total - chosen.device_bytes) * 5 // 4
    if not chosen.counts.get("memo"):  # input-only layers alone: their own correction
        return dataclasses.replace(costs, input_only_overhead=costs.input_overhead + error)
    # A memo split's error is memo's: input-only splits keep the correction they had (they hold
    # less, and are chosen again when memo no longer fits).
    costs = dataclasses.replace(costs, input_only_overhead=costs.input_overhead)
    if attempt == 2:
        return dataclasses.replace(costs, memo_alpha_bytes=ALPHA_GIVEN_UP)
    if chosen.alpha > 1e-6 and costs.memo_alpha_bytes < ALPHA_GIVEN_UP:
        return dataclasses.replace(costs, memo_alpha_bytes=costs.memo_alpha_bytes + int(
            math.ceil(error / chosen.alpha)))
    return dataclasses.replace(costs, memo_overhead=costs.memo_overhead + error)


def probe_policy(chosen: PolicySolution, costs: LayerCosts, record: RecordPolicy, *, inputs: AlphaInputs,
                 alpha: float | None, device_budget: int | None, headroom: float, headroom_bytes: int,
                 may_probe: bool, say: Callable[[str], None]) -> ProbedPolicy:
    """The chosen policy recorded once (when ``may_probe`` and it has memo or input-only layers): an
    estimate short of the cap is corrected (:func:`corrected_costs`) and chosen again, PROBES times
    at most (alpha, then memo at alpha = 0, then input-only layers alone, then what is left).

    ``alpha``, ``device_budget``, ``headroom`` and ``headroom_bytes`` are :func:`choose_policy`'s, for
    each choice after the first; ``inputs`` gives each choice its AlphaSolution (:func:`alpha_of`);
    ``say`` is called with one line per choice and per correction. Raises DeviceBudgetError when the
    last recording still needs more than the cap.
    """
    for attempt in range(PROBES):
        solution = alpha_of(chosen, inputs, alpha)
        say(f"policy: {describe_policy(chosen.policy)}; alpha = {solution.alpha:.4f} "
            f"(binding: {solution.binding}); device need {format_bytes(chosen.device_bytes)} per "
            f"rank, estimated (full recompute {format_bytes(chosen.full_recompute_bytes)})")
        if not may_probe or not (chosen.counts.get("memo") or chosen.counts.get("input-only")):
            break
        total = record(chosen, solution.alpha).total_bytes
        if total <= chosen.device_cap:
            break
        if attempt == PROBES - 1:
            raise DeviceBudgetError(
                f"memo.profiler: the chosen policy ({describe_policy(chosen.policy)}, alpha "
                f"{solution.alpha:.4f}) needs {format_bytes(total)} per rank when recorded, over the cap "
                f"of {format_bytes(chosen.device_cap)}, after every correction of the estimate; give a fixed "
                "--alpha, or more --device-mem-gb")
        costs = corrected_costs(costs, chosen, total, attempt)
        say(f"policy: the recorded iteration needs {format_bytes(total)}, over the cap of "
            f"{format_bytes(chosen.device_cap)}; choosing again")
        chosen = choose_policy(costs, device_budget, alpha, headroom, headroom_bytes)
    return ProbedPolicy(chosen, solution)
