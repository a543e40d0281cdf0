"""Meta kernels' outputs reused by what they depend on, in recordings on meta (NOTE [Meta kernels
by their inputs' shapes])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["MetaKernelCache", "reused"]

# NOTE [Meta kernels by their inputs' shapes]
# An estimate records iterations of a meta rank model (NOTE [Estimate from a meta profile] in
# memo/estimate/plan_method.py), and much of a recording's time is not the recorder's: many aten ops
# reach the meta device through torch's Python meta kernels (its prims references for elementwise ops,
# a few hundred microseconds of Python each). A meta kernel reads nothing but its inputs' metadata, so
# an op called again on inputs of the same sizes, strides, offsets and dtypes, with the same other
# arguments, returns outputs of the same sizes, strides and dtypes: the layers of a rank model repeat one
# another's ops on the same shapes, and the recordings of one length (two depths, memo's policies)
# repeat the whole model's. :class:`MetaKernelCache`, a dispatch mode under the recorder, runs an op's
# meta kernel the first time it sees that key and afterwards allocates the outputs it returned, empty,
# in storages of the same bytes. The recorder above it sees the same ops with outputs of the same
# storages' sizes, so every number read off the trace is the one it was (tests/estimate/
# test_meta_cache.py compares estimates made with and without it).
#
# Only what is a function of the key is reused: an op whose schema mutates or aliases an argument
# (views, in-place and out= ops) always runs, as does one whose outputs shared a storage with an input
# or with one another when it ran (aten._unsafe_view returns its input's storage without saying so),
# one with an argument the key cannot hold exactly (anything but tensors on the meta device, numbers,
# strings, dtypes, devices, layouts, memory formats, None and lists of these), and any op whose output
# is not a plain strided meta tensor. The cache lives as long as one estimator: torch's default dtype,
# the one global setting a meta kernel reads, is part of every key.


_TENSORS = (torch.Tensor, torch.nn.Parameter)
_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key_of(values: tuple[Any, ...] | list[Any], out: list[Any]) -> bool:
    """Appends the key of every one of ``values`` to ``out``, each led by its type (so that the key of a
    sequence of values is the only one of its parts); False where one has none (the op then runs).
    Called for every op a recording dispatches, so it is kept to the cheapest checks."""
    for value in values:
        kind = type(value)
        if kind in _TENSORS:
            if not value.is_meta or value.layout is not torch.strided or value.is_conj() or value.is_neg():
                return False
            out.append(kind)
            out.append(value.dtype)
            out.append(value.shape)
            out.append(value.stride())
            out.append(value.storage_offset())
        elif kind in _VALUES:
            out.append(kind)
            out.append(value)
        elif kind is list or kind is tuple:
            out.append(kind)
            out.append(len(value))
            if not _key_of(value, out):
                return False
        else:
            return False
    return True


class MetaKernelCache(TorchDispatchMode):
    """NOTE [Meta kernels by their inputs' shapes]: outputs of meta kernels by their inputs' metadata.

    Enter it outside the recorder (so the recorder, entered after, sees every op first). ``hits`` and
    ``misses`` count the ops it answered and ran."""

    def __init__(self) -> None:
        super().__init__()
        #: key -> (output leaves' metadata, or a non-tensor leaf as it was; the tree's spec), or None
        #: where the op's outputs were not a function of the key.
        self._outputs: dict[tuple, tuple[list[Any], Any] | None] = {}
        self._plain: dict[torch._ops.OpOverload, bool] = {}
        self.hits = 0
        self.misses = 0

    def _reusable(self, func: torch._ops.OpOverload) -> bool:
        plain = self._plain.get(func)
        if plain is None:
            schema = func._schema
            plain = self._plain[func] = not schema.is_mutable and all(
                ret.alias_info is None for ret in schema.returns)
        return plain

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not self._reusable(func):
            return func(*args, **kwargs)
        parts: list[Any] = [func, torch.get_default_dtype(), len(args), *kwargs]
        if not (_key_of(args, parts) and _key_of(tuple(kwargs.values()), parts)):
            return func(*args, **kwargs)
        key = tuple(parts)
        known = self._outputs.get(key, False)
        if known is None:
            return func(*args, **kwargs)
        if known is not False:
            self.hits += 1
            leaves, spec = known
            return tree_unflatten([_empty(leaf) if isinstance(leaf, _Meta) else leaf for leaf in leaves],
                                  spec)
        self.misses += 1
        out = func(*args, **kwargs)
        self._outputs[key] = _describe(out, args, kwargs)
        return out


class _Meta(tuple):
    """An output tensor's metadata: (dtype, sizes, strides, storage offset, storage bytes)."""


def _empty(meta: _Meta) -> torch.Tensor:
    """A meta tensor of ``meta``'s metadata, in a storage of its bytes."""
    dtype, size, stride, offset, nbytes = meta
    t = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    if offset or t.untyped_storage().nbytes() != nbytes:
        storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        t = torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, size, stride)
    return t


def _describe(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any] | None:
    """What :meth:`MetaKernelCache.__torch_dispatch__` returns again for ``out``, or None where it is
    not a function of the key (NOTE [Meta kernels by their inputs' shapes])."""
    leaves, spec = tree_flatten(out)
    inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    seen: set[int] = set()
    described: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if type(leaf) is not torch.Tensor or leaf.device.type != "meta" or leaf.layout != torch.strided \
                    or leaf.is_conj() or leaf.is_neg() or leaf.requires_grad:
                return None
            storage = id(leaf.untyped_storage())
            if storage in inputs or storage in seen:
                return None
            seen.add(storage)
            described.append(_Meta((leaf.dtype, tuple(leaf.shape), leaf.stride(), leaf.storage_offset(),
                                    leaf.untyped_storage().nbytes())))
        elif leaf is None or isinstance(leaf, (bool, int, float)):
            described.append(leaf)
        else:
            return None
    return described, spec


#: The cache :func:`reused` entered and has not left: one answers every op under it, so a recording
#: within one (a profile within an estimate) keeps it rather than stacking a second mode, which would
#: dispatch every op twice and answer from a cache that lasts one profile.
_active: MetaKernelCache | None = None


@contextlib.contextmanager
def reused(cache: MetaKernelCache | None) -> Iterator[None]:
    """``cache`` active (nothing where None, or where a cache is active already)."""
    global _active
    if cache is None or _active is not None:
        yield
        return
    _active = cache
    try:
        with cache:
            yield
    finally:
        _active = None
