"""The global gradient norm of a step, and ``--clip-grad``: both training loops call it after the
gradients are reduced and before the optimizer steps (NOTE [Global gradient norm])."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["GradNorm"]


# NOTE [Global gradient norm]
# The norm is that of the whole model's gradient, as one process would compute it:
# - one process, and ZeRO-1 (every rank holds whole, already averaged gradients): the parameters' own;
# - FSDP2: each gradient is a DTensor shard; torch's norm of DTensors is a DTensor whose full_tensor()
#   sums the shards' squares over the mesh;
# - megatron: a tensor-parallel slice (``tensor_model_parallel``) is one rank's part of a gradient; every
#   other parameter is the same on each tensor-parallel rank (sequence-parallel norms after
#   finalize_model_grads too), so it is counted on tensor-parallel rank 0 only, and the squares are summed
#   over the model-parallel group (tensor x pipeline ranks); a parameter megatron marks ``shared`` (an
#   embedding tied across pipeline stages) is counted where it is not shared, as megatron's own clipping
#   does.
# Clipping scales every gradient by max_norm / (norm + 1e-6) when that is below 1, the same factor on
# every rank, so the ranks' weights stay one model.
class GradNorm:
    """A step's global gradient norm (``last``) and, with ``max_norm``, clipping to it (NOTE [Global
    gradient norm]). ``megatron``: the parameters are megatron-core's, split over its parallel groups."""

    def __init__(self, max_norm: float | None, megatron: bool = False) -> None:
        self.max_norm = max_norm
        self.megatron = megatron
        #: The norm of the last step's gradients, before clipping (None before the first).
        self.last: float | None = None

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> float:
        """Measure (and clip) the gradients of ``params``; the norm before clipping."""
        with_grad = [p for p in params if p.grad is not None]
        norm = self._megatron_norm(with_grad) if self.megatron else self._norm(with_grad)
        self.last = norm
        if self.max_norm is not None:
            scale = self.max_norm / (norm + 1e-6)
            if scale < 1.0:
                for p in with_grad:
                    p.grad.mul_(scale)
        return norm

    @staticmethod
    def _norm(params: list[torch.nn.Parameter]) -> float:
        if not params:
            return 0.0
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        full = getattr(total, "full_tensor", None)
        return float(full() if full is not None else total)

    @staticmethod
    def _megatron_norm(params: list[torch.nn.Parameter]) -> float:
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        counted = [p for p in params if not getattr(p, "shared", False)
                   and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)]
        device = params[0].device if params else torch.device("cpu")
        # per-tensor reductions (no copy of a gradient: the step's peak stays the plan's), summed on the
        # device, one collective
        squares = torch.zeros((), dtype=torch.float64, device=device)
        if counted:
            norms = torch.stack([torch.linalg.vector_norm(p.grad.detach()) for p in counted])  # type: ignore[union-attr]
            squares = norms.double().pow(2).sum()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        return float(squares.sqrt())
