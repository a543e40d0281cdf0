"""A pipeline stage's step under megatron-core's schedules (NOTE [Pipelined steps] in
memo/train/pipelined.py): :class:`StageStep`, a :class:`memo.pipeline.step.Step` like any other
(NOTE [One step, one path]), and the megatron world and weights it runs on."""

from __future__ import annotations

import contextlib
import math
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.pipeline.stage_plan import StagePhases
from memo.pipeline.step import PhaseListener

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

    from memo.distributed.layout import ParallelLayout, ParallelRun

__all__ = ["StageStep", "initialise", "one_process_world", "shard"]

#: ``(ids, labels, positions, global counted tokens)`` of one micro-batch, as this rank holds it.
MicroBatch = tuple[torch.Tensor, ...]


def one_process_world() -> list[Callable[[], None]]:
    """Install what megatron's schedules need in one process (the CPU shims; megatron's parallel state
    and a process group of one come with ``init_megatron_world``) and return how to undo what was not
    there before, so that the process is left as it was found."""
    from megatron.core import parallel_state

    from memo.distributed.cpu_shims import cpu_shims_installed, install_cpu_shims, remove_cpu_shims

    undo: list[Callable[[], None]] = []
    if not cpu_shims_installed():
        install_cpu_shims()  # megatron's schedules on the CPU (nothing where CUDA is usable)
        undo.append(remove_cpu_shims)
    if not torch.distributed.is_initialized():
        undo.append(torch.distributed.destroy_process_group)
    if not parallel_state.model_parallel_is_initialized():
        undo.append(parallel_state.destroy_model_parallel)
    return undo


# NOTE [Pipeline initialisation]
# megatron draws each stage's weights from the generator of the process that builds it, so a stage
# built for PP = 2 does not hold the weights of the same layers built in one process, and a pipelined
# run could not be checked against the single-process one. Each random weight (every matrix: the
# embeddings, the projections, the LM head) is drawn again from a generator seeded by the run's seed and
# the weight's name in the whole model (layers by their global number), with megatron's init: normal,
# std 0.02, the two projections into the residual stream scaled by 1/sqrt(2L). A tensor-parallel rank
# draws the whole tensor and keeps its slice, as megatron's CPU init does. Norms and biases keep the
# constants megatron gave them. Any --pp, --vpp and --tp then start from one model.
INIT_STD = 0.02


def initialise(chunks: list[nn.Module], seed: int, n_layers: int, layout: ParallelLayout) -> None:
    """NOTE [Pipeline initialisation]."""
    from memo.distributed.pipeline import whole_model_name

    tp = layout.tensor_parallel
    rank = 0
    if tp > 1:
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if p.dim() < 2:
                    continue
                whole = whole_model_name(chunk, name)
                std = INIT_STD / math.sqrt(2 * n_layers) if whole.endswith(
                    ("linear_proj.weight", "linear_fc2.weight")) else INIT_STD
                sliced = getattr(p, "tensor_model_parallel", False) and tp > 1
                dim, stride = (p.partition_dim, getattr(p, "partition_stride", 1)) if sliced else (0, 1)
                shape = list(p.shape)
                if sliced:
                    shape[dim] *= tp
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{whole}".encode()))
                full = torch.randn(shape, generator=g, dtype=torch.float32) * std
                if sliced:
                    full = torch.cat(full.chunk(tp * stride, dim=dim)[rank::tp], dim=dim)
                p.copy_(full)


def shard(batch: tuple[torch.Tensor, torch.Tensor], parallel: ParallelRun | None, device: torch.device
          ) -> MicroBatch:
    """This rank's ``(ids, labels, positions, global counted tokens)`` of a global micro-batch."""
    ids, labels = batch
    count = torch.tensor(int((labels != -100).sum()))
    if parallel is None:
        b, s = ids.shape
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        return ids.to(device), labels.to(device), positions.to(device), count
    ids, labels, positions = parallel.shard(ids, labels)
    return ids.to(device), labels.to(device), positions.to(device), count


def _data_parallel(chunks: list[nn.Module], layout: ParallelLayout) -> list[DistributedDataParallel] | None:
    """megatron's DDP around each chunk where gradients need a reduction (context-parallel ranks, the
    sequence-parallel norms): finalize_model_grads then reduces them (NOTE [Parallel layout])."""
    if layout.context_parallel == 1 and not layout.sequence_parallel and layout.data_parallel == 1:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    return [DistributedDataParallel(c.config, DistributedDataParallelConfig(), c) for c in chunks]


def _forward_step(layout: ParallelLayout
                  ) -> Callable[[Iterator[MicroBatch], nn.Module], tuple[torch.Tensor, Callable[..., Any]]]:
    """megatron's ``forward_step_func``: one micro-batch through a chunk, and the last stage's loss."""
    from megatron.core import parallel_state

    # DDP averages the gradients of the DP x CP ranks, each of which holds 1/(d·c) of the tokens
    scale = layout.context_parallel * layout.data_parallel

    def forward_step(data_iterator: Iterator[MicroBatch], model: nn.Module
                     ) -> tuple[torch.Tensor, Callable[..., Any]]:
        ids, labels, positions, count = next(data_iterator)
        counted = labels != -100
        per_token = model(ids, positions, None, labels=torch.where(counted, labels, 0))

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            local = (out * counted.to(out.dtype)).sum()
            total = local.detach().clone()
            if scale > 1:
                torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(
                    with_context_parallel=True))
            n = max(int(count), 1)
            # megatron divides what this returns by the micro-batch count, in place: a copy is reported
            return local * (scale / n), {"loss": (total / n).clone()}

        return per_token, loss_func

    return forward_step


class StageStep:
    """This rank's pipeline stage under megatron's schedule (no pipelining for P = 1, 1F1B, or the
    interleaved schedule with V > 1): its model chunks, each under megatron's DDP where a reduction is
    needed, and the micro-batches of the step it runs (NOTE [One step, one path])."""

    def __init__(self, chunks: list[nn.Module], layout: ParallelLayout, seq_len: int,
                 batches: list[MicroBatch]) -> None:
        self.chunks = chunks
        self.layout = layout
        self.seq_len = seq_len
        #: The micro-batches of the step (the next step's replace them).
        self.batches = batches
        self.ddp = _data_parallel(chunks, layout)

    def chunk_layers(self) -> list[int]:
        return [len(c.decoder.layers) for c in self.chunks]

    def phases(self, listener: PhaseListener) -> StagePhases:
        return StagePhases(self.chunks, listener)

    def run(self) -> None:
        """The schedule's forwards and backwards, and no gradient kept: a recorded step (NOTE [A stage's
        address plan]) leaves the model as it found it."""
        self._forward_backward()
        for chunk in self.chunks:
            for p in chunk.parameters():
                p.grad = None
        for d in self.ddp or ():
            d.zero_grad_buffer()

    def train(self, optimizer: torch.optim.Optimizer,
              phases: Callable[[], contextlib.AbstractContextManager[None]],
              grad_norm: Callable[[list[nn.Parameter]], float] | None = None) -> float | None:
        """One training step, its forwards and backwards inside ``phases`` (the Session's iteration);
        the mean of the micro-batches' losses on the last stage (None on the others). ``grad_norm``
        measures (and clips) the reduced gradients before the optimizer steps (memo/train/grad_norm.py)."""
        optimizer.zero_grad(set_to_none=True)
        with phases():
            out = self._forward_backward()
        if self.ddp is not None:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads(self.ddp)
            for chunk in self.chunks:
                for p in chunk.parameters():
                    if getattr(p, "main_grad", None) is not None:
                        p.grad = p.main_grad
        if grad_norm is not None:
            grad_norm([p for chunk in self.chunks for p in chunk.parameters()])
        optimizer.step()
        if not out:
            return None
        return float(torch.stack([d["loss"] for d in out]).mean())

    def evaluate(self, batches: list[MicroBatch]) -> float | None:
        """The mean loss of ``batches`` (this rank's shares) by the schedule's forwards only, without
        gradients; on the last stage (None on the others)."""
        with torch.no_grad():
            out = self._schedule(batches, forward_only=True)
        if not out:
            return None
        return float(torch.stack([d["loss"] for d in out]).mean())

    def state_bytes(self) -> int:
        """What lives across steps and is not in a step's trace: the parameters, AdamW's two moments of
        each, and megatron DDP's gradient buffers (made when the chunks were wrapped)."""
        params = sum(p.numel() * p.element_size() for c in self.chunks for p in c.parameters())
        return 3 * params + self.ddp_buffer_bytes()

    def ddp_buffer_bytes(self) -> int:
        """Bytes of megatron DDP's contiguous gradient buffers."""
        total = 0
        for d in self.ddp or ():
            for buffer in list(getattr(d, "buffers", [])) + list(getattr(d, "expert_parallel_buffers", [])):
                grad = getattr(buffer, "grad_data", None)
                if grad is not None:
                    total += grad.numel() * grad.element_size()
        return total

    def _forward_backward(self) -> list[dict[str, torch.Tensor]]:
        """The schedule's forwards and backwards of the micro-batches from zero gradients; what the last
        stage's loss functions reported."""
        if self.ddp is not None:
            for d in self.ddp:
                d.zero_grad_buffer()
        return self._schedule(self.batches)

    def _schedule(self, batches: list[MicroBatch], forward_only: bool = False
                  ) -> list[dict[str, torch.Tensor]]:
        """megatron's schedule over ``batches``; what the last stage's loss functions reported."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected here
            from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=_forward_step(self.layout),
            data_iterator=[iter(batches) for _ in self.chunks],
            model=self.ddp if self.ddp is not None else self.chunks, num_microbatches=len(batches),
            seq_length=self.seq_len,  # megatron divides by CP (and TP under SP)
            micro_batch_size=batches[0][0].shape[0], forward_only=forward_only)
