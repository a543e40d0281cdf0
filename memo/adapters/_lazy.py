"""Adapters registered by name, loaded on first use (NOTE [Model adapters] in memo/adapters/model.py)."""

from __future__ import annotations

import importlib
from typing import Any

from memo.errors import MemoError


def load_qualified(entry: str, what: str, key: str) -> Any:
    """The object ``"module:attribute"`` names, instantiated when it is a class: the adapter
    registered for ``key`` (``what``: "layer adapter" or "model adapter", for the error)."""
    module, _, attribute = entry.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise MemoError(f"memo.adapters: the {what} {entry!r} registered for {key} cannot be loaded "
                        f"({err})") from None
    return found() if isinstance(found, type) else found
