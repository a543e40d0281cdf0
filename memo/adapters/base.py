"""Layer adapters: how memo sees a layer class as ``pre`` / ``core`` / ``post``.

NOTE [Layer adapters]
memo's runtime never calls a wrapped layer's ``forward``. It calls the adapter,
which maps the layer onto the anatomy of DESIGN.md ("layer anatomy"):

- ``split_args(layer, args, kwargs) -> (x, ctx)``: the hidden states ``x: [s, b, h]``
  out of whatever the layer's ``forward`` takes; ``ctx`` carries the rest (e.g.
  Megatron's ``rotary_pos_emb``). Arguments the adapter cannot honour are refused
  with a :class:`~memo.errors.MemoError`, never ignored.
- ``pre(layer, x, offset, ctx) -> (q, k, v)``: token-wise; ``q: [s, b, n, d]``,
  ``k, v: [s, b, n_kv, d]``; ``offset`` is the absolute position of ``x[0]``.
- ``core_forward(layer, q, k, v, ctx) -> (o, lse)`` and
  ``core_backward(layer, grad_o, q, k, v, o, lse, ctx) -> (dq, dk, dv)``: causal
  attention without autograd; ``o: [s, b, n * d]``. Attention is never recomputed.
- ``post(layer, o, x, ctx) -> y``: token-wise; ``y: [s, b, h]``.
- ``pack_output(layer, y, ctx)``: what the layer's ``forward`` returns.

Token-wise means token t of the output depends only on token t of the inputs;
the runtime relies on it to recompute ``pre``/``post`` on the token slice
``[a:s]`` and to run them on ``[0:a]`` separately. An adapter for a new layer
class is registered with :func:`register_adapter`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memo.errors import MemoError

__all__ = ["LayerAdapter", "AnatomyAdapter", "register_adapter", "unregister_adapter", "find_adapter",
           "registered_adapters"]


class LayerAdapter:
    """Maps one layer class onto pre / core / post (NOTE [Layer adapters]).

    The default ``core_forward``/``core_backward`` are memo's causal attention
    (:mod:`memo.models.causal_attention`, softmax scale ``1/sqrt(d)``); override them for
    a layer whose attention differs.
    """

    #: Short name used in error messages and ``MemoRuntime.describe()``.
    name: str = "adapter"

    def check(self, layer: nn.Module) -> None:
        """Raise :class:`MemoError` if this layer instance is configured in a way the adapter cannot split."""

    def split_args(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
            torch.Tensor, Any]:
        """``forward``'s arguments -> (``x: [s, b, h]``, context passed to the other methods)."""
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define split_args")

    def pre(self, layer: nn.Module, x: torch.Tensor, offset: int, ctx: Any) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [t, b, h]`` (from token ``offset``) -> ``q: [t, b, n, d]``, ``k, v: [t, b, n_kv, d]``."""
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define pre")

    def post(self, layer: nn.Module, o: torch.Tensor, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        """``o: [t, b, n * d]``, ``x: [t, b, h]`` -> ``y: [t, b, h]``."""
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define post")

    def core_forward(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention without autograd: -> ``o: [s, b, n * d]``, ``lse: [b, n, s]`` (float32)."""
        from memo.models.causal_attention import attention_forward

        o, lse = attention_forward(q, k, v)
        s, b, n, d = o.shape
        return o.view(s, b, n * d), lse

    def core_backward(self, layer: nn.Module, grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, ctx: Any) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        """``grad_o: [s, b, n * d]`` -> ``dq: [s, b, n, d]``, ``dk, dv: [s, b, n_kv, d]``."""
        from memo.models.causal_attention import attention_backward

        s, b, n, d = q.shape
        return attention_backward(grad_o.reshape(s, b, n, d), q, k, v, o.view(s, b, n, d), lse)

    def pack_output(self, layer: nn.Module, y: torch.Tensor, ctx: Any) -> Any:
        """The value the layer's ``forward`` returns, given ``y: [s, b, h]``."""
        return y


class AnatomyAdapter(LayerAdapter):
    """For layers that already have the anatomy: ``layer.pre(x, offset=)``, ``layer.post(o, x)``,
    ``forward(x)`` (memo's reference GPT and Llama layers, and any layer written the same way)."""

    name = "anatomy"

    def check(self, layer: nn.Module) -> None:
        for method in ("pre", "post"):
            if not callable(getattr(layer, method, None)):
                raise MemoError(
                    f"memo.adapters: {type(layer).__name__} has no {method}() method; the anatomy adapter "
                    "needs pre(x, offset=0) -> (q, k, v) and post(o, x) -> y"
                )

    def split_args(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
            torch.Tensor, Any]:
        if len(args) == 1 and not kwargs:
            return args[0], None
        if not args and set(kwargs) == {"x"}:
            return kwargs["x"], None
        raise MemoError(
            f"memo.adapters: {type(layer).__name__}.forward is called as forward(x) when wrapped by memo; "
            f"got {len(args)} positional and keyword arguments {sorted(kwargs)}"
        )

    def pre(self, layer: nn.Module, x: torch.Tensor, offset: int, ctx: Any) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        return layer.pre(x, offset=offset)

    def post(self, layer: nn.Module, o: torch.Tensor, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        return layer.post(o, x)


# Registry: layer class -> adapter. Looked up along the MRO, so a subclass of a
# registered class is served by its parent's adapter unless it has its own.
_ADAPTERS: dict[type, LayerAdapter] = {}
_LAZY: list[Callable[[], None]] = []


def register_adapter(layer_class: type, adapter: LayerAdapter) -> None:
    """Let :func:`memo.wrap` wrap layers of ``layer_class`` (and its subclasses) through ``adapter``.

    Example::

        class MyAdapter(memo.adapters.LayerAdapter):
            def split_args(self, layer, args, kwargs): return args[0], None
            def pre(self, layer, x, offset, ctx): ...   # -> q, k, v
            def post(self, layer, o, x, ctx): ...       # -> y
        memo.adapters.register_adapter(MyLayer, MyAdapter())
    """
    if not isinstance(layer_class, type) or not issubclass(layer_class, nn.Module):
        raise MemoError(f"memo.adapters: register_adapter needs an nn.Module subclass, got {layer_class!r}")
    if not isinstance(adapter, LayerAdapter):
        raise MemoError(
            f"memo.adapters: adapter for {layer_class.__name__} must be a LayerAdapter, got {type(adapter)}"
        )
    _ADAPTERS[layer_class] = adapter


def unregister_adapter(layer_class: type) -> None:
    """Remove ``layer_class``'s adapter (a missing one is not an error)."""
    _ADAPTERS.pop(layer_class, None)


def registered_adapters() -> dict[type, LayerAdapter]:
    """A copy of the registry (after loading the built-in adapters)."""
    _load_builtin()
    return dict(_ADAPTERS)


def find_adapter(module: nn.Module) -> LayerAdapter | None:
    """The adapter serving ``type(module)`` (nearest registered class in its MRO), or ``None``."""
    _load_builtin(module)
    for cls in type(module).__mro__:
        adapter = _ADAPTERS.get(cls)
        if adapter is not None:
            return adapter
    return None


_BUILTIN_DONE: set[str] = set()


def _load_builtin(module: nn.Module | None = None) -> None:
    # The reference models are part of memo; megatron-core and transformers are optional and
    # heavy, so their adapters are registered only when the model at hand comes from them.
    if "reference" not in _BUILTIN_DONE:
        _BUILTIN_DONE.add("reference")
        from memo.models.layers import TransformerLayer

        _ADAPTERS.setdefault(TransformerLayer, AnatomyAdapter())
    if module is not None and "megatron" not in _BUILTIN_DONE and type(module).__module__.startswith(
            "megatron."):
        _BUILTIN_DONE.add("megatron")
        from memo.adapters import megatron  # noqa: F401  (registers TransformerLayer)
    if module is not None and "transformers" not in _BUILTIN_DONE and type(module).__module__.startswith(
            "transformers."):
        _BUILTIN_DONE.add("transformers")
        from memo.adapters.hf import register_layer_adapters

        register_layer_adapters()
