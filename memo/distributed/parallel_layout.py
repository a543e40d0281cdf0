"""The parallel layout of one training job: the one type ``memo train`` launches and ``memo estimate``
counts, and what a model and a sequence refuse of it.

NOTE [One layout type]
A job's layout is one frozen :class:`ParallelLayout`: the sizes of its tensor-, context-, data- and
pipeline-parallel groups and the virtual pipeline's chunks, whether TP also splits the tokens (sequence
parallelism), how the CP ranks' attention communicates, how the model states are sharded, the
micro-batch and Ulysses' chunks of heads. ``memo train`` resolves one from its flags and the world
(``resolve_layout`` in memo/distributed/layout.py; under FSDP2 every state is sharded, in host memory
with ``--offload-states``: ``start_parallel`` in memo/train/parallel.py); ``memo estimate`` makes one
from N GPUs and the sizes with the factory ``Layout`` in memo/estimate/layout.py (d = N / (t·c·p) must
be whole; TP > 1 comes with sequence parallelism, as the estimate counts a rank). A factory, not a
second constructor, so that both argument orders keep their meaning: ``ParallelLayout(2, 1, 2, True)``
is t, c, d, sp and ``Layout(8, 2)`` is N, t. The fields carry the launcher's long names, the only names
a constructor or ``dataclasses.replace`` takes; ``tp``, ``cp``, ``dp``, ``pp``, ``vpp``, ``sp`` and
``gpus`` (``world``) are read-only aliases, which the estimate's arithmetic reads. One type has one
validation (every bad field is refused when a layout is made, however it is made), one divisibility
check (:func:`layout_problems`) and one engine lookup, so the layout an estimate answers with is the
layout its printed command launches. ``cp_comm`` and ``sharding`` are held as their planner/vocab.py
members whatever string made them.

NOTE [Valid layouts]
A layout is valid for a model and a sequence when every size divides what it splits:

* N = t·c·p·d: the data-parallel size d = N / (t·c·p) must be whole;
* t divides the query heads, the key/value heads (megatron-core's ``num_query_groups``) and the
  MLP size (column-parallel linear layers split them; memo's rank model refuses the rest);
* p·v divides the layers (every stage holds L/p layers in v model chunks, as the seed's derivation
  assumes);
* the sequence is a multiple of ``token_multiple(t, c)``: 2·c load-balanced context-parallel
  chunks, and c·t ranks' shares of a layer's input under sequence parallelism;
* under Ulysses (CP by all-to-all) the c ranks share each TP rank's heads
  (NOTE [Ulysses context parallelism] in memo/models/ulysses_attention.py).

The vocabulary need not divide by t: Megatron pads it (memo's rank model does the same;
``padded_vocab_size`` in memo/distributed/layout.py checks the padded one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memo.errors import MemoError
from memo.planner.engines import RUNNABLE, EngineLayouts, engine_for_layout, layout_problem
from memo.planner.vocab import CP_COMMS, SHARDINGS, CPComm, Sharding

if TYPE_CHECKING:
    from memo.models.config import ModelConfig

__all__ = ["ParallelLayout", "layout_problems", "size_problem"]


def size_problem(flag: str, value: object) -> str | None:
    """``"--tp must be a positive integer, got 0"`` where ``value`` is not one, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{flag} must be a positive integer, got {value!r}"
    return None


@dataclass(frozen=True)
class ParallelLayout:
    """How a job's ranks split the work (NOTE [One layout type]; NOTE [Parallel layout] in
    memo/distributed/layout.py)."""

    tensor_parallel: int = 1
    """t: ranks a layer's weights are split over (megatron's TP)."""
    context_parallel: int = 1
    """c: ranks a sequence is split over (megatron's CP, load-balanced causal layout)."""
    data_parallel: int = 1
    """d: ranks the batch rows are split over."""
    sequence_parallel: bool = False
    """megatron's sequence parallelism inside each TP group (needs tensor_parallel > 1)."""
    cp_comm: CPComm = CPComm.ALL_GATHER
    """How the c context-parallel ranks' attention communicates (megatron's ``cp_comm_type``):
    ``all_gather`` (K and V) or ``a2a`` (Ulysses: every rank attends all tokens of its share of the
    heads, NOTE [Ulysses context parallelism] in memo/models/ulysses_attention.py)."""
    pipeline_parallel: int = 1
    """p: pipeline stages (megatron's PP): each rank holds L/p layers (NOTE [Pipeline stages] in
    memo/distributed/pipeline.py); the estimate is the first stage's."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline rank (megatron's interleaved schedule); 1: the 1F1B schedule."""
    micro_batch: int = 1
    """b: sequences per micro-batch of one rank (the estimate's; ``memo train --micro-batch`` is the
    global batch, b·d)."""
    sharding: Sharding = Sharding.OPTIMIZER
    """How the model states are split over the d·c ranks that share weights (NOTE [Sharded model
    states] in memo/estimate/core.py): ``optimizer`` (megatron's distributed optimizer, ZeRO-1),
    ``full`` (FSDP2, ZeRO-3) or ``full-offload`` (FSDP2 with its states in host memory)."""
    head_chunks: int | None = None
    """The chunks of heads Ulysses attends over, one at a time (``--ulysses-head-chunks``, NOTE
    [Ulysses over chunks of heads] in memo/models/ulysses_attention.py); None: memo train's default.
    Ulysses layouts only."""

    def __post_init__(self) -> None:
        problem = self._field_problem()
        if problem is not None:
            raise MemoError(f"memo layout: {problem}")
        object.__setattr__(self, "cp_comm", CPComm(self.cp_comm))
        object.__setattr__(self, "sharding", Sharding(self.sharding))

    def _field_problem(self) -> str | None:
        """What is wrong with a field on its own (or with head chunks outside Ulysses), or None."""
        for flag, value in (("--tp", self.tensor_parallel), ("--cp", self.context_parallel),
                            ("--dp", self.data_parallel), ("--pp", self.pipeline_parallel),
                            ("--vpp", self.virtual_pipeline), ("--micro-batch", self.micro_batch)):
            problem = size_problem(flag, value)
            if problem is not None:
                return problem
        if not isinstance(self.sequence_parallel, bool):
            return f"--sp must be True or False, got {self.sequence_parallel!r}"
        if self.cp_comm not in CP_COMMS:
            return (f"--cp-comm must be one of {', '.join(CP_COMMS)} (memo's context-parallel attention), "
                    f"got {self.cp_comm!r}")
        if self.sharding not in SHARDINGS:
            return f"--sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}"
        chunks = self.head_chunks
        if chunks is None:
            return None
        problem = size_problem("--ulysses-head-chunks", chunks)
        if problem is None and not self.ulysses:
            problem = (f"{chunks} head chunks are Ulysses' (CP > 1, --cp-comm a2a); got CP "
                       f"{self.context_parallel}, {self.cp_comm}")
        return problem

    # ------------------------------------------------------------------------ derived values, aliases
    @property
    def world(self) -> int:
        """t·c·p·d: every rank of the job."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def gpus(self) -> int:
        """N, the estimate's name for :attr:`world`."""
        return self.world

    @property
    def model_parallel(self) -> int:
        """t·c·p: the ranks one sequence is spread over, which talk to each other every micro-batch."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel

    @property
    def tp(self) -> int:
        return self.tensor_parallel

    @property
    def cp(self) -> int:
        return self.context_parallel

    @property
    def dp(self) -> int:
        return self.data_parallel

    @property
    def pp(self) -> int:
        return self.pipeline_parallel

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline

    @property
    def sp(self) -> bool:
        return self.sequence_parallel

    @property
    def ulysses(self) -> bool:
        """CP by all-to-all: the context-parallel ranks exchange heads for tokens."""
        return self.context_parallel > 1 and self.cp_comm == CPComm.A2A

    # ------------------------------------------------------------------------ records and words
    def as_dict(self) -> dict[str, Any]:
        """What training reports record: ``tp, cp, sp, dp, pp, vpp, world, cp_comm``."""
        return {"tp": self.tp, "cp": self.cp, "sp": self.sp, "dp": self.dp, "pp": self.pp, "vpp": self.vpp,
                "world": self.world, "cp_comm": self.cp_comm.value}

    def to_dict(self) -> dict[str, Any]:
        """What an estimate's JSON records: ``gpus, tp, cp, pp, micro_batch, cp_comm, sharding,
        head_chunks, dp``."""
        return {"gpus": self.gpus, "tp": self.tp, "cp": self.cp, "pp": self.pp,
                "micro_batch": self.micro_batch, "cp_comm": self.cp_comm.value,
                "sharding": self.sharding.value, "head_chunks": self.head_chunks, "dp": self.dp}

    def __str__(self) -> str:
        return (f"tp={self.tp} cp={self.cp} dp={self.dp}" + (f" pp={self.pp}" if self.pp > 1 else "")
                + (f" vpp={self.vpp}" if self.vpp > 1 else "") + (" sp" if self.sp else "")
                + (f" cp_comm={self.cp_comm}" if self.cp > 1 else ""))

    def describe(self) -> str:
        """``TP t x CP c x PP p x DP d`` and what else differs from the defaults, for a sentence."""
        return (f"TP {self.tp} x CP {self.cp} x PP {self.pp} x DP {self.dp}"
                + (f", micro-batch {self.micro_batch}" if self.micro_batch > 1 else "")
                + (", Ulysses all-to-all" if self.ulysses else "")
                + (f" over {self.head_chunks} chunks of heads" if self.head_chunks else "")
                + {Sharding.OPTIMIZER: "", Sharding.FULL: ", states fully sharded",
                   Sharding.FULL_OFFLOAD: ", states fully sharded in host memory"}[self.sharding])

    def short(self) -> str:
        """``t2 c4 a2a p1 d1 b1``: the layout in a table cell or a progress line."""
        a2a = (" a2a" if self.ulysses else "") + (f"/{self.head_chunks}" if self.head_chunks else "")
        return (f"t{self.tp} c{self.cp}{a2a} p{self.pp} d{self.dp} b{self.micro_batch}"
                + ("" if self.sharding == Sharding.OPTIMIZER else f" {self.sharding}"))

    # ------------------------------------------------------------------------ what runs it, what refuses it
    @property
    def engine(self) -> str | None:
        """The engine of ``memo train`` that launches this layout, or None (NOTE [Which engine runs which
        layout] in planner/engines.py)."""
        return engine_for_layout(tp=self.tp, cp=self.cp, pp=self.pp, cp_comm=self.cp_comm,
                                 sharding=self.sharding, head_chunks=self.head_chunks)

    def launch_problem(self) -> str | None:
        """Why no engine of ``memo train`` launches this layout, each engine's reason and what does run,
        in one sentence; None when one does (NOTE [Layouts memo train launches] in
        memo/estimate/layout.py)."""
        if self.engine is not None:
            return None
        reasons = [layout_problem(row.engine, tp=self.tp, cp=self.cp, pp=self.pp, cp_comm=self.cp_comm,
                                  sharding=self.sharding, head_chunks=self.head_chunks) for row in RUNNABLE]
        runs = "; ".join(_runs(row) for row in RUNNABLE)
        return (f"memo train launches no {self.describe()}: " + "; ".join(r for r in reasons if r)
                + f". What it launches: {runs}; --search ranks only those")

    def problems(self, config: ModelConfig, seq_len: int | None = None) -> list[str]:
        """What NOTE [Valid layouts] refuses of this layout for ``config`` (and ``seq_len``), one
        sentence each (empty: valid)."""
        return layout_problems(self, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads or config.n_heads,
                               n_layers=config.n_layers, ffn_hidden=config.ffn_hidden or 0, seq_len=seq_len)

    def check(self, config: ModelConfig, seq_len: int | None = None, who: str = "memo estimate") -> None:
        """Refuse, in one line from ``who``, a layout no engine of ``memo train`` runs, or one the model
        or the sequence cannot take (NOTE [Valid layouts])."""
        problem = self.launch_problem()
        if problem is not None:
            raise MemoError(f"{who}: {problem}")
        problems = self.problems(config, seq_len)
        if problems:
            raise MemoError(f"{who}: {self.describe()} does not fit {config.name}: " + "; ".join(problems))


def _runs(row: EngineLayouts) -> str:
    """What one row of memo train's engine table launches, in the estimate's flags."""
    sizes = [f"{flag} {'any' if used else 1}" for flag, used in (("--tp", row.tensor_parallel),
                                                                   ("--pp", row.pipeline_parallel))]
    return (f"{row.engine}: {', '.join(sizes)}, --cp with --cp-comm {' or '.join(row.cp_comms)}, "
            f"--sharding {' or '.join(row.shardings)}")


def layout_problems(layout: ParallelLayout, *, n_heads: int, n_kv_heads: int, n_layers: int = 0,
                    ffn_hidden: int = 0, seq_len: int | None = None) -> list[str]:
    """What the model (its query and key/value heads, layers and MLP size; 0: not known) and ``seq_len``
    (None: not known) refuse of ``layout`` (NOTE [Valid layouts]), one sentence each that names the flag
    to change; empty where it fits. ``memo estimate`` and ``memo train`` both ask this."""
    from memo.token_split import seq_len_problem

    out = []
    t, c, p, v = layout.tp, layout.cp, layout.pp, layout.vpp
    # megatron-core's names: attention heads, query groups (NOTE [Valid layouts])
    whole = f"which --tp {t} cannot split evenly: each tensor-parallel rank holds a whole number of them"
    for count, what, why in (
            (n_heads, "query heads", f"the model's {n_heads} attention heads, {whole}"),
            (n_kv_heads, "key/value heads", f"the model's {n_kv_heads} query groups, {whole}"),
            (ffn_hidden, "MLP size", "its column-parallel layers give each tensor-parallel rank a share")):
        if count % t:
            out.append(f"TP {t} does not divide its {count} {what} ({why}); use a --tp that divides {count}")
    if n_layers % (p * v):
        sizes, over, flags = ((f"PP {p} x VPP {v}", f"--pp {p} x --vpp {v} = {p * v} model chunks",
                               "--pp x --vpp") if v > 1 else (f"PP {p}", f"--pp {p} stages", "--pp"))
        out.append(f"{sizes} does not divide its {n_layers} layers: the model's {n_layers} layers cannot be "
                   f"split evenly over {over}; use a {flags} that divides {n_layers}")
    if layout.ulysses and not n_heads % t and not n_kv_heads % t:
        out.extend(_ulysses_problems(layout, n_heads, n_kv_heads))
    problem = None if seq_len is None else seq_len_problem(seq_len, t, c)
    if problem is not None:  # NOTE [Tokens per rank] in memo/token_split.py
        # memo's profile of a rank (NOTE [Context-parallel profile]) takes seq_len / (c·t) tokens per
        # layer input under TP, with or without --sp, and 2c load-balanced chunks under CP.
        out.append(f"--seq-len: {problem}" + ("" if layout.sp or t == 1 else
                                              " (memo profiles one rank's share also without --sp)"))
    return out


def _ulysses_problems(layout: ParallelLayout, n_heads: int, n_kv_heads: int) -> list[str]:
    """What Ulysses refuses of a TP rank's heads (NOTE [Ulysses context parallelism] in
    memo/models/ulysses_attention.py): ranks that cannot share them, or chunks they do not split into."""
    from memo.models.ulysses_attention import legal_head_chunks, ulysses_heads_problem

    t, c = layout.tp, layout.cp
    heads, groups = n_heads // t, n_kv_heads // t
    problem = ulysses_heads_problem(heads, groups, c)
    if problem is not None:
        return [f"Ulysses CP, --cp-comm a2a: the model has {n_heads} attention heads and {n_kv_heads} query "
                f"groups, {heads} and {groups} per --tp {t} rank, and {problem}; use a --cp that divides "
                f"{heads} and divides or is a multiple of {groups}, or --cp-comm all_gather"]
    if layout.head_chunks is not None:
        legal = legal_head_chunks(heads, groups, c)
        if layout.head_chunks not in legal:
            return [f"Ulysses CP: the heads per rank do not split into {layout.head_chunks} chunks (legal "
                    f"counts: {', '.join(map(str, legal))}); use one of those with --ulysses-head-chunks"]
    return []
