"""The autocast state a layer's forward ran under, replayed by its recompute
(NOTE [Recompute replays autocast])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AutocastState"]


# NOTE [Recompute replays autocast]
# The [a:s] token range of ``pre`` and ``post`` runs twice: in forward under no_grad, and
# again in backward to build its graph. Autocast is thread-local state that the ops read,
# and backward usually runs outside the forward's context (``with torch.autocast(...):
# loss = model(x)`` then ``loss.backward()``), or inside one the forward did not use. A
# recompute under the ambient state would run in float32 where forward ran in bfloat16
# (``mat1 and mat2 must have the same dtype`` against the bfloat16 o, or recomputed q/k/v
# whose dtype does not match the saved rows and o/lse, so attention's backward refuses
# them), and would silently compute other numbers than forward did. So forward records
# the autocast state of the layer's device type and of the CPU (the CPU state matters on
# CUDA too: CPU ops inside the layer obey it), with its dtype and the cache flag, and
# every backward-time re-execution of forward code runs inside exactly that state, as
# torch.utils.checkpoint does with ``_get_autocast_kwargs``. The backward ops themselves
# (``torch.autograd.backward``, attention's backward) run under the ambient state, as
# they do for the unwrapped model.


@dataclass(frozen=True)
class AutocastState:
    """The autocast state one forward ran under (NOTE [Recompute replays autocast])."""

    #: ``(device_type, torch.autocast kwargs)`` for the layer's device type (when it has
    #: autocast) and for ``"cpu"``.
    kwargs: tuple[tuple[str, dict[str, Any]], ...]

    @classmethod
    def capture(cls, device: torch.device) -> AutocastState:
        types = ["cpu"]
        if device.type != "cpu" and torch.amp.is_autocast_available(device.type):
            types.insert(0, device.type)
        cache = torch.is_autocast_cache_enabled()
        return cls(tuple((t, {"enabled": torch.is_autocast_enabled(t), "dtype": torch.get_autocast_dtype(t),
                              "cache_enabled": cache}) for t in types))

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device_type, kwargs in self.kwargs:
                stack.enter_context(torch.autocast(device_type, **kwargs))
            yield
