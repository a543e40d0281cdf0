"""memo: train transformers on very long sequences on few GPUs.

Token-wise activation offload/recompute (the Memo method), a bi-level MIP
memory planner, and a planned, fragmentation-free activation allocator.
See README.md and DESIGN.md for the picture.
"""

from __future__ import annotations

import importlib
from typing import Any

from memo._version import __version__

__all__ = ["Session", "__version__", "unwrap", "wrap"]

# NOTE [Lazy package attributes]
# ``import memo.profiler`` (or ``memo.planner``) must not load the runtime, the allocator or the
# pipeline: dependencies point down the data flow (DESIGN.md), and importing a lower part runs
# this file first. So the public names are resolved on first use (PEP 562), not imported here.
_LAZY = {
    "wrap": "memo.runtime",
    "unwrap": "memo.runtime",
    "Session": "memo.session",
}


def __getattr__(name: str) -> Any:
    if name == "_C":
        # ``from memo import _C``: the extension links libtorch, whose libraries torch loads.
        import torch  # noqa: F401

        return importlib.import_module("memo._C")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
