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

Under FSDP2 (``fully_shard``) a rank holds its shard of each parameter (a DTensor's local
tensor), and the gradients and optimizer states of that shard: those are counted, not the
replicated model (the gathered parameters of a layer are allocations of the iteration, in its
trace: NOTE [memo under FSDP2] in memo/distributed/fsdp2.py). With FSDP2's CPU offload the
shards, their gradients and optimizer states live in host memory: a shard held on the CPU while
the rank profiles on an accelerator counts in ``host_bytes``, not in ``bytes`` (device bytes).
Under ZeRO-1 a parameter marked :data:`OPTIMIZER_STATES_ELSEWHERE` has its optimizer states on
another rank: its parameter and gradient count, its states do not.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from memo.errors import MemoError

__all__ = ["OPTIMIZER_STATES", "OPTIMIZER_STATES_ELSEWHERE", "local_tensor", "model_states",
           "model_states_bytes"]

OPTIMIZER_STATES = ("same", "mixed")
#: Set (True) on a parameter whose optimizer states another rank holds (ZeRO-1: NOTE [ZeRO-1 under
#: megatron] in memo/train/optim.py): its states are not this rank's.
OPTIMIZER_STATES_ELSEWHERE = "memo_optimizer_states_elsewhere"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (FSDP2's sharded parameters), else ``t``.

    No DTensor exists before ``torch.distributed.tensor`` is imported, so it is not imported here
    (1.3 s of every process's start)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t.to_local()
    return t


def model_states(model: nn.Module, optimizer_states: str = "same",
                 device: torch.device | None = None) -> dict[str, Any]:
    """Bytes of parameters, gradients and optimizer states one rank holds (NOTE [Model states]).

    ``device``: where the rank computes; a parameter shard held on the CPU while it is an accelerator
    (FSDP2's CPU offload) counts as host memory, with its gradient and optimizer states."""
    if optimizer_states not in OPTIMIZER_STATES:
        raise MemoError(f"memo.profiler: optimizer_states must be one of {OPTIMIZER_STATES}, "
                        f"got {optimizer_states!r}")
    seen: set[int] = set()
    count = trainable = param_bytes = stepped = 0
    host_count = host_trainable = host_bytes = 0
    dtypes: set[str] = set()
    elem = 4
    offloading = device is not None and device.type not in ("cpu", "meta")
    for p in model.parameters():
        if id(p) in seen:
            continue  # tied weights (embedding and head) are one parameter
        seen.add(id(p))
        local = local_tensor(p)
        n = local.numel()
        dtypes.add(str(p.dtype).removeprefix("torch."))
        elem = p.element_size()
        if offloading and local.device.type == "cpu":
            host_count += n
            host_bytes += n * elem
            host_trainable += n if p.requires_grad else 0
            continue
        count += n
        param_bytes += n * elem
        if p.requires_grad:
            trainable += n
            stepped += 0 if getattr(p, OPTIMIZER_STATES_ELSEWHERE, False) else n
    dtype = ",".join(sorted(dtypes)) or "none"
    if optimizer_states == "same":
        grads = {"bytes": trainable * elem, "dtype": dtype}
        opt = {"bytes": 2 * stepped * elem, "dtype": dtype, "what": "AdamW exp_avg, exp_avg_sq"}
        host_grads, host_opt = host_trainable * elem, 2 * host_trainable * elem
    else:
        grads = {"bytes": trainable * 4, "dtype": "float32"}
        opt = {"bytes": 12 * stepped, "dtype": "float32", "what": "fp32 master weights, Adam moments"}
        host_grads, host_opt = host_trainable * 4, 12 * host_trainable
    params: dict[str, Any] = {"count": count, "bytes": param_bytes, "dtype": dtype}
    if host_count:  # FSDP2's CPU offload: the shards and their states are on the host
        params.update(host_count=host_count, host_bytes=host_bytes)
        grads["host_bytes"], opt["host_bytes"] = host_grads, host_opt
    return {
        "optimizer_states": optimizer_states,
        "parameters": params,
        "gradients": grads,
        "optimizer": opt,
    }


def model_states_bytes(states: dict[str, Any]) -> int:
    """Parameters + gradients + optimizer states, in bytes."""
    return int(states["parameters"]["bytes"] + states["gradients"]["bytes"] + states["optimizer"]["bytes"])
