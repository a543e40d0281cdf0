"""Per-layer skeletal sizes: S_input, S_attn, S_others (bytes), from a recorded iteration.

NOTE [Layer sizes]
For layer ``i`` we look at the allocations made in ``layer.fwd[i]``:

- *transient* ones die before the phase closes; memo never moves them.
- *skeletal* ones outlive the phase: autograd saved them for backward (or
  they are the layer's output).
- ``S_input`` is the size of the layer's input ``x`` (numel * element size).
  It was allocated by the previous phase (the previous layer's output, or the
  embedding's), so the layer's output is *not* counted in the layer's own
  sizes: it is the next layer's S_input (or the head's input).
- ``S_attn`` is every skeletal allocation made inside ``layer.core_attention``
  (attention output and log-sum-exp).
- ``S_others`` is what memo's runtime copies for every other tensor the layer saves for
  backward, counted by a pack hook with the runtime's own rule (NOTE [One truth for saved
  bytes] in memo/profiler/saved.py): one copy per storage, views of the input or the
  attention output free, a small view of a big storage copied alone. It can be less than
  the other skeletal allocations, which count whole storages.
- ``rows`` is the tokens (dim 0) of the layer input: memo's backward recomputes them in
  chunks (NOTE [Chunked recompute] in memo/runtime/layer.py).

These are the three quantities of the alpha LP (docs/profiling.md compares
them with the paper's 16·b·s·h elements).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from memo.errors import MemoError
from memo.phases import layer_phase
from memo.profiler.recorder import Allocation, DispatchRecorder

__all__ = ["LayerStats", "layer_stats", "offloaded_bytes", "summarise_layers"]


@dataclass
class LayerStats:
    """Sizes of one layer's forward phase, in bytes.

    Attributes:
        index: layer index.
        s_input: bytes of the layer input.
        s_attn: skeletal bytes made inside core attention.
        s_others: all other skeletal bytes (the layer output excluded).
        output: bytes of the layer output (the next layer's input).
        n_skeletal, n_transient: allocation counts in the phase.
        transient_bytes: total bytes of the phase's transient allocations.
        skeletal: ``(op, bytes, tag)`` for each skeletal allocation, in order;
            tag is ``"attn"``, ``"output"`` or ``"other"``.
        forward_ms: measured forward time of the layer (None where not measurable).
        rows: tokens (dim 0) of the layer input (0 where unknown).
    """

    index: int
    s_input: int
    s_attn: int
    s_others: int
    output: int
    n_skeletal: int
    n_transient: int
    transient_bytes: int
    skeletal: list[tuple[str, int, str]] = field(default_factory=list)
    forward_ms: float | None = None
    rows: int = 0

    @property
    def total(self) -> int:
        """S_input + S_attn + S_others: what one layer moves or recomputes."""
        return self.s_input + self.s_attn + self.s_others

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "S_input": self.s_input,
            "S_attn": self.s_attn,
            "S_others": self.s_others,
            "rows": self.rows,
            "output": self.output,
            "n_skeletal": self.n_skeletal,
            "n_transient": self.n_transient,
            "transient_bytes": self.transient_bytes,
            "forward_ms": self.forward_ms,
        }


def _tag(alloc: Allocation) -> str:
    if "layer_output" in alloc.tags:
        return "output"
    if "attn" in alloc.tags:
        return "attn"
    return "other"


def layer_stats(
    rec: DispatchRecorder, n_layers: int, inputs: dict[int, int], outputs: dict[int, int],
    saved_others: dict[int, int] | None = None, input_rows: dict[int, int] | None = None,
) -> list[LayerStats]:
    """One :class:`LayerStats` per layer from the recorder's allocations (NOTE [Layer sizes]).

    ``saved_others``: per layer, the bytes the runtime copies for the other saved tensors
    (NOTE [One truth for saved bytes]); without it, S_others is the other skeletal allocations.
    ``input_rows``: per layer, the tokens (dim 0) of its input.
    """
    by_phase: dict[str | None, list[Allocation]] = {}
    for alloc in rec.allocations.values():
        by_phase.setdefault(alloc.phase, []).append(alloc)
    stats = []
    for i in range(n_layers):
        allocs = by_phase.get(layer_phase("fwd", i), [])
        skeletal = [a for a in allocs if not a.transient and "param_grad" not in a.tags]
        transient = [a for a in allocs if a.transient]
        sizes: Counter[str] = Counter()
        rows = []
        for a in skeletal:
            tag = _tag(a)
            sizes[tag] += a.size
            rows.append((a.op, a.size, tag))
        stats.append(
            LayerStats(
                index=i,
                s_input=inputs.get(i, 0),
                s_attn=sizes["attn"],
                s_others=sizes["other"] if saved_others is None else saved_others.get(i, 0),
                output=sizes["output"],
                n_skeletal=len(skeletal),
                n_transient=len(transient),
                transient_bytes=sum(a.size for a in transient),
                skeletal=rows,
                rows=(input_rows or {}).get(i, 0),
            )
        )
    return stats


def summarise_layers(stats: list[LayerStats]) -> dict[str, Any]:
    """The trace's ``"layers"`` object: the largest S_* over layers plus the per-layer list.

    Layers of one model are identical, so the maximum is every layer's value;
    taking it keeps the alpha LP safe should one layer differ.
    """
    if not stats:
        raise MemoError("memo.profiler: the model has no layers; nothing to plan per layer")
    out: dict[str, Any] = {
        "S_input": max(s.s_input for s in stats),
        "S_attn": max(s.s_attn for s in stats),
        "S_others": max(s.s_others for s in stats),
        "rows": max(s.rows for s in stats),
        "per_layer": [s.to_dict() for s in stats],
    }
    times = [s.forward_ms for s in stats if s.forward_ms is not None]
    if times:
        out["layer_fwd_ms"] = max(times)
    return out


def offloaded_bytes(layers: dict[str, Any], offloaded_tokens: int, seq_len: int,
                    policy: list[str] | None = None) -> int:
    """Bytes one offloaded layer copies when ``offloaded_tokens`` of ``seq_len`` tokens are offloaded:
    S_input + S_attn + a/s · S_others (NOTE [Planned and actual offload] in planner/plan.py).

    With a layer ``policy``, the most any of its offloading layers copies (the runtime sizes its
    buffers by the largest): a memo layer's as above, an input-only layer's S_input alone (NOTE
    [Input-only layers] in memo/runtime/layer.py)."""
    if policy is not None and "memo" not in policy and "input-only" in policy:  # the planner's LayerPolicy
        return int(layers["S_input"])
    return layers["S_input"] + layers["S_attn"] + offloaded_tokens * layers["S_others"] // seq_len
