"""MemoRuntime: the manager object of one wrapped model (buffers, copy engine, stats).

There is no module-level runtime state: :func:`memo.runtime.wrap` creates (or is
given) a :class:`MemoRuntime` and every wrapped layer holds a reference to it.

NOTE [Sizing the host arena]
A layer's offloaded bytes depend on alpha, the sequence length, the micro-batch
and the dtype, and on the layer itself: which of its parameters require grad (a
frozen layer saves less: a matmul against a frozen weight keeps no input for the
weight's gradient) and which of its modules are in train mode (dropout saves its
mask). So they are measured per layer, by dry runs on the first real input (same
code path as a training forward, with a byte counter in place of the buffer): every
offloaded layer is dry-run with the first layer's input and context (layers map
``[s, b, h]`` to ``[s, b, h]`` and share the context), once per distinct layer
signature (:func:`layer_signature`: class, parameter shapes, dtypes and
requires_grad, train/eval modes), so a uniform model measures one layer. The two
device buffers (one layer each) and the host arena (one region per offloaded layer,
NOTE [Layer policy]) are then sized for the largest layer and allocated at once,
before any layer offloads. With a plan, its ``host_bytes`` must hold that, else the
plan belongs to another job (PlanMismatchError).

The signatures are checked again at the start of every iteration (the first
offloaded layer's forward), where no layer's data lives in the buffers: after
fine-tuning unfreezes a layer or ``model.train()`` turns dropout on, the changed
layers are measured again and, when the largest no longer fits, the buffers and the
arena are released and allocated again for the new size (they never shrink). The input is
checked there too: a forward with another input shape (the shorter last batch of a
``drop_last=False`` loader), dtype or autocast setting is measured (once per distinct input)
and runs in the buffers as they are when it fits; a larger one grows them the same way, and is
refused with the numbers while another forward awaits its backward in them. With a plan, the
planned allocator serves what matches the plan and falls back (counted) for the rest. Within
an iteration every layer must offload at most what it was measured at; a layer that
offloads more names what changed since (RoundingBuffers' overflow hint).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

from memo.errors import MemoError, PlanMismatchError
from memo.planner.policy import LAYER_POLICIES, OFFLOADING_POLICIES, validate_policy
from memo.runtime.buffers import (
    BufferState,
    CopyEngine,
    RoundingBuffers,
    RuntimeStats,
    debug_delay_from_env,
    make_engine,
)
from memo.runtime.layer import LayerCall, MemoLayerFunction, offload_tokens
from memo.runtime.signature import LayerSignature, layer_signature, signature_change

if TYPE_CHECKING:
    from memo.adapters.base import LayerAdapter
    from memo.planner import Plan

#: A plan as the runtime reads it: a :class:`~memo.planner.Plan`, or a mapping with its fields.
PlanFields = Union["Plan", Mapping[str, Any], None]
#: What the buffers were sized for besides the layers: the input's shape, dtype and device, the
#: offloaded tokens and the autocast dtype ("off": none).
InputKey = tuple[tuple[int, ...], torch.dtype, torch.device, int, str]
#: An offloaded layer's policy and signature: what decides the bytes it offloads.
PolicySignature = tuple[str, LayerSignature]

__all__ = ["LAYER_POLICIES", "OFFLOADING_POLICIES", "MemoRuntime", "default_policy", "layer_signature",
           "validate_alpha", "validate_policy"]

# NOTE [Layer policy]
# Every wrapped layer runs one of four policies, chosen per layer by the planner
# (planner/policy.py) to be fastest within the device budget, the host memory and the link:
#   "memo"       token-wise offload (alpha) / recompute (NOTE [Token-wise recompute]): nothing
#                of the layer stays on the device between its forward and its backward; its input,
#                attention output and alpha of the rest go to the host;
#   "input-only" its input alone goes to the host, everything else is recomputed in backward,
#                attention included (NOTE [Input-only layers] in memo/runtime/layer.py): half of
#                memo's host bytes at alpha = 0, for when host memory binds;
#   "recompute"  full recompute (torch.utils.checkpoint, non-reentrant): only its input stays;
#   "keep"       plain autograd: every activation it saves stays on the device;
#   "segment"    an input-only layer whose input is not offloaded: its backward makes it again from the
#                input-only layer right before it (NOTE [Segments of two layers] in segments.py).
# The offloading layers ("memo", "input-only" and "segment", in any order but a segment layer after an
# input-only one) must come first: the host arena
# has one region per offloading layer, in layer order, and the gradient of layer i + 1's output
# starts layer i's prefetch. Without a policy
# (no plan) memo keeps the last two layers whole and offloads the others, the paper's fixed
# rule: the last layers' backward follows their forward at once, so offloading them would
# only add copies.
#: Layers at the end of the model that the default policy keeps: their backward follows at once.
NOT_OFFLOADED_TAIL = 2


def default_policy(n_layers: int, tail: int = NOT_OFFLOADED_TAIL) -> list[str]:
    """The policy without a plan: offload all layers but the last ``tail`` (two; none for a pipeline
    chunk whose output goes to the next stage: NOTE [Pipeline stages]), which are kept."""
    kept = min(n_layers, tail)
    return ["memo"] * (n_layers - kept) + ["keep"] * kept


def kept_tail(model: nn.Module, tail: int = NOT_OFFLOADED_TAIL) -> int:
    """Layers at the end of ``model`` the default policy keeps whole: ``tail``, or 0 for a pipeline chunk
    whose output goes to the next stage (megatron-core's ``post_process=False``, on a ``GPTModel`` or its
    ``TransformerBlock``): its backward waits for the rest of the pipeline (NOTE [Pipeline stages] in
    memo/distributed/pipeline.py)."""
    return 0 if getattr(model, "post_process", True) is False else tail


def validate_alpha(alpha: object) -> float:
    """Return ``alpha`` as a float in [0, 1], or raise a :class:`MemoError` saying what is wrong."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise MemoError(
            f"memo.runtime: alpha must be a number in [0, 1] (the fraction of tokens whose skeletal tensors "
            f"are offloaded rather than recomputed), got {alpha!r} of type {type(alpha).__name__}"
        )
    value = float(alpha)
    if not math.isfinite(value) or value < 0.0 or value > 1.0:
        raise MemoError(
            f"memo.runtime: alpha must be in [0, 1] (0 = recompute all but input and attention output, "
            f"1 = offload everything), got {alpha!r}; memo.planner.solve_alpha computes one for your machine"
        )
    return value


def _plan_field(plan: PlanFields, name: str) -> Any:
    if plan is None:
        return None
    if isinstance(plan, Mapping):
        return plan.get(name)
    return getattr(plan, name, None)


class MemoRuntime:
    """Holds the rounding buffers, the copy engine and the statistics of one wrapped model.

    Args:
        alpha: fraction of each layer's tokens whose skeletal tensors (other than the
            layer input and attention output, always offloaded) are offloaded; the rest
            are recomputed in backward. In [0, 1].
        plan: optional plan (an object or mapping with ``alpha`` and ``host_bytes``); the host
            arena is its ``host_bytes``, which must hold what the runtime measures
            (NOTE [Sizing the host arena]).
        debug_copy_delay_us: CPU backend: each copy waits a random 0..N microseconds
            first, to force races into the open in tests. Default: ``MEMO_DEBUG_COPY_DELAY_US``.
        host_memory_limit: bytes of host memory the arena may take (default: MemAvailable).
        seed: seed of the debug delays.
        policy: what each layer does, one of :data:`LAYER_POLICIES` per layer (NOTE [Layer
            policy]); default: the plan's ``policy``, else :func:`default_policy`.
        recompute_chunk_tokens: tokens per tile of the token-wise parts, both token ranges (NOTE
            [Tiles bounded by memory] in memo/runtime/tiles.py); default: the plan's ``tile_tokens``,
            else s / 8 tokens while a tile's transient stays within TILE_BYTES, never below NOTE [How
            small a chunk]'s floor.
    """

    def __init__(
        self,
        alpha: float | None = None,
        *,
        plan: PlanFields = None,
        debug_copy_delay_us: int | None = None,
        host_memory_limit: int | None = None,
        seed: int = 0,
        policy: list[str] | None = None,
        recompute_chunk_tokens: int | None = None,
    ) -> None:
        plan_alpha = _plan_field(plan, "alpha")
        if alpha is None and plan_alpha is None:
            raise MemoError(
                "memo.runtime: give alpha (a number in [0, 1]) or a plan that carries one; "
                "`memo profile` or memo.planner.solve_alpha computes it"
            )
        if alpha is not None and plan_alpha is not None and abs(float(alpha) - float(plan_alpha)) > 1e-12:
            raise PlanMismatchError(
                f"memo.runtime: alpha={alpha} was given but the plan was made for alpha={plan_alpha}; "
                "pass only the plan, or re-run `memo profile` for the new alpha"
            )
        self.alpha = validate_alpha(alpha if alpha is not None else plan_alpha)
        self.plan = plan
        plan_policy = _plan_field(plan, "policy")
        if policy is not None and plan_policy is not None and list(policy) != list(plan_policy):
            raise PlanMismatchError(f"memo.runtime: policy={list(policy)} was given but the plan was made "
                                    "for "
                                    f"{list(plan_policy)}; pass only the plan")
        given = policy if policy is not None else plan_policy
        self._given_policy = None if given is None else validate_policy(given)
        self.policy: list[str] = []
        self.debug_copy_delay_us = debug_delay_from_env() if debug_copy_delay_us is None else int(
            debug_copy_delay_us)
        if self.debug_copy_delay_us < 0:
            raise MemoError(f"memo.runtime: debug_copy_delay_us must be >= 0, got {self.debug_copy_delay_us}")
        plan_tile = _plan_field(plan, "tile_tokens")
        chunk = recompute_chunk_tokens
        if chunk is not None and plan_tile is not None and chunk != plan_tile:
            raise PlanMismatchError(f"memo.runtime: recompute_chunk_tokens={chunk} was given; the plan was "
                                    f"made for tiles of {plan_tile} tokens; pass only the plan")
        chunk = recompute_chunk_tokens = chunk if chunk is not None else plan_tile
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise MemoError("memo.runtime: recompute_chunk_tokens must be a positive number of tokens "
                            f"(or None for the default), got {chunk!r}")
        self.recompute_chunk_tokens = recompute_chunk_tokens
        self.host_memory_limit = host_memory_limit
        self.seed = seed
        self.stats = RuntimeStats()
        self.engine: CopyEngine | None = None
        self.buffers: RoundingBuffers | None = None
        #: Bytes each rounding buffer (and each host region) holds: the largest offloaded layer's.
        self.layer_bytes: int | None = None
        #: What the largest offloaded layer copies, ``(what, bytes)`` per tensor (after the first forward).
        self.layer_tensors: list[tuple[str, int]] = []
        #: Measured offloaded bytes of each "memo" layer, and the signatures they were measured
        #: at (NOTE [Sizing the host arena]).
        self.layer_sizes: list[int] = []
        self._layer_sigs: list[PolicySignature] = []
        #: ``(input key, signature) -> (bytes, tensors)`` of the dry runs so far.
        self._measured: dict[tuple[InputKey, PolicySignature], tuple[int, list[tuple[str, int]]]] = {}
        self.calls: list[LayerCall] = []
        #: Zero-size tensor that requires grad: the anchor of every memo autograd node.
        self.anchor = torch.zeros(0, requires_grad=True)
        self._input_key: InputKey | None = None
        #: ``(flight, memo layer index)`` -> weak reference to its forward's record, until its
        #: backward runs (NOTE [Abandoned forward]).
        self.pending: dict[tuple[int, int], Any] = {}
        #: The flight of the forward now running (NOTE [Forwards in flight] in buffers.py).
        self.flight = 0
        #: Topics of the warnings already given (each is said once).
        self.said: set[str] = set()
        self._debug_skip_waits: set[str] = set()

    # Layers ------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.calls)

    @property
    def n_offloaded(self) -> int:
        """Layers with a slot in the rounding buffers: the leading "memo", "input-only" and "segment" layers
        of the policy (NOTE [Layer policy]; a segment layer's slot has no host bytes)."""
        return sum(p in OFFLOADING_POLICIES for p in self.policy)

    def attach(self, layers: list[tuple[nn.Module, LayerAdapter]],
               tail: int = NOT_OFFLOADED_TAIL) -> list[LayerCall]:
        """Register the model's layers (in forward order) with their adapters; without a policy the last
        ``tail`` layers are kept (:func:`default_policy`)."""
        if self.calls:
            raise MemoError("memo.runtime: this MemoRuntime already serves a model; create one per model")
        given = self._given_policy
        self.policy = (default_policy(len(layers), tail) if given is None
                       else validate_policy(given, len(layers)))
        self.calls = [LayerCall(self, layer, adapter, i) for i, (layer, adapter) in enumerate(layers)]
        return self.calls

    # Sizing and allocation (NOTE [Sizing the host arena]) ---------------------------------------
    @property
    def host_bytes(self) -> int:
        """Host bytes the offloaded layers use (0 before the first forward allocated the buffers)."""
        return 0 if self.buffers is None else self.buffers.host_bytes

    @property
    def arena_bytes(self) -> int:
        """Size of the host arena: ``host_bytes``, or the plan's ``host_bytes`` when a plan is given."""
        return 0 if self.buffers is None else self.buffers.arena_bytes

    def prepare(self, call: LayerCall, x: torch.Tensor, ctx: object) -> None:
        """Allocate the buffers on the first forward; at the start of each later iteration, size them
        again if a layer's signature changed; check inputs match what they were sized for."""
        # Autocast changes the dtypes, so the bytes, of what a layer saves: it is part of the key.
        kind = x.device.type
        autocast = "off"
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
            autocast = str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
        key = (tuple(x.shape), x.dtype, x.device, offload_tokens(self.alpha, x.shape[0]), autocast)
        if self.buffers is not None:
            old = self._input_key
            if key[2] != old[2]:
                raise MemoError(
                    f"memo.runtime: the rounding buffers live on {old[2]}, this forward runs on {x.device}; "
                    "memo.unwrap and memo.wrap again after moving the model")
            if call.index != 0:
                if key != old:
                    raise MemoError(
                        f"memo.runtime: layer {call.index}'s input is {list(x.shape)} {x.dtype} with "
                        f"autocast {autocast}, but this forward's first wrapped layer took {list(old[0])} "
                        f"{old[1]} with autocast {old[4]}; memo needs every wrapped layer to take the "
                        "shape of the first")
                return
            self.drop_abandoned()
            sigs = self._signatures()
            if key != old or sigs != self._layer_sigs:
                from memo.allocator import unplanned

                with unplanned():
                    self._refit(x, ctx, key, sigs)
            return
        from memo.allocator import unplanned

        # NOTE [One-time allocations inside a phase] (memo/allocator/_api.py): the dry run and
        # the buffers happen once, inside layer.fwd[0]; keep them out of its request indices.
        with unplanned():
            sigs = self._signatures()
            sizes, tensors = self._measure_layers(x, ctx, key, sigs)
            self._allocate_buffers(x, key, sizes, tensors, sigs)

    def _signatures(self) -> list[PolicySignature]:
        # The policy is part of what decides a layer's bytes: an input-only layer offloads its input only.
        return [(self.policy[i], layer_signature(self.calls[i].layer)) for i in range(self.n_offloaded)]

    def _can_resize(self) -> bool:
        """No layer's data lives in the buffers (between iterations): they may be released."""
        return not self.buffers.busy_flights()

    def _measure_layers(self, x: torch.Tensor, ctx: object, key: InputKey,
                        sigs: list[PolicySignature]) -> tuple[list[int], list[list[tuple[str, int]]]]:
        """Dry-run every offloaded layer on ``x`` (once per distinct signature and input key):
        bytes and tensors of each."""
        sizes, tensors = [], []
        for i, sig in enumerate(sigs):
            if (key, sig) not in self._measured:
                self._measured[key, sig] = self.calls[i].measure(x, ctx)
            size, what = self._measured[key, sig]
            sizes.append(size)
            tensors.append(what)
        return sizes, tensors

    def _refit(self, x: torch.Tensor, ctx: object, key: InputKey, sigs: list[PolicySignature]) -> None:
        """A forward whose input (a shorter last batch, another dtype or autocast) or whose layers'
        signatures differ from what the buffers were sized for (NOTE [Sizing the host arena]): measure
        it; go on when it fits, else size the buffers again where no forward is in flight."""
        sizes, tensors = self._measure_layers(x, ctx, key, sigs)
        if all(n <= have for n, have in zip(sizes, self.buffers.region_bytes, strict=True)):
            self.layer_sizes, self._layer_sigs, self._input_key = sizes, sigs, key
            return
        old = self._input_key
        changed = [f"layer {i}: {signature_change(a[1], b[1])}"
                   for i, (a, b) in enumerate(zip(self._layer_sigs, sigs, strict=True)) if a != b]
        if key != old:
            changed.insert(0, f"the input went from {list(old[0])} {old[1]} (autocast {old[4]}) to "
                              f"{list(key[0])} {key[1]} (autocast {key[4]})")
        why = "; ".join(changed)
        if not self._can_resize():
            raise MemoError(
                f"memo.runtime: this forward offloads {max(sizes):,} bytes per layer, more than the "
                f"{self.buffers.layer_bytes:,} the rounding buffers hold ({why}), and they cannot grow "
                f"now: {len(self.buffers.busy_flights())} earlier forward(s) still hold their layers "
                "there, awaiting a backward (NOTE [Forwards in flight]). Size them for the longest input "
                "first: one forward and backward at the longest length (a warm-up step) serves every "
                "shorter one after it, and of two forwards kept for one backward (DPO's chosen and "
                "rejected) run the longer first. An output kept without a backward also holds its "
                "forward (an evaluation run with gradients enabled): evaluate under torch.no_grad(), or "
                "`del` that output before training on")
        self._release()  # every layer is idle: nothing lives in the buffers
        self._allocate_buffers(x, key, sizes, tensors, sigs, why=why)

    def _allocate_buffers(self, x: torch.Tensor, key: InputKey, sizes: list[int],
                          tensors: list[list[tuple[str, int]]], sigs: list[PolicySignature],
                          why: str = "") -> None:
        largest = max(range(len(sizes)), key=sizes.__getitem__)
        layer_bytes = sizes[largest]
        regions = self._regions(sizes)
        host_bytes = sum(regions)
        planned = _plan_field(self.plan, "host_bytes")
        if planned is not None and int(planned) < host_bytes:
            since = f" (it grew after {why})" if why else ""
            raise PlanMismatchError(
                f"memo.runtime: the plan reserves host_bytes={int(planned):,} but this job offloads "
                f"{host_bytes:,}{since} ({self.n_offloaded} layers x {layer_bytes:,} bytes, the largest "
                f"offloaded layer's (layer {largest}), at alpha={self.alpha}, input {list(x.shape)} "
                f"{x.dtype}); the plan was made for another model, sequence length, dtype or set of frozen "
                "layers. Re-run `memo profile`"
            )
        self.engine = make_engine(x.device, self.debug_copy_delay_us, self.seed)
        self.buffers = RoundingBuffers(self.engine, self.n_offloaded, layer_bytes, self.stats,
                                       self.host_memory_limit,
                                       None if planned is None else int(planned), region_bytes=regions)
        self.buffers.debug_skip_waits = self._debug_skip_waits
        self.buffers.overflow_hint = self._overflow_hint
        self.layer_bytes = layer_bytes
        self.layer_tensors = tensors[largest]
        self.layer_sizes, self._layer_sigs = sizes, sigs
        self._input_key = key

    def _regions(self, sizes: list[int]) -> list[int]:
        """Each offloaded layer's host region: the largest measured size among the layers of its policy
        (memo layers alike, input-only layers alike; NOTE [Sizing the host arena])."""
        largest: dict[str, int] = {}
        for kind, n in zip(self.policy, sizes, strict=False):
            largest[kind] = max(largest.get(kind, 0), n)
        return [largest[kind] for kind in self.policy[:len(sizes)]]

    def _overflow_hint(self, i: int) -> str:
        """Why layer ``i`` offloads more than it was measured at (RoundingBuffers.pack's error)."""
        measured = self.layer_sizes[i] if i < len(self.layer_sizes) else None
        at = f"; it was measured at {measured:,} bytes" if measured is not None else ""
        if i < len(self._layer_sigs):
            change = signature_change(self._layer_sigs[i][1], layer_signature(self.calls[i].layer))
            if change:
                return (f"{at}. Since the buffers were sized at the start of this iteration, {change}; "
                        "change requires_grad and train/eval mode between iterations, not inside a forward")
        return (f"{at}, and its parameters' requires_grad and train/eval modes are unchanged: what the layer "
                "saves depends on something else (the data, or global state the dry run did not see)")

    def allocate(self, *layer_args: object, **layer_kwargs: object) -> None:
        """Size and allocate the buffers now, from an example input of the first layer.

        Call it before training to fail early (with the numbers) when host memory is short;
        otherwise the first forward does it. ``layer_args``/``layer_kwargs`` are what the
        first wrapped layer's ``forward`` takes (e.g. ``x: [s, b, h]``); only shapes matter.
        """
        if not self.calls:
            raise MemoError("memo.runtime: allocate() needs a wrapped model; call memo.wrap first")
        if self.n_offloaded == 0:
            return
        call = self.calls[0]
        x, ctx = call.adapter.split_args(call.layer, layer_args, layer_kwargs)
        with torch.enable_grad():
            self.prepare(call, x, ctx)

    # Per-layer entry points ---------------------------------------------------------------------
    def run_layer(self, call: LayerCall, x: torch.Tensor, ctx: object) -> torch.Tensor:
        """Forward of offloaded layer ``call.index`` through :class:`MemoLayerFunction`."""
        self.prepare(call, x, ctx)
        self.anchor = self.anchor if self.anchor.device == x.device else torch.zeros(
            0, device=x.device, requires_grad=True)
        # The trainable parameters are inputs: memo's node returns their gradients (NOTE [Gradients
        # through the engine] in memo/runtime/layer.py).
        params = [p for p in call.layer.parameters() if p.requires_grad]
        return MemoLayerFunction.apply(call, ctx, self.anchor, x, *params)

    # NOTE [Abandoned forward]
    # A forward whose backward never runs (an exception between them, validation without
    # no_grad, a skipped batch) leaves its flight's buffers OFFLOADING/OFFLOADED. Each memo layer's
    # forward leaves a record that only its autograd node holds; ``pending`` keeps weak references
    # to them. When the next forward starts (the first memo layer's), a busy flight none of whose
    # records is alive, and none of whose layers is in its backward, belongs to a graph that was
    # freed: its backward can never run, so the flight is dropped (reset), counted and said once.
    # A record still alive is a forward in flight; the new forward takes another flight (NOTE
    # [Forwards in flight] in memo/runtime/buffers.py).
    def drop_abandoned(self) -> None:
        """Before a forward of the model: drop the flights of freed graphs (NOTE [Abandoned forward])."""
        buffers = self.buffers
        live = self._live_flights()
        dead = [f for f in buffers.busy_flights() if f not in live
                and not any(slot.state is BufferState.READY for slot in buffers.layers[f])]
        if dead:
            self._drop_flights(dead)
            self.stats.abandoned_iterations += len(dead)
            if self.stats.abandoned_iterations == len(dead):
                warnings.warn("memo.runtime: a forward's graph was freed without its backward (an exception, "
                              "validation with autograd on, a skipped batch); memo dropped that forward's "
                              "offloaded activations and goes on (counted in stats.abandoned_iterations; "
                              "this is said once)", stacklevel=4)

    def _live_flights(self) -> set[int]:
        """The flights with a record still alive whose layer's backward has not run."""
        return {f for (f, _), ref in self.pending.items() if ref() is not None}

    def _drop_flights(self, flights: list[int]) -> None:
        """Wait for their copies, set their slots idle and forget their records."""
        self.buffers.reset(flights)
        self.pending = {key: ref for key, ref in self.pending.items() if key[0] not in flights}

    def forwards_awaiting_backward(self) -> int:
        """Forwards whose graph is alive and whose wrapped layers' backward has not all run."""
        return len(self._live_flights())

    def begin_forward(self) -> None:
        """The first memo layer's forward: pick the flight of this forward of the model."""
        self.flight = self.buffers.free_flight()

    # NOTE [Failed iteration]
    # An exception inside a wrapped layer's forward or backward (an out-of-memory at long context,
    # a bad input, a hook that raises) leaves that forward's flight half-used: a layer READY in a
    # device buffer whose backward will never finish, others OFFLOADED. Its graph is dead (autograd
    # frees what a failed backward used; a failed forward has no loss), but the caller may still
    # hold it (``loss`` stays bound until the next step assigns it), so NOTE [Abandoned forward]
    # would keep the flight, and the next forward would find the buffer taken. So the layer that
    # sees the exception drops the flight at once: copies waited for, every slot IDLE, its host
    # region free for the next forward. Counted in stats.failed_iterations and said once; the
    # exception goes on to the caller unchanged, and a loop that catches it and skips the batch
    # goes on. Each layer forward gets a number no other gets (LayerSlot.epoch), kept in its record:
    # a backward whose record's number is not its slot's (a backward tried again on the dropped
    # graph, after another forward reused the flight) is refused, never run on another forward's
    # activations.
    def drop_failed(self, flight: int, index: int, epoch: int, where: str) -> None:
        """NOTE [Failed iteration]: drop the flight of layer ``index``'s failed ``where`` pass."""
        buffers = self.buffers
        if buffers is None or flight >= buffers.n_flights or buffers.layers[flight][index].epoch != epoch:
            return  # not that forward's flight any more: nothing of it to drop
        self._drop_flights([flight])
        self.stats.failed_iterations += 1
        if "failed iteration" not in self.said:
            self.said.add("failed iteration")
            warnings.warn(f"memo.runtime: an exception in layer {index}'s {where} ended its iteration; memo "
                          "dropped that forward's offloaded activations, and the next forward starts clean "
                          "(counted in stats.failed_iterations; this is said once)", stacklevel=3)

    def prefetch_hook(self, index: int, flight: int = 0) -> None:
        """Called when the gradient of layer ``index + 1``'s output is ready: prefetch layer ``index``
        of that forward's flight."""
        if self.buffers is not None and index < self.n_offloaded and flight < self.buffers.n_flights:
            self.buffers.prefetch(index, flight)

    # Test and debug switches --------------------------------------------------------------------
    def set_debug_copy_delay_us(self, us: int) -> None:
        """Random delay of up to ``us`` microseconds before each copy (CPU backend)."""
        self.debug_copy_delay_us = int(us)
        if self.engine is not None:
            self.engine.set_debug_delay_us(int(us))

    def debug_skip_wait(self, name: str, skip: bool = True) -> None:
        """Test-only: drop the ``"offload"`` or ``"prefetch"`` wait of the protocol (tests must catch it)."""
        from memo.runtime.buffers import SKIPPABLE_WAITS

        if name not in SKIPPABLE_WAITS:
            raise MemoError(f"memo.runtime: skippable waits are {sorted(SKIPPABLE_WAITS)}, got {name!r}")
        if skip:
            self._debug_skip_waits.add(name)
        else:
            self._debug_skip_waits.discard(name)

    # Lifecycle ----------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until every copy issued so far is done."""
        if self.engine is not None:
            self.engine.synchronize()

    def reset(self) -> None:
        """Drop an abandoned iteration (forward without backward): wait for copies, set every layer idle."""
        if self.buffers is not None:
            self.buffers.reset()
        self.pending.clear()

    def _release(self) -> None:
        self.synchronize()
        if self.engine is not None:
            self.engine.release()
        self.buffers = None
        self.engine = None

    def close(self) -> None:
        """Wait for copies and release the buffers (unwrap calls it)."""
        self._release()
        self._input_key = None
        self.layer_sizes, self._layer_sigs = [], []
        self._measured = {}

    # Copies (NOTE [Copying a wrapped model] in memo/runtime/wrap.py) ---------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """A fresh runtime's state: the settings, policy and layers, without buffers, copy engine
        (threads, pinned memory), sizes measured or statistics. Used by ``copy.deepcopy`` and pickle;
        the runtime itself is left untouched."""
        state = dict(self.__dict__)
        state.update(engine=None, buffers=None, layer_bytes=None, layer_tensors=[], layer_sizes=[],
                     _layer_sigs=[], _measured={}, _input_key=None, stats=RuntimeStats(), pending={},
                     said=set(), flight=0,
                     _debug_skip_waits=set(self._debug_skip_waits))
        del state["anchor"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.anchor = torch.zeros(0, requires_grad=True)

    def describe(self) -> dict[str, Any]:
        """A summary for logs: alpha, layers, bytes, stats."""
        return {
            "alpha": self.alpha,
            "layers": self.n_layers,
            "offloaded_layers": self.n_offloaded,
            "policy": list(self.policy),
            "layer_offload_bytes": self.layer_bytes,
            "layer_sizes": list(self.layer_sizes),
            "host_bytes": self.host_bytes,
            "arena_bytes": self.arena_bytes,
            "flights": 0 if self.buffers is None else self.buffers.n_flights,
            "device": None if self.engine is None else str(self.engine.device),
            "stats": self.stats.as_dict(),
        }

    def __repr__(self) -> str:
        return (f"MemoRuntime(alpha={self.alpha}, layers={self.n_layers}, offloaded={self.n_offloaded}, "
                f"host_bytes={self.host_bytes})")
