"""Which engine of ``memo train`` runs which layout family: the one table the layout checks of
``memo train`` and the layouts ``memo estimate`` answers with both read (torch-free; re-exported by
memo/engines.py).

NOTE [Which engine runs which layout]
The one table of the layout families ``memo train`` can launch, read by ``memo train`` (its checks
before any process group, memo/distributed/layout.py) and by ``memo estimate`` (it ranks and returns
only these, and prints the command that launches each). A family is the engine, whether tensor
(with sequence) and pipeline parallelism are used, how the context-parallel ranks communicate and
how the model states are sharded (planner/vocab.py's Sharding):

- megatron: megatron-core's parallel layers (TP with SP, PP, CP by K/V all-gather or Ulysses
  all-to-all), megatron's DistributedDataParallel, and the optimizer states sharded over the
  DP x CP ranks (ZeRO-1: torch's ZeroRedundancyOptimizer, memo/train/loop.py);
- fsdp2: PyTorch's FSDP2 over a (DP, CP) mesh: every state sharded over all DP x CP ranks (ZeRO-3),
  in host memory with --offload-states, and Ulysses CP (memo/distributed/fsdp2.py). No TP or PP,
  and no K/V all-gather: its load-balanced layout needs position ids of two chunks, which memo's
  reference models and HF's do not take per tile; Ulysses needs none (contiguous tokens). Its
  Ulysses runs memo's core attention on memo's models, over any count of head chunks the heads
  split into (--ulysses-head-chunks, NOTE [Ulysses over chunks of heads] in
  memo/models/ulysses_attention.py); megatron's runs memo train's default count only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .vocab import CPComm, Sharding

__all__ = ["RUNNABLE", "EngineLayouts", "engine_for_layout", "layout_problem"]


@dataclass(frozen=True)
class EngineLayouts:
    """The layouts one engine of ``memo train`` runs (NOTE [Which engine runs which layout])."""

    engine: str
    tensor_parallel: bool
    """TP > 1 (with sequence parallelism, as the estimate counts it)."""
    pipeline_parallel: bool
    """PP > 1."""
    cp_comms: tuple[CPComm, ...]
    """Context-parallel communications it runs when CP > 1."""
    shardings: tuple[Sharding, ...]
    """How it shards the model states (planner/vocab.py's Sharding)."""
    head_chunks: bool
    """Ulysses over a chosen count of head chunks (``--ulysses-head-chunks``)."""


RUNNABLE: tuple[EngineLayouts, ...] = (
    EngineLayouts("megatron", True, True, (CPComm.ALL_GATHER, CPComm.A2A), (Sharding.OPTIMIZER,), False),
    EngineLayouts("fsdp2", False, False, (CPComm.A2A,), (Sharding.FULL, Sharding.FULL_OFFLOAD), True),
)


def layout_problem(engine: str, *, tp: int = 1, cp: int = 1, pp: int = 1, cp_comm: str = CPComm.ALL_GATHER,
                   sharding: str | None = None, sp: bool = False,
                   head_chunks: int | None = None) -> str | None:
    """Why ``engine`` cannot run this layout family (NOTE [Which engine runs which layout]), or None.
    ``sharding`` None: any of the engine's; ``sp``: sequence parallelism, which splits a tensor-parallel
    group's tokens; ``head_chunks``: Ulysses' chunks of heads, None for the default."""
    table = {row.engine: row for row in RUNNABLE}
    row = table.get(engine)
    if row is None:
        return f"--engine {engine} builds one process's model (no parallel layers); use {' or '.join(table)}"
    if (tp > 1 or sp) and not row.tensor_parallel:
        flag = f"--tp {tp}" if tp > 1 else "--sp"
        return f"--engine {engine} runs no tensor parallelism ({flag}); use --engine megatron"
    if pp > 1 and not row.pipeline_parallel:
        return f"--engine {engine} runs no pipeline stages (--pp {pp}); use --engine megatron"
    if cp > 1 and cp_comm not in row.cp_comms:
        return (f"--engine {engine} runs context parallelism by {' or '.join(row.cp_comms)}, not "
                f"{cp_comm} (--cp-comm {' / '.join(row.cp_comms)}, or --engine megatron)")
    if sharding is not None and sharding not in row.shardings:
        return f"--engine {engine} shards the model states as {' or '.join(row.shardings)}, not {sharding}"
    if head_chunks is not None and not row.head_chunks:
        return (f"--engine {engine} runs Ulysses over its default chunks of heads, not "
                f"--ulysses-head-chunks {head_chunks} (--engine fsdp2 does)")
    return None


def engine_for_layout(*, tp: int = 1, cp: int = 1, pp: int = 1, cp_comm: str = CPComm.ALL_GATHER,
                      sharding: str = Sharding.OPTIMIZER, head_chunks: int | None = None) -> str | None:
    """The engine of :data:`RUNNABLE` that runs this layout family, or None when none does."""
    for row in RUNNABLE:
        if layout_problem(row.engine, tp=tp, cp=cp, pp=pp, cp_comm=cp_comm, sharding=sharding,
                          head_chunks=head_chunks) is None:
            return row.engine
    return None
