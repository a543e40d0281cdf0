"""``memo train`` over several processes: the parallel layout, its checks, and one rank's part.

NOTE [Parallel layout]
A job of ``world`` processes (launched by ``torchrun``) is a grid of tensor-parallel (``tp``),
context-parallel (``cp``) and data-parallel (``dp``) ranks, ``tp · cp · dp == world``, in
megatron-core's order (TP fastest, then CP, then DP: ``parallel_state.initialize_model_parallel``).
With ``--sp`` the TP group also splits the tokens between its layers' tensor-parallel blocks
(megatron's sequence parallelism). Every rank builds the same megatron-core ``GPTModel`` from
the same seed on the CPU (``use_cpu_initialization``), so its TP shard is a slice of the
single-process weights, and reads the same global batch (same seed):

- DP rank d keeps batch rows ``d·b/dp .. (d+1)·b/dp``;
- CP rank r keeps chunks r and 2c-1-r of the sequence cut into 2c chunks (megatron's
  load-balanced causal layout, NOTE [Context-parallel profile]); labels and position ids the same;
  the CP ranks' attention all-gathers K and V (``--cp-comm all_gather``) or exchanges heads for
  tokens by all-to-all (``--cp-comm a2a``, NOTE [Ulysses context parallelism] in
  memo/models/ulysses_attention.py), the tokens laid out the same either way;
- TP ranks keep the same tokens.

The loss is the mean over the counted tokens of the *global* batch: each rank sums its tokens'
losses, the sums are all-reduced over the DP x CP ranks and divided by the global count, so it is
the single-process loss. megatron's ``DistributedDataParallel`` averages gradients over the
DP x CP group (it scales them by ``1/(dp·cp)``), so a rank back-propagates its sum over the global
count times ``dp·cp``, and the averaged gradient is the single-process one.

NOTE [Plans under gloo]
Each rank's plan is made from its own recorded iteration, and under tensor or context parallelism
on the CPU a few of a step's requests miss it ("slot busy": 15-56 of the ~560 planned requests
per step of tiny at 256 tokens). The requests are the same, in the same order, as the recorded iteration's;
what differs is when some blocks are freed: a gloo collective keeps the tensors it was given and
its worker thread drops them only after ``wait()`` has returned, at a moment that varies from run
to run, so an input megatron has let go (the sequence-parallel all-gather's, the reduce-scatter's)
may still hold its planned address when the next request wants it. The allocator serves such a
request from its fallback pool, counts it and says so once (results are unchanged: the losses
are the single-process ones). NCCL on a GPU keeps no such references to PyTorch tensors past the
stream's order; whether its runs hold the plan exactly is still to be measured on hardware.

NOTE [Checks before any process group]
Every check of a layout reads only the command line and the launch environment, which every rank
has, and runs before ``init_process_group``: a bad layout raises the same MemoError on every rank
and none is left waiting in a collective for one that has gone. What only the ranks together know
(the alpha and plan each one chose) is compared by :meth:`ParallelRun.agree`, one
``all_gather_object`` that every rank makes and every rank judges the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from memo.distributed.parallel_layout import ParallelLayout, layout_problems, size_problem
from memo.errors import MemoError
from memo.planner.vocab import CPComm

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from torch.distributed import ProcessGroup

    from memo.adapters.model import ModelAdapter
    from memo.planner import Plan

_T = TypeVar("_T")

__all__ = [
    "VOCAB_MULTIPLE",
    "LaunchEnv",
    "ParallelLayout",
    "ParallelRun",
    "check_layout",
    "free_port",
    "join_process_group",
    "padded_vocab_size",
    "plan_fingerprint",
    "rank_device",
    "resolve_layout",
]

#: megatron's ``make_vocab_size_divisible_by`` default: the vocabulary is padded to a multiple of it
#: for every layout alike, so a TP run and a single-process run build the same model.
VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the launch, from ``torchrun``'s environment (one process without it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    #: Started by a launcher (torchrun sets RANK and WORLD_SIZE): a world of one is then a
    #: distributed run too (its process group is gloo or NCCL), not memo's single-process path.
    launched: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (torchrun sets them all)."""
        env = os.environ if environ is None else environ
        values = {}
        for field, name, default in (("rank", "RANK", 0), ("world_size", "WORLD_SIZE", 1),
                                     ("local_rank", "LOCAL_RANK", None), ("local_world_size",
                                                                          "LOCAL_WORLD_SIZE", None)):
            text = env.get(name)
            if text is None:
                values[field] = default
                continue
            try:
                values[field] = int(text)
            except ValueError:
                raise MemoError(f"memo.distributed: {name}={text!r} in the environment is not an integer; "
                                "launch with torchrun, which sets it") from None
        if values["local_rank"] is None:
            values["local_rank"] = values["rank"]
        if values["local_world_size"] is None:
            values["local_world_size"] = values["world_size"]
        launch = cls(**values, launched="RANK" in env and "WORLD_SIZE" in env)
        if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
            raise MemoError(f"memo.distributed: RANK={launch.rank} and WORLD_SIZE={launch.world_size} in the "
                            "environment do not make a rank of a world; launch with torchrun")
        if launch.world_size > 1 and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
            raise MemoError("memo.distributed: WORLD_SIZE > 1 but MASTER_ADDR or MASTER_PORT is not set; "
                            "launch with torchrun (--standalone, or --rdzv-endpoint)")
        return launch


def resolve_layout(tensor_parallel: int = 1, context_parallel: int = 1, data_parallel: int | None = None,
                   sequence_parallel: bool = False, world_size: int = 1,
                   cp_comm: str = CPComm.ALL_GATHER.value, pipeline_parallel: int = 1,
                   virtual_pipeline: int = 1) -> ParallelLayout:
    """The layout of ``world_size`` processes; ``data_parallel`` None is ``world / (tp·cp·pp)``.

    Raises a MemoError when the layout does not make up the world (NOTE [Checks before any process
    group]).
    """
    for flag, value in (("--tp", tensor_parallel), ("--cp", context_parallel), ("--dp", data_parallel),
                        ("--pp", pipeline_parallel), ("--vpp", virtual_pipeline)):
        problem = None if value is None else size_problem(flag, value)
        if problem is not None:
            raise MemoError(f"memo.distributed: {problem}")
    if virtual_pipeline > 1 and pipeline_parallel == 1:
        raise MemoError(f"memo.distributed: --vpp {virtual_pipeline} interleaves model chunks over pipeline "
                        "stages; give --pp 2 or more, or drop --vpp")
    model = tensor_parallel * context_parallel * pipeline_parallel
    pp = f" x --pp {pipeline_parallel}" if pipeline_parallel > 1 else ""
    if data_parallel is None:
        if world_size % model:
            raise MemoError(
                f"memo.distributed: --tp {tensor_parallel} x --cp {context_parallel}{pp} = {model} ranks per "
                f"model replica does not divide the world of {world_size} process(es) (WORLD_SIZE); launch "
                f"a multiple of {model} processes (torchrun --nproc-per-node {model}), or change "
                "--tp/--cp/--pp")
        data_parallel = world_size // model
    layout = ParallelLayout(tensor_parallel, context_parallel, data_parallel, bool(sequence_parallel),
                            cp_comm, pipeline_parallel, virtual_pipeline)
    if layout.world != world_size:
        raise MemoError(
            f"memo.distributed: --tp {tensor_parallel} x --cp {context_parallel}{pp} x --dp "
            f"{data_parallel} = {layout.world} ranks, but {world_size} process(es) were launched "
            f"(WORLD_SIZE); launch torchrun --nproc-per-node {layout.world} (on one node), or leave --dp "
            "out to use world / (tp·cp·pp)")
    return layout


def padded_vocab_size(vocab_size: int, tensor_parallel: int = 1) -> int:
    """The vocabulary megatron's model is built with: ``vocab_size`` rounded up to a multiple of
    :data:`VOCAB_MULTIPLE`, the same for every layout (checked divisible by ``tensor_parallel``)."""
    padded = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if padded % tensor_parallel:
        raise MemoError(
            f"memo.distributed: the padded vocabulary ({vocab_size} -> {padded}, a multiple of "
            f"{VOCAB_MULTIPLE}) cannot be split over --tp {tensor_parallel} ranks (megatron's vocab-parallel "
            f"embedding gives each an equal share); use a --tp that divides {padded}")
    return padded


def check_layout(layout: ParallelLayout, *, engine: str, n_heads: int, n_query_groups: int,
                 vocab_size: int, seq_len: int, micro_batch: int, n_layers: int = 0,
                 micro_batches: int = 1, ffn_hidden: int = 0) -> None:
    """Refuse a layout this job cannot run, from the arguments alone (NOTE [Checks before any
    process group]): the engine's, then what the model and the sequence refuse (:func:`layout_problems`,
    which ``memo estimate`` asks too), then the vocabulary and the batch. ``micro_batch`` is the global batch
    (every DP rank keeps its share) of each of the step's ``micro_batches``; ``n_layers`` and
    ``ffn_hidden`` 0: not checked."""
    tp, dp, sp = layout.tensor_parallel, layout.data_parallel, layout.sequence_parallel
    pipeline_problem = _pipeline_problem(layout, engine, micro_batches)
    if pipeline_problem is not None:
        raise MemoError(f"memo.distributed: {pipeline_problem}")
    if engine == "fsdp2":  # NOTE [Which engine runs which layout] in planner/engines.py
        from memo.planner.engines import layout_problem

        problem = layout_problem(engine, tp=tp, cp=layout.context_parallel, pp=layout.pipeline_parallel,
                                 cp_comm=layout.cp_comm, sp=sp)
        if problem is not None:
            raise MemoError(f"memo.train: {layout}: {problem}")
    if engine not in ("megatron", "fsdp2") and (layout.world > 1 or sp):
        raise MemoError(
            f"memo.train: --engine {engine} builds one process's model; {layout} needs megatron-core's "
            "parallel layers: use --engine megatron (or --engine fsdp2 for data parallelism alone), or "
            "run this model as one process (no torchrun, or torchrun --nproc-per-node 1, with "
            "--tp/--cp/--dp 1 and no --sp)")
    if sp and tp == 1:
        raise MemoError("memo.distributed: --sp (sequence parallelism) splits the tokens between the "
                        "ranks of a tensor-parallel group, and megatron-core refuses it without one; give "
                        "--tp 2 or more, or drop --sp")
    problems = layout_problems(layout, n_heads=n_heads, n_kv_heads=n_query_groups, n_layers=n_layers,
                               ffn_hidden=ffn_hidden, seq_len=seq_len)
    if problems:
        raise MemoError(f"memo.distributed: {problems[0]}")
    padded_vocab_size(vocab_size, tp)
    if micro_batch % dp:
        raise MemoError(
            f"memo.distributed: --micro-batch {micro_batch} (the global batch) cannot be split over --dp "
            f"{dp} data-parallel ranks; give a multiple of {dp}")


def _pipeline_problem(layout: ParallelLayout, engine: str, micro_batches: int) -> str | None:
    """What keeps ``layout``'s pipeline from running besides its layers (NOTE [Pipeline stages] in
    memo/distributed/pipeline.py; :func:`layout_problems` checks that the stages share the layers), or
    None."""
    p, v = layout.pipeline_parallel, layout.virtual_pipeline
    if p == 1:
        return None
    if engine != "megatron":
        return (f"--pp {p}: pipeline stages are megatron-core's (its GPTModel chunks and schedules); use "
                "--engine megatron")
    if v > 1 and (micro_batches < p or micro_batches % p):
        return (f"--micro-batches {micro_batches}: megatron's interleaved schedule (--vpp {v}) runs the "
                f"micro-batches in groups of --pp {p} per model chunk; give a multiple of {p}")
    return None


def plan_fingerprint(plan: Plan | None) -> str | None:
    """A short hash of a plan's JSON (None without a plan): equal plans, equal fingerprints."""
    if plan is None:
        return None
    text = json.dumps(plan.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def requests_fingerprint(plan: Plan | None) -> str | None:
    """A short hash of what a plan was made from (its requests: sizes, phases, lifetimes): two ranks
    whose plans share it recorded the same iteration and may run one plan."""
    if plan is None:
        return None
    data = plan.to_dict()
    text = json.dumps([data["allocations"], data["phases"], data["policy"], data["alpha"]], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rank_device(device: str, launch: LaunchEnv) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) for a CUDA run, else ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(dev)
    return dev


def join_process_group(launch: LaunchEnv, device: torch.device) -> bool:
    """Join the launch's process group (nccl on CUDA, gloo otherwise; a group of one on a free port
    when no launcher made one) unless one exists; True when this call made it (the run destroys it)."""
    if torch.distributed.is_initialized():
        return False
    if launch.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         rank=launch.rank, world_size=launch.world_size)
    return True


class ParallelRun:
    """One rank of a parallel ``memo train`` job: its process groups, its share of the data, the
    global loss, the gradient reduction and the start-up agreement (NOTE [Parallel layout]).

    Made by :meth:`start` after :func:`check_layout`; :meth:`close` destroys what it set up.
    """

    def __init__(self, layout: ParallelLayout, launch: LaunchEnv, device: torch.device) -> None:
        self.layout, self.launch, self.device = layout, launch, device
        self.tp_rank = self.cp_rank = self.dp_rank = self.pp_rank = 0
        self.ddp: DistributedDataParallel | None = None
        self._owns_group = False

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def is_first(self) -> bool:
        """Rank 0, the one that prints and writes the report."""
        return self.launch.rank == 0

    def as_dict(self) -> dict[str, Any]:
        """What reports record of this run: its layout (an engine's run adds its own settings)."""
        return self.layout.as_dict()

    # ------------------------------------------------------------------------ start and stop
    @classmethod
    def start(cls, layout: ParallelLayout, launch: LaunchEnv, device: str, seed: int) -> ParallelRun:
        """Join the process group (gloo on CPU, nccl on CUDA), install the CPU shims where there is no
        CUDA, and set up megatron's parallel state and RNG tracker for ``layout``."""
        import warnings

        run = cls(layout, launch, rank_device(device, launch))
        run._owns_group = join_process_group(launch, run.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            from memo.distributed.cpu_shims import install_cpu_shims
        install_cpu_shims()  # nothing where CUDA is usable
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        v = layout.virtual_pipeline
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tensor_parallel,
                                                 context_parallel_size=layout.context_parallel,
                                                 pipeline_model_parallel_size=layout.pipeline_parallel,
                                                 virtual_pipeline_model_parallel_size=v if v > 1 else None)
        model_parallel_cuda_manual_seed(seed)
        run.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        run.cp_rank = parallel_state.get_context_parallel_rank()
        run.dp_rank = parallel_state.get_data_parallel_rank()
        run.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        return run

    def close(self) -> None:
        """Destroy megatron's parallel state and (when this run made it) the process group."""
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if self._owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._owns_group = False

    # ------------------------------------------------------------------------ data
    def shard(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
        """This rank's ``(ids, labels, position_ids)`` of a global batch ``ids, labels: [b, s]``
        (NOTE [Parallel layout]): rows of its DP rank, chunks r and 2c-1-r of its CP rank."""
        b, s = ids.shape
        dp = self.layout.data_parallel
        rows = slice(self.dp_rank * b // dp, (self.dp_rank + 1) * b // dp)
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        keep = self.token_index(s)
        return tuple(t[rows][:, keep].contiguous() for t in (ids, labels, positions))

    def token_index(self, s: int) -> torch.Tensor:
        """The positions of a sequence of ``s`` tokens this rank's CP rank keeps: chunks r and 2c-1-r
        (megatron's load-balanced causal layout)."""
        cp = self.layout.context_parallel
        if cp == 1:
            return torch.arange(s)
        chunk, r = s // (2 * cp), self.cp_rank
        return torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                          torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)])

    # ------------------------------------------------------------------------ loss and gradients
    def loss(self, model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
             global_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(to_backward, global_loss)`` of one step (NOTE [Parallel layout]).

        ``ids, labels, positions``: this rank's shard; ``global_count``: the counted tokens
        (label != -100) of the global batch. ``global_loss`` (detached) is the single-process
        loss; ``to_backward`` is the share whose DDP-averaged gradient is the single-process one.
        """
        from megatron.core import parallel_state

        counted = labels != -100
        per_token = model(ids, positions, None, labels=torch.where(counted, labels, 0))
        local = (per_token * counted.to(per_token.dtype)).sum()
        total = local.detach().clone()
        if self.layout.data_parallel * self.layout.context_parallel > 1:
            torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(
                with_context_parallel=True))
        count = max(global_count, 1)
        scale = self.layout.data_parallel * self.layout.context_parallel
        return local * (scale / count), total / count

    def model_adapter(self, positions: torch.Tensor, global_count: int) -> ModelAdapter:
        """The GPT model adapter whose loss is this rank's step loss (:meth:`loss` with the shard's
        ``positions``), for :func:`memo.adapters.model.use_model_adapter`: memo's profile then records
        the iteration every step runs, allocation for allocation, and the plan holds in training."""
        from memo.adapters.megatron import GPTModelAdapter

        run = self

        class ShardLoss(GPTModelAdapter):
            name = "megatron-gpt-shard"

            def loss(self, model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                return run.loss(model, ids, labels, positions, global_count)[0]

        return ShardLoss()

    def wrap(self, model: torch.nn.Module) -> None:
        """Wrap ``model`` in megatron-core's ``DistributedDataParallel`` (gradient buffers, the reduction
        over DP x CP and, in ``finalize_model_grads``, the SP norms' all-reduce over TP)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)

    def optimizer_group(self) -> ProcessGroup | None:
        """The ranks that hold the same weights and gradients, over which the optimizer states are
        sharded (NOTE [ZeRO-1 under megatron] in memo/train/optim.py): megatron's DP x CP group."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    def zero_grads(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()

    def finish_grads(self, model: torch.nn.Module) -> None:
        """Reduce the gradients (``finalize_model_grads``) and hand them to the torch optimizer."""
        if self.ddp is None:
            return
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        for p in model.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad

    # ------------------------------------------------------------------------ agreement
    def gather(self, obj: _T) -> list[_T]:
        """``obj`` of every rank, in rank order (a collective: every rank must call it)."""
        out: list[Any] = [None] * self.launch.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def agree(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Compare ``record`` (layout, strategy, alpha, layer policy, plan fingerprint) across ranks;
        every rank raises the same MemoError when they differ (NOTE [Checks before any process group]).

        ``record["plan_made_from"]``, when present, is what each rank's own plan was made from
        (:func:`requests_fingerprint`): ranks that recorded different iterations may run different
        plans (the addresses are each rank's own; alpha and the layer policy, which decide the
        collectives, must still agree), ranks that recorded the same one must run the same plan.
        """
        records = self.gather(record)
        first = records[0]
        for key in first:
            if key == "plan_made_from":
                continue
            groups = [r.get("plan_made_from") for r in records] if key == "plan" else [None] * len(records)
            values = [r.get(key) for r in records]
            n = len(values)
            if any(values[i] != values[j] for i in range(n) for j in range(i) if groups[i] == groups[j]):
                table = ", ".join(f"rank {i}: {v}" for i, v in enumerate(values))
                hint = {"alpha": "give every rank the same --alpha (or --plan), or the same --bandwidth-gbps "
                                 "and --layer-ms",
                        "plan": "give every rank the same --plan file, or let every rank profile"}.get(
                    key, "launch every rank with the same arguments")
                raise MemoError(f"memo.distributed: the ranks disagree on {key} ({table}); they would run "
                                f"different collectives and hang. {hint}")
        return records

    def agree_max(self, value: int) -> int:
        """The largest ``value`` of any rank (called by every rank). memo's profile records iterations
        whose peaks decide what it records next (NOTE [Decisions every rank shares] in
        memo/pipeline/policy.py): with the largest on every rank, every rank decides the same."""
        return int(max(self.gather(int(value))))

    def agree_machine(self, bandwidth_gbps: float, layer_ms: float, host_mem_gb: float) -> tuple[
            float, float, float]:
        """One machine for every rank: the slowest link, the slowest layer and the smallest node any
        rank measured (nodes alike in name differ in MemTotal by megabytes), so that every rank solves
        the same alpha LP (called by every rank)."""
        got = self.gather((float(bandwidth_gbps), float(layer_ms), float(host_mem_gb)))
        return (min(b for b, _, _ in got), max(m for _, m, _ in got), min(h for _, _, h in got))


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous (MASTER_PORT) that no launcher chose."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
