"""``memo train --engine fsdp2``: the model states sharded by PyTorch FSDP2, data parallel over the ranks,
with Ulysses context parallelism (``--cp C --cp-comm a2a``) inside groups of C consecutive ranks.

Every rank builds the same model from the same seed (memo's reference models or a Hugging Face
causal LM), shards it with ``torch.distributed.fsdp.fully_shard`` (each transformer layer, then
the root; ``CPUOffloadPolicy`` with ``--offload-states``) over a one-dimensional device mesh of all
ranks, and takes its rows of each global batch as megatron's data-parallel ranks do (NOTE
[Parallel layout] in memo/distributed/layout.py): DP rank d keeps rows ``d·b/dp .. (d+1)·b/dp``,
back-propagates its tokens' summed loss over the global count times ``dp``, and FSDP2's
reduce-scatter averages the gradients over the ``dp`` ranks, so every shard's gradient is the
single-process one. One process without ``torchrun`` is a world of one (a gloo or NCCL group
of one on a free port), so the same code path runs.

NOTE [FSDP2 x Ulysses]
With ``--cp C`` the world is a (DP, CP) grid, rank = d·C + r. FSDP2 shards every state over all
ranks of the world, flattened (a one-dimensional mesh of the world is that flattening, as torchtitan
flattens its dp_shard x cp mesh), and each CP group of C consecutive ranks runs Ulysses attention
(memo/distributed/ulysses.py): CP rank r holds tokens ``[r·s/C, (r+1)·s/C)`` of its DP rows, labels
cut the same way after the caller shifted them. Every rank back-propagates its tokens' summed loss
over the global count times DP·C, and FSDP2's reduce-scatter averages over the DP·C ranks, so each
shard's gradient is the single-process one; a rank whose tokens are all -100 still runs its forward
and backward (its exchanges pair with its group's) and adds zero. K/V all-gather CP is not run under
FSDP2 (NOTE [Which engine runs which layout] in planner/engines.py).

NOTE [memo under FSDP2]
The order is memo first, FSDP2 second, as with activation checkpointing (checkpoint the layer,
then ``fully_shard`` it)::

    memo.wrap(model, plan=plan)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

and ``memo.wrap`` after ``fully_shard`` works the same (``memo train`` does that: its Session wraps
the model the engine built). Why both are correct:

- Neither changes the module tree. memo sets an instance ``forward`` on each layer (NOTE
  [Wrapping in place] in memo/runtime/wrap.py); ``fully_shard`` swaps the layer's class for an
  FSDP subclass of it (memo's layer adapter is found through its bases) and adds module hooks.
  ``nn.Module.__call__`` runs the hooks around whatever ``forward`` is, so in either order memo's
  forward runs between FSDP2's pre-forward (all-gather, the unsharded parameters registered on
  the module) and its post-forward (reshard: the unsharded parameters' storage freed).
- Forward: memo's node takes the layer's parameters as it finds them when it runs (the gathered
  ones) and records which tensor each name held (NOTE [Recompute with the forward's tensors] in
  memo/runtime/module_state.py). The packer keeps parameters by reference, never copies them.
- Backward: FSDP2's pre-backward hook sits on the layer's output, so it fires when that output's
  gradient is ready, before memo's node runs; it all-gathers into the same storages and registers
  the same unsharded parameters again. memo's recompute therefore runs with gathered parameters
  (``as_in_forward`` finds the forward's tensors in place and swaps nothing). A parameter whose
  storage is still freed when memo's backward starts is refused with a MemoError rather than read
  (``LayerCall.backward``).
- Gradients: memo's node returns the parameters' gradients to the autograd engine (NOTE
  [Gradients through the engine] in memo/runtime/layer.py), which accumulates them into the
  unsharded parameters' ``.grad`` (AccumulateGrad nodes run before any other ready node); FSDP2's
  post-backward, on the layer's inputs, then reduce-scatters them into the shards' ``.grad``. memo
  writes no ``.grad`` itself, so no gradient passes around the reduce-scatter.
- Outside a layer's call: memo's sizing dry run of a layer gathers it with FSDP2's own
  ``unshard()``/``reshard()`` (NOTE [Dry runs under FSDP2] in memo/runtime/module_state.py), and a
  forward that memo stops at the first layer is followed by FSDP2's ``reset_iter_state()`` (NOTE
  [An aborted forward under FSDP2] below).

tests/distributed/test_fsdp2.py checks both orders against one process's gradients, with and without CPU
offload, and that memo's recompute sees the gathered parameters while they are freed between
forward and backward.

NOTE [FSDP2's root is the loss]
FSDP2 gathers the parameters of the root's own group (embedding, final norm, LM head) in the root's
pre-forward hook, so the root's ``forward`` must be what computes the loss. A model adapter's loss
need not call the model's ``forward`` (Hugging Face's calls ``model.model`` and then memo's chunked
loss head), so the root here is a small module holding the model whose forward is the model adapter's
loss; the model's own module tree, state dict and parameters are unchanged.

NOTE [FSDP2's gathered parameters on the CPU backend]
FSDP2 allocates each parameter's all-gather output once and afterwards only resizes its storage
(``storage.resize_``: to 0 after the layer, back to its size before the next use). A CPU storage
resizes through the allocator it was made by, not the one installed at the time. memo's CPU backend
stands in for a device whose memory is what memo's allocator serves, and it is installed only
inside a Session or a profile's recording; outside them, FSDP2's first all-gather would make those
storages with PyTorch's CPU allocator, and every later gather would pass memo's trace, plan and
measured peak by. So right after sharding, every FSDP2 module gathers and reshards once under memo's
allocator (its fallback pool, no plan): the storages are then memo's, and each gathered layer is an
allocation the trace records and the plan places. (On CUDA memo's allocator, when used, is PyTorch's
CUDA allocator for the whole process, installed before the first CUDA tensor: nothing to do.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.adapters.model import ModelAdapter, ModelParts, adapter_loss, model_adapter_for
from memo.distributed.layout import (
    LaunchEnv,
    ParallelLayout,
    ParallelRun,
    join_process_group,
    rank_device,
)
from memo.errors import MemoError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDP2Run", "LossRoot", "fsdp_modules", "shard_model"]


class LossRoot(nn.Module):
    """FSDP2's root around ``model``: its forward is the model adapter's loss (NOTE [FSDP2's root is
    the loss]). ``ids, labels: [b, s]`` (``positions``: of packed documents, or None) -> the mean loss
    over the counted tokens."""

    def __init__(self, model: nn.Module, adapter: ModelAdapter) -> None:
        super().__init__()
        self.model = model
        self._adapter = adapter

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        return adapter_loss(self._adapter, self.model, ids, labels, positions)


def shard_model(model: nn.Module, mesh: DeviceMesh | None, offload_states: bool = False,
                device: torch.device | None = None) -> LossRoot:
    """``fully_shard`` each of ``model``'s layers (its model adapter's) and then a :class:`LossRoot`
    around it, over ``mesh``; ``CPUOffloadPolicy`` when ``offload_states`` (pinned host memory where
    the device is CUDA). Returns the root, whose call is the loss."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    adapter = model_adapter_for(model, "memo.train")
    parts = adapter.parts(model)
    pin = device is not None and device.type == "cuda"
    policy = CPUOffloadPolicy(pin_memory=pin) if offload_states else OffloadPolicy()
    for layer in parts.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    return fully_shard(LossRoot(model, adapter), mesh=mesh, offload_policy=policy)


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The modules under ``module`` (itself included) that ``fully_shard`` has sharded."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _bind_gathers_to_memo(root: nn.Module) -> None:
    """NOTE [FSDP2's gathered parameters on the CPU backend]: gather and reshard every FSDP2 module
    once under memo's CPU allocator, so that every later gather is memo's."""
    from memo import allocator

    with allocator.planned({}, peak=0, device="cpu"):
        for module in fsdp_modules(root):
            module.unshard()
            module.reshard()


class _ShardLoss(ModelAdapter):
    """The model's own adapter, with this rank's step loss (:meth:`FSDP2Run.loss`) as its loss: memo's
    profile then records the iteration every step runs (as ``ParallelRun.model_adapter``)."""

    name = "fsdp2-shard"

    def __init__(self, run: FSDP2Run, base: ModelAdapter, positions: torch.Tensor, global_count: int,
                 documents: torch.Tensor | None = None) -> None:
        self.run, self.base = run, base
        self.positions, self.global_count, self.documents = positions, global_count, documents

    def check(self, model: nn.Module) -> None:
        self.base.check(model)

    def parts(self, model: nn.Module) -> ModelParts:
        return self.base.parts(model)

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.run.loss(model, ids, labels, self.positions, self.global_count, self.documents)[0]

    def targets(self, model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        return self.base.targets(model, labels)

    def vocab_size(self, model: nn.Module) -> int:
        return self.base.vocab_size(model)


class FSDP2Run(ParallelRun):
    """One rank of ``memo train --engine fsdp2`` (the module docstring): a data-parallel
    :class:`ParallelRun` whose model states FSDP2 shards, with Ulysses context parallelism inside
    each group of ``cp`` consecutive ranks (NOTE [FSDP2 x Ulysses]); no megatron state."""

    def __init__(self, layout: ParallelLayout, launch: LaunchEnv, device: torch.device,
                 offload_states: bool = False, head_chunks: int | None = None) -> None:
        super().__init__(layout, launch, device)
        self.offload_states = offload_states
        #: Ulysses' chunks of heads (None: the default count; NOTE [Ulysses over chunks of heads]).
        self.head_chunks = head_chunks
        cp = layout.context_parallel
        self.dp_rank, self.cp_rank = launch.rank // cp, launch.rank % cp
        self.mesh: DeviceMesh | None = None
        self.cp_group: ProcessGroup | None = None
        self.root: nn.Module | None = None

    @classmethod
    def start(cls, layout: ParallelLayout, launch: LaunchEnv, device: str, seed: int,
              offload_states: bool = False, head_chunks: int | None = None) -> FSDP2Run:
        """Join the process group (gloo on CPU, NCCL on CUDA; a group of one on a free port when no
        launcher made one), make the device mesh of all ranks FSDP2 shards over and, with context
        parallelism, the (DP, CP) mesh whose CP groups run Ulysses; ``layout`` was checked by
        :func:`memo.distributed.layout.check_layout`. ``seed`` is the caller's."""
        run = cls(layout, launch, rank_device(device, launch), offload_states, head_chunks)
        run._owns_group = join_process_group(launch, run.device)
        from torch.distributed.device_mesh import init_device_mesh

        run.mesh = init_device_mesh(run.device.type, (launch.world_size,))
        if layout.context_parallel > 1:
            grid = init_device_mesh(run.device.type, (layout.data_parallel, layout.context_parallel),
                                    mesh_dim_names=("dp", "cp"))
            run.cp_group = grid.get_group("cp")
        return run

    def close(self) -> None:
        """Let go of the model and destroy the process group when this run made it."""
        # The model adapter given for the model (memo.adapters.model.use_model_adapter, a weak key)
        # holds this run: through the root it would hold the model, its key, alive for good.
        self.root = None
        if self._owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._owns_group = False

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "engine": "fsdp2", "offload_states": self.offload_states}

    def wrap(self, model: nn.Module) -> None:
        """Make ``model`` a Ulysses rank with context parallelism (memo/distributed/ulysses.py), then
        shard it with FSDP2 (:func:`shard_model`); on the CPU, bind its gathers to memo's allocator
        (NOTE [FSDP2's gathered parameters on the CPU backend])."""
        if self.cp_group is not None:
            from memo.distributed.ulysses import shard_sequence

            shard_sequence(model, self.cp_group, self.head_chunks)
        self.root = shard_model(model, self.mesh, self.offload_states, self.device)
        if self.device.type == "cpu":
            _bind_gathers_to_memo(self.root)

    def token_index(self, s: int) -> torch.Tensor:
        """The contiguous tokens ``[r·s/c, (r+1)·s/c)`` of CP rank r (labels already shifted when the
        batch is cut: NOTE [Contiguous Ulysses] in memo/models/ulysses_attention.py)."""
        cp = self.layout.context_parallel
        return torch.arange(self.cp_rank * s // cp, (self.cp_rank + 1) * s // cp)

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
             global_count: int, documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(to_backward, global_loss)`` as :meth:`ParallelRun.loss` (NOTE [Parallel layout]): the root's
        mean over this rank's counted tokens times their count is its sum; FSDP2's reduce-scatter
        averages over all ``dp·cp`` ranks, so the rank back-propagates its sum over the global count
        times ``dp·cp``. ``positions`` are implied by the shard (the model knows its first position);
        ``documents``: the shard's position ids of packed documents (NOTE [Packed documents] in
        memo/train/corpus.py), handed to the model."""
        if self.root is None:
            raise MemoError("memo.distributed: FSDP2Run.loss before wrap(model); shard the model first")
        count = int((labels != -100).sum())
        if count == 0:
            # A rank whose tokens are all -100 (padding at the end of a long sequence) adds nothing, but
            # its forward and backward must still run: its Ulysses exchanges and FSDP2's collectives
            # pair with the other ranks'. One counted token makes the mean finite; times 0 it adds 0.
            labels = labels.clone()
            labels.view(-1)[0] = 0
        try:
            local = self.root(ids, labels, documents) * count
        except BaseException:
            # NOTE [An aborted forward under FSDP2]
            # A forward can end early on purpose: memo stops the model's forward at its first layer to
            # take that layer's inputs (NOTE [First layer's inputs] in memo/profiler/record.py). FSDP2
            # would keep what it had gathered registered on the modules (the unsharded parameters of
            # the root and the first layer), and an optimizer built then would hold those instead of
            # the shards and never update them. FSDP2's recovery after an aborted forward is
            # reset_iter_state() on the root: every group resharded, its iteration state cleared.
            self.root.reset_iter_state()
            raise
        total = local.detach().clone()
        ranks = self.layout.data_parallel * self.layout.context_parallel
        if ranks > 1:
            torch.distributed.all_reduce(total)
        scale = max(global_count, 1)
        return local * (ranks / scale), total / scale

    def model_adapter(self, positions: torch.Tensor, global_count: int,
                      documents: torch.Tensor | None = None) -> ModelAdapter:
        if self.root is None:
            raise MemoError("memo.distributed: FSDP2Run.model_adapter before wrap(model)")
        return _ShardLoss(self, self.root._adapter, positions, global_count, documents)

    def optimizer_group(self) -> None:
        """None: FSDP2 already shards every state, the optimizer's with the parameters."""
        return None

    def zero_grads(self) -> None:
        """Nothing: the optimizer sets the shards' gradients to None."""

    def finish_grads(self, model: nn.Module) -> None:
        """Nothing: FSDP2 reduce-scattered the gradients into the shards' ``.grad`` in backward."""
