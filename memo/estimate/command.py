"""The command that launches an estimate's answer: ``torchrun ... -m memo train ...``.

NOTE [The launch command of an answer]
Every answer of ``memo estimate`` (one layout, a ranked search, the longest sequence per strategy)
comes with the one command that trains it, built here and nowhere else, so that what is printed
and what the JSON's ``"command"`` holds cannot drift apart. The layout's engine is the one NOTE
[Which engine runs which layout] in planner/engines.py names for it. The flags say what the estimate
assumed, where ``memo train``'s defaults would differ:

- ``--tp T --sp``: the estimate counts a tensor-parallel rank with sequence parallelism;
- ``--pp P --micro-batches P``: the 1F1B step the estimate records holds P micro-batches on the
  first stage (NOTE [First stage under 1F1B] in memo/estimate/plan_method.py);
- ``--micro-batch b·d``: ``memo train``'s ``--micro-batch`` is the global batch, which its d
  data-parallel ranks split, and the estimate's b is one rank's;
- ``--offload-states``: FSDP2's states in host memory (sharding ``full-offload``);
- ``--ulysses-head-chunks N``: Ulysses over the layout's chunks of heads, where it is not memo
  train's default (NOTE [Head chunks in an estimate] in memo/estimate/meta_ulysses.py);
- ``--dtype``, ``--device cuda``, ``--device-mem-gb``, ``--host-mem-gb``: ``memo train`` defaults to
  float32 on the CPU and to the memory it finds; the answer holds for the estimate's dtype and
  machine, so its plan is made for those;
- ``--gpus-per-node``, where it differs from the processes per node: the estimate shares a node's
  host memory between that many GPUs, ``memo train`` by default between its local processes.

One node is ``torchrun --standalone``; more (N above ``--gpus-per-node``) take the fewest nodes with
the same number of processes each, and a c10d rendezvous at :data:`RDZV_ENDPOINT`, whose host the
user replaces with the first node's address.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from memo.errors import MemoError
from memo.estimate.layout import ParallelLayout
from memo.planner.vocab import Sharding

if TYPE_CHECKING:
    from memo.estimate.core import Estimator

__all__ = ["RDZV_ENDPOINT", "launch_argv", "launch_command", "nodes"]

#: The rendezvous of a job over several nodes: HOST stands for the first node's address.
RDZV_ENDPOINT = "HOST:29500"


def nodes(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node) of ``gpus`` GPUs on nodes of ``gpus_per_node``: the fewest nodes
    that hold them with the same number of processes each (torchrun starts as many on every node)."""
    count = -(-gpus // gpus_per_node)
    while gpus % count:
        count += 1
    return count, gpus // count


def launch_argv(estimator: Estimator, layout: ParallelLayout, seq_len: int, strategy: str) -> list[str]:
    """The command that trains ``estimator``'s model on ``layout`` at ``seq_len`` tokens under
    ``strategy``, as an argument list (NOTE [The launch command of an answer])."""
    engine = layout.engine
    if engine is None:
        raise MemoError(f"memo estimate: {layout.launch_problem()}")
    machine = estimator.machine
    count, per_node = nodes(layout.gpus, machine.gpus_per_node)
    if count == 1:
        argv = ["torchrun", "--standalone", "--nproc-per-node", str(per_node)]
    else:
        argv = ["torchrun", "--nnodes", str(count), "--nproc-per-node", str(per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", RDZV_ENDPOINT]
    argv += ["-m", "memo", "train", "--engine", engine]
    if layout.tp > 1:
        argv += ["--tp", str(layout.tp), "--sp"]
    if layout.cp > 1:
        argv += ["--cp", str(layout.cp), "--cp-comm", str(layout.cp_comm)]
    if layout.head_chunks is not None:
        argv += ["--ulysses-head-chunks", str(layout.head_chunks)]
    if layout.pp > 1:
        argv += ["--pp", str(layout.pp), "--micro-batches", str(layout.pp)]
    if layout.dp > 1:
        argv += ["--dp", str(layout.dp)]
    if layout.sharding == Sharding.FULL_OFFLOAD:
        argv.append("--offload-states")
    argv += ["--model", estimator.model, "--seq-len", str(seq_len)]
    if layout.micro_batch * layout.dp > 1:
        argv += ["--micro-batch", str(layout.micro_batch * layout.dp)]
    argv += ["--strategy", strategy, "--dtype", str(estimator.dtype).removeprefix("torch."),
             "--device", "cuda", "--device-mem-gb", f"{machine.device_mem_gb:g}",
             "--host-mem-gb", f"{machine.host_mem_gb:g}"]
    if machine.gpus_per_node != per_node:
        argv += ["--gpus-per-node", str(machine.gpus_per_node)]
    return argv


def launch_command(estimator: Estimator, layout: ParallelLayout, seq_len: int, strategy: str) -> str:
    """:func:`launch_argv` as one shell line."""
    return shlex.join(launch_argv(estimator, layout, seq_len, strategy))
