"""Phases: labelled spans of one training iteration.

A phase is one of ``embed.fwd``, ``layer.fwd[i]``, ``head.fwd``, ``head.bwd``,
``layer.bwd[i]``, ``embed.bwd`` and ``optimizer``. The profiler tags every
allocation with the phase it happened in, the planned allocator selects
offsets by (phase, request index), and the runtime knows which layer it is
moving. All of them learn the current phase from one :class:`PhaseTracker`.
The names and their parsing are torch-free, in :mod:`memo.phase_names`; this
module, which hooks modules and so needs torch, re-exports them.

NOTE [Phase boundaries]
Forward phases open in a module's forward pre-hook and close in its forward
hook. Backward phases open in a gradient hook on the module's output tensor,
which fires once the gradient of the output is ready, i.e. just before the
module's own backward work, and stay open until the next backward phase opens
(or the iteration ends). A tensor hook rather than a full backward pre-hook:
it wraps nothing, so it allocates nothing and changes no autograd graph. Work
the autograd engine does between two modules (e.g. accumulating a residual
gradient) is therefore attributed to the module whose backward is about to
run, which is the module that consumes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

# The names live in a torch-free module (the planner reads them); re-exported here for callers.
from memo.phase_names import (
    PHASE_KINDS,
    is_backward_phase,
    layer_phase,
    micro_batch_phase,
    parse_phase,
    phase_kind,
    phase_micro_batch,
)

__all__ = [
    "PHASE_KINDS",
    "PhaseTracker",
    "is_backward_phase",
    "layer_phase",
    "micro_batch_phase",
    "parse_phase",
    "phase_kind",
    "phase_micro_batch",
]

PhaseListener = Callable[[str | None], None]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class PhaseTracker:
    """Knows the current phase of a training iteration and tells listeners when it changes.

    Args:
        embedding: module whose forward is ``embed.fwd`` (token ids -> hidden states).
        layers: the transformer layers, in order; layer ``i`` is ``layer.fwd[i]``/``layer.bwd[i]``.
        head: module whose forward is ``head.fwd`` (hidden states -> scalar loss), or the modules
            that together make the head (a final norm, then the LM head / loss module): each one's
            forward is ``head.fwd`` and the gradient of each one's output opens ``head.bwd``.
        listeners: callables ``f(phase_or_None)`` called on every change.
        first_layer: the number of ``layers[0]`` (a pipeline stage's chunks number their layers on
            from the chunk before).
        micro_batch: a pipeline stage's micro-batch counter: each phase then carries the micro-batch
            its forward ran for (NOTE [Micro-batch phases] in memo/phase_names.py), taken when the
            forward runs, so a backward is named for the forward it belongs to, whatever order the
            schedule runs them in. A stage without an embedding passes ``embedding=None``, one without
            the loss head ``head=()``.

    Use ``tracker.iteration()`` around forward + backward so the last backward
    phase closes when backward returns, and ``tracker.phase("optimizer")``
    around the optimizer step. ``tracker.remove()`` detaches every hook.
    """

    def __init__(
        self,
        embedding: nn.Module | None,
        layers: Sequence[nn.Module],
        head: nn.Module | Sequence[nn.Module],
        listeners: Sequence[PhaseListener] = (),
        *,
        first_layer: int = 0,
        micro_batch: Callable[[], int] | None = None,
    ) -> None:
        self._listeners: list[PhaseListener] = list(listeners)
        self._current: str | None = None
        self._paused = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._micro_batch = micro_batch
        if embedding is not None:
            self._hook("embed", None, embedding)
        for i, layer in enumerate(layers):
            self._hook("layer", first_layer + i, layer)
        heads = [head] if isinstance(head, nn.Module) else list(head)
        for k, module in enumerate(heads):
            # NOTE [One head phase]: head.fwd runs from the first head module's forward to the
            # last one's. Closing it after each module would open it again at the next one, and
            # every opening restarts the phase's request index (memo.allocator.set_phase): the
            # plan, made from the whole phase, would no longer match its requests.
            self._hook("head", None, module, closes=k == len(heads) - 1)

    @property
    def current(self) -> str | None:
        """The phase now open, or ``None`` outside every phase."""
        return self._current

    def add_listener(self, listener: PhaseListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: PhaseListener) -> None:
        self._listeners.remove(listener)

    def set(self, phase: str | None) -> None:
        """Open ``phase`` (closing the current one), or close the current one with ``None``."""
        if phase is not None:
            parse_phase(phase)
            if self._paused:
                return
        if phase == self._current:
            return
        self._current = phase
        for listener in self._listeners:
            listener(phase)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Open ``name`` for the body of the ``with``; restore the previous phase afterwards."""
        previous = self._current
        self.set(name)
        try:
            yield
        finally:
            self.set(previous)

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        """Wrap one forward + backward; closes whatever backward phase is open when it ends."""
        self.set(None)
        try:
            yield
        finally:
            self.set(None)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Open no phase in the body (a step its plan was not made for: NOTE [A batch of another
        length] in memo/session.py); no phase is open before or after it."""
        self.set(None)
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self.set(None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, part: str, index: int | None, module: nn.Module, closes: bool = True) -> None:
        fwd = f"{part}.fwd" if index is None else layer_phase("fwd", index)
        bwd = f"{part}.bwd" if index is None else layer_phase("bwd", index)

        def named(phase: str) -> str:
            return phase if self._micro_batch is None else micro_batch_phase(phase, self._micro_batch())

        # A forward that runs inside backward is a recomputation (checkpointing, memo's
        # token-wise recompute): it belongs to the backward phase already open.
        def open_fwd(_module: nn.Module, _args: object) -> None:
            if not _in_backward():
                self.set(named(fwd))

        def close_fwd(_module: nn.Module, _args: object, out: object) -> None:
            if _in_backward():
                return
            if closes:
                self.set(None)
            output = _first_grad_tensor(out)
            if output is not None:
                backward = named(bwd)
                output.register_hook(lambda _grad: self.set(backward))

        self._handles.append(module.register_forward_pre_hook(open_fwd))
        self._handles.append(module.register_forward_hook(close_fwd))


def _first_grad_tensor(out: object) -> torch.Tensor | None:
    """The module output whose gradient marks the start of the module's backward."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return item
    return None
