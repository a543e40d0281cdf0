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
class is registered with :func:`register_adapter`, by class or by qualified class name
(built-in adapters for other libraries are registered by name and imported on first use).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from memo.adapters._lazy import AdapterRegistry, qualname
from memo.errors import MemoError

__all__ = ["LayerAdapter", "AnatomyAdapter", "AttentionBackward", "AttentionForward", "CoreFunction",
           "MLPSite", "register_adapter", "unregister_adapter", "find_adapter", "registered_adapters"]

#: What :meth:`LayerAdapter.split_args` leaves to the adapter's other methods: each adapter's own.
Ctx = TypeVar("Ctx")
#: Causal attention without autograd: ``(q [s, b, n, d], k, v [s, b, n_kv, d]) -> (o [s, b, n, d], lse)``.
AttentionForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: Its gradients: ``(grad_o [s, b, n, d], q, k, v, o, lse) -> (dq, dk, dv)``.
AttentionBackward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
#: A layer's own core attention run as a black box, with autograd: ``(q, k, v) -> o [s, b, n * d]``.
CoreFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MLPSite:
    """Where a layer computes its MLP, for strategies that run it their own way (ALST's tiled MLP,
    NOTE [Tiled MLP] in memo/runtime/peers.py).

    ``getattr(owner, attribute)`` is the MLP as a callable ``z -> out`` (no norm, no residual),
    token-wise along ``token_dim`` of ``z``; it uses exactly ``parameters``. A strategy replaces it by
    setting an instance attribute of that name on ``owner`` and undoes that by deleting it, so the
    layer's state dict never changes.
    """

    owner: nn.Module
    attribute: str
    token_dim: int
    parameters: tuple[nn.Parameter, ...]


class LayerAdapter(Generic[Ctx]):
    """Maps one layer class onto pre / core / post (NOTE [Layer adapters]).

    ``Ctx`` is the type of the context :meth:`split_args` returns and the other methods take. The
    default ``core_forward``/``core_backward`` are memo's causal attention
    (:mod:`memo.models.causal_attention`, softmax scale ``1/sqrt(d)``): override
    :meth:`attention_kernels` for other causal kernels, ``core_forward``/``core_backward`` for
    another computation, or :meth:`core_function` to run the layer's own attention as a black box.
    """

    #: Short name used in error messages and ``MemoRuntime.describe()``.
    name: str = "adapter"
    #: Whether the unwrapped layer holds its activations batch-first (``[b, s, h]``, Hugging Face)
    #: rather than ``[s, b, h]`` (memo's models, megatron-core): the order its dropouts draw their
    #: masks in, which memo's full-sequence masks follow (NOTE [Dropout as unwrapped]).
    batch_first: bool = False

    def check(self, layer: nn.Module) -> None:
        """Raise :class:`MemoError` if this layer instance is configured in a way the adapter cannot split."""

    def split_args(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
            torch.Tensor, Ctx]:
        """``forward``'s arguments -> (``x: [s, b, h]``, context passed to the other methods)."""
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define split_args")

    def pre(self, layer: nn.Module, x: torch.Tensor, offset: int, ctx: Ctx) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [t, b, h]`` (from token ``offset``) -> ``q: [t, b, n, d]``, ``k, v: [t, b, n_kv, d]``."""
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define pre")

    def post(self, layer: nn.Module, o: torch.Tensor, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """``o: [t, b, n * d]``, ``x: [t, b, h]`` -> ``y: [t, b, h]``."""
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define post")

    #: How ``pre`` lays out the attention-side rows of a token slice when ``sequence_gather`` is g > 1:
    #: ``"token-major"`` (rows ``j·g … j·g+g-1`` are local token j's: memo's emulated rank, NOTE
    #: [Tensor-parallel rank]) or ``"rank-major"`` (the g ranks' slices one after another: megatron's
    #: sequence-parallel all-gather). The runtime puts rank-major rows in sequence order around the
    #: core attention (NOTE [Gathered rows in sequence order] in memo/runtime/sequence_order.py).
    gather_layout: str = "token-major"

    def sequence_gather(self, layer: nn.Module) -> int:
        """Attention-side rows per layer-input token: 1, or t for a rank of a tensor + sequence parallel
        group whose ``pre`` gathers the sequence (NOTE [Tensor-parallel rank])."""
        return int(getattr(layer, "sequence_gather", 1))

    def core_module(self, layer: nn.Module) -> nn.Module | None:
        """The submodule that computes the layer's core attention, if it is one: the profiler counts
        what is made inside it as S_attn (NOTE [Layer anatomy] in memo/models/layers.py)."""
        core = getattr(layer, "core_attention", None)
        return core if isinstance(core, nn.Module) else None

    def core_function(self, layer: nn.Module, ctx: Ctx) -> CoreFunction | None:
        """The layer's own core attention as a differentiable ``(q, k, v) -> o [s, b, n * d]``, to run
        as a black box (NOTE [Black-box core attention] in memo/runtime/core_attention.py), or None when
        :meth:`core_forward` / :meth:`core_backward` compute what the layer computes."""
        return None

    def attention_kernels(self, layer: nn.Module) -> tuple[AttentionForward, AttentionBackward]:
        """``(forward, backward)`` of the causal attention :meth:`core_forward` / :meth:`core_backward`
        run: ``forward(q, k, v) -> (o [s, b, n, d], lse)``, ``backward(grad_o [s, b, n, d], q, k, v, o,
        lse) -> (dq, dk, dv)``; memo's (:mod:`memo.models.causal_attention`) by default."""
        from memo.models.causal_attention import attention_backward, attention_forward

        return attention_forward, attention_backward

    def core_forward(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention without autograd: -> ``o: [s, b, n * d]``, ``lse: [b, n, s]`` (float32)."""
        forward, _ = self.attention_kernels(layer)
        o, lse = forward(q, k, v)
        s, b, n, d = o.shape
        return o.view(s, b, n * d), lse

    def core_backward(self, layer: nn.Module, grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, ctx: Ctx) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        """``grad_o: [s, b, n * d]`` -> ``dq: [s, b, n, d]``, ``dk, dv: [s, b, n_kv, d]``."""
        _, backward = self.attention_kernels(layer)
        s, b, n, d = q.shape
        return backward(grad_o.reshape(s, b, n, d), q, k, v, o.view(s, b, n, d), lse)

    def pack_output(self, layer: nn.Module, y: torch.Tensor, ctx: Ctx) -> Any:
        """The value the layer's ``forward`` returns, given ``y: [s, b, h]``."""
        return y

    def mlp_site(self, layer: nn.Module) -> MLPSite | None:
        """Where ``layer`` computes its MLP (:class:`MLPSite`), or None when the adapter does not name
        one. Raises :class:`MemoError` when the layer has an MLP that cannot be run token by token."""
        return None


class AnatomyAdapter(LayerAdapter[int]):
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
            torch.Tensor, int]:
        """-> ``(x, first)``: ``first`` is the absolute position of ``x[0]`` (``layer.first_position``:
        not 0 on a Ulysses rank, NOTE [Contiguous Ulysses] in memo/models/ulysses_attention.py)."""
        if len(args) == 1 and not kwargs:
            x = args[0]
        elif not args and set(kwargs) == {"x"}:
            x = kwargs["x"]
        else:
            x = None
        if isinstance(x, torch.Tensor):
            first = getattr(layer, "first_position", None)
            return x, int(first(x)) if callable(first) else 0
        raise MemoError(
            f"memo.adapters: {type(layer).__name__}.forward is called as forward(x) when wrapped by memo; "
            f"got {len(args)} positional and keyword arguments {sorted(kwargs)}"
        )

    def pre(self, layer: nn.Module, x: torch.Tensor, offset: int, ctx: int) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        return layer.pre(x, offset=offset + (ctx or 0))

    def post(self, layer: nn.Module, o: torch.Tensor, x: torch.Tensor, ctx: int) -> torch.Tensor:
        return layer.post(o, x)

    def attention_kernels(self, layer: nn.Module) -> tuple[AttentionForward, AttentionBackward]:
        """The core attention module's own halves when it has them (``attention_kernels()``: Ulysses
        ranks, memo/models/ulysses_attention.py), else memo's causal attention."""
        own = getattr(self.core_module(layer), "attention_kernels", None)
        return own() if callable(own) else super().attention_kernels(layer)

    def mlp_site(self, layer: nn.Module) -> MLPSite | None:
        """``layer.mlp(z)`` with ``layer.mlp_parameters()``, ``z: [s, b, h]`` (NOTE [Layer MLP] in
        memo/models/layers.py); None for an anatomy layer without them."""
        if not callable(getattr(layer, "mlp", None)) or not callable(getattr(layer, "mlp_parameters", None)):
            return None
        if self.sequence_gather(layer) != 1:
            raise MemoError(
                f"memo.adapters: {type(layer).__name__} is one rank of a tensor + sequence parallel group "
                f"(sequence_gather {self.sequence_gather(layer)}): its MLP gathers the sequence, so it "
                "cannot run on token tiles of this rank alone; use it with tensor_parallel=1")
        return MLPSite(layer, "mlp", 0, tuple(layer.mlp_parameters()))


# Registry: qualified class name -> the adapter, or "module:attribute" to import on first use (the
# megatron-core and Hugging Face adapters are registered here by name, so that memo imports neither
# library, nor their adapters' modules, until a layer of theirs is met; the same scheme as
# memo.adapters.model). Looked up along the MRO, so a subclass of a registered class is served by
# its parent's adapter unless it has its own.
_REGISTRY: AdapterRegistry[LayerAdapter[Any]] = AdapterRegistry(LayerAdapter, "layer adapter", {
    "memo.models.layers.TransformerLayer": AnatomyAdapter(),
    "megatron.core.transformer.transformer_layer.TransformerLayer":
        "memo.adapters.megatron:MegatronLayerAdapter",
    "transformers.models.llama.modeling_llama.LlamaDecoderLayer": "memo.adapters.hf:HFDecoderLayerAdapter",
    "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer": "memo.adapters.hf:HFDecoderLayerAdapter",
    "transformers.models.mistral.modeling_mistral.MistralDecoderLayer":
        "memo.adapters.hf:HFDecoderLayerAdapter",
})
#: The entries, by qualified class name (NOTE [Adapters by class name] in memo/adapters/_lazy.py).
_ADAPTERS = _REGISTRY.entries


def register_adapter(layer_class: type | str, adapter: LayerAdapter[Any] | str) -> None:
    """Let :func:`memo.wrap` wrap layers of ``layer_class`` (and its subclasses) through ``adapter``.

    Either may be given by name: the class as ``"package.module.Class"``, the adapter as
    ``"package.module:attribute"`` (a LayerAdapter instance or class, imported on first use).

    Example::

        class MyAdapter(memo.adapters.LayerAdapter):
            def split_args(self, layer, args, kwargs): return args[0], None
            def pre(self, layer, x, offset, ctx): ...   # -> q, k, v
            def post(self, layer, o, x, ctx): ...       # -> y
        memo.adapters.register_adapter(MyLayer, MyAdapter())
    """
    if isinstance(layer_class, str):
        key = layer_class
    elif isinstance(layer_class, type) and issubclass(layer_class, nn.Module):
        key = qualname(layer_class)
    else:
        raise MemoError(f"memo.adapters: register_adapter needs an nn.Module subclass, got {layer_class!r}")
    if not isinstance(adapter, (LayerAdapter, str)):
        raise MemoError(
            f"memo.adapters: adapter for {key} must be a LayerAdapter or 'module:attribute', "
            f"got {type(adapter)}"
        )
    _REGISTRY.register(key, adapter)


def unregister_adapter(layer_class: type | str) -> None:
    """Remove ``layer_class``'s adapter (a missing one is not an error)."""
    _REGISTRY.unregister(layer_class if isinstance(layer_class, str) else qualname(layer_class))


def registered_adapters() -> dict[type, LayerAdapter[Any]]:
    """The layer classes that can be wrapped now, with their adapters: those of memo and those of the
    libraries already imported (a class of a library not imported yet cannot be at hand, and is not
    listed, so that listing imports no library)."""
    found: dict[type, LayerAdapter[Any]] = {}
    for key, entry in list(_REGISTRY.entries.items()):
        module_name, _, class_name = key.rpartition(".")
        if module_name.split(".", 1)[0] not in sys.modules:
            continue
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # e.g. a model family this version of the library does not have
        found[cls] = _REGISTRY.load(key, entry)
    return found


def find_adapter(module: nn.Module) -> LayerAdapter[Any] | None:
    """The adapter serving ``type(module)`` (nearest registered class in its MRO), or ``None``."""
    return _REGISTRY.find(type(module))
