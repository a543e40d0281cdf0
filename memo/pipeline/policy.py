"""Step 3 of the pipeline, the torch side: the layer policy's cost model from pass 1 and the machine,
calibrated against recorded iterations (NOTE [Calibrated policy]), and the chosen policy probed. What
the recordings mean is decided by the torch-free planner (:mod:`memo.planner.calibrate`); this module
records them."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from memo.errors import MemoError, internal_assert
from memo.machine import GB
from memo.planner import LayerCosts, PolicySolution, Trace
from memo.planner.calibrate import (
    AlphaInputs,
    PolicyRecording,
    ProbedPolicy,
    memo_calibration,
    probe_policy,
    with_recorded_full_recompute,
    with_recorded_memo,
)
from memo.profiler.record import Recording

from .device import (
    FALLBACK_HEADROOM,
    FALLBACK_SEGMENT_BYTES,
    iteration_total,
    optimizer_moment,
    static_bytes,
)
from .passes import wrapped_pass

__all__ = ["StepProbe", "calibrated_choice", "choose_profile_policy", "layer_costs"]

if TYPE_CHECKING:
    from memo.profiler.measure import Quantity

    from .job import ProfileJob
    from .result import ProfileResult


def choose_profile_policy(job: ProfileJob, plain: Recording, states: dict[str, Any], layer_params: int,
                          alpha: float | None, policy: list[str] | None, wrap_pass: bool | None,
                          result: ProfileResult) -> PolicySolution:
    """The layer policy and alpha (NOTE [Calibrated policy]), probed against a recorded iteration."""
    req, st = job.request, job.state
    t0 = time.perf_counter()
    lp_inputs, costs = _policy_costs(job, plain, states, layer_params, result.quantities)
    result.costs = costs
    net = job.built()
    ids, labels = job.inputs()

    def record(policy: list[str], alpha: float, tile_tokens: int | None) -> dict[str, Any]:
        trace, wrapped = wrapped_pass(job, net, ids, labels, alpha, False, plain, policy, tile_tokens)
        st.last_probe = ((float(alpha), tuple(policy), tile_tokens), trace, wrapped)
        return trace

    def record_total(policy: list[str], alpha: float, tile_tokens: int | None) -> dict[str, Any]:
        cold, st.warmed = not st.warmed, True  # NOTE [A calibration needs no warm-up]
        trace = record(policy, alpha, tile_tokens)
        if cold:  # its one-time allocations hold request indices no later iteration makes: never a plan
            st.last_probe = None
        return trace

    probe = StepProbe(record, static_bytes(states), req.agree_max, req.gradients, record_total=record_total)
    probed = calibrated_choice(probe, costs, lp_inputs, alpha=alpha, policy=policy,
                               budget=req.machine.device_budget_bytes, wrap_pass=wrap_pass, say=req.say)
    result.policy, result.alpha, result.model_states = probed.policy, probed.alpha, states
    st.timings["alpha"] = time.perf_counter() - t0
    return probed.policy


def _policy_costs(job: ProfileJob, plain: Recording, states: dict[str, Any], layer_params: int,
                  q: dict[str, Quantity]) -> tuple[AlphaInputs, LayerCosts]:
    """The alpha LP's inputs and the layer policy's cost model, from pass 1 and the machine."""
    req, st = job.request, job.state
    stats = plain.layer_stats
    summary = plain.trace["layers"]
    # The runtime starts every tensor it offloads at a SLOT_ALIGNMENT boundary (NOTE [Slot alignment]
    # in memo/runtime/buffers.py), which the S_* do not count: a few dozen tensors per tile of every
    # offloaded layer. Leave that room, so that an arena the LP filled to the byte still fits.
    from memo.runtime.buffers import SLOT_ALIGNMENT
    from memo.runtime.tiles import default_tile_tokens, min_tile_tokens, params_token_bytes

    rows = int(summary.get("rows", 0))
    hidden = int(summary["S_input"]) // max(1, rows * req.micro_batch * req.dtype.itemsize)
    # NOTE [Tiles of the device a plan is for]: the tiles are the target's; where pass 2 runs
    # elsewhere (meta for a GPU), the runtime there gets the target's default tile explicitly.
    target = req.tile_device_type
    if target != req.device.type and rows > 0:
        token_bytes = params_token_bytes(layer_params, hidden, req.dtype.itemsize)
        st.default_tile = default_tile_tokens(rows, batch=req.micro_batch, hidden=hidden, device_type=target,
                                               token_bytes=token_bytes)
    most_tiles = 1 + rows // min_tile_tokens(req.micro_batch, hidden, target)
    slack = len(stats) * SLOT_ALIGNMENT * 32 * most_tiles
    host = max(0, req.machine.host_per_process(int(q["host_memory_bytes"].value)) - slack)
    # NOTE [Per-rank sizes]: with Megatron tensor + sequence parallelism over tp ranks, the
    # profiled model is one rank (NOTE [Tensor-parallel rank] in memo/models/parallel.py), so the
    # S_*, the alpha LP, the layer policy and the address plan all describe that rank. A T_layer
    # estimated from FLOPs is the whole layer's and is split; a given or measured one is a rank's.
    layer_s = q["layer_ms"].value / 1e3
    if req.tp > 1 and q["layer_ms"].source == "estimated":
        layer_s /= req.tp
    lp_inputs = AlphaInputs(summary["S_input"], summary["S_attn"], summary["S_others"],
                            q["bandwidth_gbps"].value * GB, layer_s, len(stats), host)
    costs = layer_costs(plain.trace, lp_inputs, req.seq_len, req.micro_batch, req.dtype.itemsize,
                         layer_params, states, target)
    return lp_inputs, costs


def layer_costs(trace: dict[str, Any], lp_inputs: AlphaInputs, seq_len: int, micro_batch: int,
                 elem_size: int, layer_params: int, states: dict[str, Any], device_type: str) -> LayerCosts:
    """The per-rank numbers of NOTE [Policy cost model] from pass 1 (the plain model); the recompute
    chunks are those memo's runtime makes on ``device_type``, the device the plan is for (NOTE [Tiles
    of the device a plan is for] in memo/pipeline/job.py)."""
    from memo.planner import Trace, lower_bound

    s_input, s_attn, s_others, bandwidth, layer_s, n_layers, host = lp_inputs
    keep = s_input + s_attn + s_others
    # The plain model keeps every layer: what its peak holds beyond the layers' activations does
    # not depend on the policy (embedding, head, gradients as they appear).
    peak_plain = lower_bound(Trace.from_dict(trace))
    base = max(0, peak_plain - n_layers * keep)
    # Attention's share of a layer's forward FLOPs: 2 s^2 w (causal) against 2 s P_layer, with w the
    # attention width per token, read off the attention output's bytes.
    width = s_attn / max(1, seq_len * micro_batch * elem_size)
    attn = seq_len * width
    fraction = attn / (attn + layer_params) if attn + layer_params > 0 else 0.0
    static = static_bytes(states)
    # NOTE [Tiles bounded by memory] (memo/runtime/layer.py): how many tiles a memo layer runs in, by
    # the runtime's default and for each smaller tile the policy may choose (halving, down to
    # min_tile_tokens: the work floor on an accelerator, 256 tokens on the CPU; NOTE [How small a
    # chunk]).
    from memo.runtime.tiles import min_tile_tokens, params_token_bytes, token_chunks

    # The layer input is [rows, micro_batch, hidden]: its width per token gives the hidden size.
    rows = int(trace["layers"].get("rows", 0))
    hidden = int(s_input) // max(1, rows * micro_batch * elem_size)
    tiles = functools.partial(token_chunks, rows, batch=micro_batch, hidden=hidden, device_type=device_type,
                              token_bytes=params_token_bytes(layer_params, hidden, elem_size))
    chunks = max(1, len(tiles()))
    floor = min_tile_tokens(micro_batch, hidden, device_type)
    choices = []
    size = -(-rows // chunks) // 2
    while size >= floor:
        choices.append((size, len(tiles(size))))
        size //= 2
    return LayerCosts(n_layers=n_layers, s_input=int(s_input), s_attn=int(s_attn), s_others=int(s_others),
                      layer_time=float(layer_s), attn_fraction=float(min(max(fraction, 0.0), 1.0)),
                      base_bytes=int(base + static), bandwidth=float(bandwidth), host_memory=int(host),
                      recompute_chunks=chunks, tile_choices=tuple(choices),
                      buffer_rounding=FALLBACK_SEGMENT_BYTES)


# NOTE [Decisions every rank shares]
# Under tensor, context or data parallelism every rank profiles its own shard, and the ranks' passes
# run collectives (the all-gathers of sequence and context parallelism), so every rank must record
# the same iterations: the same layer policies and alphas, in the same order. The policy is chosen
# from a cost model calibrated against recorded peaks (NOTE [Calibrated policy]), and a recorded
# peak is not the same on every rank: the allocator recorder sees every allocation of the process,
# the communication library's own buffers included, at whatever moment its threads make them. A
# rank that chose differently would wait in a collective the others never join. So every recorded
# peak that feeds a decision is replaced by the largest over the ranks (``agree_max``, a collective
# every rank reaches at the same point): every rank then holds the same costs, makes the same
# (deterministic) choice, and the largest need is the one planned for.
@dataclass
class StepProbe:
    """Records one iteration of a step wrapped with a layer policy and says what it needed: the
    :data:`~memo.planner.calibrate.RecordPolicy` of :func:`memo.planner.calibrate.probe_policy`, and the
    recordings the cost model is calibrated against (NOTE [One step, one path] in
    memo/pipeline/step.py: any step, one model or a pipeline stage, is recorded through one of these)."""

    #: Records the step wrapped with ``(policy, alpha, tile tokens)``; the trace (a ``memo.trace`` dict).
    record: Callable[[list[str], float, int | None], dict[str, Any]]
    #: Bytes of parameters and optimizer state, added to a recorded iteration's peak.
    static: int
    #: The largest of a number over the ranks deciding together (NOTE [Decisions every rank shares]).
    agree_max: Callable[[int], int]
    #: Where the plan puts the parameter gradients (NOTE [The optimizer's moment]).
    gradients: str
    #: Whether a recording counts the optimizer's moment (under a device budget only).
    with_moment: bool = False
    #: Records as ``record`` does, for the calibration's totals only: it may log an iteration without
    #: warming up first (NOTE [A calibration needs no warm-up]); None: ``record``.
    record_total: Callable[[list[str], float, int | None], dict[str, Any]] | None = None

    def total(self, policy: list[str], alpha: float, tile_tokens: int | None = None) -> int:
        """NOTE [Device total] of one recorded iteration of ``policy`` at ``alpha`` in the tile of
        ``tile_tokens`` (None: the runtime's default), the same on every rank; for a calibration."""
        return self.measure((self.record_total or self.record)(policy, alpha, tile_tokens)).iteration_bytes

    def __call__(self, chosen: PolicySolution, alpha: float) -> PolicyRecording:
        return self.measure(self.record(list(chosen.policy), alpha, chosen.tile_tokens))

    def measure(self, trace: dict[str, Any]) -> PolicyRecording:
        """What a recorded iteration needed, agreed on by the ranks: the same collectives for every
        recording (NOTE [Decisions every rank shares])."""
        parsed = Trace.from_dict(trace)
        total = self.agree_max(iteration_total(parsed, self.static))
        moment = None
        if self.with_moment:  # NOTE [The optimizer's moment]
            moment = self.agree_max(optimizer_moment(parsed, self.static, self.gradients))
        return PolicyRecording(total, moment)


def calibrated_choice(probe: StepProbe, costs: LayerCosts, inputs: AlphaInputs, *, alpha: float | None,
                      policy: list[str] | None, budget: int | None, wrap_pass: bool | None,
                      say: Callable[[str], None]) -> ProbedPolicy:
    """The layer policy and alpha of a step (NOTE [Calibrated policy]): ``policy`` when given, else
    chosen from ``costs`` calibrated against recorded iterations; then probed by
    :func:`memo.planner.calibrate.probe_policy`, the one loop that corrects and chooses again.

    ``wrap_pass``: record wrapped iterations (None: try, and choose from the uncalibrated model when
    the runtime refuses the step; False: never)."""
    from memo.planner import choose_policy, given_policy

    can_wrap = wrap_pass is not False
    probe.with_moment = budget is not None
    if policy is not None:
        from memo.runtime import validate_policy

        chosen = given_policy(costs, validate_policy(policy, costs.n_layers), alpha, budget)
    else:
        full_recompute = True
        if can_wrap:
            costs, can_wrap, full_recompute = _calibrated_costs(probe, costs, wrap_pass, budget, alpha)
        chosen = choose_policy(costs, budget, alpha, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)
        offloads = chosen.counts.get("memo") or chosen.counts.get("input-only")
        if can_wrap and not full_recompute and not offloads:  # the runtime wraps the step, and
            # NOTE [Full recompute where it can change the choice]: it can now
            costs = with_recorded_full_recompute(costs, probe.total(["recompute"] * costs.n_layers, 0.0))
            chosen = choose_policy(costs, budget, alpha, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)
    return probe_policy(chosen, costs, probe, inputs=inputs, alpha=alpha, device_budget=budget,
                        headroom=FALLBACK_HEADROOM, headroom_bytes=FALLBACK_SEGMENT_BYTES,
                        may_probe=can_wrap and policy is None, say=say)


def _calibrated_costs(probe: StepProbe, costs: LayerCosts, wrap_pass: bool | None, budget: int | None,
                      alpha: float | None) -> tuple[LayerCosts, bool, bool]:
    """The cost model calibrated against recorded iterations, whether the runtime can wrap the
    step (False: it refused, and ``costs`` is returned as it came), and whether full recompute was
    recorded (NOTE [Full recompute where it can change the choice]).

    NOTE [Calibrated policy]: the cost model's full-recompute need is checked against a
    recorded full-recompute iteration (where it can change the choice: NOTE [Full recompute where it
    can change the choice]), and its constant part corrected by the difference,
    so that "never more than full recompute" compares memo with a measured figure; then
    its memo need likewise, against a recorded iteration of every layer under memo at
    alpha = 0 in the tile the choice is expected to use (_record_memo; NOTE [A correction per
    tile] in planner/calibrate.py). The chosen policy is recorded once more (the StepProbe, for
    memo.planner.calibrate.probe_policy). The torch-free arithmetic of each step is in
    planner/calibrate.py; the recordings are made through the StepProbe. The memo iteration is
    recorded first: it is the cheaper one to log without a warm-up (NOTE [A calibration needs no
    warm-up]).
    """
    memo = _record_memo(probe, costs, budget, alpha)
    if memo is not None and budget is not None:
        return _with_memo(costs, *memo), True, False
    try:
        recorded = probe.total(["recompute"] * costs.n_layers, 0.0)
    except MemoError:
        if wrap_pass:
            raise
        return costs, False, False  # the runtime refuses this model: pass 2 says so, in a note
    costs = with_recorded_full_recompute(costs, recorded)
    return (costs if memo is None else _with_memo(costs, *memo)), True, True


def _with_memo(costs: LayerCosts, tile: int | None, total: int) -> LayerCosts:
    """``costs`` corrected by memo's recorded ``total`` in ``tile``, against the estimate of ``costs`` as
    they are now: a full-recompute recording made after memo's moved their base, and the estimate with it."""
    calibration = memo_calibration(costs, tile)
    internal_assert(calibration is not None, "a policy recorded for memo_calibration is one")
    return with_recorded_memo(costs, total, cast("tuple[list[str], int]", calibration)[1], tile)


# NOTE [Full recompute where it can change the choice]
# Without a device budget the cap is what full recompute needs, so it is recorded. Under a budget the
# recording corrects the cost model's constant part (base_bytes) alone, and memo's correction, recorded
# in the same model, moves by the opposite amount: the estimate of every split with memo or input-only
# layers is the same with it or without it. It can change only a choice of kept and recomputed layers
# alone, so under a budget it is recorded only when the choice is one (and chosen again); a full
# recompute iteration costs more than a memo one (gpt-mini at 4K: 8.9 CPU s against 7.6 to 9.8). The
# plan's "full recompute needs" is then the estimate.


# NOTE [A calibration needs no warm-up]
# A recording whose trace becomes a plan warms up first (NOTE [Warm-up before logging] in
# memo/pipeline/step.py): one-time allocations logged in it would take request indices no later
# iteration makes. A calibration's recording is only read for its total, and what a first iteration
# allocates once only adds to the bytes live at each moment, so its total is at least the warmed
# one's: a correction from it is never short. So the job's first recording on the CPU, a calibration,
# logs its first iteration (after the runtime's own one-time allocations, ModelStep.prepare), and the
# recordings after it find the process warmed. gpt-mini, float32, CPU: recorded this way, full
# recompute at 2K and memo at alpha 0 in 256-token tiles at 2K and 4K need the same bytes as after a
# warm-up (69,838,600, 59,437,576 and 72,086,024), and at 2K the plan's trace is the same event for
# event; the warm-up was a whole iteration (2.5 CPU s of full recompute at 2K). CUDA always warms up
# (record_step).
def _record_memo(probe: StepProbe, costs: LayerCosts, budget: int | None, alpha: float | None
                 ) -> tuple[int | None, int] | None:
    """NOTE [Calibrated policy]: the tile the policy is expected to run memo in (chosen once from the
    model as it is; None: the runtime's default) and what :func:`memo_calibration`'s policy at
    alpha = 0 needed there, recorded; None where the host holds no such policy or the runtime refused it.

    The cost model leaves out what a memo layer's backward holds besides its recomputed share
    (gradients of q, k, v and o, the prefetched layer's rounding buffer in flight) and may count
    more than the runtime holds at once; the correction is added to, or taken from, every split
    with memo or input-only layers in that tile. Where the host memory cannot hold every layer at
    alpha = 0 but can hold every layer's input, the recording is of every layer input-only (NOTE
    [Input-only layers]) instead: the estimate of the policies the host allows is then the one checked
    (without it, an estimate far above what the runtime holds would go uncorrected: Llama-3.1-8B at
    336K on meta is estimated at 73.4 GB, recorded at 55.7 GB).
    """
    from memo.planner import choose_policy

    try:
        first = choose_policy(costs, budget, alpha, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)
        tile = first.tile_tokens if first.counts.get("memo") else None
    except MemoError:
        tile = None  # nothing fits the model as it is: the default tile
    calibration = memo_calibration(costs, tile)
    if calibration is None:
        return None
    try:
        return tile, probe.total(calibration[0], 0.0, tile)
    except MemoError:
        return None  # the chosen policy's probe (below) still checks what is chosen
