"""Dropout masks of a wrapped layer drawn for the whole sequence, as the unwrapped layer draws them.

NOTE [Dropout as unwrapped]
memo runs a layer's ``pre`` and ``post`` on token ranges: ``[0:a]`` with autograd, ``[a:s]`` in
chunks without (NOTE [Chunked recompute]). A dropout called on each range would draw a mask per
range, and the masks would differ from the one the unwrapped layer draws over all ``s`` tokens:
a run with memo would not reproduce a run without it (loss 5e-4 to 5e-3 off at 0 < alpha < 1).
So while a layer in train mode runs under memo, :class:`LayerDropout` intercepts
``torch.nn.functional.dropout`` and ``torch.dropout`` (a ``TorchFunctionMode``). The first call of
a dropout *site* (its ordinal within ``pre`` or ``post``) in a forward draws the site's mask once,
by calling the same dropout on a tensor of ones of the full-sequence shape, at the point of the
random stream where the unwrapped layer draws it (sites are met in the same order); every range
then multiplies its rows by the rows of that mask, the very ``input * noise`` the unwrapped
dropout computes. The masks live as ``bool`` plus the scale while the layer's forward runs (the
draw itself holds a full-size noise tensor for a moment, as the unwrapped dropout does).

Backward never keeps them: the ``[0:a]`` rows are saved by autograd (through the pack hook, like
any saved tensor), and a recompute of ``[a:s]`` draws the site's full mask again from the random
state recorded before its first draw (in a forked generator, so the global stream is not
touched) and keeps it for the rest of that backward phase. So the masks of the recompute never
depend on grad mode, chunking or ``torch.compile``: the draw runs eagerly even inside compiled
code (``torch._dynamo.disable``; dynamo breaks the graph there), where a compiled dropout could
pick another kernel, and another random stream, for grad and no-grad mode.

The mask is drawn in the layout the unwrapped layer holds its activations in, which is also the
layout memo runs its submodules in: ``[s, b, ...]`` for memo's models and megatron-core's,
``[b, s, ...]`` for Hugging Face's (the adapter's ``batch_first``), and a range takes its tokens
along that layout's sequence dimension. With more than one sequence per batch the two orders assign
the random stream to different elements, so a mask drawn in the other one differs from the unwrapped
layer's (PEFT's LoRA dropout was 8.5e-4 off in loss).

A dropout whose input rows are not the range's tokens (a layer that gathers its sequence under
tensor parallelism, a dropout on attention scores) cannot take rows of a full-sequence mask; it
draws a mask per range (the recompute replays each range's random state, so gradients stay
exact for the masks drawn) and memo says once that those masks differ from the unwrapped layer's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memo.runtime.compiled import eager

__all__ = ["LayerDropout", "replay_rng", "rng_state", "same_rng_state"]

_DROPOUTS = (F.dropout, torch.dropout)


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global CPU generator's state, and ``device``'s where it is a CUDA device."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def same_rng_state(a: tuple[torch.Tensor, torch.Tensor | None],
                   b: tuple[torch.Tensor, torch.Tensor | None]) -> bool:
    """Whether two :func:`rng_state` results are equal: nothing drew random numbers in between
    (generators only move forward)."""
    if (a[1] is None) != (b[1] is None):
        return False
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


@contextlib.contextmanager
def replay_rng(state: tuple[torch.Tensor, torch.Tensor | None] | None,
               device: torch.device) -> Iterator[None]:
    """Run with the global generators at ``state``, restoring them after (no-op for ``None``)."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _dropout_args(func: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[torch.Tensor, float, bool, bool]:
    """``(input, p, training, inplace)`` of a call of F.dropout or torch.dropout."""
    names = ("input", "p", "training", "inplace") if func is F.dropout else ("input", "p", "train")
    bound = dict(zip(names, args, strict=False)) | kwargs
    training = bound.get("training", bound.get("train", True))
    return bound["input"], float(bound.get("p", 0.5)), bool(training), bool(bound.get("inplace", False))


@dataclass
class _Site:
    """One dropout site of a layer: how to draw its full-sequence mask, and the mask while held."""

    state: tuple[torch.Tensor, torch.Tensor | None]
    draw: Callable[[], torch.Tensor]
    mask: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    def take(self) -> None:
        """Draw the mask; the caller has the generator where the unwrapped layer's draw happens."""
        noise = self.draw()
        self.mask = noise.ne(0)
        # The exact value the unwrapped dropout multiplies by: 1 / (1 - p) as its kernel rounds it.
        # (A meta tensor has no values to look at: profiling only needs the shapes.)
        found = noise.device.type != "meta" and bool(self.mask.any())
        self.scale = noise.amax() if found else noise.new_ones(())
        del noise

    def rows(self, dim: int, t0: int, t1: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask of tokens ``[t0:t1]`` (along ``dim``) as the multiplier dropout applies."""
        return self.mask.narrow(dim, t0, t1 - t0).to(dtype) * self.scale.to(dtype)


class LayerDropout:
    """Full-sequence dropout masks of one forward of one wrapped layer (NOTE [Dropout as unwrapped]).

    Args:
        s: the layer's tokens (the full sequence of this rank).
        device: the layer's device (whose generator dropout draws from).
        say: ``say(topic, text)`` tells the user something once per runtime (a dropout whose rows
            are not tokens, a dropout inside compiled code).
        batch_first: the layer holds ``[b, s, ...]`` (memo runs its submodules so): the sequence is
            the dropouts' dimension 1, and masks are drawn in that order.
    """

    def __init__(self, s: int, device: torch.device, say: Callable[[str, str], None],
                 batch_first: bool = False) -> None:
        self.s = s
        #: The dimension of the sequence in what the layer's dropouts see.
        self.dim = 1 if batch_first else 0
        self.device = device
        self.say = say
        self.sites: dict[tuple[str, int], _Site] = {}
        self.replaying = False

    @contextlib.contextmanager
    def scope(self, phase: str, t0: int, t1: int) -> Iterator[None]:
        """Run ``pre`` or ``post`` (``phase``) on tokens ``[t0:t1]`` with full-sequence masks."""
        with _DropoutMode(self, phase, t0, t1):
            yield

    def end_forward(self) -> None:
        """The forward is done: drop the masks, keep how to draw them again."""
        for site in self.sites.values():
            site.mask = site.scale = None

    def begin_replay(self) -> None:
        """Backward: masks are drawn again from their recorded states (NOTE [Dropout as unwrapped])."""
        self.replaying = True

    def end_phase(self) -> None:
        """A backward phase (post, or pre) is done with its masks."""
        self.end_forward()

    def site(self, phase: str, k: int, func: Callable[..., Any], x: torch.Tensor, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> _Site:
        key = (phase, k)
        site = self.sites.get(key)
        if site is None:
            if self.replaying:
                raise RuntimeError(f"memo: dropout site {key} met in backward but not in forward")
            shape = list(x.shape)
            shape[self.dim] = self.s
            dtype, device = x.dtype, x.device
            rest, kw = args[1:], {n: v for n, v in kwargs.items() if n not in ("input", "inplace")}

            def draw() -> torch.Tensor:
                return func(torch.ones(shape, dtype=dtype, device=device), *rest, **kw)

            site = self.sites[key] = _Site(rng_state(self.device), draw)
            site.take()
        elif site.mask is None:
            with replay_rng(site.state, self.device):
                site.take()
        return site


class _DropoutMode(TorchFunctionMode):
    """Routes the dropouts of one ``pre``/``post`` call to their full-sequence masks."""

    def __init__(self, owner: LayerDropout, phase: str, t0: int, t1: int) -> None:
        super().__init__()
        self.owner, self.phase, self.t0, self.t1 = owner, phase, t0, t1
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _DROPOUTS:
            return func(*args, **kwargs)
        x, p, training, inplace = _dropout_args(func, args, kwargs)
        if not training or p <= 0.0 or p >= 1.0 or x.numel() == 0:
            return func(*args, **kwargs)  # no random draw: as unwrapped
        if torch.compiler.is_compiling():
            # Eager even inside compiled code: dynamo breaks the graph here, so the draw is PyTorch's
            # eager dropout whatever compiles the layer (NOTE [Dropout as unwrapped]).
            return eager(type(self)._dropout)(self, func, args, kwargs, x, inplace, True)
        return self._dropout(func, args, kwargs, x, inplace, False)

    def _dropout(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor,
                 inplace: bool, compiled: bool) -> torch.Tensor:
        if compiled:
            self.owner.say("compiled", "a dropout runs inside torch.compile'd code; memo draws its mask with "
                           "PyTorch's eager dropout (dynamo breaks the graph there), so forward and "
                           "recompute draw the same mask in grad and no-grad mode. The unwrapped compiled "
                           "layer draws with the compiler's generator instead, so runs with and without "
                           "memo differ in their masks")
        k, self.count = self.count, self.count + 1
        dim = self.owner.dim
        if x.dim() <= dim or x.shape[dim] != self.t1 - self.t0:
            rows = x.shape[dim] if x.dim() > dim else 0
            self.owner.say("rows", f"a dropout in {self.phase}() takes {rows} rows for {self.t1 - self.t0} "
                           "tokens, so memo cannot give it rows of the "
                           "full-sequence mask the unwrapped layer draws; its masks are drawn per token "
                           "range and differ from the unwrapped layer's (gradients are exact for the masks "
                           "drawn)")
            return func(*args, **kwargs)
        site = self.owner.site(self.phase, k, func, x, args, kwargs)
        noise = site.rows(dim, self.t0, self.t1, x.dtype)
        return x.mul_(noise) if inplace else x * noise
