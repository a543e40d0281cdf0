"""The numbers of one recorded iteration of a rank (:class:`RankNumbers`), read off its trace
(:func:`analyse_trace`), and their extension over a stage's depth (NOTE [Estimate from a meta profile]
in memo/estimate/plan_method.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RankNumbers", "analyse_trace"]


@dataclass(frozen=True)
class RankNumbers:
    """Bytes one recorded iteration holds (NOTE [Gradients in the peak], [First stage under 1F1B] in
    memo/estimate/plan_method.py)."""

    iteration: int
    """Most bytes live at once: the trace's lower bound."""
    activations: int
    """Most bytes live at once, parameter gradients left out."""
    stage_activations: int
    """The same outside the LM head's phases."""
    held: int
    """Bytes live when the head's forward begins that are freed later: what a micro-batch keeps."""
    gradients: int
    """Parameter gradients: allocations made in backward and live at the end."""
    by_kind: tuple[tuple[str, int, int, int], ...] = ()
    """``(kind, iteration, activations, stage_activations)``: the same peaks over the phases of each
    kind, where :func:`analyse_trace` was given kinds (NOTE [Inputs on the device where the host binds]
    in memo/estimate/core.py: each is linear in the layer counts where the largest one need not be)."""

    def along(self, steps: tuple[tuple[RankNumbers, int], ...]) -> RankNumbers:
        """``self + Σ count·(other - self)``: from this recording, ``count`` more of what each ``other``
        recording added (one layer of a kind). The peaks are extended kind by kind and the largest
        taken, where every recording has the same kinds; otherwise, and for the other fields, field by
        field."""

        def ext(mine: int, theirs: tuple[int, ...]) -> int:
            return int(round(mine + sum(n * (t - mine) for t, (_, n) in zip(theirs, steps, strict=True))))

        fields = {k: ext(getattr(self, k), tuple(getattr(o, k) for o, _ in steps))
                  for k in ("iteration", "activations", "stage_activations", "held", "gradients")}
        kinds = {row[0] for row in self.by_kind}
        if kinds and all({row[0] for row in o.by_kind} == kinds for o, _ in steps):
            theirs = [{row[0]: row[1:] for row in o.by_kind} for o, _ in steps]
            peaks = [tuple(ext(mine[i], tuple(t[kind][i] for t in theirs)) for i in range(3))
                     for kind, *mine in self.by_kind]
            for i, name in enumerate(("iteration", "activations", "stage_activations")):
                fields[name] = max(p[i] for p in peaks)
        return RankNumbers(iteration=fields["iteration"], activations=fields["activations"],
                           stage_activations=fields["stage_activations"], held=fields["held"],
                           gradients=fields["gradients"])

    def halfway(self, other: RankNumbers) -> RankNumbers:
        """Every number (and every kind's peaks, where both have the same kinds) halfway to ``other``'s."""
        def mid(a: int, b: int) -> int:
            return (a + b) // 2

        kinds: tuple[tuple[str, int, int, int], ...] = ()
        if [row[0] for row in self.by_kind] == [row[0] for row in other.by_kind]:
            kinds = tuple((a[0], mid(a[1], b[1]), mid(a[2], b[2]), mid(a[3], b[3]))
                          for a, b in zip(self.by_kind, other.by_kind, strict=True))
        return RankNumbers(iteration=mid(self.iteration, other.iteration),
                           activations=mid(self.activations, other.activations),
                           stage_activations=mid(self.stage_activations, other.stage_activations),
                           held=mid(self.held, other.held), gradients=mid(self.gradients, other.gradients),
                           by_kind=kinds)

    def extend(self, other: RankNumbers, depth: int, other_depth: int, target: int) -> RankNumbers:
        """Linear in depth through (depth, self) and (other_depth, other), at ``target``."""
        f = (target - depth) / (other_depth - depth)
        def at(name: str) -> int:
            return int(round(getattr(self, name) + f * (getattr(other, name) - getattr(self, name))))

        return RankNumbers(iteration=at("iteration"), activations=at("activations"),
                           stage_activations=at("stage_activations"), held=at("held"),
                           gradients=at("gradients"))


def analyse_trace(trace: dict[str, Any], kind_of: Callable[[str], str] | None = None) -> RankNumbers:
    """The numbers of :class:`RankNumbers` from a ``memo.trace`` dict (time = event index); with
    ``kind_of`` (a phase name -> its kind) also the peaks over each kind's phases."""
    events = trace["events"]
    freed = {e["id"] for e in events if e["op"] == "free"}
    phase_of: dict[int, str] = {}
    for e in events:
        if e["op"] == "malloc":
            phase_of[e["id"]] = str(e.get("phase") or "")
    grads = {i for i, ph in phase_of.items() if i not in freed and ".bwd" in ph}
    live: dict[int, int] = {}
    total = other = peak = peak_other = peak_stage = 0
    held = None
    kinds: dict[str, list[int]] = {}
    for e in events:
        op = e["op"]
        if op == "malloc":
            phase = str(e.get("phase") or "")
            if held is None and phase == "head.fwd":
                held = sum(size for i, size in live.items() if i in freed)
            size = int(e["size"])
            live[e["id"]] = size
            total += size
            if e["id"] not in grads:
                other += size
            peak = max(peak, total)
            peak_other = max(peak_other, other)
            if not phase.startswith("head."):
                peak_stage = max(peak_stage, other)
            if kind_of is not None:
                mine = kinds.setdefault(kind_of(phase), [0, 0, 0])
                mine[0], mine[1] = max(mine[0], total), max(mine[1], other)
                if not phase.startswith("head."):
                    mine[2] = max(mine[2], other)
        elif op == "free" and e["id"] in live:
            size = live.pop(e["id"])
            total -= size
            if e["id"] not in grads:
                other -= size
    grad_bytes = sum(int(e["size"]) for e in events if e["op"] == "malloc" and e["id"] in grads)
    return RankNumbers(iteration=peak, activations=peak_other, stage_activations=peak_stage,
                       held=held or 0, gradients=grad_bytes,
                       by_kind=tuple((k, v[0], v[1], v[2]) for k, v in sorted(kinds.items())))
