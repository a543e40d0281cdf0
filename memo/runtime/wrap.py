"""``memo.wrap`` / ``memo.unwrap``: switch a model's transformer layers to token-wise offload/recompute.

NOTE [Wrapping in place]
``wrap`` finds every module whose class has an adapter (NOTE [Layer adapters];
the search does not descend into a found layer) and sets an instance attribute
``forward`` on it. Nothing is added to or removed from the module tree, so the
state dict (keys and values) is exactly the unwrapped model's and checkpoints
load either way; module hooks (e.g. :class:`memo.phases.PhaseTracker`) keep
firing because ``nn.Module.__call__`` still runs them around ``forward``.
``unwrap`` deletes the attribute (or restores one the user had set).

The wrapped forward runs the original one when grad is disabled (evaluation:
no backward will come, so nothing is offloaded); otherwise it runs the layer's
policy (NOTE [Layer policy] in memo/runtime/runtime.py): memo's token-wise
offload/recompute, full recompute under torch.utils.checkpoint, or the original
forward (kept). The layer after a memo layer hooks its output's gradient to
start the prefetch of that memo layer (NOTE [Rounding buffer reuse]).

NOTE [Copying a wrapped model]
``copy.deepcopy(model)`` and pickling (``torch.save(model)``, then ``torch.load(...,
weights_only=False)``) give a *wrapped* copy with a runtime of its own, as deep-copying
a module keeps its hooks: the same alpha, plan, policy and settings, its layers'
``forward`` bound to its own layers, no buffers until its first forward, statistics at
zero. The original is untouched and keeps training, even with a forward in flight. What
cannot be copied (the copy engine's threads and pinned memory, the buffers and what a
forward left in them) is left out by ``MemoRuntime.__getstate__``; the wrapped
``forward`` holds no bound method of the layer for the class's own forward (it looks
it up at each call) and the "no forward of its own" marker pickles as itself, so the
copy calls its own layers and ``memo.unwrap`` of the copy restores a plain model.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from memo.adapters.base import LayerAdapter, find_adapter, registered_adapters
from memo.adapters.model import find_model_adapter
from memo.errors import MemoError
from memo.planner.vocab import LayerPolicy
from memo.runtime.compiled import eager
from memo.runtime.layer import LayerCall
from memo.runtime.module_state import as_in_forward, module_tensors
from memo.runtime.runtime import NOT_OFFLOADED_TAIL, OFFLOADING_POLICIES, MemoRuntime, PlanFields, kept_tail

__all__ = ["find_layers", "is_wrapped", "runtime_of", "unwrap", "wrap"]

_RUNTIME_ATTR = "_memo_runtime"
_CALL_ATTR = "_memo_call"
_SAVED_FORWARD_ATTR = "_memo_saved_forward"


class _NoSaved:
    """Marks a layer that had no instance ``forward`` of its own; pickles and copies as itself."""

    def __reduce__(self) -> str:
        return "_NO_SAVED"

    def __repr__(self) -> str:
        return "_NO_SAVED"


_NO_SAVED = _NoSaved()


def find_layers(model: nn.Module) -> list[tuple[nn.Module, LayerAdapter]]:
    """The transformer layers of ``model`` in forward order, each with its adapter.

    Raises:
        MemoError: when no layer class with an adapter is found; names the most
            likely layer class (the element type of a ``ModuleList``) and how to add one.
    """
    found: list[tuple[nn.Module, LayerAdapter]] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            adapter = find_adapter(child)
            if adapter is not None:
                found.append((child, adapter))
            else:
                visit(child)

    root_adapter = find_adapter(model)
    if root_adapter is not None:
        raise MemoError(
            f"memo.wrap: {type(model).__name__} is itself a transformer layer; wrap the model that holds "
            "the layers (memo decides per layer of a model what to offload, NOTE [Layer policy])"
        )
    visit(model)
    if not found:
        raise MemoError(_unsupported_message(model))
    return found


def _unsupported_message(model: nn.Module) -> str:
    candidates: Counter[type] = Counter()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                candidates[kinds.pop()] += len(module)
    known = ", ".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in registered_adapters())) or "none"
    if candidates:
        cls = candidates.most_common(1)[0][0]
        what = (f"its layers look like {cls.__module__}.{cls.__qualname__} (a ModuleList of them), which has "
                "no memo adapter")
    else:
        what = "no transformer layer class with a memo adapter was found"
        cls = None
    name = cls.__qualname__ if cls is not None else "YourLayer"
    return (
        f"memo.wrap: cannot wrap {type(model).__name__}: {what}. Supported layer classes: {known}. "
        "To add one, "
        f"map the layer onto pre/core/post: subclass memo.adapters.LayerAdapter (split_args, pre, post; see "
        f"NOTE [Layer adapters]) and call memo.adapters.register_adapter({name}, YourAdapter()) before "
        "memo.wrap"
    )


#: A layer's ``forward``: whatever it takes and returns.
Forward = Callable[..., Any]


def _wrapped_forward(call: LayerCall, original: Forward | None, *args: object, **kwargs: object) -> Any:
    """``forward`` of a wrapped layer; ``original`` is the forward the user had set on the instance,
    or None for the class's (looked up at each call, so that a copy calls its own layer's)."""
    if not torch.is_grad_enabled():
        # Evaluation, generation: the layer's own forward, which a compiler traces as unwrapped.
        return _own_forward(call, original)(*args, **kwargs)
    if torch.compiler.is_compiling():
        # NOTE [memo under torch.compile] (memo/runtime/compiled.py): opaque to the compiler.
        return eager(_layer_forward)(call, original, *args, **kwargs)
    return _layer_forward(call, original, *args, **kwargs)


def _own_forward(call: LayerCall, original: Forward | None) -> Forward:
    """The forward the layer would run unwrapped: the user's instance forward, else the class's."""
    return original if original is not None else type(call.layer).forward.__get__(call.layer)


def _layer_forward(call: LayerCall, original: Forward | None, *args: object, **kwargs: object) -> Any:
    rt = call.runtime
    original = _own_forward(call, original)
    kind = rt.policy[call.index]
    if not _needs_grad(call.layer, args, kwargs):
        # NOTE [Frozen layers cost what they cost unwrapped]
        # Nothing of this layer needs a gradient (a frozen bottom of the model: its input and its
        # parameters need none), so autograd would record nothing and run no backward for it:
        # neither does memo. It runs as it is, with nothing offloaded, prefetched or recomputed, and
        # its output does not require grad. The layer still opens the iteration when it is the first
        # (the buffers are sized and a flight is chosen), so the layers above it that train find
        # them ready.
        if kind in OFFLOADING_POLICIES and call.index == 0:
            x, ctx = call.adapter.split_args(call.layer, args, kwargs)
            rt.prepare(call, x, ctx)
            rt.begin_forward()
        rt.stats.frozen_layers += 1
        return original(*args, **kwargs)
    if kind in OFFLOADING_POLICIES:
        x, ctx = call.adapter.split_args(call.layer, args, kwargs)
        y = rt.run_layer(call, x, ctx)
        out = call.adapter.pack_output(call.layer, y, ctx)
    elif kind == LayerPolicy.RECOMPUTE:
        rt.stats.recomputed_layers += 1
        # torch's checkpoint recomputes with the module's tensors of the moment: under
        # functional_call those are no longer the forward's (NOTE [Recompute with the forward's
        # tensors] in memo/runtime/module_state.py).
        out = checkpoint(_with_tensors(original, call.layer), *args, use_reentrant=False, **kwargs)
    else:
        out = original(*args, **kwargs)
    if 0 < call.index <= rt.n_offloaded:
        y_out = out if isinstance(out, torch.Tensor) else out[0]
        if isinstance(y_out, torch.Tensor) and y_out.requires_grad:
            hook = functools.partial(_prefetch_previous, rt, call.index - 1, rt.flight)
            y_out.register_hook(hook)
    return out


def _needs_grad(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether any input tensor of this call, or any parameter of ``layer``, requires grad."""
    leaves = tree_leaves((args, kwargs))
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        return True
    return any(p.requires_grad for p in layer.parameters())


def _with_tensors(forward: Forward, layer: nn.Module) -> Forward:
    """``forward``, run with the parameters and buffers ``layer`` holds now, whenever it is run."""
    saved = module_tensors(layer)

    def run(*args: object, **kwargs: object) -> Any:
        with as_in_forward(layer, saved):
            return forward(*args, **kwargs)

    return run


def _prefetch_previous(rt: MemoRuntime, index: int, flight: int, grad: torch.Tensor) -> None:
    rt.prefetch_hook(index, flight)


def wrap(
    model: nn.Module,
    alpha: float | None = None,
    plan: PlanFields = None,
    *,
    runtime: MemoRuntime | None = None,
    debug_copy_delay_us: int | None = None,
    host_memory_limit: int | None = None,
    policy: list[str] | None = None,
    recompute_chunk_tokens: int | None = None,
) -> nn.Module:
    """Wrap ``model``'s transformer layers in place for token-wise offload/recompute; returns ``model``.

    Args:
        model: a model holding transformer layers (memo's GPT/Llama, a megatron-core
            ``GPTModel``/``TransformerBlock``, or any model whose layer class has an adapter).
            Layers take and return hidden states ``[s, b, h]``.
        alpha: fraction in [0, 1] of each layer's tokens whose skeletal tensors are offloaded;
            the rest are recomputed in backward. The layer input and attention output are
            always offloaded.
        plan: a plan carrying ``alpha`` and ``host_bytes`` (alpha may then be omitted).
        runtime: a :class:`MemoRuntime` to use (else one is created from the arguments above).
        debug_copy_delay_us: see :class:`MemoRuntime`.
        host_memory_limit: see :class:`MemoRuntime`.
        policy: per layer "memo", "input-only", "segment", "recompute" or "keep" (NOTE [Layer policy]);
            default: the plan's,
            else all layers but the last two offload.
        recompute_chunk_tokens: tokens per tile of the token-wise parts (NOTE [Tiles bounded by
            memory] in memo/runtime/tiles.py); default: the plan's ``tile_tokens``, else the runtime's
            memory-bounded default.

    The runtime is available as :func:`runtime_of(model) <runtime_of>`. The state dict is
    unchanged (NOTE [Wrapping in place]).

    ``copy.deepcopy(model)`` and ``torch.save(model)`` / ``torch.load(f, weights_only=False)``
    work at any time and give a wrapped copy with its own :class:`MemoRuntime` (same alpha,
    plan and policy; buffers allocated at its first forward; statistics at zero), leaving the
    original as it was (NOTE [Copying a wrapped model]). For a plain copy, ``memo.unwrap`` the
    copy; to save only the weights, ``torch.save(model.state_dict())`` (the same keys as unwrapped).
    """
    if not isinstance(model, nn.Module):
        raise MemoError(f"memo.wrap: expected an nn.Module, got {type(model).__name__}")
    if is_wrapped(model):
        raise MemoError("memo.wrap: this model is already wrapped; call memo.unwrap(model) first")
    recompute = getattr(model, "recompute", None)
    if isinstance(recompute, str) and recompute != "none":
        raise MemoError(
            f"memo.wrap: the model has recompute={recompute!r}; memo does the recomputation itself "
            "(token-wise), so set model.recompute = 'none' before wrapping"
        )
    if runtime is None:
        runtime = MemoRuntime(alpha, plan=plan, debug_copy_delay_us=debug_copy_delay_us,
                              host_memory_limit=host_memory_limit, policy=policy,
                              recompute_chunk_tokens=recompute_chunk_tokens)
    elif alpha is not None or plan is not None or policy is not None or recompute_chunk_tokens is not None:
        raise MemoError("memo.wrap: pass alpha/plan/policy either to MemoRuntime or to wrap, not both")
    # The model's own settings too (e.g. gradient checkpointing flagged on an HF base model only).
    model_adapter = find_model_adapter(model)
    if model_adapter is not None:
        model_adapter.check(model)
    layers = find_layers(model)
    for layer, adapter in layers:
        adapter.check(layer)
        if _CALL_ATTR in layer.__dict__:
            raise MemoError(f"memo.wrap: layer {type(layer).__name__} is already wrapped by another model")
    calls = runtime.attach(layers, kept_tail(model, NOT_OFFLOADED_TAIL))
    if calls and runtime.n_offloaded == 0 and runtime._given_policy is None:
        warnings.warn(
            f"memo.wrap: none of the model's {len(calls)} layers offloads: without a plan or a policy memo "
            f"keeps the last {NOT_OFFLOADED_TAIL} layers whole (their backward follows their forward at "
            f"once), so alpha={runtime.alpha} has no effect and the model trains as unwrapped. Pass "
            f"policy=['memo'] * {len(calls)} to offload them anyway", stacklevel=2)
    for call in calls:
        layer = call.layer
        saved = layer.__dict__.get("forward", _NO_SAVED)
        original = saved if saved is not _NO_SAVED else None
        object.__setattr__(layer, _SAVED_FORWARD_ATTR, saved)
        object.__setattr__(layer, _CALL_ATTR, call)
        object.__setattr__(layer, "forward", functools.partial(_wrapped_forward, call, original))
    object.__setattr__(model, _RUNTIME_ATTR, runtime)
    return model


def unwrap(model: nn.Module, *, force: bool = False) -> nn.Module:
    """Restore the layers :func:`wrap` wrapped and release the runtime's buffers; returns ``model``.

    Refused while a forward of the model awaits its backward: that backward needs the runtime's
    buffers and its layers' wrapped backward. ``force`` (for clean-up after an exception) drops such
    forwards instead: their backward, if tried, is refused with a clear error."""
    runtime = runtime_of(model)
    waiting = runtime.forwards_awaiting_backward()
    if waiting and force:
        runtime.reset()
    elif waiting:
        raise MemoError(
            f"memo.unwrap: {waiting} forward(s) of this model still await their backward, which needs "
            "memo's buffers and wrapped layers; run that backward first (loss.backward()), or drop "
            "what holds its graph (del loss, and any output kept), then unwrap")
    for call in runtime.calls:
        layer = call.layer
        saved = layer.__dict__.pop(_SAVED_FORWARD_ATTR, _NO_SAVED)
        layer.__dict__.pop("forward", None)
        layer.__dict__.pop(_CALL_ATTR, None)
        if saved is not _NO_SAVED:
            object.__setattr__(layer, "forward", saved)
    runtime.close()
    model.__dict__.pop(_RUNTIME_ATTR, None)
    return model


def is_wrapped(model: nn.Module) -> bool:
    """Whether :func:`wrap` wrapped ``model``."""
    return _RUNTIME_ATTR in model.__dict__


def runtime_of(model: nn.Module) -> MemoRuntime:
    """The :class:`MemoRuntime` of a wrapped model."""
    runtime = model.__dict__.get(_RUNTIME_ATTR)
    if runtime is None:
        raise MemoError(
            f"memo.runtime: {type(model).__name__} is not wrapped; call memo.wrap(model, alpha=...)"
        )
    return runtime
