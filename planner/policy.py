"""The per-layer policy: which layers keep their activations, which run memo at alpha, which
fully recompute (NOTE [Layer policy] in memo/runtime/runtime.py).

NOTE [Policy cost model]
All quantities are per rank. For one layer (the layers of a model are alike):

    policy      device bytes held from forward to backward     extra seconds per iteration
    keep        K = S_input + S_attn + S_others                 0
    recompute   S_input                                         T                   (whole forward again)
    memo        0                                               (1 - alpha)(1 - f) T + stall

T is one layer's forward time, f the share of it spent in attention (memo never recomputes
attention), and stall = max(0, copy - T) where a layer's copy (S_input + S_attn + alpha
S_others at the link's bandwidth) does not hide under the next layer's compute. On top of
what the layers hold, the device needs:

* ``base``: the model states and every activation that is not a layer's (embedding, head, the
  running gradient of the hidden states);
* two rounding buffers of S_input + S_attn + alpha S_others each when any layer runs memo;
* one layer's backward at a time: a recomputed layer's activations (K) under full recompute;
  under memo, one token chunk's share of S_others (memo recomputes the (1 - alpha) share of a
  layer in n_chunks chunks, one at a time: NOTE [Chunked recompute] in memo/runtime/layer.py)
  plus what does not shrink with alpha or the chunks (q, k and v whole for attention's
  backward, their gradients, the gradient of o), which is not modelled: a recorded memo
  iteration measures it (``memo_overhead``, NOTE [Calibrated policy] in memo/pipeline/policy.py).

NOTE [Segments in the policy]
Where the host cannot hold every input-only layer's input, a pair of them may share one: the second
runs "segment" (NOTE [Segments of two layers] in memo/runtime/segments.py), its input recomputed in its
backward by the forward of the first, from the first's input. It costs the device nothing beyond an
input-only layer (the recomputed input takes the segment layer's own rounding buffer), and time: one
more forward of a layer (T) and the first's prefetch, which no backward hides (S_input / B); it frees
S_input of host per pair. A split of input-only layers takes the fewest
segments that make their inputs fit the host (``split_segments``), at most one per two layers; only
then does it count as not fitting.

NOTE [Forwards in flight in the policy]
A pipeline stage runs the forwards of several micro-batches before their backwards (1F1B: up to P - i
at stage i), so what a layer holds from its forward to its backward is held ``in_flight`` times: a kept
layer's K, a recomputed layer's input, and a memo or input-only layer's host region. What one backward
needs at a time (the transient term) and the two rounding buffers are not: one layer's backward runs at
a time, and memo's buffers are the runtime's, shared by every forward. The time is per micro-batch.

The memo layers come first, then the recomputed ones, then the kept ones (their backward
follows their forward soonest). Layers are alike, so a policy is three counts and alpha; every
split of the layers is tried (O(n_layers^2)) with alpha at the largest value its constraints
allow, and the fastest split within the device cap wins (ties: the smaller device need). The
device cap is the budget when one is given (memory the user has is used to go faster: kept
layers need no recompute); without one it is what full recompute needs, so memo never needs
more device memory than full recompute at the same sequence length. Where full recompute is
faster within the cap, it is chosen for those layers. The estimate picks the policy; the plan's peak
comes from the recorded trace of the wrapped model (calibrate.py checks it: probe_policy).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from memo.errors import DeviceBudgetError, MemoError, internal_assert
from memo.units import format_bytes

from .alpha import AlphaSolution, solve_alpha
from .vocab import LAYER_POLICIES, OFFLOADING_POLICIES, LayerPolicy

__all__ = ["ALPHA_GIVEN_UP", "LAYER_POLICIES", "OFFLOADING_POLICIES", "LayerCosts", "PolicySolution",
           "choose_policy", "describe_policy", "device_need", "full_recompute_need", "given_policy",
           "split_segments", "usable_budget", "validate_policy"]

# What a layer may do (NOTE [Layer policy] in memo/runtime/runtime.py): LAYER_POLICIES, and
# OFFLOADING_POLICIES whose layers copy to the host arena, come from planner/vocab.py (LayerPolicy),
# in the torch-free planner, so that loading a plan that records a policy needs no torch.

def validate_policy(policy: Any, n_layers: int | None = None) -> list[str]:
    """``policy`` as a list of :data:`LAYER_POLICIES`, with the offloading layers first; or a MemoError."""
    if isinstance(policy, str) or not isinstance(policy, (list, tuple)):
        raise MemoError(f"memo.policy: a layer policy is a list with one of {LAYER_POLICIES} per layer, "
                        f"got {policy!r}")
    bad = [p for p in policy if p not in LAYER_POLICIES]
    if bad:
        raise MemoError(f"memo.policy: unknown layer policy {bad[0]!r}; each layer is one of "
                        f"{LAYER_POLICIES}")
    if n_layers is not None and len(policy) != n_layers:
        raise MemoError(f"memo.policy: the layer policy has {len(policy)} entries but the model has "
                        f"{n_layers} "
                        "layers; the plan was made for another model (re-run `memo profile`)")
    n_offloading = sum(p in OFFLOADING_POLICIES for p in policy)
    if any(p not in OFFLOADING_POLICIES for p in policy[:n_offloading]):
        raise MemoError("memo.policy: the offloading layers of a policy ('memo', 'input-only', 'segment') "
                        f"must come first (NOTE [Layer policy]), got {list(policy)}")
    for i, p in enumerate(policy):
        if p == LayerPolicy.SEGMENT and (i == 0 or policy[i - 1] != LayerPolicy.INPUT_ONLY):
            raise MemoError(f"memo.policy: layer {i} is 'segment' but layer {i - 1} is "
                            f"{policy[i - 1] if i else 'none'!r}: a segment layer recomputes its input from "
                            "the input-only layer right before it (NOTE [Segments of two layers] in "
                            "memo/runtime/segments.py)")
    return list(policy)


@dataclass(frozen=True)
class LayerCosts:
    """What the policy choice needs to know about one rank's layers (bytes, seconds)."""

    n_layers: int
    s_input: int
    s_attn: int
    s_others: int
    layer_time: float
    attn_fraction: float
    base_bytes: int
    bandwidth: float
    host_memory: int
    #: Bytes a recorded iteration with memo layers needed beyond this model (NOTE [Calibrated policy]
    #: in memo/pipeline/policy.py); added to every split that has memo layers. May be negative.
    memo_overhead: int = 0
    #: The same for the splits whose offloading layers are all input-only (None: memo_overhead), once
    #: a recorded memo split corrected memo_overhead alone (NOTE [Calibrated policy]).
    input_only_overhead: int | None = None
    #: Bytes per unit of alpha that such a recording showed beyond the model's (the error of the
    #: model's slope in alpha: what the [0:a] sub-graphs hold in forward besides the buffers).
    memo_alpha_bytes: int = 0
    #: The token chunks memo recomputes a layer's (1 - alpha) share in (NOTE [Chunked recompute]).
    recompute_chunks: int = 1
    #: Smaller tiles the policy may choose instead of the runtime's default, largest first:
    #: ``(tile tokens, chunks of a layer)`` (NOTE [Tiles bounded by memory] in memo/runtime/tiles.py).
    tile_choices: tuple[tuple[int, int], ...] = ()
    #: The device pool serves each rounding buffer in whole segments of this many bytes (0: exact):
    #: NOTE [Fallback headroom] in memo/pipeline/device.py.
    buffer_rounding: int = 0
    #: Forwards whose activations the layers hold at once (NOTE [Forwards in flight in the policy]):
    #: 1 for one iteration; a pipeline stage's schedule keeps more.
    in_flight: int = 1
    #: ``(tile tokens, memo_overhead)`` of each tile a recorded iteration at alpha = 0 measured (None:
    #: the runtime's default tile); memo_overhead stands for the tiles not recorded (NOTE [A correction
    #: per tile] in planner/calibrate.py).
    tile_overheads: tuple[tuple[int | None, int], ...] = ()

    def tile_costs(self, tokens: int | None) -> LayerCosts:
        """These costs in the tile of ``tokens`` (None: the runtime's default): its chunks and, where
        recorded, its own correction."""
        chunks = self.recompute_chunks if tokens is None else dict(self.tile_choices)[tokens]
        overhead = dict(self.tile_overheads).get(tokens, self.memo_overhead)
        return dataclasses.replace(self, recompute_chunks=chunks, memo_overhead=overhead)

    @property
    def keep_bytes(self) -> int:
        return self.s_input + self.s_attn + self.s_others

    def buffer_bytes(self, nbytes: float) -> int:
        """What one rounding buffer of ``nbytes`` takes on the device: whole segments of the pool."""
        n = int(math.ceil(nbytes))
        return -(-n // self.buffer_rounding) * self.buffer_rounding if self.buffer_rounding > 0 else n

    def copy_bytes(self, alpha: float) -> float:
        return self.s_input + self.s_attn + alpha * self.s_others

    @property
    def recompute_bytes(self) -> float:
        """R: the recomputed activations a memo layer's backward holds at alpha = 0, one chunk's
        (NOTE [Policy cost model]); (1 - alpha) R at alpha."""
        return self.s_others / max(1, self.recompute_chunks)

    @property
    def input_overhead(self) -> int:
        """The measured correction of a split whose offloading layers are all input-only."""
        return self.memo_overhead if self.input_only_overhead is None else self.input_only_overhead

    @property
    def input_only_bytes(self) -> int:
        """What an input-only layer's backward holds besides its rounding buffer: one chunk's
        recomputed share and the recomputed attention output (NOTE [Input-only layers])."""
        return int(self.recompute_bytes) + self.s_attn


@dataclass
class PolicySolution:
    """The chosen policy, its alpha and why, and the device need it was chosen with."""

    policy: list[str]
    alpha: float
    binding: str
    extra_seconds: float
    device_bytes: int
    parts: dict[str, int]
    device_cap: int
    device_budget: int | None
    full_recompute_bytes: int
    alpha_solution: AlphaSolution | None = None
    counts: dict[str, int] = field(default_factory=dict)
    #: Tokens per tile the policy chose (None: the runtime's default; NOTE [Tiles bounded by memory]).
    tile_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("alpha_solution")
        return out


def _policy(n_memo: int, n_fr: int, n_keep: int, n_in: int = 0, n_seg: int = 0) -> list[str]:
    """``n_in`` counts the segment layers too: each pairs with the input-only layer before it."""
    return (["memo"] * n_memo + ["input-only", "segment"] * n_seg + ["input-only"] * (n_in - 2 * n_seg)
            + ["recompute"] * n_fr + ["keep"] * n_keep)


def split_segments(c: LayerCosts, n_memo: int, n_in: int) -> int | None:
    """The fewest segment layers (NOTE [Segments in the policy]) among ``n_in`` input-only ones for their
    inputs to fit the host; None where even one segment per two layers does not fit."""
    if n_memo or not n_in:
        return 0
    per_layer = c.s_input * c.in_flight
    over = n_in * per_layer - c.host_memory
    if over <= 0:
        return 0
    need = -(-over // per_layer) if per_layer else 0
    return need if need <= n_in // 2 else None


def _counts(policy: list[str]) -> dict[str, int]:
    return {kind: policy.count(kind) for kind in LAYER_POLICIES}


def device_need(c: LayerCosts, n_memo: int, n_fr: int, n_keep: int, alpha: float, n_in: int = 0
                ) -> dict[str, int]:
    """The device bytes of one split (memo, full-recompute, kept and input-only layer counts) and
    alpha, by part (NOTE [Policy cost model])."""
    transient = max(c.keep_bytes if n_fr else 0, int((1 - alpha) * c.recompute_bytes) if n_memo else 0,
                    c.input_only_bytes if n_in else 0)
    buffers = 0
    if n_memo or n_in:  # the buffers hold the largest offloading layer: memo's, else an input-only one's
        buffers = 2 * c.buffer_bytes(c.copy_bytes(alpha) if n_memo else c.s_input)
    correction = 0
    if n_memo:
        correction = c.memo_overhead + int(alpha * c.memo_alpha_bytes)
    elif n_in:
        correction = c.input_overhead
    return {
        "base (model states, other activations)": c.base_bytes,
        "kept layers": n_keep * c.keep_bytes * c.in_flight,
        "recomputed layers' inputs": n_fr * c.s_input * c.in_flight,
        "rounding buffers": buffers,
        "one layer's backward": transient,
        # NOTE [Calibrated policy] in memo/pipeline/policy.py: what a recorded memo iteration showed
        # beyond (or below) the parts above.
        "measured correction": correction,
    }


def _split_need(c: LayerCosts, split: Split, alpha: float) -> dict[str, int]:
    n_memo, n_fr, n_keep, n_in = split
    return device_need(c, n_memo, n_fr, n_keep, alpha, n_in)


def _constant_transient(c: LayerCosts, n_fr: int, n_in: int) -> int:
    """The backward bytes of the split's full-recompute and input-only layers (alpha plays no part)."""
    return max(c.keep_bytes if n_fr else 0, c.input_only_bytes if n_in else 0)


def _alpha_upper(c: LayerCosts, n_memo: int, n_fr: int, n_keep: int, cap: float, n_in: int = 0
                 ) -> dict[str, float]:
    """Largest alpha each constraint allows for this split (may be < 0: infeasible)."""
    base = c.s_input + c.s_attn
    so = max(c.s_others, 1e-9)
    f = c.in_flight
    fixed = c.base_bytes + (n_keep * c.keep_bytes + n_fr * c.s_input) * f + c.memo_overhead
    room = cap - fixed - 2 * base - 2 * c.buffer_rounding  # each buffer rounds up by < one segment
    # buffers 2(base + a So) plus max(C, (1 - a) R), C the other layers' backward: two linear bounds,
    # both upper bounds on a (R <= So, so 2 So - R > 0).
    r = c.recompute_bytes
    slope = 2 * so + max(0, c.memo_alpha_bytes)
    dev = (room - _constant_transient(c, n_fr, n_in)) / slope
    dev = min(dev, (room - r) / (slope - r))
    return {
        "bandwidth": (c.layer_time * c.bandwidth - base) / so,
        "host_memory": ((c.host_memory - n_in * c.s_input * f) / (n_memo * f) - base) / so,
        "device_memory": dev,
    }


def _seconds(c: LayerCosts, n_memo: int, n_fr: int, alpha: float, n_in: int = 0, n_seg: int = 0) -> float:
    stall = max(0.0, c.copy_bytes(alpha) / c.bandwidth - c.layer_time)
    memo = (1 - alpha) * (1 - c.attn_fraction) * c.layer_time + stall
    # NOTE [Input-only layers] in memo/runtime/layer.py: the whole forward again, attention included.
    input_only = c.layer_time + max(0.0, c.s_input / c.bandwidth - c.layer_time)
    # a segment layer's backward runs the forward of the layer before it once more, after waiting for that
    # layer's input, whose prefetch has no backward to hide under (NOTE [Segments in the policy])
    segment = c.layer_time + c.s_input / c.bandwidth
    return n_fr * c.layer_time + n_memo * memo + n_in * input_only + n_seg * segment


def _split_alpha(c: LayerCosts, n_memo: int, n_fr: int, n_keep: int, cap: float,
                 alpha: float | None, n_in: int = 0) -> tuple[float, str] | None:
    """The alpha of one split (memo / full-recompute / keep / input-only layer counts) and what binds
    it: the given one, or the largest every hard bound allows; None when it does not fit in host
    memory."""
    f = c.in_flight
    if split_segments(c, n_memo, n_in) is None:
        return None
    if not n_memo:
        # no memo layer: alpha does nothing, but a given one is kept (it is what was asked)
        a = 0.0 if alpha is None else alpha
        if n_in and c.n_layers * c.copy_bytes(0.0) * f > c.host_memory:
            return a, "host_memory"  # input-only because memo's host bytes do not fit
        return a, "device_memory" if n_keep < c.n_layers else "none"
    bounds = _alpha_upper(c, n_memo, n_fr, n_keep, cap, n_in)
    if bounds["host_memory"] < 0:
        return None  # not even alpha = 0 fits in host memory
    if alpha is not None:
        a, why = alpha, "given"
    elif c.memo_alpha_bytes >= ALPHA_GIVEN_UP:
        a, why = 0.0, "device_memory"
    else:
        # bandwidth is soft: below alpha = 0 the copies stall compute (counted in time)
        hard = {k: v for k, v in bounds.items() if k != "bandwidth" or v >= 0}
        why = min(hard, key=hard.__getitem__)
        a = min(1.0, hard[why])
        if a >= 1.0:
            a, why = 1.0, "alpha<=1"
        a = max(a, 0.0)
    if (n_memo * c.copy_bytes(a) + n_in * c.s_input) * f > c.host_memory:
        return None
    return a, why


#: ``LayerCosts.memo_alpha_bytes`` at or past this: alpha > 0 was given up (a recorded memo split kept
#: needing more than its estimate), memo layers run at alpha = 0 (NOTE [Calibrated policy]).
ALPHA_GIVEN_UP = 1 << 62

#: One split of the layers: (n_memo, n_fr, n_keep, n_in) (NOTE [Policy cost model]).
Split = tuple[int, int, int, int]


def _search_splits(c: LayerCosts, cap: float, alpha: float | None
                   ) -> tuple[tuple[float, int, Split, float, str] | None, tuple[int, Split, float] | None]:
    """Every split of the layers into memo, full-recompute, kept and input-only ones, each at its
    alpha: the fastest that fits ``cap`` as (seconds, need, split, alpha, binding), and the one of
    smallest need as (need, split, alpha); None where there is none."""
    best: tuple[float, int, Split, float, str] | None = None
    smallest: tuple[int, Split, float] | None = None
    n = c.n_layers
    for n_memo in range(n + 1):
        for n_in in range(n - n_memo + 1):
            for n_keep in range(n - n_memo - n_in + 1):
                n_fr = n - n_memo - n_in - n_keep
                found = _split_alpha(c, n_memo, n_fr, n_keep, cap, alpha, n_in)
                if found is None:
                    continue
                a, why = found
                split = (n_memo, n_fr, n_keep, n_in)
                need = sum(device_need(c, n_memo, n_fr, n_keep, a, n_in).values())
                if smallest is None or need < smallest[0]:
                    smallest = (need, split, a)
                if need > cap + 2:  # alpha at its device bound: the two buffers round up by a byte each
                    continue
                n_seg = split_segments(c, n_memo, n_in) or 0
                key = (_seconds(c, n_memo, n_fr, a, n_in, n_seg), need, split, a, why)
                if best is None or key[:2] < best[:2]:
                    best = key
    return best, smallest


def _no_fit_error(c: LayerCosts, smallest: tuple[int, Split, float], cap: float,
                  device_budget: int | None, headroom: float, headroom_bytes: int = 0) -> DeviceBudgetError:
    """The error when no split fits: the budget (and its usable part), the smallest need with its
    parts, and what to give more of."""
    need, split, a = smallest
    parts = _split_need(c, split, a)
    detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
    what = _describe(*split, a)
    return DeviceBudgetError(
        "memo.policy: no layer policy fits the device budget of "
        f"{format_bytes(cap if device_budget is None else device_budget)} per rank"
        + (f" ({format_bytes(cap)} of it usable, {1 - cap / device_budget:.0%} being kept free for the "
           "fallback allocator)" if device_budget and cap < device_budget else "") + "; the "
        f"smallest need is {format_bytes(need)} ({what}): {detail}. Give more device memory "
        + (f"(a budget of at least {format_bytes(_budget_for(need, headroom, headroom_bytes))} with the "
           "headroom, --device-mem-gb)" if device_budget is not None and (headroom or headroom_bytes)
           else "(--device-mem-gb)")
        + ", more host memory, more tensor/context parallelism, or a shorter sequence")


def _lp_alpha(c: LayerCosts, split: Split, cap: float, a: float, why: str
              ) -> tuple[float, str, AlphaSolution]:
    """The chosen split's alpha from the LP itself (NOTE [Policy cost model]): the same bound.
    Returns the alpha and what binds it (the LP's where it differs, bandwidth aside) and the LP's
    solution."""
    n_memo, n_fr, n_keep, n_in = split
    fixed_other = c.base_bytes + (n_keep * c.keep_bytes + n_fr * c.s_input) * c.in_flight + c.memo_overhead
    # the buffers' rounding to whole segments, as it is at the split's alpha (a constant near it)
    rounding = c.buffer_bytes(c.copy_bytes(a)) - int(math.ceil(c.copy_bytes(a)))
    linear: float = 2 * (c.s_input + c.s_attn + rounding)
    slope: float = 2 * c.s_others + max(0, c.memo_alpha_bytes)
    r = c.recompute_bytes
    other = _constant_transient(c, n_fr, n_in)
    if not other:  # (1 - a) R can be the larger backward term; the LP takes the linear bound of it
        linear, slope = linear + r, slope - r
    else:
        linear += max(other, r)
    # the host holds each memo layer's region once per forward in flight
    solution = solve_alpha(c.s_input, c.s_attn, c.s_others, c.bandwidth, c.layer_time,
                           c.n_layers * c.in_flight, c.host_memory - n_in * c.s_input * c.in_flight,
                           offloaded_layers=n_memo * c.in_flight, device_memory=cap,
                           device_fixed=fixed_other + linear, device_per_alpha=slope)
    if abs(solution.alpha - a) > 1e-6 and why != "bandwidth":
        a, why = min(a, solution.alpha), solution.binding
    return a, why, solution


def choose_policy(c: LayerCosts, device_budget: int | None = None, alpha: float | None = None,
                  headroom: float = 0.0, headroom_bytes: int = 0) -> PolicySolution:
    """The fastest policy within ``device_budget`` (bytes per rank; None: full recompute's need),
    the host memory and the link. ``alpha``: fixed instead of solved; without a budget it also
    fixes the paper's policy (all layers but the last two offload). ``headroom``: the share of
    the budget left free, and ``headroom_bytes`` at least that many bytes of it (NOTE [Fallback
    headroom] in memo/pipeline/device.py).

    The tiles the memo and input-only layers run in are chosen too (NOTE [Tiles bounded by memory]
    in memo/runtime/tiles.py): the runtime's default, or a smaller one of ``c.tile_choices`` where
    that makes a faster policy fit (a smaller tile holds less of a layer's backward at once).

    Raises:
        MemoError: when no policy fits the budget, with the smallest need and its parts.
    """
    if c.n_layers < 1:
        raise MemoError("memo.policy: the model has no layers")
    if device_budget is not None and (isinstance(device_budget, bool) or device_budget <= 0):
        raise MemoError("memo.policy: the device budget must be a positive number of bytes, "
                        f"got {device_budget!r}")
    full_recompute = full_recompute_need(c)
    if alpha is not None and device_budget is None:
        # A given alpha without a budget asks for memo as the paper runs it: every layer but the
        # last two offloads at that alpha, the last two are kept (no cap to choose against).
        n_keep = min(2, c.n_layers)
        return given_policy(c, _policy(c.n_layers - n_keep, 0, n_keep), alpha)
    cap = full_recompute if device_budget is None else usable_budget(device_budget, headroom, headroom_bytes)
    found: tuple[float, int, Split, float, str] | None = None
    least: tuple[tuple[int, Split, float], LayerCosts] | None = None
    tile = None
    tiles = [None, *(t for t, _ in c.tile_choices)]
    for i, tokens in enumerate(tiles):
        costs = c.tile_costs(tokens)
        best, smallest = _search_splits(costs, cap, alpha)
        if smallest is not None and (least is None or smallest[0] < least[0][0]):
            least = (smallest, costs)
        if best is None:
            continue
        if found is not None and best[:2] >= found[:2]:
            # a smaller tile does not help: keep the larger (fewer tiles, less host time); a smaller one
            # still may where its correction was recorded (NOTE [A correction per tile] in calibrate.py)
            if any(t in dict(c.tile_overheads) for t in tiles[i + 1:]):
                continue
            break
        found, tile, chosen = best, tokens, costs
    if found is None:
        internal_assert(least is not None, "full recompute always has a need")
        least = cast("tuple[tuple[int, Split, float], LayerCosts]", least)  # not None: checked above
        raise _no_fit_error(least[1], least[0], cap, device_budget, headroom, headroom_bytes)
    c = chosen
    seconds, need, split, a, why = found
    n_memo, n_fr, n_keep, n_in = split
    solution = None
    if n_memo and alpha is None:
        a, why, solution = _lp_alpha(c, split, cap, a, why)
    if n_memo == 0 and n_in == 0 and n_keep < c.n_layers:
        why = "device_memory"
    parts = _split_need(c, split, a)
    policy = _policy(n_memo, n_fr, n_keep, n_in, split_segments(c, n_memo, n_in) or 0)
    return PolicySolution(policy=policy, alpha=float(a), binding=why,
                          extra_seconds=seconds, device_bytes=sum(parts.values()), parts=parts,
                          device_cap=int(cap),
                          device_budget=device_budget, full_recompute_bytes=int(full_recompute),
                          alpha_solution=solution, counts=_counts(policy), tile_tokens=tile)


def usable_budget(budget: int, headroom: float, headroom_bytes: int) -> int:
    """The budget less its headroom: ``headroom`` of it, at least ``headroom_bytes``."""
    return max(0, budget - max(int(budget * headroom), headroom_bytes))


def _budget_for(need: float, headroom: float, headroom_bytes: int) -> int:
    """The smallest budget whose usable part (:func:`usable_budget`) holds ``need`` bytes."""
    return int(max(math.ceil(need / (1 - headroom)), need + headroom_bytes))


def full_recompute_need(c: LayerCosts) -> int:
    """Device bytes of every layer under full recompute (the cap when no budget is given)."""
    return sum(device_need(c, 0, c.n_layers, 0, 0.0).values())


def given_policy(c: LayerCosts, policy: list[str], alpha: float | None = None,
                 device_budget: int | None = None) -> PolicySolution:
    """The PolicySolution of a policy fixed by the caller: its estimated need and time (not
    checked against the budget; the recorded pass tells the truth)."""
    n_memo, n_in, n_fr, n_keep, n_seg = (policy.count(k) for k in LAYER_POLICIES)
    a = 0.0 if alpha is None else float(alpha)
    parts = device_need(c, n_memo, n_fr, n_keep, a, n_in + n_seg)
    need = sum(parts.values())
    return PolicySolution(policy=list(policy), alpha=a, binding="given",
                          extra_seconds=_seconds(c, n_memo, n_fr, a, n_in + n_seg, n_seg), device_bytes=need,
                          parts=parts,
                          device_cap=device_budget or need,
                          device_budget=device_budget, full_recompute_bytes=full_recompute_need(c),
                          counts=_counts(list(policy)))


def _describe(n_memo: int, n_fr: int, n_keep: int, n_in: int, alpha: float) -> str:
    parts = []
    if n_memo:
        parts.append(f"{n_memo} memo layers at alpha {alpha:.3f}")
    if n_in:
        parts.append(f"{n_in} input-only")
    if n_fr:
        parts.append(f"{n_fr} recomputed")
    if n_keep:
        parts.append(f"{n_keep} kept")
    return ", ".join(parts)


def describe_policy(policy: list[str]) -> str:
    """``"10 memo, 2 recompute"`` style summary of a per-layer policy."""
    return ", ".join(f"{policy.count(k)} {k}" for k in LAYER_POLICIES if policy.count(k))
