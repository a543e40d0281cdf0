"""What ``torch.compile`` sees of a wrapped model (NOTE [memo under torch.compile]).

NOTE [memo under torch.compile]
A memo layer is not one graph: its forward packs saved tensors into host buffers through native
calls, hands copies to a worker, records random states and keeps sub-graphs as autograd edges,
and its backward recomputes and back-propagates token tiles with ``torch.autograd.grad``. Dynamo
tracing into all of that breaks the graph some forty times a layer (the native allocator, the
copy worker, saved-tensor hooks, ``fork_rng``) and, as the tile and phase change from call to
call, hits the recompile limit in every layer: a 3-layer Llama took 112 s for three steps
(gradients still exact).

So a wrapped layer's call is opaque to the compiler: ``_wrapped_forward`` (memo/runtime/wrap.py)
runs it through :func:`eager`, ``torch.compiler.disable`` of the layer's whole memo path. Compiling
the wrapped model then compiles everything around the layers (embedding, final norm, head, loss)
with one graph break at each layer call and no recompile per layer, and the layers run eagerly,
as memo runs them. Without grad (evaluation, generation) a wrapped layer runs its own forward, so
there the compiler traces the layers as it would unwrapped. Inside a layer in training, compile
the token-wise submodules themselves (``layer.mlp.compile()``): memo calls them on token tiles, so
they compile once per tile length (mark the length dynamic, or let dynamo's automatic dynamic
shapes do it after the second).
tests/runtime/test_compile.py pins this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["eager"]


@functools.cache
def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``, made on first use: it imports dynamo, about 2.5 s of every
    process's start that no eager run needs (compiled code has imported it already)."""
    return torch.compiler.disable(fn)
