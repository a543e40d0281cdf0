"""Per-GPU memory from memo's own meta-device profile of the rank (``--method plan``).

NOTE [Estimate from a meta profile]
One GPU of the first pipeline stage is profiled as ``memo profile`` profiles a rank: memo's
reference model built on the meta device as one rank of t-way tensor + sequence parallelism
(NOTE [Tensor-parallel rank] in memo/models/parallel.py), fed s/c tokens (NOTE [Context-parallel
profile]), one iteration recorded by the dispatch recorder (NOTE [Sizes from meta]); no memory is
allocated, so 7B at 1M tokens takes seconds. Per strategy:

* ``none``: the plain model (pass 1 of the profile);
* ``full-recompute``: the model with ``recompute="full"``, every layer under
  ``torch.utils.checkpoint``, as ``memo train --strategy full-recompute`` runs it;
* ``memo``: the model wrapped by memo's runtime with every layer under memo at the alpha the LP
  gives for the stage's L/p layers (or ``--alpha``); where that does not fit the device limit,
  alpha is lowered to the largest that does (NOTE [Memo's alpha in an estimate]).

The iteration's device bytes (the trace's lower bound: what the plan's device total counts,
NOTE [Device total]) are linear in the depth once a few layers exist: every layer adds what it
keeps (none: its activations; full recompute: its input; memo: its parameters' gradients) and the
peak stays in the same place. So the stage's L/p layers are not built: two depths
(:data:`DEPTHS`) are recorded and the numbers extended linearly; a stage no deeper than that is
recorded as it is. ``tests/estimate/test_estimate.py`` checks the extension against whole-depth profiles.

NOTE [Gradients in the peak]
``model_states="same"`` is torch's AdamW as ``memo train`` runs it: gradients are created during
backward and freed between steps, so the iteration's peak counts those that exist at its moment,
and the activations reported are that peak less all gradients (the total is exact: the peak plus
parameters and optimizer states, as the plan's device total). The seed's states (and
``"mixed"``) are Megatron's: fp32 main-gradient buffers live for the whole run, so the gradients
are counted whole and the activations are the peak of everything else the iteration holds.

NOTE [First stage under 1F1B]
With p > 1 the first stage runs the embedding and L/p layers, not the LM head, and holds p
micro-batches at once. What is recorded is that stage's step as its schedule runs it (NOTE [A stage's
address plan] in memo/pipeline/stage_plan.py, here on meta): p forwards of the rank model without
its head, each one's output sent on (its data freed, as megatron's schedule frees it) and the next
stage's gradient received, before the first backward, then the backwards and the forwards 1F1B
alternates, phases named per micro-batch. Its lower bound, the device total a stage plan of that step
counts, is the stage's. For memo the host memory of a process is shared by the p micro-batches in
flight, so alpha is solved with M_CPU / p.

NOTE [Last stage under 1F1B]
The last stage holds one micro-batch at a time, but its LM head's logits (s x V per sequence) can
outweigh the first stage's p forwards at long sequences and large vocabularies. One iteration of one
micro-batch through L/p layers and the head (the single-iteration profile at the stage's depth, the
embedding's small share included) bounds it; the activations an estimate reports are the larger of
the two stages'.

NOTE [Memo's alpha in an estimate]
``memo`` is every layer under memo at the LP's alpha, the last two included (the leanest policy
memo's planner has; the paper's fixed rule keeps the last two whole, and the planner's per-layer
choice of kept or fully recomputed layers only spends room a budget leaves, so neither decides a
fit). All L/p layers offload, so the LP's host constraint counts all of them. ``memo_keep_last
= 2`` estimates the paper's rule instead: the last two layers kept, the LP counting L/p - 2. When
that does not fit the device limit, alpha is lowered (:func:`memo_alpha_within`): a lower alpha
offloads less and recomputes more, so the device holds less. The memo profile records the
wrapped model at a given alpha with a huge host memory and layer time: the real ones are
checked by the LP here, for the stage's whole depth, not for the recorded depth.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memo.errors import internal_assert
from memo.estimate.formula import FORMULA_STRATEGIES
from memo.estimate.layout import ParallelLayout
from memo.estimate.meta_ulysses import meta_ulysses
from memo.estimate.rank_numbers import RankNumbers, analyse_trace
from memo.machine import Machine
from memo.planner.vocab import CPComm, LayerPolicy, StrategyName
from memo.repeated_tiles import repeated_tiles_skipped
from memo.units import GB

if TYPE_CHECKING:
    import torch
    from torch import nn

    from memo.models.config import ModelConfig
    from memo.models.model import TransformerModel

__all__ = ["DEPTHS", "ESTIMATE_DEFAULTS", "PLAN_STRATEGIES", "Machine", "RankNumbers", "RankProfiler",
           "analyse_trace", "attention_exchange_bytes", "counted_parameters", "estimate_machine",
           "rank_layer_ms"]


#: The depths recorded and extended linearly to a stage's L/p layers (NOTE [Estimate from a meta
#: profile]). From three layers on, each added layer is a middle one: the first layer (its input
#: comes from the embedding) and the last (its backward starts the prefetches) are already there.
DEPTHS = (3, 4)

PLAN_STRATEGIES = (*FORMULA_STRATEGIES, StrategyName.MEMO.value, StrategyName.OFFLOADED_CHECKPOINT.value)

# NOTE [The peer in an estimate]
# ``offloaded-checkpoint`` is the peer ``memo train --strategy offloaded-checkpoint`` runs (ALST's
# recipe with PyTorch's APIs: every layer under non-reentrant checkpoint, its input sent to the host
# by saved-tensor hooks, the MLP over token tiles; memo/runtime/peers.py), recorded on the meta rank
# model with the hooks counting host bytes instead of copying. Its device bytes extend over the depth
# like the other strategies'; its host bytes are every layer's input, L/p · S_input per process,
# which must fit the host memory a process may use (else it cannot run). It keeps the 80% rule.
# ``memo train`` runs it without pipeline stages only, so an estimate refuses it on PP > 1
# (strategy_problem in memo/estimate/core.py).


#: What memo estimate assumes of a machine field not given (NOTE [One machine description]): a node
#: of eight 80 GB GPUs with 2 TB of host memory and 32 GB/s links, and the paper's A800 for the
#: layer time when none is given.
ESTIMATE_DEFAULTS: dict[str, Any] = {"device_mem_gb": 80.0, "host_mem_gb": 2048.0, "gpus_per_node": 8,
                                     "bandwidth_gbps": 32.0, "gpu": "a800"}


def estimate_machine(machine: Machine | None = None) -> Machine:
    """``machine`` (else an empty one) with memo estimate's defaults in its unset fields."""
    return (machine or Machine()).with_defaults(**ESTIMATE_DEFAULTS)


def rank_layer_ms(machine: Machine, config: ModelConfig, layout: ParallelLayout, seq_len: int,
                  dtype: torch.dtype) -> float:
    """T_layer of one rank: the given time scaled by forward FLOPs (length) and by t·c (how many
    ranks share a layer's work), or the FLOP estimate on ``machine.gpu`` split over t·c ranks."""
    from memo.profiler import estimate_layer_ms, layer_forward_flops

    b, tc = layout.micro_batch, layout.tp * layout.cp
    if machine.layer_ms is not None:
        at, at_tc = machine.layer_ms_at or (seq_len, tc)
        scale = layer_forward_flops(config, seq_len, b) / layer_forward_flops(config, at, b)
        return machine.layer_ms * scale * at_tc / tc
    return estimate_layer_ms(config, seq_len, b, machine.gpu, dtype, machine.efficiency).value / tc


def _rank_model(config: ModelConfig, n_layers: int, layout: ParallelLayout, seq_len: int, dtype: torch.dtype,
                recompute: str) -> TransformerModel:
    from memo.models import DEFAULT_MAX_SEQ_LEN, build_model

    cfg = dataclasses.replace(config, n_layers=n_layers)
    # GPT's position table as the profiler and training size it (build_profile_model).
    kw = {"max_seq_len": max(seq_len, DEFAULT_MAX_SEQ_LEN)} if config.arch == "gpt" else {}
    model = build_model(cfg, device="meta", dtype=dtype, tensor_parallel=layout.tp, recompute=recompute, **kw)
    if layout.ulysses:
        meta_ulysses(model, layout.cp, head_chunks=layout.head_chunks)
    return model


def counted_parameters(config: ModelConfig, layout: ParallelLayout, seq_len: int,
                       dtype: torch.dtype) -> tuple[int, int]:
    """(parameters, bytes per parameter) one GPU of the first stage holds in memo's reference rank
    model: its embedding (and GPT's position table), L/p layers and, with p = 1, the final norm and
    the LM head (once when tied). Counted on a meta model of two layers, extended by the depth."""
    from memo.profiler import model_parts

    model = _rank_model(config, 1, layout, seq_len, dtype, "none")
    parts = model_parts(model)
    embedding, layers, head = parts.embedding, parts.layers, parts.head
    seen: set[int] = set()

    def count(module: nn.Module) -> int:
        n = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    total = count(embedding) + config.n_layers // layout.pp * count(layers[0])
    if layout.pp == 1:
        total += sum(count(module) for module in head)
        total += sum(p.numel() for p in model.parameters() if id(p) not in seen)  # final norm etc.
    elem = next(model.parameters()).element_size()
    return total, elem


def record_first_stage(model: TransformerModel, layout: ParallelLayout, seq_len: int,
                       meta: dict[str, Any]) -> dict[str, Any]:
    """NOTE [First stage under 1F1B]: the trace of the first of ``layout.pp`` stages running the 1F1B
    step of ``layout.pp`` micro-batches, on the meta rank model (its head replaced by the send)."""
    import torch

    from memo.phases import PhaseTracker
    from memo.profiler.context_parallel import rank_tokens
    from memo.profiler.record import _tag_param_grads
    from memo.profiler.recorder import DispatchRecorder
    from memo.trace_format import TraceBuilder

    class SendOnward(torch.nn.Module):
        """The first stage's end: its hidden states go to the next stage (the head is not on it)."""

        def forward(self, x: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor:
            return x

    p = layout.pp
    head, model.head = model.head, SendOnward()
    counter = [-1]
    tracker = PhaseTracker(model.embedding, list(model.layers), [], micro_batch=lambda: counter[0])
    rec = DispatchRecorder(lambda: tracker.current, device=torch.device("meta"))
    tracker.add_listener(rec.on_phase)
    ids = torch.zeros(layout.micro_batch, rank_tokens(seq_len, layout.tp, layout.cp), dtype=torch.long,
                      device="meta")
    params = list(model.parameters())
    for param in params:
        param.grad = None
    sent: list[tuple[torch.Tensor, torch.Size]] = []

    def forward() -> None:
        counter[0] += 1
        out = model(ids, ids)
        shape = out.shape
        out.data = torch.empty(1, dtype=out.dtype, device=out.device)  # sent on: only its graph stays
        sent.append((out, shape))

    def backward() -> None:
        out, shape = sent.pop(0)
        grad = torch.zeros(shape, dtype=out.dtype, device=out.device)  # the next stage's gradient
        # megatron's custom_backward: the output's data is gone, so no shape check
        torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
            (out,), (grad,), False, False, (), True, True)

    try:
        with tracker.iteration(), rec:
            # 1F1B on the first stage: p - 1 forwards of warm-up, one steady forward and backward, then
            # the p - 1 backwards of the cool-down: p forwards are in flight at the first backward
            for _ in range(p):
                forward()
            for _ in range(p):
                backward()
        rec.close()
    finally:
        tracker.remove()
        model.head = head
    _tag_param_grads(rec, params)
    builder = TraceBuilder(meta=meta)
    builder.events = rec.events
    return builder.finish()


def _record_offloaded_checkpoint(model: TransformerModel, layout: ParallelLayout,
                                 seq_len: int) -> dict[str, Any]:
    """One iteration of the ``offloaded-checkpoint`` peer on the meta rank model (NOTE [The peer in an
    estimate]): its layers checkpointed with their inputs sent to the host, MLPs tiled; the trace."""
    import torch

    from memo.profiler.context_parallel import rank_tokens
    from memo.profiler.record import phase_tracker, record
    from memo.runtime.peers import CheckpointedLayers, MetaHostOffload

    layers = CheckpointedLayers(model.layers, offload=MetaHostOffload(), tile_mlp=True)  # type: ignore[arg-type]
    layers.install()
    tracker = phase_tracker(model)
    tokens = rank_tokens(seq_len, layout.tp, layout.cp)
    ids = torch.zeros(layout.micro_batch, tokens, dtype=torch.long, device="meta")
    try:
        return record(model, ids, ids, tracker=tracker, meta={"model": model.config.name,
                                                               "seq_len": seq_len}).trace
    finally:
        tracker.remove()
        layers.remove()


def _policy_kinds(policy: tuple[str, ...]) -> Callable[[str], str]:
    """A phase's kind for :func:`analyse_trace` under a mixed ``policy``: a layer's backward by its
    layer's policy (a recomputed layer's runs first and holds every recomputed input still there; an
    offloading layer's runs after them all), forwards together, the rest by their own kind."""
    from memo.phase_names import parse_phase

    def kind(phase: str) -> str:
        if not phase:
            return ""
        what, index = parse_phase(phase)
        if what == "layer.bwd" and index is not None:
            return f"{what}.{policy[index]}"
        return what

    return kind


class RankProfiler:
    """Meta profiles of first-stage ranks, cached by what they depend on."""

    def __init__(self, config: ModelConfig, source: str, dtype: torch.dtype, machine: Machine,
                 log: Callable[[str], None] | None = None, device: str = "cuda") -> None:
        from memo.profiler.meta_cache import MetaKernelCache

        self.config = config
        #: The device type the estimate is for: "cuda" (machine.gpu's), or "cpu" (memo train on
        #: the CPU, what tests compare with); it decides memo's tiles in the recorded pass.
        self.device = device
        self.source = source
        self.dtype = dtype
        self.machine = machine
        self.log = log or (lambda _line: None)
        self.cache: dict[tuple, tuple[RankNumbers, Any]] = {}
        self.profiles = 0
        self.notes: list[str] = []
        #: NOTE [Meta kernels by their inputs' shapes] in memo/profiler/meta_cache.py (None: every kernel
        #: runs, what tests compare with).
        self.kernels: MetaKernelCache | None = MetaKernelCache()

    def _record(self, strategy: str, layout: ParallelLayout, seq_len: int, depth: int, alpha: float | None,
                stage: bool = True, policy: tuple[str, ...] | None = None) -> tuple[RankNumbers, Any]:
        """The numbers of one recorded iteration (and pass 1's layer statistics), or with ``stage`` and
        p > 1 of the first stage's 1F1B step (NOTE [First stage under 1F1B]; no statistics). memo's
        layers run ``policy`` where given (``depth`` is its length), else ``strategy`` in every layer
        but the kept last ones."""
        stages = layout.pp if stage and strategy != StrategyName.OFFLOADED_CHECKPOINT else 1
        if policy is None and strategy in (LayerPolicy.MEMO, LayerPolicy.INPUT_ONLY):
            kept = min(self.machine.memo_keep_last, depth)
            policy = (strategy,) * (depth - kept) + (LayerPolicy.KEEP.value,) * kept
        # a Ulysses rank records its exchange (NOTE [Ulysses in a meta estimate] in meta_ulysses.py)
        ulysses = layout.ulysses
        exchange = (layout.cp_comm, layout.head_chunks) if ulysses else None
        key = (strategy, layout.tp, layout.cp, layout.micro_batch, seq_len, depth,
               None if alpha is None else round(alpha, 6), stages, policy, exchange)
        if key in self.cache:
            return self.cache[key]
        from memo.profiler.meta_cache import reused

        with reused(self.kernels):
            out = self._recorded(strategy, layout, seq_len, depth, alpha, stages, policy)
        self.cache[key] = out
        return out

    def _recorded(self, strategy: str, layout: ParallelLayout, seq_len: int, depth: int, alpha: float | None,
                  stages: int, policy: tuple[str, ...] | None) -> tuple[RankNumbers, Any]:
        """:meth:`_record`'s recording, not cached."""
        from memo.pipeline import profile

        recompute = "full" if strategy == StrategyName.FULL_RECOMPUTE else "none"
        model = _rank_model(self.config, depth, layout, seq_len, self.dtype, recompute)
        mixed = policy is not None and (LayerPolicy.RECOMPUTE in policy or LayerPolicy.SEGMENT in policy)
        kind_of = _policy_kinds(policy) if mixed else None
        if stages > 1:
            self.profiles += 1
            trace = self._first_stage(model, strategy, layout, seq_len, alpha, policy)
            return analyse_trace(trace, kind_of), None
        common = {"tensor_parallel": layout.tp, "context_parallel": layout.cp}
        with warnings.catch_warnings(), repeated_tiles_skipped():  # NOTE [Repeated tiles in a meta estimate]
            warnings.simplefilter("ignore")  # the planner's notes on layer phases; alpha is checked here
            if policy is not None:  # NOTE [Memo's policy in an estimate] in core.py
                trace = self._wrapped(model, strategy, layout, seq_len, alpha, policy)
            elif strategy == StrategyName.OFFLOADED_CHECKPOINT:
                trace = _record_offloaded_checkpoint(model, layout, seq_len)
            else:
                result = profile(model, seq_len, layout.micro_batch, self.dtype, "meta", solve=False,
                                 **common)
        self.profiles += 1
        if policy is not None or strategy == StrategyName.OFFLOADED_CHECKPOINT:
            return analyse_trace(trace, kind_of), None
        return analyse_trace(result.trace, kind_of), result.layer_stats

    def _wrapped(self, model: TransformerModel, strategy: str, layout: ParallelLayout, seq_len: int,
                 alpha: float | None, policy: tuple[str, ...]) -> dict[str, Any]:
        """One iteration of the rank model wrapped by memo's runtime with ``policy``, recorded: what
        ``memo profile``'s second pass records (memo/pipeline/passes.py's wrapped_pass), with the tiles of
        the GPU the estimate is for (NOTE [Tiles of the device a plan is for] in memo/pipeline/job.py), and
        without its first pass of the plain model, which an estimate does not read."""
        import torch

        from memo import runtime
        from memo.profiler.context_parallel import rank_tokens
        from memo.profiler.record import phase_tracker, record

        runtime.wrap(model, alpha=0.0 if strategy == LayerPolicy.INPUT_ONLY else alpha, policy=list(policy),
                     recompute_chunk_tokens=self._tile(model, layout, seq_len))
        tracker = phase_tracker(model)
        ids = torch.zeros(layout.micro_batch, rank_tokens(seq_len, layout.tp, layout.cp), dtype=torch.long,
                          device="meta")
        try:
            return record(model, ids, ids, tracker=tracker,
                          meta={"model": self.config.name, "seq_len": seq_len}).trace
        finally:
            tracker.remove()
            runtime.unwrap(model, force=True)

    def _first_stage(self, model: TransformerModel, strategy: str, layout: ParallelLayout, seq_len: int,
                     alpha: float | None, policy: tuple[str, ...] | None) -> dict[str, Any]:
        """NOTE [First stage under 1F1B]: the first stage's step, memo's layers wrapped as the single
        iteration's profile wraps them (its policy, alpha and the tiles of the device the estimate is
        for)."""
        from memo import runtime

        meta = {"model": self.config.name, "seq_len": seq_len}
        if policy is None:
            with repeated_tiles_skipped():
                return record_first_stage(model, layout, seq_len, meta)
        runtime.wrap(model, alpha=0.0 if strategy == LayerPolicy.INPUT_ONLY else alpha, policy=list(policy),
                     recompute_chunk_tokens=self._tile(model, layout, seq_len))
        try:
            with warnings.catch_warnings(), repeated_tiles_skipped():
                warnings.simplefilter("ignore")
                return record_first_stage(model, layout, seq_len, meta)
        finally:
            runtime.unwrap(model, force=True)

    def _tile(self, model: TransformerModel, layout: ParallelLayout, seq_len: int) -> int | None:
        """The tile memo's runtime runs on the GPU the estimate is for (NOTE [Tiles of the device a plan
        is for] in memo/pipeline/job.py); None on the CPU: the runtime's default where it records."""
        if self.device != "cuda":
            return None
        import torch

        from memo.profiler.context_parallel import rank_tokens
        from memo.runtime.tiles import default_tile_tokens, params_token_bytes

        ids = torch.zeros(layout.micro_batch, rank_tokens(seq_len, layout.tp, layout.cp), dtype=torch.long,
                          device="meta")
        with torch.no_grad():
            rows = int(model.embedding(ids).shape[0])
        hidden = int(self.config.hidden)
        layer_params = sum(p.numel() for p in model.layers[0].parameters())
        return default_tile_tokens(rows, batch=layout.micro_batch, hidden=hidden, device_type="cuda",
                                   token_bytes=params_token_bytes(layer_params, hidden, self.dtype.itemsize))

    def numbers(self, strategy: str, layout: ParallelLayout, seq_len: int, alpha: float | None = None,
                whole_depth: bool = False, stage: bool = True, recomputed: int = 0,
                pairs: int = 0) -> RankNumbers:
        """The first stage's :class:`RankNumbers` at its L/p layers (NOTE [Estimate from a meta profile]);
        ``whole_depth`` records all L/p layers instead of extending two depths (what the tests compare);
        ``stage=False``: one iteration of one micro-batch through them and the head (NOTE [Last stage
        under 1F1B]); ``recomputed``: that many of memo's layers keep their input on the device and
        recompute (NOTE [Inputs on the device where the host binds] in core.py); ``pairs``: that many
        pairs of them share one offloaded input (NOTE [Segments where the host binds] in core.py)."""
        depth = self.config.n_layers // layout.pp
        if recomputed or pairs:
            return self._mixed(strategy, layout, seq_len, alpha, whole_depth, stage, recomputed, pairs)
        if depth <= DEPTHS[-1] or whole_depth:
            return self._record(strategy, layout, seq_len, depth, alpha, stage)[0]
        lo, hi = DEPTHS[0], DEPTHS[-1]
        a = self._record(strategy, layout, seq_len, lo, alpha, stage)[0]
        b = self._record(strategy, layout, seq_len, hi, alpha, stage)[0]
        return a.extend(b, lo, hi, depth)

    def _mixed(self, strategy: str, layout: ParallelLayout, seq_len: int, alpha: float | None,
               whole_depth: bool, stage: bool, recomputed: int, pairs: int = 0) -> RankNumbers:
        """:meth:`numbers` of a stage whose first ``pairs`` pairs of layers run ``strategy`` and
        ``"segment"``, the next ones ``strategy``, the next ``recomputed`` ones ``"recompute"`` (then the
        kept ones). Linear in each count, as the depth extension is (NOTE [Estimate from a meta
        profile]): recorded with a few of each kind, with one more of each kind in turn, and extended by
        each slope."""
        depth = self.config.n_layers // layout.pp
        kept = min(self.machine.memo_keep_last, depth)
        counts = (pairs, depth - kept - recomputed - 2 * pairs, recomputed)
        internal_assert(counts[1] >= 0 and (counts[0] or counts[1]) and (recomputed or pairs),
                        "a mixed policy needs layers of two kinds")

        def record(n: tuple[int, ...]) -> RankNumbers:
            policy = ((strategy, LayerPolicy.SEGMENT.value) * n[0] + (strategy,) * n[1]
                      + (LayerPolicy.RECOMPUTE.value,) * n[2] + (LayerPolicy.KEEP.value,) * kept)
            return self._record(strategy, layout, seq_len, len(policy), alpha, stage, policy)[0]

        if whole_depth or depth <= DEPTHS[-1] + kept:
            return record(counts)
        # A pair and a single offloading layer (three layers: the first and the last differ from the
        # middle ones), then one more pair, and one more recomputed layer; a single offloading layer adds
        # half of what a pair adds (a segment layer holds what an input-only one does: NOTE [Segments
        # where the host binds] in core.py), so pairs cost one recording more than input-only alone.
        if not pairs:
            base = (0, 2, 1)
            steps = [(record((0, 3, 1)), counts[1] - 2)]
        else:
            base = (1, 1, min(recomputed, 1))
            more = record((2, 1, base[2]))
            first = record(base)
            half = first.halfway(more)
            steps = [(more, pairs - 1), (half, counts[1] - 1)]
        if recomputed > base[2]:
            steps.append((record((base[0], base[1], base[2] + 1)), recomputed - base[2]))
        return record(base).along(tuple(steps))

    def layer_sizes(self, layout: ParallelLayout, seq_len: int) -> tuple[int, int, int]:
        """S_input, S_attn, S_others of one layer of the rank (pass 1 of the plain model)."""
        depth = min(self.config.n_layers // layout.pp, DEPTHS[0])
        stats = self._record("none", layout, seq_len, depth, None, stage=False)[1]
        return (max(s.s_input for s in stats), max(s.s_attn for s in stats), max(s.s_others for s in stats))

    def input_bytes(self, layout: ParallelLayout, seq_len: int) -> int:
        """S_input of one layer of the rank without recording it: its ``[s/(c·t), b, h]`` input in the
        model's dtype (what :meth:`layer_sizes` records first; tests/estimate checks they agree)."""
        from memo.profiler.context_parallel import rank_tokens

        rows = rank_tokens(seq_len, layout.tp, layout.cp) // layout.tp
        return rows * layout.micro_batch * self.config.hidden * self.dtype.itemsize

    def offloaded_layers(self, layout: ParallelLayout) -> int:
        """Memo layers of the stage that offload (NOTE [Memo's alpha in an estimate])."""
        depth = self.config.n_layers // layout.pp
        return depth - min(self.machine.memo_keep_last, depth)

    def alpha(self, layout: ParallelLayout, seq_len: int, given: float | None,
              host: int | None = None) -> Any:
        """The alpha LP for the stage's L/p layers with ``host`` bytes (default M_CPU / p, NOTE [First
        stage under 1F1B]): an AlphaSolution, or a MemoError when the host cannot hold even alpha = 0."""
        from memo.planner import evaluate_alpha, solve_alpha

        m = self.machine
        s_in, s_attn, s_oth = self.layer_sizes(layout, seq_len)
        layer_s = rank_layer_ms(m, self.config, layout, seq_len, self.dtype) / 1e3
        host = m.host_per_process() // layout.pp if host is None else host
        depth = self.config.n_layers // layout.pp
        args = (s_in, s_attn, s_oth, m.bandwidth_gbps * GB, layer_s, depth, host)
        offloaded = self.offloaded_layers(layout)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            solution = (solve_alpha(*args, offloaded_layers=offloaded) if given is None
                        else evaluate_alpha(given, *args, offloaded_layers=offloaded))
        for w in caught:
            note = str(w.message)
            # memo's own warnings (a copy that stalls compute) are notes; a solver's deprecations not.
            if note.startswith("memo") and note not in self.notes:
                self.notes.append(note)
        return solution


# NOTE [Context-parallel exchange in an estimate]
# The meta profile of a context-parallel rank runs attention on the rank's own s/c tokens (NOTE
# [Context-parallel profile]); what the exchange between the c ranks holds besides is counted here, in
# a layer's backward (its larger direction), and added to the recorded peak, an upper bound (the peak
# may fall elsewhere). Per micro-batch of b sequences, with e bytes per element, S = s tokens in all,
# n and n_kv the heads of a tensor-parallel rank and d the head size:
# - all-gather (memo/models/cp_attention.py): K and V of all S tokens gathered, and their float32
#   gradients before the reduce-scatter: 2·S·b·n_kv·d·(e + 4);
# - all-to-all (Ulysses, memo/models/ulysses_attention.py): the head-sharded copies of grad_o, q and o
#   and the dq they give (4 · S·b·(n/c)·d·e), and of k, v and dk, dv (4 · S·b·max(n_kv/c, 1)·d·e):
#   about four times the rank's own q, independent of c.


def attention_exchange_bytes(config: ModelConfig, layout: ParallelLayout, seq_len: int, elem: int) -> int:
    """NOTE [Context-parallel exchange in an estimate]: bytes a rank's attention exchange holds."""
    c, t = layout.cp, layout.tp
    if c == 1:
        return 0
    n, n_kv = config.n_heads // t, config.n_kv_heads // t
    d = config.head_dim
    tokens = seq_len * layout.micro_batch
    if layout.cp_comm == CPComm.A2A:
        if layout.head_chunks is not None:  # one chunk's heads at a time (NOTE [Head chunks in an estimate])
            n, n_kv = n // layout.head_chunks, max(n_kv // layout.head_chunks, 1)
        return 4 * tokens * d * elem * (n // c + max(n_kv // c, 1))
    return 2 * tokens * n_kv * d * (elem + 4)


def memo_alpha_within(total_at: Callable[[float], int], alpha: float, limit: int) -> tuple[float, int, bool]:
    """NOTE [Memo's alpha in an estimate]: the largest alpha <= ``alpha`` whose total is within ``limit``.

    ``total_at(alpha)`` is the recorded per-GPU total. It grows with alpha (the rounding buffers
    hold alpha's share of S_others), so the alpha that fits is read off the straight line between
    the best fitting and the least failing alpha, re-recorded, and corrected at most three times
    (to a thousandth). Where even alpha = 0 does not fit, memo does not fit: alpha 0 is returned.
    Returns (alpha, total, fits).
    """
    total = total_at(alpha)
    if total <= limit or alpha <= 0:
        return alpha, total, total <= limit
    total0 = total_at(0.0)
    if total0 > limit:
        return 0.0, total0, False
    lo, lo_total, hi, hi_total = 0.0, total0, alpha, total
    for _ in range(3):
        share = (limit - lo_total) / (hi_total - lo_total) if hi_total > lo_total else 0.0
        guess = math.floor((lo + (hi - lo) * share) * 1000) / 1000
        if guess <= lo:
            break
        t = total_at(guess)
        if t <= limit:
            lo, lo_total = guess, t
        else:
            hi, hi_total = guess, t
    return lo, lo_total, True
