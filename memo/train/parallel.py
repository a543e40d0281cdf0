"""What :func:`memo.train.train` adds for one rank of a parallel job (NOTE [Parallel layout] in
memo/distributed/layout.py): the rank's start, its share of each batch and of the loss, the
agreement every rank checks before the steps, and the record of every rank's numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memo.models import get_config
from memo.planner.vocab import Sharding
from memo.train.data import Batch

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelRun
    from memo.models import ModelConfig
    from memo.train.config import TrainConfig, TrainResult
    from memo.train.strategies import Strategy

__all__ = ["ParallelLoss", "Sharded", "agree", "parallel_record", "ranks_text", "shard_batch",
           "start_parallel"]


def ranks_text(n: int) -> str:
    return "1 rank" if n == 1 else f"{n} ranks"


def start_parallel(config: TrainConfig) -> ParallelRun | None:
    """This rank's :class:`memo.distributed.layout.ParallelRun`, or None for a single-process run.

    Every check is made from the arguments and the launch environment before any process group
    exists (NOTE [Checks before any process group]).
    """
    from memo.distributed.layout import LaunchEnv, ParallelRun, check_layout, resolve_layout

    launch = LaunchEnv.from_environ()
    layout = resolve_layout(config.tensor_parallel, config.context_parallel, config.data_parallel,
                            config.sequence_parallel, launch.world_size, config.cp_comm,
                            config.pipeline_parallel, config.virtual_pipeline)
    if config.engine == "fsdp2":  # a world of one too: FSDP2 needs a process group (distributed/fsdp2.py)
        from memo.distributed.fsdp2 import FSDP2Run

        # NOTE [One layout type] in memo/distributed/parallel_layout.py: FSDP2 shards every state
        layout = dataclasses.replace(layout, sharding=Sharding.FULL_OFFLOAD if config.offload_states
                                     else Sharding.FULL)
        heads = _heads(config) if layout.context_parallel > 1 else (1, 1)  # Ulysses shares them out
        check_layout(layout, engine="fsdp2", n_heads=heads[0], n_query_groups=heads[1], vocab_size=1,
                     seq_len=config.seq_len, micro_batch=config.micro_batch)
        return FSDP2Run.start(layout, launch, config.device, config.seed, config.offload_states,
                              config.ulysses_head_chunks)
    megatron = config.engine == "megatron"  # memo's model or a --hf-model checkpoint converted to it
    if layout.world == 1 and not layout.sequence_parallel and not (launch.launched and megatron):
        # One process (megatron's world of one: memo/engines.py). Under torchrun a
        # megatron world of one is a distributed run (NCCL on a GPU); memo's and Hugging Face's
        # models have no parallel layers and run as one process whatever launched them.
        return None
    if config.engine != "megatron":  # refused first by check_layout
        check_layout(layout, engine="hf" if config.hugging_face else config.engine, n_heads=1,
                     n_query_groups=1, vocab_size=1, seq_len=1, micro_batch=1)
    shapes = get_config(config.model) if config.hf_model is None else _checkpoint_shapes(config)
    check_layout(layout, engine=config.engine, n_heads=shapes.n_heads,
                 n_query_groups=shapes.n_kv_heads or shapes.n_heads, vocab_size=shapes.vocab_size,
                 seq_len=config.seq_len, micro_batch=config.micro_batch, n_layers=shapes.n_layers,
                 micro_batches=config.micro_batches, ffn_hidden=shapes.ffn_hidden or 0)
    return ParallelRun.start(layout, launch, config.device, config.seed)


def _checkpoint_shapes(config: TrainConfig) -> ModelConfig:
    """The shapes of megatron's model of the ``--hf-model`` checkpoint (memo/adapters/megatron_hf.py)."""
    from memo.adapters.megatron_hf import megatron_shapes
    from memo.engines import hf_checkpoint_config

    hf = hf_checkpoint_config(str(config.hf_model), config.rope_theta, config.rope_scaling)
    return megatron_shapes(hf, f"memo.train: --hf-model {config.hf_model!r}")


def _heads(config: TrainConfig) -> tuple[int, int]:
    """The query and key/value heads of the model ``config`` trains (memo's, or the HF config's)."""
    if not config.hugging_face:
        shapes = get_config(config.model)
        return shapes.n_heads, shapes.n_kv_heads or shapes.n_heads
    from memo.engines import hf_checkpoint_config, hf_config

    hf = hf_config(config.hf_config) if config.hf_model is None else hf_checkpoint_config(config.hf_model)
    heads = int(getattr(hf, "num_attention_heads", 1) or 1)
    return heads, int(getattr(hf, "num_key_value_heads", None) or heads)


@dataclass
class ParallelLoss:
    """One step's loss and gradients on a rank of a parallel job (NOTE [Parallel layout])."""

    parallel: ParallelRun
    positions: torch.Tensor
    global_count: int
    documents: torch.Tensor | None = None
    """The shard's position ids of packed documents (NOTE [Packed documents] in memo/train/corpus.py)."""

    def loss(self, model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.documents is None:
            return self.parallel.loss(model, ids, labels, self.positions, self.global_count)
        return self.parallel.loss(model, ids, labels, self.positions, self.global_count,
                                  documents=self.documents)  # type: ignore[call-arg]  # FSDP2Run's

    def zero_grads(self) -> None:
        self.parallel.zero_grads()

    def finish_grads(self, model: torch.nn.Module) -> None:
        self.parallel.finish_grads(model)


class Sharded:
    """The global batches of a token source, each cut to this rank's share (NOTE [Parallel layout]):
    yields ``(ids, labels, position_ids)`` and keeps the global batch's counted tokens in ``count``. A
    source of packed documents (batches ``(ids, labels, document positions)``, NOTE [Packed documents] in
    memo/train/corpus.py) adds the rank's cut of its document positions, ``(ids, labels, position_ids,
    document positions)``; only an FSDP2 run takes them (megatron gets no packed data: TrainConfig)."""

    def __init__(self, batches: Iterator[Batch], parallel: ParallelRun) -> None:
        self.batches, self.parallel = batches, parallel
        self.count = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        batch = next(self.batches)
        self.count = int((batch[1] != -100).sum())
        return shard_batch(self.parallel, batch)


def shard_batch(parallel: ParallelRun, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """This rank's share of a global batch (:class:`Sharded`): ``(ids, labels, position_ids)``, plus the
    rank's cut of the document positions of packed documents, cut like the ids (the same rows and tokens)."""
    ids, labels, *documents = batch
    shard = parallel.shard(ids, labels)
    if documents:
        shard = (*shard, parallel.shard(documents[0], documents[0])[0])
    return shard


def agree(parallel: ParallelRun, strategy: Strategy, emit: Callable[[str], None]) -> None:
    """Every rank runs the same strategy, alpha, layer policy and plan, or every rank stops
    (NOTE [Checks before any process group])."""
    from memo.distributed.layout import plan_fingerprint, requests_fingerprint

    policy = getattr(strategy, "policy", None)
    record = {"layout": parallel.as_dict(), "strategy": strategy.name,
              "alpha": None if strategy.alpha is None else round(float(strategy.alpha), 12),
              "policy": None if policy is None else list(policy),
              "plan": plan_fingerprint(strategy.plan)}
    if getattr(getattr(strategy, "options", None), "plan", None) is None:
        # each rank profiled: its plan is its own shard's (a --plan file must be the same everywhere)
        record["plan_made_from"] = requests_fingerprint(strategy.plan)
    parallel.agree(record)
    emit(f"memo.distributed: {ranks_text(parallel.layout.world)} ({parallel.layout}) agree on strategy "
         f"{strategy.name}" + ("" if strategy.alpha is None else f", alpha {strategy.alpha:.4f}")
         + ("" if strategy.plan is None else f", plan {plan_fingerprint(strategy.plan)}"))


def parallel_record(parallel: ParallelRun, result: TrainResult) -> dict[str, Any]:
    """The layout and every rank's device peak and host bytes, gathered on every rank (a collective)."""
    extras = result.steps[-1].extras if result.steps else {}
    peak = max((s.peak_memory_bytes or 0) for s in result.steps) if result.steps else None
    mine = {"rank": parallel.rank, "tp_rank": parallel.tp_rank, "cp_rank": parallel.cp_rank,
            "dp_rank": parallel.dp_rank, "peak_device_bytes": peak,
            "peak_device_kind": result.peak_memory_kind,
            "host_pinned_bytes": int(extras.get("host_pinned_bytes", 0))}
    chunks = {"ulysses_head_chunks": result.config.ulysses_head_chunks} if result.config.ulysses_head_chunks \
        else {}  # NOTE [Ulysses over chunks of heads]: asked for by --ulysses-head-chunks
    return {**parallel.as_dict(), **chunks, "ranks": parallel.gather(mine)}
