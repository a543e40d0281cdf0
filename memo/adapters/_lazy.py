"""The one registry for layer and model adapters.

NOTE [Adapters by class name]
Adapters are registered by qualified class name (``"package.module.Class"``), so that memo can name
the classes of libraries it does not import (megatron-core, transformers) without importing them,
and looked up along a class's MRO, so that a subclass of a registered class is served by its
parent's adapter unless it has its own. An adapter may be given as ``"module:attribute"`` (an
instance or a class): it is imported the first time a class it serves is met, once however many
classes name it.
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from memo.errors import MemoError

__all__ = ["AdapterRegistry", "load_qualified", "qualname"]

A = TypeVar("A")


def qualname(cls: type) -> str:
    """``"package.module.Class"`` of ``cls``: the key adapters are registered under."""
    return f"{cls.__module__}.{cls.__qualname__}"


def load_qualified(entry: str, what: str, key: str) -> object:
    """The object ``"module:attribute"`` names, instantiated when it is a class: the adapter
    registered for ``key`` (``what``: "layer adapter" or "model adapter", for the error)."""
    module, _, attribute = entry.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise MemoError(f"memo.adapters: the {what} {entry!r} registered for {key} cannot be loaded "
                        f"({err})") from None
    return found() if isinstance(found, type) else found


class AdapterRegistry(Generic[A]):
    """Adapters of type ``kind`` by qualified class name (NOTE [Adapters by class name])."""

    def __init__(self, kind: type[A], what: str, entries: dict[str, A | str]) -> None:
        self.kind, self.what = kind, what
        #: Qualified class name -> the adapter, or ``"module:attribute"`` to import on first use.
        self.entries: dict[str, A | str] = dict(entries)
        #: "module:attribute" -> the adapter loaded from it: one instance however many classes name it.
        self._loaded: dict[str, A] = {}

    def register(self, key: str, adapter: A | str) -> None:
        self.entries[key] = adapter

    def unregister(self, key: str) -> None:
        self.entries.pop(key, None)

    def find(self, cls: type) -> A | None:
        """The adapter of the nearest registered class in ``cls``'s MRO, loaded; or None."""
        for base in cls.__mro__:
            key = qualname(base)
            entry = self.entries.get(key)
            if entry is not None:
                return self.load(key, entry)
        return None

    def load(self, key: str, entry: A | str) -> A:
        """``entry`` (registered for ``key``) as an adapter, imported on first use."""
        if not isinstance(entry, str):
            return entry
        adapter = self._loaded.get(entry)
        if adapter is None:
            adapter = load_qualified(entry, self.what, key)
            if not isinstance(adapter, self.kind):
                raise MemoError(f"memo.adapters: {entry!r} (registered for {key}) is a "
                                f"{type(adapter).__name__}, not a {self.kind.__name__}")
            self._loaded[entry] = adapter
        return adapter
