"""A parallel layout of one training job: N GPUs as TP x CP x PP x DP, and the micro-batch.

NOTE [Valid layouts]
A layout is valid for a model and a sequence when every size divides what it splits:

* N = t·c·p·d: the data-parallel size d = N / (t·c·p) must be whole;
* t divides the query heads, the key/value heads (megatron-core's ``num_query_groups``) and the
  MLP size (column-parallel linear layers split them; memo's rank model refuses the rest);
* p divides the layers (every stage holds L/p layers, as the seed's derivation assumes);
* the sequence is a multiple of ``token_multiple(t, c)``: 2·c load-balanced context-parallel
  chunks, and c·t ranks' shares of a layer's input under sequence parallelism.

The vocabulary need not divide by t: Megatron pads it (memo's rank model does the same).

NOTE [Layouts memo train launches]
The estimate answers only with layouts an engine of ``memo train`` launches (NOTE [Which engine runs
which layout] in planner/engines.py): :func:`valid_layouts` leaves the others out, so no search ranks or
returns one, and :meth:`Layout.check` refuses one asked for by name, with the table's reasons; a
strategy ``memo train`` does not run on a layout is refused likewise (``strategy_problem`` in
memo/estimate/core.py). A memory number for a layout nobody can run answers no one's question, and a
search that ranked it first would send its user to a command that fails before the first step.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memo.errors import MemoError
from memo.planner.engines import RUNNABLE, EngineLayouts, engine_for_layout, layout_problem
from memo.planner.vocab import CP_COMMS, SHARDINGS

if TYPE_CHECKING:
    from memo.models.config import ModelConfig

__all__ = ["CP_COMMS", "SHARDINGS", "Layout", "divisors", "valid_layouts"]

# Model-state shardings (NOTE [Sharded model states] in memo/estimate/core.py) and context-parallel
# communications a layout may use: planner/vocab.py.


@dataclass(frozen=True)
class Layout:
    """How N GPUs share one job."""

    gpus: int
    """N, all GPUs of the job."""
    tp: int = 1
    """t: tensor (+ sequence) parallel size."""
    cp: int = 1
    """c: context parallel size (megatron-core's load-balanced split of the sequence)."""
    pp: int = 1
    """p: pipeline stages (1F1B schedule; the estimate is the first stage's)."""
    micro_batch: int = 1
    """b: sequences per micro-batch."""
    cp_comm: str = "all_gather"
    """How the c context-parallel ranks' attention communicates (megatron's ``cp_comm_type``):
    ``"all_gather"`` (K and V) or ``"a2a"`` (Ulysses, NOTE [Ulysses context parallelism] in
    memo/models/ulysses_attention.py)."""
    sharding: str = "optimizer"
    """How the model states are split over the d·c ranks that share weights (NOTE [Sharded model
    states]): ``"optimizer"`` (megatron's distributed optimizer, ZeRO-1), ``"full"`` (FSDP2,
    ZeRO-3: weights, gradients and optimizer states) or ``"full-offload"`` (FSDP2 with its
    states in host memory: ``CPUOffloadPolicy``)."""
    head_chunks: int | None = None
    """The chunks of heads Ulysses attends over, one at a time (``memo train --ulysses-head-chunks``,
    NOTE [Ulysses over chunks of heads] in memo/models/ulysses_attention.py); None: memo train's
    default, one chunk per key/value head a rank receives. Ulysses layouts only."""

    def __post_init__(self) -> None:
        for name in ("gpus", "tp", "cp", "pp", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemoError(f"memo estimate: {name} must be a positive integer, got {value!r}")
        if self.cp_comm not in CP_COMMS:
            raise MemoError(f"memo estimate: --cp-comm must be one of {', '.join(CP_COMMS)}, got "
                            f"{self.cp_comm!r}")
        if self.sharding not in SHARDINGS:
            raise MemoError(f"memo estimate: --sharding must be one of {', '.join(SHARDINGS)}, got "
                            f"{self.sharding!r}")
        chunks = self.head_chunks
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise MemoError(f"memo estimate: head chunks must be a positive integer, got {chunks!r}")
        if chunks is not None and (self.cp == 1 or self.cp_comm != "a2a"):
            raise MemoError(f"memo estimate: {chunks} head chunks are Ulysses' (CP > 1, --cp-comm a2a); got "
                            f"CP {self.cp}, {self.cp_comm}")
        group = self.tp * self.cp * self.pp
        if self.gpus % group:
            raise MemoError(
                f"memo estimate: TP {self.tp} x CP {self.cp} x PP {self.pp} = {group} GPUs does not divide "
                f"the {self.gpus} GPUs, so the data-parallel size N / (T·C·P) is not whole; choose sizes "
                f"whose product divides {self.gpus} (or --search for the valid ones)")

    @property
    def dp(self) -> int:
        """d = N / (t·c·p)."""
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def model_parallel(self) -> int:
        """t·c·p: the ranks one sequence is spread over, which talk to each other every micro-batch."""
        return self.tp * self.cp * self.pp

    def describe(self) -> str:
        return (f"TP {self.tp} x CP {self.cp} x PP {self.pp} x DP {self.dp}"
                + (f", micro-batch {self.micro_batch}" if self.micro_batch > 1 else "")
                + (", Ulysses all-to-all" if self.cp > 1 and self.cp_comm == "a2a" else "")
                + (f" over {self.head_chunks} chunks of heads" if self.head_chunks else "")
                + {"optimizer": "", "full": ", states fully sharded",
                   "full-offload": ", states fully sharded in host memory"}[self.sharding])

    def short(self) -> str:
        a2a = (" a2a" if self.cp > 1 and self.cp_comm == "a2a" else "") + (
            f"/{self.head_chunks}" if self.head_chunks else "")
        return (f"t{self.tp} c{self.cp}{a2a} p{self.pp} "
                f"d{self.dp} b{self.micro_batch}"
                + ("" if self.sharding == "optimizer" else f" {self.sharding}"))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dp": self.dp}

    @property
    def engine(self) -> str | None:
        """The engine of ``memo train`` that launches this layout, or None (NOTE [Layouts memo train
        launches])."""
        return engine_for_layout(tp=self.tp, cp=self.cp, pp=self.pp, cp_comm=self.cp_comm,
                                 sharding=self.sharding, head_chunks=self.head_chunks)

    def launch_problem(self) -> str | None:
        """Why no engine of ``memo train`` launches this layout, each engine's reason and what does run,
        in one sentence; None when one does (NOTE [Layouts memo train launches])."""
        if self.engine is not None:
            return None
        reasons = [layout_problem(row.engine, tp=self.tp, cp=self.cp, pp=self.pp, cp_comm=self.cp_comm,
                                  sharding=self.sharding, head_chunks=self.head_chunks) for row in RUNNABLE]
        runs = "; ".join(_runs(row) for row in RUNNABLE)
        return (f"memo train launches no {self.describe()}: " + "; ".join(r for r in reasons if r)
                + f". What it launches: {runs}; --search ranks only those")

    def check(self, config: ModelConfig, seq_len: int | None = None) -> None:
        """NOTE [Valid layouts]: refuse, in one line, a layout the model or the sequence cannot take;
        NOTE [Layouts memo train launches]: and one no engine of ``memo train`` runs."""
        problem = self.launch_problem()
        if problem is not None:
            raise MemoError(f"memo estimate: {problem}")
        problems = self.problems(config, seq_len)
        if problems:
            raise MemoError(f"memo estimate: {self.describe()} does not fit {config.name}: "
                            + "; ".join(problems))

    def problems(self, config: ModelConfig, seq_len: int | None = None) -> list[str]:
        """What NOTE [Valid layouts] refuses for this layout, one phrase each (empty: valid)."""
        from memo.token_split import seq_len_problem

        out = []
        t = self.tp
        for what, value in (("query heads", config.n_heads), ("key/value heads", config.n_kv_heads),
                            ("MLP size", config.ffn_hidden)):
            if value % t:
                out.append(f"TP {t} does not divide its {value} {what}")
        if config.n_layers % self.pp:
            out.append(f"PP {self.pp} does not divide its {config.n_layers} layers")
        if self.cp > 1 and self.cp_comm == "a2a" and not config.n_heads % t and not config.n_kv_heads % t:
            from memo.models.ulysses_attention import ulysses_heads_problem

            problem = ulysses_heads_problem(config.n_heads // t, config.n_kv_heads // t, self.cp)
            if problem is not None:
                out.append(f"Ulysses CP: {problem}")
            elif self.head_chunks is not None:
                from memo.models.ulysses_attention import legal_head_chunks

                legal = legal_head_chunks(config.n_heads // t, config.n_kv_heads // t, self.cp)
                if self.head_chunks not in legal:
                    out.append(f"Ulysses CP: the heads per rank do not split into {self.head_chunks} chunks "
                               f"(legal counts: {', '.join(map(str, legal))})")
        problem = None if seq_len is None else seq_len_problem(seq_len, t, self.cp)
        if problem is not None:
            out.append(problem)  # NOTE [Tokens per rank] in memo/token_split.py
        return out


def _runs(row: EngineLayouts) -> str:
    """What one row of memo train's engine table launches, in the estimate's flags."""
    sizes = [f"{flag} {'any' if used else 1}" for flag, used in (("--tp", row.tensor_parallel),
                                                                   ("--pp", row.pipeline_parallel))]
    return (f"{row.engine}: {', '.join(sizes)}, --cp with --cp-comm {' or '.join(row.cp_comms)}, "
            f"--sharding {' or '.join(row.shardings)}")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def valid_layouts(config: ModelConfig, gpus: int, seq_len: int | None = None,
                  micro_batches: tuple[int, ...] = (1,), data_parallel_one: bool = False,
                  shardings: tuple[str, ...] = ("optimizer",),
                  cp_comms: tuple[str, ...] = ("all_gather",)) -> list[Layout]:
    """Every layout of ``gpus`` GPUs valid for ``config`` (and ``seq_len``), NOTE [Valid layouts], that
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
