"""Whether a layer is exactly the one an adapter was written for.

NOTE [memo runs the layer the user wrote, or refuses it]
An adapter that computes a layer itself (Hugging Face's and megatron-core's: memo's runtime calls
the layer's submodules in its own order and never the layer's ``forward``) reproduces one class's
``forward`` and one attention module's. It serves a layer only when the layer is exactly that:

- the layer's class is the class the adapter was written for, not a subclass (a subclass that
  overrides ``forward``, or anything it calls, would silently run its parent's computation), and
  neither the class's ``forward`` nor the instance's has been replaced;
- every submodule whose ``forward`` the adapter does not call (HF's ``self_attn``, megatron's
  ``self_attention``: memo calls their projections and computes attention itself) is of the class
  the adapter knows, with that class's own ``forward``, and no forward hooks of its own or global
  ones (a hook there would never fire);
- every option of the layer that changes what the adapter computes is one it implements (each
  adapter lists its own: an HF attention's ``is_causal``, megatron's TransformerConfig fields in
  memo/adapters/megatron_config.py).

Anything else is refused with a MemoError that names what memo would not run. Submodules the
adapter does call (norms, projections, the MLP, PEFT's LoRA layers around them) run as the user
wrote them, hooks included. This is the stance of ``torch.utils.checkpoint``: it re-runs the
user's function, never a copy. Layers written with memo's anatomy (``pre``/``post`` methods) are
always the user's own code and need none of this. FSDP2's ``fully_shard`` swaps a module's class
for a generated subclass (``FSDP<Name>``) that adds no computation; it is looked through.
"""

from __future__ import annotations

from torch import nn

__all__ = ["user_class", "unhonoured"]


def user_class(module: nn.Module) -> type:
    """``type(module)``, looking through FSDP2's generated subclass (``FSDP<Name>(FSDPModule, cls)``)."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


def _replaced_forward(module: nn.Module, known: type) -> str | None:
    """How ``module``'s forward differs from ``known.forward``, or None."""
    own = module.__dict__.get("forward")
    func = getattr(own, "func", None)
    if func is not None and getattr(func, "__module__", "") == "memo.runtime.wrap":
        own = own.args[1]  # memo's own wrapper (NOTE [Wrapping in place]): what it found on the instance
    if own is not None:
        return "its forward was replaced on the instance"
    # The forward the class resolves to must be one its library wrote for it or a base: a patch (a
    # function of the user's assigned to the class) names another owner or module.
    fn = getattr(user_class(module), "forward", None)
    owner, _, name = getattr(fn, "__qualname__", "").rpartition(".")
    module_name = getattr(fn, "__module__", None)
    written = any(c.__qualname__ == owner and c.__module__ == module_name for c in known.__mro__)
    if name != "forward" or not written:
        return f"{known.__name__}.forward was replaced (patched to {getattr(fn, '__qualname__', fn)!r})"
    return None


def _hooks(module: nn.Module) -> list[str]:
    from torch.nn.modules import module as torch_module

    found = []
    if module._forward_pre_hooks:
        found.append("forward pre-hook")
    if module._forward_hooks:
        found.append("forward hook")
    if torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks:
        found.append("global forward hook")
    return found


def unhonoured(layer: nn.Module, known: tuple[type, ...], bypassed: dict[str, tuple[type, ...]],
               options: list[str] | None = None) -> list[str]:
    """What of ``layer`` an adapter written for the classes ``known`` would not run (NOTE [memo runs the
    layer the user wrote, or refuses it]), one phrase each; empty when the layer is exactly one of them.

    ``bypassed``: submodule name -> the classes the adapter reproduces without calling their
    ``forward``. ``options``: what the adapter found of the layer's options that it does not implement.
    """
    problems = []
    cls = user_class(layer)
    match = next((k for k in known if cls is k), None)
    if match is None:
        parent = next((k for k in known if issubclass(cls, k)), None)
        what = f"a subclass of {parent.__name__}" if parent is not None else "not a class it knows"
        problems.append(f"its class {cls.__qualname__} is {what}; memo's adapter computes "
                        f"{' / '.join(k.__name__ for k in known)} exactly and would not run its code")
    else:
        replaced = _replaced_forward(layer, match)
        if replaced is not None:
            problems.append(replaced)
    for name, classes in bypassed.items():
        sub: object = getattr(layer, name, None)
        if not isinstance(sub, nn.Module):
            continue
        sub_cls = user_class(sub)
        sub_match = next((k for k in classes if sub_cls is k), None)
        if sub_match is None:
            names = " / ".join(k.__name__ for k in classes)
            problems.append(f"its {name} is a {sub_cls.__qualname__}, not {names}, whose forward memo does "
                            "not call (it computes attention itself)")
            continue
        replaced = _replaced_forward(sub, sub_match)
        if replaced is not None:
            problems.append(f"its {name}: {replaced}; memo does not call {name}.forward")
        hooks = _hooks(sub)
        if hooks:
            problems.append(f"its {name} has a {' and a '.join(hooks)}, which would never fire: memo "
                            f"computes {name} from its projections without calling it (register the hook on "
                            "a projection, or on the layer)")
    return problems + list(options or [])
