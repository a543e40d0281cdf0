"""``memo.estimate(...)``: the per-GPU memory of one job on one parallel layout.

The estimate is of one GPU of the first pipeline stage (the one that runs out of memory first):
its model states (:mod:`memo.estimate.formula`, or counted from memo's rank model) plus its
activations, from the seed's closed form (``method="formula"``) or from memo's meta-device profile
of that rank (``method="plan"``, :mod:`memo.estimate.plan_method`). ``fits`` is the seed's 80%
rule: the total within ``fit_fraction`` of the GPU's memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from memo.errors import MemoError, internal_assert
from memo.estimate.formula import (
    FORMULA_STRATEGIES,
    FormulaShape,
    formula_activations,
    formula_layer_parameters,
    formula_parameters,
)
from memo.estimate.layout import Layout, ParallelLayout
from memo.estimate.plan_method import (
    PLAN_STRATEGIES,
    Machine,
    RankProfiler,
    attention_exchange_bytes,
    counted_parameters,
    estimate_machine,
    memo_alpha_within,
    rank_layer_ms,
)
from memo.planner.vocab import ESTIMATE_METHODS, CPComm, EstimateMethod, LayerPolicy, Sharding, StrategyName
from memo.units import GB, GiB

__all__ = ["ESTIMATE_KIND", "ESTIMATE_VERSION", "MEMO_POLICIES", "METHODS", "MODEL_STATES", "Estimate",
           "Estimator", "estimate", "fit_limit", "limit_rule", "limit_words", "strategy_problem"]

ESTIMATE_KIND = "memo.estimate"
ESTIMATE_VERSION = 1
METHODS = ESTIMATE_METHODS

#: memo's layer policies an estimate may use (NOTE [Memo's policy in an estimate]).
MEMO_POLICIES = ("auto", LayerPolicy.MEMO.value, LayerPolicy.INPUT_ONLY.value)

# NOTE [Memo's policy in an estimate]
# memo's rows run every offloading layer one way: "memo" (input and attention output to the host,
# alpha of the rest) while the host holds that at alpha = 0, else "input-only" (the input alone to
# the host, everything else recomputed, attention included: half the host bytes, NOTE [Input-only
# layers] in memo/runtime/layer.py). "auto" is that rule; "memo" and "input-only" force one.
# memo's least device need at a length (what the longest-sequence search asks) is input-only's under
# "auto" whatever the host holds: its two rounding buffers hold the input alone where memo's hold the
# input and the attention output, and its backward holds one recomputed attention output where memo
# holds two in the buffers, so it needs one S_attn less than memo at alpha = 0 (recorded: Llama-3.1-8B
# on one GPU at 688K tokens, 52.2 GiB against 57.6), and the planner picks it where nothing else fits.
#
# NOTE [Fit limits]
# The seed's 80% rule covers PyTorch's fragmentation and the temporaries no plan sees: full
# recompute and the peers keep it. memo's plan has neither (every activation at a planned address),
# so memo's rows are measured against the budget its plan uses on a device: the usable budget less
# the fallback pool's headroom (NOTE [Fallback headroom] in memo/pipeline/device.py). A limit given
# in bytes (``memo estimate --fit-limit-gib``) holds every strategy to that one number instead, for a
# comparison on equal terms whatever each strategy's own rule would allow. Estimate.limit_rule says
# which one a row used: "plan", "fraction" or "given".

# NOTE [Inputs on the device where the host binds]
# Where the host cannot hold every offloading layer's input even input-only, the device's free bytes
# and the host's together are the capacity: as many layers as the host holds stay input-only (the
# first ones, as the runtime orders offloading layers), and the others run "recompute", their input
# kept on the device and the layer recomputed whole in its backward (NOTE [Layer policy] in
# memo/runtime/runtime.py), which planner/policy.py chooses the same way (a split of input-only and
# recomputed layers) when ``memo train`` plans the job. Each recomputed layer costs the device its
# input, and its backward holds the whole layer at once where an input-only layer's holds one tile's
# share; the estimate records that policy (NOTE [Estimate from a meta profile]: linear in each count).
# A length the host cannot hold one layer's input of is refused: memo offloads nothing there, which is
# the full-recompute row.
#
# NOTE [Segments where the host binds]
# Before any layer keeps its input on the device, pairs of input-only layers share one offloaded input:
# the second of a pair runs "segment" (NOTE [Segments of two layers] in memo/runtime/segments.py), its
# input recomputed in its backward from the first's, in its own rounding buffer, so the device holds
# what an input-only layer's backward holds. The estimate takes the fewest pairs that make the inputs
# fit the host (each frees one S_input), as planner/policy.py's split does when ``memo train`` plans the
# job (NOTE [Segments in the policy]); only where every layer is paired and the host still cannot hold
# them do layers keep their input on the device and recompute (then r of them leave (L - r) / 2 pairs).
# The recorded policy is the runtime's: pairs first, then single input-only layers, then recomputed
# ones, each count extended linearly (NOTE [Estimate from a meta profile]).

#: How model states are counted (NOTE [Estimate model states]).
MODEL_STATES = ("formula", "mixed", "same")

# NOTE [Sharded model states]
# How the d·c ranks that hold the same weights (data and context parallel ranks; tensor and pipeline
# parallelism split the weights themselves) share the states, per parameter of w bytes of weight, g of
# gradient and o of optimizer state (NOTE [Estimate model states] gives w, g, o):
# - "optimizer", megatron's distributed optimizer (ZeRO-1): w + g + o/(d·c) on every GPU;
# - "full", FSDP2's fully_shard (ZeRO-3): (g + o)/(d·c), plus what a layer needs whole while it
#   runs: its weights gathered, and the next layer's prefetched (2·w per parameter of a layer), and in
#   backward its unsharded gradients before the reduce-scatter (g per parameter of a layer). Where the
#   weights train in mixed precision (the "formula" and "mixed" countings: o holds an fp32 master
#   copy), FSDP2's sharded parameter is that fp32 master (MixedPrecisionPolicy casts it to the model
#   dtype as it gathers), so no model-dtype copy is sharded beside it: 16 bytes per parameter, not 18.
#   Where they do not ("same": AdamW in the model dtype), the shard is the weight itself: (w + g + o);
# - "full-offload", FSDP2 with CPUOffloadPolicy: the (w + g + o)/(d·c) shard lives in host memory, so
#   the GPU holds only the gathered layer buffers, and the shard is taken from the host memory memo
#   may pin for its offload.
# A layer's parameters come from the closed form (NOTE [Estimator formula]) in every counting: the
# gathered buffers are a few layers' worth, where the counting differs by biases and norms.

# NOTE [Estimate model states]
# "formula" (the default, both methods): the seed's closed form, (6 + 12/(d·c)) bytes per parameter
# of the first stage with its parameter count (NOTE [Estimator formula]). "mixed": the same bytes
# per parameter (model-dtype weights, fp32 gradients, fp32 master weights and Adam moments split
# over d·c), but the parameters counted on memo's rank model as built (GPT's position table,
# biases, the vocabulary padded for TP). "same": torch's AdamW in the model's dtype, as `memo
# train` runs (weights, gradients, two moments, the moments split over d·c; NOTE [Gradients in
# the peak]), counted likewise: what the validation against `memo train` uses.


def limit_rule(strategy: str, given: bool = False) -> str:
    """NOTE [Fit limits]: "given" when one limit holds every strategy, else "plan" for memo (its plan's
    usable budget) and "fraction" for the others."""
    if given:
        return "given"
    return "plan" if strategy == StrategyName.MEMO else "fraction"


def fit_limit(device_mem_gb: float, fit_fraction: float, rule: str, given_bytes: int | None = None) -> int:
    """The bytes one GPU may fill under ``rule`` (NOTE [Fit limits]); ``given_bytes`` is the "given"
    rule's."""
    if rule == "given":
        internal_assert(given_bytes is not None, "the given fit limit has no bytes")
        return int(cast(int, given_bytes))
    device = int(device_mem_gb * GB)
    if rule == "plan":
        from memo.pipeline.device import usable_device_bytes

        return usable_device_bytes(device)
    return int(device * fit_fraction)


def limit_words(rule: str, fit_fraction: float, device_mem_gb: float) -> str:
    """How a limit of ``rule`` was set, in a few words for a table or an error."""
    return {"plan": f"memo's plan budget of {device_mem_gb:g} GB",
            "fraction": f"{fit_fraction:.0%} of {device_mem_gb:g} GB",
            "given": "--fit-limit-gib, every strategy"}[rule]


@dataclass
class Estimate:
    """Per-GPU bytes of one job on one layout and strategy."""

    model: str
    seq_len: int
    layout: ParallelLayout
    strategy: str
    method: str
    dtype: str
    model_states: str
    parameters: int
    model_states_bytes: int
    activations_bytes: int
    device_mem_gb: float
    fit_fraction: float
    #: memo's alpha and what bound it; the host bytes its offload pins (None for other strategies).
    alpha: float | None = field(default=None)
    alpha_binding: str | None = field(default=None)
    host_bytes_per_process: int | None = field(default=None)
    host_bytes_per_node: int | None = field(default=None)
    #: memo's layer policy: "memo" (every layer at alpha) or "input-only" (NOTE [Memo's policy in an
    #: estimate]); None for other strategies.
    policy: str | None = field(default=None)
    #: memo's layers that keep their input on the device and recompute, where the host cannot hold every
    #: layer's (NOTE [Inputs on the device where the host binds]); the others run ``policy``.
    recomputed_layers: int = field(default=0)
    #: memo's segment layers (NOTE [Segments where the host binds]): each recomputes its input from the
    #: input-only layer before it, so a pair offloads one input.
    segment_layers: int = field(default=0)
    #: What "fits" is measured against (NOTE [Fit limits]): "fraction" (fit_fraction of the GPU) or
    #: "plan" (the usable budget of memo's plan) or "given" (``given_limit_bytes``, every strategy's).
    limit_rule: str = field(default="fraction")
    given_limit_bytes: int | None = field(default=None)
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.model_states_bytes + self.activations_bytes

    @property
    def limit_bytes(self) -> int:
        return fit_limit(self.device_mem_gb, self.fit_fraction, self.limit_rule, self.given_limit_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.limit_bytes

    def to_dict(self) -> dict[str, Any]:
        def gib(n: int | None) -> float | None:
            return None if n is None else round(n / GiB, 4)

        return {
            "version": ESTIMATE_VERSION, "kind": ESTIMATE_KIND,
            "model": self.model, "seq_len": self.seq_len, **self.layout.to_dict(),
            "strategy": self.strategy, "method": self.method, "dtype": self.dtype,
            "model_states_counted_as": self.model_states, "parameters_per_gpu": self.parameters,
            "model_states_gib": gib(self.model_states_bytes), "activations_gib": gib(self.activations_bytes),
            "total_gib": gib(self.total_bytes),
            "model_states_bytes": self.model_states_bytes, "activations_bytes": self.activations_bytes,
            "total_bytes": self.total_bytes,
            "device_mem_gb": self.device_mem_gb, "fit_fraction": self.fit_fraction,
            "limit_gib": gib(self.limit_bytes), "limit_bytes": self.limit_bytes, "fits": self.fits,
            "limit_rule": self.limit_rule, "policy": self.policy,
            "recomputed_layers": self.recomputed_layers, "segment_layers": self.segment_layers,
            "alpha": self.alpha, "alpha_binding": self.alpha_binding,
            "host_bytes_per_process": self.host_bytes_per_process,
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_gib_per_node": gib(self.host_bytes_per_node),
            "notes": list(self.notes),
        }


def strategy_problem(strategy: str, layout: ParallelLayout) -> str | None:
    """Why ``strategy`` cannot run on ``layout`` at all, or None (NOTE [The peer in an estimate])."""
    if strategy == StrategyName.OFFLOADED_CHECKPOINT and layout.tp > 1:
        return ("offloaded-checkpoint tiles each MLP over the rank's own tokens, which a tensor + sequence "
                "parallel rank cannot (its MLP gathers the sequence); it runs with TP 1")
    if strategy == StrategyName.OFFLOADED_CHECKPOINT and layout.pp > 1:
        # NOTE [Layouts memo train launches]: memo train runs pipeline stages by megatron's schedules
        # under none, full-recompute and memo only (PIPELINED_STRATEGIES in memo/train/pipelined.py).
        return ("memo train runs pipeline stages (megatron's schedules) under none, full-recompute or memo, "
                "not offloaded-checkpoint; it runs with PP 1")
    return None


class Estimator:
    """One model, dtype and machine; estimates any layout, length and strategy (profiles cached)."""

    def __init__(self, model: str, *, method: str = "plan", dtype: str = "bfloat16",
                 model_states: str = "formula", machine: Machine | None = None,
                 log: Callable[[str], None] | None = None, device: str = "cuda", memo_policy: str = "auto",
                 fit_limit_bytes: int | None = None) -> None:
        from memo.models import get_config
        from memo.pipeline import DTYPES

        if method not in METHODS:
            raise MemoError(f"memo estimate: --method must be one of {', '.join(METHODS)}, got {method!r}")
        if model_states not in MODEL_STATES:
            raise MemoError(f"memo estimate: model states must be one of {', '.join(MODEL_STATES)}, "
                            f"got {model_states!r}")
        if dtype not in DTYPES:
            raise MemoError(f"memo estimate: unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        self.config = get_config(model)  # an unknown name fails here with the list of valid ones
        self.model = model
        self.method = method
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.model_states = model_states
        self.machine = estimate_machine(machine)
        self.shape = FormulaShape.of(self.config)
        if device not in ("cuda", "cpu"):
            raise MemoError(f"memo estimate: device must be 'cuda' or 'cpu', got {device!r}")
        self.profiler = RankProfiler(self.config, model, self.dtype, self.machine, log, device)
        if memo_policy not in MEMO_POLICIES:
            raise MemoError(f"memo estimate: --memo-policy must be one of {', '.join(MEMO_POLICIES)}, "
                            f"got {memo_policy!r}")
        #: NOTE [Memo's policy in an estimate].
        self.memo_policy = memo_policy
        device_bytes = int(self.machine.device_mem_gb * GB)
        if fit_limit_bytes is not None and not 0 < fit_limit_bytes <= device_bytes:
            raise MemoError(f"memo estimate: --fit-limit-gib {fit_limit_bytes / GiB:g} must be more than 0 "
                            f"and at most the GPU's memory, --device-mem-gb {self.machine.device_mem_gb:g} "
                            f"GB ({device_bytes / GiB:,.2f} GiB)")
        #: NOTE [Fit limits]: one limit for every strategy, or None for each strategy's own rule.
        self.fit_limit_bytes = fit_limit_bytes

    def limit_rule(self, strategy: str) -> str:
        """How ``strategy``'s fit limit is set (NOTE [Fit limits])."""
        return limit_rule(strategy, self.fit_limit_bytes is not None)

    def limit_bytes(self, strategy: str) -> int:
        """The bytes one GPU may fill for ``strategy`` (NOTE [Fit limits])."""
        m = self.machine
        return fit_limit(m.device_mem_gb, m.fit_fraction, self.limit_rule(strategy), self.fit_limit_bytes)

    def strategies(self) -> tuple[str, ...]:
        return PLAN_STRATEGIES if self.method == EstimateMethod.PLAN else FORMULA_STRATEGIES

    def states(self, layout: ParallelLayout, seq_len: int) -> tuple[int, int]:
        """(parameters, model-state bytes on the device) of one first-stage GPU (NOTE [Estimate model
        states], [Sharded model states])."""
        params, device, _ = self.state_bytes(layout, seq_len)
        return params, device

    def state_bytes(self, layout: ParallelLayout, seq_len: int) -> tuple[int, int, int]:
        """(parameters, device bytes, host bytes) of one first-stage GPU's model states (NOTE
        [Sharded model states])."""
        if self.model_states == "formula":
            params = int(round(formula_parameters(self.shape, layout)))
            weight, grad, optim = 2, 4, 12
        else:
            params, elem = counted_parameters(self.config, layout, seq_len, self.dtype)
            weight, grad, optim = (elem, elem, 2 * elem) if self.model_states == "same" else (elem, 4, 12)
        shards = layout.dp * layout.cp
        if layout.sharding == Sharding.OPTIMIZER:
            return params, weight * params + grad * params + -(-optim * params // shards), 0
        # NOTE [Sharded model states]: under mixed precision the shard is the optimizer's fp32 master
        shard = grad + optim + (weight if self.model_states == "same" else 0)
        sharded = -(-shard * params // shards)
        gathered = int(round((2 * weight + grad) * formula_layer_parameters(self.shape, layout)))
        if layout.sharding == Sharding.FULL:
            return params, sharded + gathered, 0
        return params, gathered, sharded

    def estimate(self, seq_len: int, layout: ParallelLayout, strategy: str = "memo",
                 alpha: float | None = None, *, least: bool = False) -> Estimate:
        """The per-GPU estimate; a MemoError for a layout the job cannot take.

        ``least``: memo at its least device need, input-only layers (NOTE [Memo's policy in an
        estimate]; what the longest-sequence search asks: NOTE [Longest sequence search])."""
        if strategy not in PLAN_STRATEGIES:
            raise MemoError(f"memo estimate: --strategy must be one of {', '.join(PLAN_STRATEGIES)}, "
                            f"got {strategy!r}")
        if alpha is not None and strategy != StrategyName.MEMO:
            raise MemoError(f"memo estimate: --alpha is memo's; strategy {strategy} has none")
        layout.check(self.config, seq_len)
        problem = strategy_problem(strategy, layout)
        if problem:
            raise MemoError(f"memo estimate: {problem}")
        params, states, host_states = self.state_bytes(layout, seq_len)
        m = self.machine
        est = Estimate(model=self.config.name, seq_len=seq_len, layout=layout, strategy=strategy,
                       method=self.method, dtype=self.dtype_name, model_states=self.model_states,
                       parameters=params, model_states_bytes=states, activations_bytes=0,
                       device_mem_gb=m.device_mem_gb, fit_fraction=m.fit_fraction,
                       limit_rule=self.limit_rule(strategy), given_limit_bytes=self.fit_limit_bytes)
        if host_states:
            est.host_bytes_per_process = host_states
            est.host_bytes_per_node = host_states * min(m.gpus_per_node, layout.gpus)
            est.notes.append(f"model states in host memory: {host_states / GiB:,.2f} GiB per GPU")
        if self.method == EstimateMethod.FORMULA:
            est.activations_bytes = int(round(formula_activations(self.shape, layout, seq_len, strategy)))
        else:
            # all-gather's exchange on top of the peak (memo's alpha is lowered with it counted); Ulysses'
            # is recorded where it lives (NOTE [Ulysses in a meta estimate] in meta_ulysses.py)
            est.activations_bytes = self._exchange_on_top(layout, seq_len)
            if strategy == StrategyName.MEMO:
                self._memo(est, 0.0 if least else alpha, least or alpha is None, least)
            else:
                if strategy == StrategyName.OFFLOADED_CHECKPOINT:
                    self._peer_host(est)
                est.activations_bytes += self._activations(strategy, layout, seq_len, None)
        est.notes.extend(self._notes(layout, seq_len))
        return est

    def screen_bytes(self, seq_len: int, layout: ParallelLayout) -> tuple[int, int]:
        """(model-state bytes on the device, activation bytes) of full recompute on ``layout`` for the
        layout search's screen (NOTE [Fast longest-sequence search]): the rank's profile on its own
        tokens, shared by both context-parallel communications, with the exchange's closed form on top
        (NOTE [Context-parallel exchange in an estimate]), for either. Cheaper than :meth:`estimate`
        and no more than a ranking: the estimates that answer record Ulysses' exchange."""
        own_tokens = Layout(layout.gpus, layout.tp, layout.cp, layout.pp, layout.micro_batch)
        exchange = attention_exchange_bytes(self.config, layout, seq_len, self.dtype.itemsize)
        if layout.pp == 1:
            activations = self._activations("full-recompute", own_tokens, seq_len, None)
        else:  # one micro-batch's iteration and what p - 1 more keep, not the stage's recorded 1F1B step
            n = self.profiler.numbers("full-recompute", own_tokens, seq_len, stage=False)
            activations = n.stage_activations + (layout.pp - 1) * n.held
        return self.state_bytes(layout, seq_len)[1], activations + exchange

    def _exchange_on_top(self, layout: ParallelLayout, seq_len: int) -> int:
        """The context-parallel exchange a recorded peak does not hold: all-gather's (NOTE
        [Context-parallel exchange in an estimate]); Ulysses' is recorded (NOTE [Ulysses in a meta
        estimate])."""
        if layout.cp_comm == CPComm.A2A:
            return 0
        return attention_exchange_bytes(self.config, layout, seq_len, self.dtype.itemsize)

    def _activations(self, strategy: str, layout: ParallelLayout, seq_len: int, alpha: float | None,
                     recomputed: int = 0, pairs: int = 0) -> int:
        """NOTE [Gradients in the peak] and [First stage under 1F1B] in memo/estimate/plan_method.py;
        ``recomputed``, ``pairs``: NOTE [Inputs on the device where the host binds], [Segments where the
        host binds]."""
        n = self.profiler.numbers(strategy, layout, seq_len, alpha, recomputed=recomputed, pairs=pairs)
        stages = [n]
        if layout.pp > 1:  # NOTE [Last stage under 1F1B]: its head, one micro-batch
            stages.append(self.profiler.numbers(strategy, layout, seq_len, alpha, stage=False,
                                                recomputed=recomputed, pairs=pairs))
        if self.model_states == "same":
            return max(s.iteration - s.gradients for s in stages)
        return max(s.activations for s in stages)

    def _memo(self, est: Estimate, alpha: float | None, may_go_input_only: bool, least: bool = False) -> None:
        """NOTE [Memo's alpha in an estimate], [Memo's policy in an estimate]."""
        from memo.planner import evaluate_alpha

        layout, seq_len = est.layout, est.seq_len
        host = self.machine.host_per_process() // layout.pp - (est.host_bytes_per_process or 0)
        if self.memo_policy == LayerPolicy.INPUT_ONLY or (least and self.memo_policy == "auto"):
            self._input_only(est, host, None)
            return
        try:
            solution = self.profiler.alpha(layout, seq_len, alpha, host)
        except MemoError as err:  # the host cannot hold every layer's input and attention output
            if not may_go_input_only or self.memo_policy == LayerPolicy.MEMO:
                raise
            self._input_only(est, host, err)
            return
        est.policy = "memo"

        exchange = est.activations_bytes

        def total_at(a: float) -> int:
            return est.model_states_bytes + exchange + self._activations("memo", layout, seq_len, a)

        if alpha is None:  # NOTE [Memo's alpha in an estimate]
            chosen, total, _ = memo_alpha_within(total_at, solution.alpha, est.limit_bytes)
        else:
            chosen, total = alpha, total_at(alpha)
        binding = solution.binding if chosen == solution.alpha else "device memory"
        est.activations_bytes = total - est.model_states_bytes
        est.alpha, est.alpha_binding = chosen, binding
        s_in, s_attn, s_oth = self.profiler.layer_sizes(layout, seq_len)
        m = self.machine
        depth = self.config.n_layers // layout.pp
        layer_s = rank_layer_ms(m, self.config, layout, seq_len, self.dtype) / 1e3
        # The LP's own solution where alpha was not lowered (re-evaluating it can miss the host
        # constraint by the solver's rounding); a lowered alpha needs less host memory.
        at = solution if chosen == solution.alpha else evaluate_alpha(
            chosen, s_in, s_attn, s_oth, m.bandwidth_gbps * 1e9, layer_s, depth, host,
            offloaded_layers=self.profiler.offloaded_layers(layout))
        # Each of the p micro-batches in flight on the first stage has its own offloaded layers.
        self._host(est, int(at.host_bytes) * layout.pp)
        if not at.copies_hidden:
            est.notes.append(f"memo: at alpha {chosen:.3f} one layer's copy ({at.copy_seconds * 1e3:,.0f} "
                             f"ms) does not hide under its forward ({layer_s * 1e3:,.0f} ms): offload "
                             "stalls compute")

    def _input_only(self, est: Estimate, host: int, memo_error: MemoError | None) -> None:
        """Every offloading layer input-only: the host holds its input alone (NOTE [Memo's policy in an
        estimate]); where it cannot hold them all, as many as it holds, the others keeping their input on
        the device (NOTE [Inputs on the device where the host binds]); a MemoError where it holds none."""
        layout, seq_len = est.layout, est.seq_len
        s_in = self.profiler.input_bytes(layout, seq_len)
        layers = self.profiler.offloaded_layers(layout)
        offloaded = min(layers, host // s_in) if s_in > 0 else layers
        # NOTE [Segments where the host binds]: pairs first, then layers whose input stays on the device
        recomputed = max(0, layers - 2 * offloaded)
        pairs = min(layers - offloaded, (layers - recomputed) // 2)
        if offloaded < 1:
            why = (f"the host cannot hold even one layer's input (S_input {s_in / GiB:,.3f} GiB > "
                   f"{host / GiB:,.2f} GiB per process), so memo offloads nothing: it is full recompute here")
            if memo_error is None:
                raise MemoError(f"memo estimate: {why}; use more host memory, more GPUs or a shorter "
                                "sequence")
            raise MemoError(f"{memo_error}; {why}") from memo_error
        est.policy = "input-only"
        est.recomputed_layers, est.segment_layers = recomputed, pairs
        est.activations_bytes += self._activations("input-only", layout, seq_len, None, recomputed, pairs)
        est.alpha, est.alpha_binding = None, "host memory"
        inputs = layers - recomputed - pairs
        self._host(est, s_in * inputs * layout.pp)
        if pairs:
            est.notes.append(f"memo: {pairs} pairs of layers share one offloaded input, the second "
                             "recomputing its input from the first's (NOTE [Segments where the host binds])")
        if est.recomputed_layers:
            held = s_in * inputs / GiB
            est.notes.append(f"memo: the host holds {inputs} layers' inputs ({held:,.2f} GiB per "
                             f"process); {est.recomputed_layers} layers keep theirs on the device and "
                             "recompute (NOTE [Inputs on the device where the host binds])")

    def _peer_host(self, est: Estimate) -> None:
        """NOTE [The peer in an estimate]: every layer's input in host memory, or a MemoError."""
        layout = est.layout
        host = self.machine.host_per_process() // layout.pp - (est.host_bytes_per_process or 0)
        s_in = self.profiler.input_bytes(layout, est.seq_len)
        need = s_in * (self.config.n_layers // layout.pp)
        if need > host:
            raise MemoError(f"memo estimate: offloaded-checkpoint keeps every layer's input in host memory, "
                            f"{need / GiB:,.2f} GiB per process (S_input {s_in / GiB:,.3f} GiB x "
                            f"{self.config.n_layers // layout.pp} layers) > {host / GiB:,.2f} GiB")
        self._host(est, need * layout.pp)

    def _host(self, est: Estimate, offload_bytes: int) -> None:
        """Adds memo's pinned offload bytes to the host bytes (the states' share when offloaded)."""
        m = self.machine
        est.host_bytes_per_process = (est.host_bytes_per_process or 0) + offload_bytes
        est.host_bytes_per_node = est.host_bytes_per_process * min(m.gpus_per_node, est.layout.gpus)

    def _notes(self, layout: ParallelLayout, seq_len: int) -> list[str]:
        out = []
        if self.model_states == "formula" and self.config.arch == "gpt":
            from memo.models import DEFAULT_MAX_SEQ_LEN

            rows = max(seq_len, DEFAULT_MAX_SEQ_LEN)
            table = rows * self.config.hidden
            out.append(f"memo's GPT also holds a learned position table of {rows:,} x {self.config.hidden} "
                       f"parameters on the first stage ({table * 2 / GiB:,.2f} GiB in bf16, replicated, "
                       "x9 with its gradient and optimizer states), which the seed's Llama formula has no "
                       "term for; --model-states mixed counts it")
        if layout.head_chunks is not None:
            from memo.models.ulysses_attention import head_chunks

            c, t = layout.head_chunks, layout.tp
            default = head_chunks(self.config.n_heads // t, self.config.n_kv_heads // t, layout.cp)
            out.append(f"Ulysses over {c} chunks of heads, one at a time (--ulysses-head-chunks {c}): 1/{c} "
                       f"of the head shards during attention, for {c / default:g}x the default's key/value "
                       "traffic (NOTE [Head chunks in an estimate])")
        if layout.cp > 1 and self.method == EstimateMethod.PLAN:
            exchange = attention_exchange_bytes(self.config, layout, seq_len, self.dtype.itemsize)
            gib = f"{exchange / GiB:,.2f} GiB"
            if layout.cp_comm == CPComm.A2A:
                out.append(f"context parallel (a2a): the head-sharded copies of the all-to-all ({gib} at "
                           "attention's backward) recorded where they live, by memo's Ulysses functions on "
                           "the meta rank (NOTE [Ulysses in a meta estimate])")
            else:
                out.append(f"context parallel (all_gather): the gathered K and V and their float32 "
                           f"gradients, {gib}, counted on top of the recorded peak (NOTE [Context-parallel "
                           "exchange in an estimate])")
        if self.method == EstimateMethod.FORMULA and self.dtype_name not in ("bfloat16", "bf16"):
            out.append("the formula counts bf16 activations and weights whatever --dtype says")
        out.extend(self.profiler.notes)
        return out


def estimate(model: str, seq_len: int, *, gpus: int = 1, tp: int = 1, cp: int = 1, pp: int = 1,
             micro_batch: int = 1, strategy: str = "memo", method: str = "plan", dtype: str = "bfloat16",
             model_states: str = "formula", alpha: float | None = None, machine: Machine | None = None,
             **machine_fields: Any) -> Estimate:
    """Per-GPU memory of training ``model`` on ``seq_len`` tokens with ``gpus`` GPUs as TP x CP x PP x DP.

    Example::

        >>> e = estimate("llama-3.1-8b", 8192, gpus=8, tp=4, pp=2, strategy="none",
        ...                   method="formula")
        >>> round(e.total_bytes / 2**30, 2), e.fits
        (27.2, True)

    ``machine_fields`` are :class:`memo.estimate.Machine`'s (``device_mem_gb``, ``host_mem_gb``,
    ``gpus_per_node``, ``bandwidth_gbps``, ``layer_ms``, ...) when ``machine`` is not given.
    """
    if machine is None:
        machine = Machine(**machine_fields)  # estimate's defaults: Estimator
    elif machine_fields:
        machine = dataclasses.replace(machine, **machine_fields)
    est = Estimator(model, method=method, dtype=dtype, model_states=model_states, machine=machine)
    return est.estimate(seq_len, Layout(gpus, tp, cp, pp, micro_batch), strategy, alpha)
