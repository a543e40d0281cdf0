"""megatron-core pipeline parallelism with memo: a stage's model chunks, wrapped and scheduled.

NOTE [Pipeline stages]
Under megatron-core pipeline parallelism (P stages, and V model chunks per stage with the
interleaved schedule) a rank holds V ``GPTModel`` chunks built with ``pre_process`` (the chunk
that embeds: chunk 0 of stage 0) and ``post_process`` (the chunk that ends in the loss head: chunk
V-1 of stage P-1), and megatron's schedule runs the forwards and backwards of the M micro-batches in
its own order, the tensors between stages sent point to point. What that changes for memo:

* Which layers to offload. Without a plan memo keeps the last two layers of a model whole, since
  their backward follows their forward at once (NOTE [Layer policy] in memo/runtime/runtime.py).
  That holds for the chunk that ends in the loss head, not for any other: a chunk whose output goes
  to the next stage waits for the rest of the pipeline before its backward begins, so each of its
  layers is offloaded (``kept_tail`` in memo/runtime/runtime.py; ``memo.wrap`` asks it of the model
  it wraps, which may be a ``GPTModel`` chunk or its ``decoder``).
* How many forwards are in flight. memo's runtime keeps one host region per forward awaiting its
  backward (NOTE [Forwards in flight] in memo/runtime/buffers.py), so a stage's host memory is its
  layers' bytes times the micro-batches its schedule keeps in flight: :func:`in_flight`.
* Nothing else: each chunk is its own model to ``memo.wrap`` (one runtime per chunk, as each chunk is
  its own module to megatron's DDP), and the schedule calls it as it calls an unwrapped chunk.

NOTE [Batched p2p under gloo]
megatron-core's p2p communication posts a stage's sends and receives with ``batch_isend_irecv`` by
default (``batch_p2p_comm``). Under gloo, when both neighbours of a stage are the same process (P = 2
with the interleaved schedule: the next and the previous stage are the one other rank), gloo pairs the
messages between two processes in the order they were posted, and a batch posts them in an order the
peer does not mirror: activations arrive where gradients are expected and the other way round, with no
error (the unwrapped model's gradients come out 2.6 to 7.0 relative off). Sent one by one
(``batch_p2p_comm=False``), every send meets the receive megatron pairs with it. memo's pipelines turn
batching off wherever the process group is not NCCL's (:func:`pipeline_config`); NCCL keeps it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.adapters.model import ModelAdapter, ModelParts, register_model_adapter
from memo.errors import MemoError

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelLayout

__all__ = ["StageAdapter", "StageModel", "in_flight", "pipeline_config", "whole_model_name"]


def pipeline_config(layout: ParallelLayout, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``layout``'s pipeline (none for one stage): its sizes, the
    dtype of what the stages send, and batched p2p only on CUDA (NOTE [Batched p2p under gloo])."""
    p, v = layout.pipeline_parallel, layout.virtual_pipeline
    if p == 1:
        if v != 1:
            raise MemoError(f"memo.train: --vpp {v} interleaves model chunks over pipeline stages; "
                            "give --pp > 1")
        return {}
    return {"pipeline_model_parallel_size": p, "virtual_pipeline_model_parallel_size": v if v > 1 else None,
            "pipeline_dtype": dtype, "batch_p2p_comm": device.type == "cuda"}


def whole_model_name(chunk: nn.Module, name: str) -> str:
    """The name in the whole model of a chunk's parameter ``name``: a chunk numbers its layers from 0,
    megatron's ``layer_number`` (from 1) is the layer's place in the whole model."""
    if name.startswith("decoder.layers."):
        local, rest = name.removeprefix("decoder.layers.").split(".", 1)
        return f"decoder.layers.{chunk.decoder.layers[int(local)].layer_number - 1}.{rest}"
    return name


def in_flight(stages: int, stage: int, chunks: int, micro_batches: int,
              group: int | None = None) -> list[int]:
    """The most forwards each model chunk of pipeline rank ``stage`` holds awaiting their backward in one
    step of megatron-core's schedule (NOTE [Pipeline stages]): 1F1B for one chunk, else the interleaved
    schedule with micro-batches taken ``group`` at a time per chunk (megatron's
    ``microbatch_group_size_per_vp_stage``, default the number of stages).

    The rank's order is replayed as megatron-core 0.16's schedules run it: its warm-up forwards
    (``stages - stage - 1`` for 1F1B; ``2·(stages - stage - 1) + (chunks - 1)·group`` interleaved, at most
    all of them), then one forward and one backward per step, then the remaining backwards. Forward k
    runs the chunk of the k-th entry of the schedule table (each group's micro-batches on chunk 0, then
    on chunk 1, ...), backward k the mirror chunk of the same entry."""
    if not 0 <= stage < stages or chunks < 1 or micro_batches < 1:
        raise MemoError(f"memo.pipeline: no stage {stage} of {stages} with {chunks} chunk(s) and "
                        f"{micro_batches} micro-batch(es)")
    group = group or stages
    table = []
    for first in range(0, micro_batches, group):
        last = micro_batches if first + group >= micro_batches else first + group
        table += [chunk for chunk in range(chunks) for _ in range(first, last)]
    total = len(table)
    if chunks == 1:
        warmup = stages - stage - 1
    else:
        warmup = 2 * (stages - stage - 1) + (chunks - 1) * group
    warmup = min(warmup, total)
    held, most = [0] * chunks, [0] * chunks

    def forward(k: int) -> None:
        held[table[k]] += 1
        most[table[k]] = max(most[table[k]], held[table[k]])

    def backward(k: int) -> None:
        held[chunks - 1 - table[k]] -= 1

    for k in range(warmup):
        forward(k)
    for i in range(total - warmup):
        forward(warmup + i)
        backward(i)
    return most


# NOTE [A stage's profile]
# memo's profiler records a model through its ModelAdapter: the module whose forward opens the
# embedding phase, the layers, the head modules, and a loss from token ids. A pipeline chunk has
# none of that around its layers unless it is the first (its embedding) or the last (its final norm,
# LM head and loss). :class:`StageModel` gives a chunk that shape for the profile: before a chunk
# that is not the first, an ``entry`` module hands it a fixed random input of the shape the previous
# stage sends (``[s/c (/t under SP), b, h]``, requiring grad, as megatron's received tensor does);
# after a chunk that is not the last, an ``exit`` module turns its output into a scalar whose gradient
# is a fixed random tensor, the stand-in for the gradient the next stage sends back. One forward and
# backward of one micro-batch through the chunk is then recorded as any model's: its layers' S_input,
# S_attn and S_others are the chunk's own (its rank's tokens, TP and CP shards), which is what the
# layer policy's cost model needs: with the forwards its schedule keeps in flight (:func:`in_flight`;
# NOTE [Forwards in flight in the policy] in planner/policy.py) it chooses the stage's layer policy
# and alpha. The address plan of the schedule's interleaved micro-batches is recorded from the stage's
# real step instead (NOTE [A stage's address plan] in memo/pipeline/stage_plan.py).


class _Entry(nn.Module):
    """The stage's input: the tensor the previous stage would send (NOTE [A stage's profile])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Exit(nn.Module):
    """A scalar whose gradient with respect to ``y`` is ``g``: the next stage's gradient, fixed."""

    def forward(self, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (y * g).sum()


class StageModel(nn.Module):
    """One pipeline chunk as memo's profiler takes a model (NOTE [A stage's profile])."""

    def __init__(self, chunk: nn.Module, positions: torch.Tensor, sends: tuple[int, ...],
                 seed: int = 0) -> None:
        super().__init__()
        self.chunk = chunk
        self.entry, self.exit = _Entry(), _Exit()
        self.positions = positions
        self.sends = sends
        self.seed = seed
        self.tensor_parallel = getattr(chunk, "tensor_parallel", 1)

    def _random(self, shape: tuple[int, ...]) -> torch.Tensor:
        p = next(self.chunk.parameters())
        g = torch.Generator().manual_seed(self.seed)
        return torch.randn(shape, generator=g, dtype=torch.float32).to(device=p.device, dtype=p.dtype)

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        chunk = self.chunk
        if not chunk.pre_process:
            x = self.entry(self._random(self.sends).requires_grad_())
            chunk.set_input_tensor(x)
        counted = labels != -100
        out = chunk(ids, self.positions, None, labels=torch.where(counted, labels, 0) if chunk.post_process
                    else None)
        if chunk.post_process:
            weight = counted.to(out.dtype)
            return (out * weight).sum() / weight.sum().clamp(min=1)
        return self.exit(out, self._random(tuple(out.shape)))


class StageAdapter(ModelAdapter):
    """:class:`StageModel`'s parts and loss (NOTE [A stage's profile])."""

    name = "megatron-stage"

    def parts(self, model: nn.Module) -> ModelParts:
        chunk = model.chunk
        entry = chunk.embedding if chunk.pre_process else model.entry
        norm = getattr(chunk.decoder, "final_layernorm", None)
        head = ([m for m in (norm, chunk.output_layer) if m is not None] if chunk.post_process
                else [model.exit])
        return ModelParts(entry, list(chunk.decoder.layers), head)

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss(ids, labels)

    def vocab_size(self, model: nn.Module) -> int:
        return int(model.chunk.vocab_size)


register_model_adapter(StageModel, StageAdapter())
