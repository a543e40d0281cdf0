"""What a layer's saved tensors cost to move: one rule for the profiler and the runtime.

NOTE [One truth for saved bytes]
autograd keeps, for backward, every storage a saved tensor views. memo's runtime copies saved
tensors into the rounding buffer by the rule of :class:`SavedStorages` (NOTE [What the pack
hook keeps] in memo/runtime/packing.py), and the profiler counts S_others with the very same
rule, so the alpha LP, the host arena, the plan and the runtime agree to the byte:

- parameters and buffers of the layer (and tensors on another device) are not activations:
  kept by reference, 0 bytes;
- a view of a storage already copied (the layer input, the attention output, or an earlier
  saved tensor's storage) costs nothing more;
- otherwise the whole storage is copied when it is at most ``WHOLE_STORAGE_RATIO`` times the
  view (so every later view of it is free), else only the view's elements.

The last rule is why memo can move *less* than autograd keeps: a value tensor that is a
quarter of a fused QKV projection's output keeps that whole output alive in plain PyTorch,
while memo copies only the quarter.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable
from typing import Any

import torch
from torch import nn

__all__ = ["LayerSavedBytes", "SavedStorages", "storage_id", "view_into"]


def storage_id(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s storage (the StorageImpl address: unlike data_ptr, distinct for empty
    and meta storages)."""
    try:
        return t.untyped_storage()._cdata
    except RuntimeError:  # tensors without storage (e.g. some subclasses)
        return None


def view_into(t: torch.Tensor, base: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """(shape, stride, element offset) of ``t`` inside contiguous ``base``, or None if it is not inside it.

    Works on every device, meta included: storages have an identity there too, so the bytes
    ``memo profile`` counts on meta are the bytes the runtime moves on the GPU.
    """
    if t.dtype != base.dtype or t.device != base.device:
        return None
    ptr = storage_id(t)
    if ptr is None or ptr != storage_id(base):
        return None
    rel = t.storage_offset() - base.storage_offset()
    if rel < 0 or any(st < 0 for st in t.stride()):
        return None
    extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    if rel + extent > base.numel():
        return None
    return tuple(t.shape), tuple(t.stride()), rel


def _storage_tensor(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor of ``t``'s dtype over all of ``t``'s storage."""
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))


class SavedStorages:
    """The copy decisions of one layer pass (NOTE [One truth for saved bytes]).

    ``keep``: storage ids kept by reference (the layer's parameters and buffers).
    ``device``: the layer's device; saved tensors elsewhere are kept by reference.
    """

    #: A storage is copied whole (so every view of it shares one copy) when it is at most this
    #: many times larger than the saved view; otherwise only the view's elements are copied.
    WHOLE_STORAGE_RATIO = 2

    def __init__(self, keep: set[int], device: torch.device) -> None:
        self.keep = keep
        self.device = device
        # storage id -> (base tensor covering the copied bytes, its token). The base keeps the
        # storage alive during the pass, so its identity cannot be reused.
        self.bases: dict[int, tuple[torch.Tensor, Hashable]] = {}

    def add_storage_base(self, t: torch.Tensor, token: Hashable) -> None:
        """``t``'s whole storage is accounted for elsewhere (the layer input, attention's output)."""
        self.add_base(_storage_tensor(t), token)

    def add_base(self, t: torch.Tensor, token: Hashable) -> None:
        """``t`` (contiguous) is copied whole, as ``token``: saved views of it refer to that copy."""
        self.bases[storage_id(t)] = (t, token)

    def decide(self, t: torch.Tensor) -> tuple[Any, ...]:
        """``("keep",)``, ``("view", token, shape, stride, offset)`` into a copied base, or
        ``("copy", tensor, whole)``: copy ``tensor`` (``t`` itself, or its whole storage when
        ``whole``); after a whole copy the caller registers it with :meth:`add_base`."""
        sid = storage_id(t)
        if isinstance(t, nn.Parameter) or t.device != self.device or sid is None or sid in self.keep:
            return ("keep",)
        entry = self.bases.get(sid)
        if entry is not None:
            where = view_into(t, entry[0])
            if where is not None:
                return ("view", entry[1], *where)
            return ("copy", t, False)  # another dtype, or outside the copied range
        whole = self._whole_storage(t)
        return ("copy", t, False) if whole is None else ("copy", whole, True)

    def _whole_storage(self, t: torch.Tensor) -> torch.Tensor | None:
        itemsize = t.element_size()
        nbytes = t.untyped_storage().nbytes()
        if nbytes % itemsize or nbytes > self.WHOLE_STORAGE_RATIO * max(1, t.numel() * itemsize):
            return None
        return _storage_tensor(t)

    def clear(self) -> None:
        self.bases.clear()

    def retain(self, tokens: Collection[Hashable]) -> None:
        """Forget every copied base but those of ``tokens``: a token tile's own tensors, which no
        later tile saves a view of (NOTE [Tiles bounded by memory] in memo/runtime/tiles.py), so
        that their storages are freed once the tile is done."""
        self.bases = {sid: entry for sid, entry in self.bases.items() if entry[1] in tokens}


class LayerSavedBytes:
    """Counts, per layer, the bytes memo's runtime would copy for what the plain layer saves
    (NOTE [One truth for saved bytes]): the profiler's S_others.

    A ``saved_tensors_hooks`` pack hook over the plain model's forward. Inside the layer's
    core attention, its output and log-sum-exp are S_attn (the runtime copies them whole) and
    q, k, v are copied as they are (the runtime copies their offloaded rows, never deduplicated);
    everywhere else in the layer the :class:`SavedStorages` rule applies, with the layer input's
    storage (S_input) already copied.
    """

    def __init__(self, in_attention: Callable[[], bool],
                 is_attention_output: Callable[[torch.Tensor], bool]) -> None:
        self._in_attention = in_attention
        self._is_attention_output = is_attention_output
        self.current: int | None = None
        self.storages: dict[int, SavedStorages] = {}
        #: layer index -> bytes counted (the layer's S_others).
        self.others: dict[int, int] = {}
        #: layer index -> tokens (dim 0) of the layer input: how many chunks memo recomputes it in.
        self.rows: dict[int, int] = {}

    def enter(self, index: int, layer: nn.Module, x: torch.Tensor, rows: int = 0) -> None:
        keep = {sid for t in [*layer.parameters(), *layer.buffers()] if (sid := storage_id(t)) is not None}
        storages = SavedStorages(keep, x.device)
        storages.add_storage_base(x, "input")
        self.storages[index] = storages
        self.others.setdefault(index, 0)
        self.rows[index] = rows
        self.current = index

    def exit(self, index: int) -> None:
        self.storages.pop(index, None)
        if self.current == index:
            self.current = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        i = self.current
        if i is None or torch._C._current_graph_task_id() != -1:  # outside layers, or a recompute
            return t
        storages = self.storages[i]
        if self._in_attention():
            if self._is_attention_output(t):
                storages.add_storage_base(t, "attn")
            elif storages.decide(t)[0] != "keep":
                self.others[i] += t.numel() * t.element_size()
            return t
        decision = storages.decide(t)
        if decision[0] == "copy":
            _, tensor, whole = decision
            self.others[i] += tensor.numel() * tensor.element_size()
            if whole:
                storages.add_base(tensor, "saved")
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t
