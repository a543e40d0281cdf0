"""Per-rank device memory: the model states a plan adds to its activations, and the costs the
layer-policy choice needs (NOTE [Policy cost model] in planner/policy.py).

NOTE [Model states]
A plan's ``peak`` is the activation arena of one rank. The device also holds the model states:
the parameters, their gradients and the optimizer's state. ``model_states`` counts them from the
parameters the rank holds (with tensor parallelism, its shards), in the dtypes training uses:

* ``"same"``: torch's AdamW on the model's own dtype (what ``memo train`` runs): gradients in
  the parameter dtype, two optimizer states (exp_avg, exp_avg_sq) in the parameter dtype.
* ``"mixed"``: Megatron-style mixed precision: fp32 main gradients, and an fp32 master copy of
  the parameters with fp32 Adam moments (4 + 4 + 8 bytes per parameter beside the parameter).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memo.errors import MemoError

__all__ = ["OPTIMIZER_STATES", "model_states", "model_states_bytes"]

OPTIMIZER_STATES = ("same", "mixed")


def model_states(model: nn.Module, optimizer_states: str = "same") -> dict[str, Any]:
    """Bytes of parameters, gradients and optimizer states one rank holds (NOTE [Model states])."""
    if optimizer_states not in OPTIMIZER_STATES:
        raise MemoError(f"memo.profiler: optimizer_states must be one of {OPTIMIZER_STATES}, "
                        f"got {optimizer_states!r}")
    seen: set[int] = set()
    count = trainable = param_bytes = 0
    dtypes: set[str] = set()
    elem = 4
    for p in model.parameters():
        if id(p) in seen:
            continue  # tied weights (embedding and head) are one parameter
        seen.add(id(p))
        count += p.numel()
        param_bytes += p.numel() * p.element_size()
        dtypes.add(str(p.dtype).removeprefix("torch."))
        elem = p.element_size()
        if p.requires_grad:
            trainable += p.numel()
    dtype = ",".join(sorted(dtypes)) or "none"
    if optimizer_states == "same":
        grads = {"bytes": trainable * elem, "dtype": dtype}
        opt = {"bytes": 2 * trainable * elem, "dtype": dtype, "what": "AdamW exp_avg, exp_avg_sq"}
    else:
        grads = {"bytes": trainable * 4, "dtype": "float32"}
        opt = {"bytes": 12 * trainable, "dtype": "float32", "what": "fp32 master weights, Adam moments"}
    return {
        "optimizer_states": optimizer_states,
        "parameters": {"count": count, "bytes": param_bytes, "dtype": dtype},
        "gradients": grads,
        "optimizer": opt,
    }


def model_states_bytes(states: dict[str, Any]) -> int:
    """Parameters + gradients + optimizer states, in bytes."""
    return int(states["parameters"]["bytes"] + states["gradients"]["bytes"] + states["optimizer"]["bytes"])
