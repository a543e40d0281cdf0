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
  chooses again, PROBES times at most; a memo choice in a tile not yet recorded at alpha = 0 has that
  tile recorded first where its estimate would be optimistic (NOTE [A correction per tile]).

NOTE [A correction per tile]
The memo correction (``memo_overhead``) is measured by one recorded iteration at alpha = 0 in one
tile, but the choice may run memo in a smaller tile (``LayerCosts.tile_choices``), and the cost model
overstates what a smaller tile saves: it counts one chunk's whole share of S_others held in a
layer's backward, where the runtime's need shrinks by about 0.29 of it from tile to tile (gpt-mini,
float32, CPU: at 2K memo at alpha 0 needs 66.98 MB in the default 2,048-token tile, 61.02, 59.96 and
59.44 MB in 1,024, 512 and 256-token tiles, where the model says 7.4, 11.0 and 12.9 MB less than the
default; at 4K 75.77 MB in the default tile and 72.09 MB in 256-token ones). A correction measured in a
larger tile makes a smaller tile's estimate short by the difference, and the probes then chase a
constant through alpha's slope (at 4K within 0.08 GB: three rounds over the cap in 256-token tiles
after a calibration in the default one). So each tile keeps the correction recorded in it
(``LayerCosts.tile_overheads``, measured by :func:`with_recorded_memo`); a tile not recorded takes
that of the smallest recorded tile, which makes a larger tile's estimate long (safe) and a smaller
one's short. Hence: the calibration records the tile the choice is expected to use (the profile
chooses once before it records), and :func:`probe_policy` records a memo choice's tile at alpha = 0
before probing it where that tile is smaller than every recorded one, or where a probe in a tile not
recorded came out over the cap. Two recordings in one tile, at alpha = 0 and at the probe's alpha,
then give the slope in alpha its own correction (:func:`corrected_costs`), and the next choice lands.
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
    given_policy,
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
    base = max(0, costs.base_bytes + recorded_bytes - estimate)
    if not costs.tile_overheads:
        return dataclasses.replace(costs, base_bytes=base)
    # memo's corrections, recorded before (NOTE [Full recompute where it can change the choice] in
    # memo/pipeline/policy.py), keep what they measured: the memo splits' estimates do not move
    shift = base - costs.base_bytes
    only = costs.input_only_overhead
    return dataclasses.replace(costs, base_bytes=base, memo_overhead=costs.memo_overhead - shift,
                               tile_overheads=tuple((t, o - shift) for t, o in costs.tile_overheads),
                               input_only_overhead=None if only is None else only - shift)


def memo_calibration(costs: LayerCosts, tile_tokens: int | None = None) -> tuple[list[str], int] | None:
    """The layer policy to record at alpha = 0 to calibrate memo's need, and its estimate in the tile
    of ``tile_tokens`` (None: the runtime's default): every layer under memo, or every layer
    input-only where the host memory cannot hold every layer at alpha = 0 but can hold every layer's
    input (NOTE [Input-only layers]); None where it holds neither (NOTE [Calibrated policy])."""
    costs = costs.tile_costs(tile_tokens)
    n = costs.n_layers
    if n * costs.copy_bytes(0.0) <= costs.host_memory:
        return ["memo"] * n, sum(device_need(costs, n, 0, 0, 0.0).values())
    if n * costs.s_input <= costs.host_memory:
        return ["input-only"] * n, sum(device_need(costs, 0, 0, 0, 0.0, n).values())
    return None


def with_recorded_memo(costs: LayerCosts, recorded_bytes: int, estimate: int,
                       tile_tokens: int | None = None) -> LayerCosts:
    """``costs`` with the correction of the tile of ``tile_tokens`` (None: the runtime's default) set
    so that the policy :func:`memo_calibration` named there, estimated at ``estimate``, needs
    ``recorded_bytes``, what its recorded iteration needed; memo_overhead, for the tiles not
    recorded, is then the smallest recorded tile's (NOTE [A correction per tile])."""
    overhead = costs.tile_costs(tile_tokens).memo_overhead + recorded_bytes - estimate
    return _with_tile_overhead(costs, tile_tokens, overhead)


def _with_tile_overhead(costs: LayerCosts, tile_tokens: int | None, overhead: int) -> LayerCosts:
    recorded = {**dict(costs.tile_overheads), tile_tokens: overhead}
    smallest = max(recorded, key=lambda t: costs.tile_costs(t).recompute_chunks)
    return dataclasses.replace(costs, memo_overhead=recorded[smallest],
                               tile_overheads=tuple(recorded.items()))


def recorded_tile(costs: LayerCosts, tile_tokens: int | None) -> bool:
    """Whether memo's correction in the tile of ``tile_tokens`` was recorded (:func:`with_recorded_memo`)."""
    return tile_tokens in dict(costs.tile_overheads)


def _tile_due(costs: LayerCosts, chosen: PolicySolution) -> bool:
    """Whether ``chosen`` runs memo in a tile smaller than every tile recorded at alpha = 0: its
    estimate is then short (NOTE [A correction per tile]), so the tile is recorded before the choice."""
    if not costs.tile_overheads or not chosen.counts.get("memo") or recorded_tile(costs, chosen.tile_tokens):
        return False
    chunks = costs.tile_costs(chosen.tile_tokens).recompute_chunks
    return chunks > max(costs.tile_costs(t).recompute_chunks for t, _ in costs.tile_overheads)


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
    tile = costs.tile_costs(chosen.tile_tokens)  # the corrections the estimate was made with
    if not chosen.counts.get("memo"):  # input-only layers alone: their own correction
        return dataclasses.replace(costs, input_only_overhead=tile.input_overhead + error)
    # A memo split's error is memo's: input-only splits keep the correction they had (they hold
    # less, and are chosen again when memo no longer fits).
    costs = dataclasses.replace(costs, input_only_overhead=costs.input_overhead)
    if attempt == 2:
        return dataclasses.replace(costs, memo_alpha_bytes=ALPHA_GIVEN_UP)
    if chosen.alpha > 1e-6 and costs.memo_alpha_bytes < ALPHA_GIVEN_UP:
        return dataclasses.replace(costs, memo_alpha_bytes=costs.memo_alpha_bytes + int(
            math.ceil(error / chosen.alpha)))
    if recorded_tile(costs, chosen.tile_tokens):
        return _with_tile_overhead(costs, chosen.tile_tokens, tile.memo_overhead + error)
    return dataclasses.replace(costs, memo_overhead=costs.memo_overhead + error)


def probe_policy(chosen: PolicySolution, costs: LayerCosts, record: RecordPolicy, *, inputs: AlphaInputs,
                 alpha: float | None, device_budget: int | None, headroom: float, headroom_bytes: int,
                 may_probe: bool, say: Callable[[str], None]) -> ProbedPolicy:
    """The chosen policy recorded once (when ``may_probe`` and it has memo or input-only layers): an
    estimate short of the cap is corrected (:func:`corrected_costs`) and chosen again, PROBES times
    at most (alpha, then memo at alpha = 0, then input-only layers alone, then what is left). Where
    ``costs`` has a tile recorded at alpha = 0, a memo choice in a smaller tile has its tile recorded
    first, and one over the cap in a tile not recorded has it recorded instead of a correction (NOTE [A
    correction per tile]).

    ``alpha``, ``device_budget``, ``headroom`` and ``headroom_bytes`` are :func:`choose_policy`'s, for
    each choice after the first; ``inputs`` gives each choice its AlphaSolution (:func:`alpha_of`);
    ``say`` is called with one line per choice and per correction. Raises DeviceBudgetError when the
    last recording still needs more than the cap.
    """
    def again(costs: LayerCosts) -> PolicySolution:
        return choose_policy(costs, device_budget, alpha, headroom, headroom_bytes)

    corrections = 0
    for attempt in range(PROBES):
        while may_probe and _tile_due(costs, chosen):
            say(f"policy: {describe_policy(chosen.policy)} in {chosen.tile_tokens}-token tiles, smaller than "
                "any recorded: recording memo at alpha 0 in them first")
            costs = _in_tile(costs, chosen, None, None, record)
            if not recorded_tile(costs, chosen.tile_tokens):
                break  # the host holds no calibration policy: probed as it is
            chosen = again(costs)
        solution = alpha_of(chosen, inputs, alpha)
        say(f"policy: {describe_policy(chosen.policy)}; alpha = {solution.alpha:.4f} "
            f"(binding: {solution.binding}); device need {format_bytes(chosen.device_bytes)} per "
            f"rank, estimated (full recompute {format_bytes(chosen.full_recompute_bytes)})")
        if not may_probe or not (chosen.counts.get("memo") or chosen.counts.get("input-only")):
            break
        recording = record(chosen, solution.alpha)
        total = recording.total_bytes
        if total <= chosen.device_cap:
            break
        if attempt == PROBES - 1:
            raise DeviceBudgetError(
                f"memo.profiler: the chosen policy ({describe_policy(chosen.policy)}, alpha "
                f"{solution.alpha:.4f}) needs {format_bytes(total)} per rank when recorded, over the cap "
                f"of {format_bytes(chosen.device_cap)}, after every correction of the estimate; give a fixed "
                "--alpha, or more --device-mem-gb")
        say(f"policy: the recorded iteration needs {format_bytes(total)}, over the cap of "
            f"{format_bytes(chosen.device_cap)}; choosing again")
        tile = chosen.tile_tokens
        if costs.tile_overheads and chosen.counts.get("memo") and not recorded_tile(costs, tile):
            # NOTE [A correction per tile]: the tile's own correction, not alpha's slope
            costs = _in_tile(costs, chosen, solution.alpha, recording, record)
        else:
            costs = corrected_costs(costs, chosen, total, corrections)
            corrections += 1
        chosen = again(costs)
    return ProbedPolicy(chosen, solution)


def _in_tile(costs: LayerCosts, chosen: PolicySolution, alpha: float | None,
             recording: PolicyRecording | None, record: RecordPolicy) -> LayerCosts:
    """``costs`` with the correction of ``chosen``'s tile recorded (:func:`with_recorded_memo`):
    :func:`memo_calibration`'s policy at alpha = 0 there, which is ``recording`` (of ``chosen`` at
    ``alpha``) where ``chosen`` is that policy at alpha = 0, else recorded through ``record``."""
    tile_tokens = chosen.tile_tokens
    calibration = memo_calibration(costs, tile_tokens)
    if calibration is None:
        return costs
    policy, estimate = calibration
    if recording is None or alpha != 0.0 or list(chosen.policy) != policy:
        given = given_policy(costs.tile_costs(tile_tokens), policy)
        recording = record(dataclasses.replace(given, tile_tokens=tile_tokens), 0.0)
    return with_recorded_memo(costs, recording.iteration_bytes, estimate, tile_tokens)
