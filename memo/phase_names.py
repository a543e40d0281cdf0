"""Phase names: the labels of one training iteration's spans, and how to read them.

A phase is one of ``embed.fwd``, ``layer.fwd[i]``, ``head.fwd``, ``head.bwd``,
``layer.bwd[i]``, ``embed.bwd`` and ``optimizer``. Traces and plans key their
events and offsets by these names, so the planner reads them; this module is
torch-free so that ``memo.planner`` stays torch-free too (the seam in
STYLE.md: planner (torch-free) <- profiler <- ...). The tracker that opens and
closes phases on a running model is :class:`memo.phases.PhaseTracker`.
"""

from __future__ import annotations

import re

from memo.errors import MemoError

__all__ = ["PHASE_KINDS", "is_backward_phase", "layer_phase", "micro_batch_phase", "parse_phase",
           "phase_kind", "phase_micro_batch"]

#: Every phase kind, in the order they happen in one iteration.
PHASE_KINDS = ("embed.fwd", "layer.fwd", "head.fwd", "head.bwd", "layer.bwd", "embed.bwd", "optimizer")

# NOTE [Micro-batch phases]: under a pipeline schedule a stage runs each layer's forward and backward
# once per micro-batch, interleaved, and the saved activations of different micro-batches live side by
# side; so a stage's phases carry the micro-batch after "@" ("layer.fwd[3]@2"), one phase instance each
# (NOTE [A stage's address plan] in memo/pipeline/stage_plan.py). Its kind is the phase's kind.
_PHASE_RE = re.compile(r"^(?:(embed\.fwd|head\.fwd|head\.bwd|embed\.bwd|layer\.(?:fwd|bwd)\[(\d+)\])"
                       r"(?:@(\d+))?|optimizer)$")


def layer_phase(direction: str, index: int) -> str:
    """``layer_phase("fwd", 3) -> "layer.fwd[3]"``."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"memo.phases: direction must be 'fwd' or 'bwd', got {direction!r}")
    return f"layer.{direction}[{index}]"


def parse_phase(name: str) -> tuple[str, int | None]:
    """Split a phase name into its kind and layer index: ``"layer.bwd[2]" -> ("layer.bwd", 2)``."""
    # fullmatch: ``$`` alone also matches before a trailing newline, which would let "embed.fwd\n" through.
    match = _PHASE_RE.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise MemoError(
            f"memo.phases: {name!r} is not a phase name; expected one of embed.fwd, layer.fwd[i], "
            "head.fwd, head.bwd, layer.bwd[i], embed.bwd, optimizer (a pipeline stage's with the "
            "micro-batch after '@': layer.fwd[i]@k)"
        )
    if match.group(1) is None:
        return name, None  # optimizer
    if match.group(2) is None:
        return match.group(1), None
    return match.group(1).split("[", 1)[0], int(match.group(2))


def micro_batch_phase(phase: str, micro_batch: int) -> str:
    """``micro_batch_phase("layer.fwd[3]", 2) -> "layer.fwd[3]@2"`` (NOTE [Micro-batch phases])."""
    parse_phase(phase)
    if "@" in phase or phase == "optimizer":
        raise ValueError(f"memo.phases: {phase!r} takes no micro-batch")
    return f"{phase}@{int(micro_batch)}"


def phase_micro_batch(name: str) -> int | None:
    """The micro-batch of a pipeline stage's phase (``"layer.fwd[3]@2" -> 2``), else None."""
    parse_phase(name)
    return int(name.rsplit("@", 1)[1]) if "@" in name else None


def phase_kind(name: str) -> str:
    """``"layer.fwd[7]" -> "layer.fwd"``; non-layer phases are their own kind."""
    return parse_phase(name)[0]


def is_backward_phase(name: str | None) -> bool:
    """Whether ``name`` is a backward pass (``head.bwd``, ``layer.bwd[i]``, ``embed.bwd``), where
    AccumulateGrad makes the parameter gradients; None (no phase) is not."""
    return name is not None and phase_kind(name).endswith(".bwd")
