"""memo: train transformers on very long sequences on few GPUs.

Token-wise activation offload/recompute (the Memo method), a bi-level MIP
memory planner, and a planned, fragmentation-free activation allocator.
See README.md and DESIGN.md for the picture.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from memo._version import __version__

__all__ = ["Session", "__version__", "unwrap", "wrap"]

# NOTE [The planner in a checkout]
# planner/ is the package memo.planner: an install maps it there (setup.py's package_dir). A
# checkout on PYTHONPATH alone (the torch-free check of `make test`, a clone not yet installed)
# has no such mapping, so memo's search path gains the checkout's root, whose planner/ then is
# memo.planner. An installed memo has its planner inside it and no planner/ beside it: unchanged.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if os.path.isfile(os.path.join(_ROOT, "planner", "__init__.py")) and not os.path.isdir(
        os.path.join(_HERE, "planner")):
    __path__.append(_ROOT)

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
