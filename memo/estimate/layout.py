"""The estimate's layouts: N GPUs as TP x CP x PP x DP with a micro-batch, made by :func:`Layout` as the
one layout type, :class:`memo.distributed.parallel_layout.ParallelLayout` (NOTE [One layout type] there),
and every one of them an engine of ``memo train`` launches (:func:`valid_layouts`).

NOTE [Layouts memo train launches]
The estimate answers only with layouts an engine of ``memo train`` launches (NOTE [Which engine runs
which layout] in planner/engines.py): :func:`valid_layouts` leaves the others out, so no search ranks or
returns one, and :meth:`ParallelLayout.check` refuses one asked for by name, with the table's reasons; a
strategy ``memo train`` does not run on a layout is refused likewise (``strategy_problem`` in
memo/estimate/core.py). A memory number for a layout nobody can run answers no one's question, and a
search that ranked it first would send its user to a command that fails before the first step.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from memo.distributed.parallel_layout import ParallelLayout, size_problem
from memo.errors import MemoError
from memo.planner.vocab import CP_COMMS, SHARDINGS, CPComm, Sharding

if TYPE_CHECKING:
    from memo.models.config import ModelConfig

__all__ = ["CP_COMMS", "SHARDINGS", "Layout", "ParallelLayout", "divisors", "valid_layouts"]

# Model-state shardings (NOTE [Sharded model states] in memo/estimate/core.py) and context-parallel
# communications a layout may use: planner/vocab.py.


def Layout(gpus: int, tp: int = 1, cp: int = 1, pp: int = 1, micro_batch: int = 1,
           cp_comm: str = CPComm.ALL_GATHER, sharding: str = Sharding.OPTIMIZER,
           head_chunks: int | None = None) -> ParallelLayout:
    """The :class:`ParallelLayout` of ``gpus`` GPUs as ``tp`` x ``cp`` x ``pp`` x DP, DP = N / (t·c·p):
    the estimate's way to make the one layout type (a factory, not a class: NOTE [One layout type] in
    memo/distributed/parallel_layout.py). TP > 1 comes with sequence parallelism, as the estimate counts a
    tensor-parallel rank and its launch command runs it (``--sp``)."""
    for flag, value in (("--gpus", gpus), ("--tp", tp), ("--cp", cp), ("--pp", pp)):
        problem = size_problem(flag, value)
        if problem is not None:
            raise MemoError(f"memo estimate: {problem}")
    group = tp * cp * pp
    if gpus % group:
        raise MemoError(
            f"memo estimate: TP {tp} x CP {cp} x PP {pp} = {group} GPUs does not divide the {gpus} GPUs, so "
            f"the data-parallel size N / (T·C·P) is not whole; choose sizes whose product divides {gpus} (or "
            "--search for the valid ones)")
    return ParallelLayout(tensor_parallel=tp, context_parallel=cp, data_parallel=gpus // group,
                          sequence_parallel=tp > 1, cp_comm=cp_comm, pipeline_parallel=pp,
                          micro_batch=micro_batch, sharding=sharding, head_chunks=head_chunks)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def valid_layouts(config: ModelConfig, gpus: int, seq_len: int | None = None,
                  micro_batches: tuple[int, ...] = (1,), data_parallel_one: bool = False,
                  shardings: tuple[str, ...] = (Sharding.OPTIMIZER,),
                  cp_comms: tuple[str, ...] = (CPComm.ALL_GATHER,)) -> list[ParallelLayout]:
    """Every layout of ``gpus`` GPUs valid for ``config`` (and ``seq_len``: NOTE [Valid layouts] in
    memo/distributed/parallel_layout.py) that
    an engine of ``memo train`` launches (NOTE [Layouts memo train launches]).

    ``data_parallel_one``: only layouts with d = 1 (the longest-sequence search: NOTE [Longest
    sequence layouts] in memo/estimate/search.py)."""
    out = []
    for t in divisors(gpus):
        for c in divisors(gpus // t):
            for p in divisors(gpus // (t * c)):
                if data_parallel_one and t * c * p != gpus:
                    continue
                for b, sharding, comm in itertools.product(micro_batches, shardings, cp_comms):
                    if c == 1 and comm != cp_comms[0]:
                        continue  # one context-parallel rank communicates nothing
                    layout = Layout(gpus, t, c, p, b, comm, sharding)
                    if layout.engine is not None and not layout.problems(config, seq_len):
                        out.append(layout)
    return out
