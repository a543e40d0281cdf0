"""The saved-tensor hooks of a memo layer pass: what they keep, and where they put it.

NOTE [What the pack hook keeps]
The pack hook runs for every tensor an op of the ``[0:a]`` sub-graphs saves.
- Parameters and buffers of the layer (weights, their transposed views, RoPE
  tables held as buffers) are kept by reference: they are not activations and
  live on the device anyway (torchtune skips parameters the same way).
- Views of the layer input ``x`` or of the attention output ``o`` (e.g. the
  LayerNorm input, the output projection's input) are recorded as
  (shape, stride, offset) into the ``x`` / ``o`` copy already in the buffer, so
  nothing is offloaded twice.
- Everything else is copied into the rounding buffer once per storage: the first
  saved view of a storage copies the whole storage (when it is not much larger
  than the view), and every saved view of it (a tensor saved by two ops, the 2-D
  view a matmul saves of a 3-D activation, the two halves of a SwiGLU input) is
  recorded as (shape, stride, offset) into that copy, the way torchtune tracks
  views. The runtime's offloaded bytes thus count storages, like the profiler's
  S_others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from memo.errors import internal_assert
from memo.profiler.saved import SavedStorages
from memo.runtime.buffers import SLOT_ALIGNMENT, align_up

if TYPE_CHECKING:
    from memo.runtime.layer_context import LayerContext

__all__ = ["BufferSink", "CountingSink", "Deferred", "Packer"]


class CountingSink:
    """Measures a layer's offloaded bytes with the same alignment as :class:`RoundingBuffers`,
    and names what it counts (``tensors``: ``(what, bytes)``, for reports and warnings)."""

    def __init__(self) -> None:
        self.used = 0
        self.count = 0
        self.tensors: list[tuple[str, int]] = []

    def pack(self, t: torch.Tensor, what: str = "saved") -> int:
        nbytes = t.numel() * t.element_size()
        self.used = align_up(self.used, SLOT_ALIGNMENT) + nbytes
        self.tensors.append((f"{what} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}", nbytes))
        self.count += 1
        return self.count - 1


class BufferSink:
    """Packs into layer ``index``'s rounding buffer."""

    def __init__(self, runtime: LayerContext, index: int, flight: int) -> None:
        self.buffers = runtime.buffers
        self.index = index
        self.flight = flight

    def pack(self, t: torch.Tensor, what: str = "saved") -> int:
        return self.buffers.pack(self.index, t, self.flight)


def _describe_saved(t: torch.Tensor, whole: bool) -> str:
    """``"<op that made it> output"`` for a saved tensor, for reports and warnings."""
    origin = t._base if t._base is not None else t
    op = type(origin.grad_fn).__name__.removesuffix("Backward0") if origin.grad_fn is not None else "saved"
    return f"{op} output (the storage of a saved {list(t.shape)} view)" if whole else f"{op} output"


class Packer:
    """The saved-tensor hooks of one layer pass (NOTE [What the pack hook keeps]); the copy
    decisions are :class:`~memo.profiler.saved.SavedStorages`', shared with the profiler."""

    def __init__(self, sink: CountingSink | BufferSink, keep_storages: set[int],
                 device: torch.device) -> None:
        self.sink = sink
        self.storages = SavedStorages(keep_storages, device)
        self.resolve_slot: Any = None  # set for backward: slot -> tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def add_base(self, t: torch.Tensor, slot: int) -> None:
        """``t`` (contiguous) was packed into ``slot``: saved views of it refer to that copy."""
        self.storages.add_base(t, slot)

    def pack(self, t: torch.Tensor) -> tuple[Any, ...]:
        decision = self.storages.decide(t)
        if decision[0] == "keep":
            return ("keep", t)
        if decision[0] == "view":
            return decision
        _, tensor, whole = decision
        slot = self.sink.pack(tensor, _describe_saved(t, whole))
        if not whole:
            return ("slot", slot)
        self.storages.add_base(tensor, slot)
        return self.pack(t)  # now a view into the whole copy

    @contextlib.contextmanager
    def deferred(self) -> Iterator[Deferred]:
        """Hooks that only note what is saved; ``resolve()`` packs it later, once the bases its views
        may refer to are known (NOTE [Black-box core attention] in
        memo/runtime/core_attention.py)."""
        later = Deferred(self)
        with torch.autograd.graph.saved_tensors_hooks(later.note, self.unpack):
            yield later

    def end_pass(self) -> None:
        self.storages.clear()  # handles carry their slots; drop the references to x, o and the rest

    def unpack(self, handle: tuple[Any, ...]) -> torch.Tensor:
        kind = handle[0]
        if kind == "later":
            internal_assert(handle[1][0] is not None, "a saved tensor of the core attention was never packed")
            return self.unpack(handle[1][0])
        if kind == "keep":
            return handle[1]
        internal_assert(self.resolve_slot is not None, "saved tensor unpacked outside the layer's backward")
        if kind == "slot":
            return self.resolve_slot(handle[1])
        _, slot, shape, stride, rel = handle
        base = self.resolve_slot(slot)
        return base.as_strided(shape, stride, base.storage_offset() + rel)


class Deferred:
    """Saved tensors noted by :meth:`Packer.deferred`, packed by :meth:`resolve`."""

    def __init__(self, packer: Packer) -> None:
        self.packer = packer
        self.cells: list[list[Any]] = []

    def note(self, t: torch.Tensor) -> tuple[str, list[Any]]:
        cell: list[Any] = [None, t]  # [handle once packed, the tensor until then]
        self.cells.append(cell)
        return ("later", cell)

    def resolve(self) -> None:
        for cell in self.cells:
            cell[0], cell[1] = self.packer.pack(cell[1]), None
        self.cells.clear()
