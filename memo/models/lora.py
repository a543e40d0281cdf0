"""LoRA-style fine-tuning of memo's reference models: a frozen base and small trainable adapters.

NOTE [LoRA linears]
:func:`add_lora` freezes every parameter of a model (embedding, layers, norms, head) and replaces
each of the layers' linears it names (default: the attention projections ``qkv`` and ``proj`` and the
MLP's ``fc1``/``fc2`` or ``gate_up``/``down``) by a :class:`LoRALinear`: ``base(x) + B(A(x)) * scale``
with ``A: [r, in]``, ``B: [out, r]`` and ``scale = lora_alpha / r`` (Hu et al., 2021). ``B`` starts at
zero, so the adapted model computes what the base computes until the first step. Only ``A`` and ``B``
require gradients: autograd still back-propagates through the frozen base (the layers' input
gradients), but makes no gradient for it, and an optimizer over ``trainable_parameters`` holds state
for the adapters alone; ``memo.profiler.device.model_states`` counts gradient and optimizer bytes
from ``requires_grad`` and so counts the base's parameters only.

A :class:`LoRALinear` holds the base linear's own ``weight`` (and ``bias``) Parameters under the same
names, so the base's state-dict keys are unchanged (``layers.0.qkv.weight``); the adapters add
``layers.0.qkv.lora_A`` and ``layers.0.qkv.lora_B``. The layers call their linears as modules
(``linear(x)``; NOTE [Layer anatomy] in memo/models/layers.py), which is what makes the replacement
work; a tensor-parallel rank model (``tensor_parallel > 1``) reads ``linear.weight`` directly
(memo/models/parallel.py) and would skip the adapter, so it is refused.

The adapters take the base's device and dtype (bf16 base, bf16 adapters: what ``memo train``'s
AdamW on the model's own dtype expects, NOTE [Model states]). On the meta device nothing is
allocated, so an 8B model with adapters is built for profiling in seconds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memo.errors import MemoError

__all__ = ["DEFAULT_TARGETS", "LoRALinear", "add_lora", "lora_parameters", "trainable_parameters"]

#: The linears of memo's layers that get adapters: attention projections and the MLP's linears
#: (GPT: qkv, proj, fc1, fc2; Llama: qkv, proj, gate_up, down).
DEFAULT_TARGETS = ("qkv", "proj", "fc1", "fc2", "gate_up", "down")


class LoRALinear(nn.Module):
    """``base(x) + (x A^T) B^T * scale`` with the base's ``weight``/``bias`` frozen (NOTE [LoRA linears])."""

    def __init__(self, base: nn.Linear, rank: int = 16, lora_alpha: float | None = None) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise MemoError(f"memo.models.lora: LoRALinear adapts an nn.Linear, got {type(base).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise MemoError(f"memo.models.lora: rank must be a positive integer, got {rank!r}")
        self.in_features, self.out_features, self.rank = base.in_features, base.out_features, rank
        self.weight = base.weight
        self.bias = base.bias  # None registers no parameter: the state dict stays the base's
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.lora_alpha = float(2 * rank if lora_alpha is None else lora_alpha)
        self.scale = self.lora_alpha / rank
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **kw))
        self.reset_lora()

    def reset_lora(self) -> None:
        """PEFT's default: A Kaiming-uniform, B zero (the adapted model starts as the base)."""
        if self.lora_A.device.type == "meta":
            return
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + adapter * self.scale

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, lora_alpha={self.lora_alpha:g}")


def add_lora(model: nn.Module, rank: int = 16, lora_alpha: float | None = None,
             targets: tuple[str, ...] = DEFAULT_TARGETS) -> nn.Module:
    """Freeze every parameter of ``model`` and give the named linears of its layers adapters, in place
    (NOTE [LoRA linears]). Returns ``model``. ``model.layers`` must hold memo's layers (or any modules
    whose target linears are direct ``nn.Linear`` children called as modules)."""
    if getattr(model, "tensor_parallel", 1) != 1:
        raise MemoError("memo.models.lora: a tensor-parallel rank model calls its linears' weights directly "
                        f"(tensor_parallel={model.tensor_parallel}); build the model with tensor_parallel=1")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise MemoError(f"memo.models.lora: {type(model).__name__} has no `layers` ModuleList")
    model.requires_grad_(False)
    adapted = 0
    for layer in layers:
        for name in targets:
            child = getattr(layer, name, None)
            if isinstance(child, nn.Linear):
                setattr(layer, name, LoRALinear(child, rank, lora_alpha))
                adapted += 1
    if not adapted:
        raise MemoError(f"memo.models.lora: no linear named {', '.join(targets)} in the layers of "
                        f"{type(model).__name__}")
    return model


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every adapter parameter (``lora_A``, ``lora_B``) of ``model``, in module order."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A, m.lora_B)]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require gradients (after :func:`add_lora`: the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]
