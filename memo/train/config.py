"""What a training run is asked for (:class:`TrainConfig`) and what it measured (:class:`StepMetrics`,
:class:`TrainResult`), with the pieces every training loop shares: the token source, the result before
the first step and the log line of a step. The loops (memo/train/loop.py, memo/train/pipelined.py) and a
parallel rank's additions (memo/train/parallel.py) import them from here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from memo.errors import MemoError
from memo.models import fingerprint, get_config, list_configs
from memo.models.dtypes import DTYPES
from memo.planner.vocab import CPComm
from memo.train.data import ByteFileTokens, SyntheticTokens
from memo.units import format_mib
from memo.utils.flops import detect_peak_flops, flops_per_sample

if TYPE_CHECKING:
    from memo.models import ModelConfig
    from memo.train.corpus import PackedDocuments
    from memo.train.strategies import Strategy

__all__ = ["StepMetrics", "TrainConfig", "TrainResult", "extras_text", "new_result", "step_line",
           "token_source"]


@dataclass
class TrainConfig:
    """What to train and how; the fields mirror the command-line flags."""

    model: str = "tiny"
    """Registered model name (see ``memo.models.list_configs()``)."""
    seq_len: int = 256
    """Tokens per sequence."""
    micro_batch: int = 1
    """Sequences per step."""
    steps: int = 10
    """Optimizer steps."""
    device: str = "cpu"
    """``cpu`` or ``cuda[:i]``."""
    dtype: str = "auto"
    """Parameter, activation and optimizer-state dtype (no float32 master copy); ``auto`` (not given) is
    the ``hf_model`` checkpoint's own dtype, else float32, and is resolved when the config is made."""
    lr: float = 1e-3
    """AdamW learning rate: the peak of ``lr_schedule`` (constant by default)."""
    seed: int = 0
    """Seed for initialisation and data."""
    peak_tflops: float | None = None
    """Peak TFLOPS for MFU; ``None`` looks the GPU up (unknown on CPU)."""
    data: str | None = None
    """``--data``: a ``.jsonl`` corpus (with ``tokenizer``), a megatron indexed dataset (``PREFIX`` or its
    ``.bin``/``.idx``), or any other file whose bytes are the tokens; ``None`` means synthetic tokens
    (NOTE [Packed documents] in memo/train/corpus.py)."""
    tokenizer: str | None = None
    """``--tokenizer``: a directory a Hugging Face tokenizer was saved to, for a ``.jsonl`` ``data``."""
    text_field: str = "text"
    """``--text-field``: the field of a JSONL record holding its text (other records are prompt/completion
    pairs)."""
    engine: str = "memo"
    """Who builds the model (NOTE [Training engines] in memo/engines.py): ``memo``, ``megatron`` or ``fsdp2``
    (memo's or a Hugging Face model, its states sharded by FSDP2: memo/distributed/fsdp2.py)."""
    offload_states: bool = False
    """``--offload-states``: FSDP2's ``CPUOffloadPolicy`` (parameter shards, gradients and optimizer states
    in host memory); ``--engine fsdp2`` only."""
    hf_config: str | None = None
    """A Hugging Face causal-LM config (JSON file, directory or inline JSON) to train, not ``model``."""
    hf_model: str | None = None
    """``--hf-model``: a local Hugging Face checkpoint directory (config.json and safetensors weights, as
    ``save_pretrained`` writes it) to fine-tune, not ``model`` or ``hf_config`` (NOTE [Loading a
    checkpoint] in memo/engines.py)."""
    rope_theta: float | None = None
    """``--rope-theta``: the rotary base of the ``hf_model`` / ``hf_config`` model (NOTE [Context
    extension] in memo/engines.py); None keeps the config's."""
    rope_scaling: dict[str, Any] | None = None
    """``--rope-scaling``: rope parameters as transformers spells them (a dict, or its JSON text), e.g.
    ``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}``; None keeps the
    config's."""
    export: str | None = None
    """``--export``: a directory (new or empty) to write the trained Hugging Face model to at the end,
    with ``save_pretrained`` (NOTE [Exporting the trained model] in memo/train/export.py)."""
    tensor_parallel: int = 1
    """``--tp``: megatron tensor-parallel ranks (NOTE [Parallel layout] in memo/distributed/layout.py)."""
    context_parallel: int = 1
    """``--cp``: megatron context-parallel ranks (load-balanced causal layout)."""
    data_parallel: int | None = None
    """``--dp``: data-parallel ranks; None is world / (tp·cp). ``micro_batch`` is the global batch."""
    sequence_parallel: bool = False
    """``--sp``: megatron sequence parallelism inside the tensor-parallel group."""
    cp_comm: str = "all_gather"  # --cp-comm: CP attention by K/V all-gather or Ulysses all-to-all ("a2a")
    pipeline_parallel: int = 1
    """``--pp``: megatron pipeline stages (NOTE [Pipelined steps] in memo/train/pipelined.py)."""
    virtual_pipeline: int = 1
    """``--vpp``: model chunks per pipeline stage (megatron's interleaved schedule)."""
    ulysses_head_chunks: int | None = None
    """``--ulysses-head-chunks``: chunks of heads Ulysses attends over (NOTE [Ulysses over chunks of heads]
    in memo/models/ulysses_attention.py); None: one per key/value head a rank receives."""
    micro_batches: int = 1
    """``--micro-batches``: micro-batches of ``micro_batch`` sequences per optimizer step, gradients
    accumulated (more than one, or ``--pp`` > 1: megatron's schedules, NOTE [Pipelined steps])."""
    # What a real run adds around the steps (memo/train/run_control.py; checked by check_run_options).
    save: str | None = None
    """``--save DIR``: checkpoints written there (NOTE [Checkpoints] in memo/train/checkpoint.py)."""
    save_every: int | None = None
    """``--save-every N``: a checkpoint every N steps (and after the last step, and on a stop signal)."""
    keep: int = 3
    """``--keep K``: the newest K checkpoints are kept in ``save``, older ones removed."""
    resume: str | None = None
    """``--resume DIR``: continue from the latest whole checkpoint in DIR (or from a step-N folder)."""
    lr_schedule: str = "constant"
    """``--lr-schedule``: ``constant``, ``cosine`` or ``linear`` decay to ``min_lr`` after the warmup."""
    warmup_steps: int = 0
    """``--warmup-steps N``: the learning rate rises linearly to ``lr`` over the first N steps."""
    min_lr: float = 0.0
    """``--min-lr``: where cosine and linear decay end, at the last step."""
    clip_grad: float | None = None
    """``--clip-grad MAX_NORM``: gradients scaled so that their global norm is at most MAX_NORM."""
    eval_data: str | None = None
    """``--eval-data FILE``: held-out tokens, read as ``data`` is; the mean loss of ``eval_batches``."""
    eval_every: int | None = None
    """``--eval-every N``: evaluate every N steps (None: after the last step only)."""
    eval_batches: int = 4
    """``--eval-batches K``: the fixed batches each evaluation averages over."""
    metrics: str | None = None
    """``--metrics FILE.jsonl``: one JSON line per step (rank 0)."""
    tensorboard: str | None = None
    """``--tensorboard DIR``: the same scalars as TensorBoard events (needs the ``tensorboard`` package)."""

    def __post_init__(self) -> None:
        from memo.engines import ENGINES

        if self.engine not in ENGINES:
            raise MemoError(f"memo.train: --engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        self._check_hf_model()
        if self.hf_config is not None and self.engine not in ("memo", "fsdp2"):
            raise MemoError("memo.train: --hf-config builds a Hugging Face model; it does not combine with "
                            f"--engine {self.engine} (--engine fsdp2 shards it)")
        if self.offload_states and self.engine != "fsdp2":
            raise MemoError("memo.train: --offload-states places the model states in host memory through "
                            f"FSDP2's CPUOffloadPolicy; add --engine fsdp2 (got --engine {self.engine})")
        if not self.hugging_face and self.model not in list_configs():
            get_config(self.model)  # raises the error listing valid names
        for name in ("seq_len", "micro_batch", "steps"):
            if getattr(self, name) < 1:
                raise MemoError(
                    f"memo.train: --{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.dtype == "auto":
            from memo.engines import checkpoint_dtype

            self.dtype = "float32" if self.hf_model is None else checkpoint_dtype(self.hf_model)
        if self.dtype not in DTYPES:
            raise MemoError(f"memo.train: --dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not self.lr > 0:
            raise MemoError(f"memo.train: --lr must be > 0, got {self.lr}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise MemoError(f"memo.train: --peak-tflops must be > 0, got {self.peak_tflops}")
        parallel = (self.tensor_parallel, self.context_parallel, self.data_parallel or 1)
        if self.engine == "fsdp2":  # NOTE [Which engine runs which layout] in planner/engines.py
            from memo.planner.engines import layout_problem

            problem = layout_problem("fsdp2", tp=self.tensor_parallel, cp=self.context_parallel,
                                     pp=self.pipeline_parallel, cp_comm=self.cp_comm,
                                     sp=self.sequence_parallel)
            if problem is not None:
                raise MemoError(f"memo.train: {problem}")
        if self.ulysses_head_chunks is not None:
            self._check_head_chunks()
        self._check_data()
        self._check_run_options()
        if (max(parallel) > 1 or self.sequence_parallel) and self.engine not in ("fsdp2", "megatron"):
            what = self._hf_flag() if self.hugging_face else f"--engine {self.engine}"
            raise MemoError(
                f"memo.train: {what} builds a single-process model; --tp/--cp/--dp > 1 and --sp need "
                "megatron-core's parallel layers: use --engine megatron (--engine fsdp2 for --dp alone), or "
                "run with --tp/--cp/--dp 1 and no --sp")

    def _check_data(self) -> None:
        """``--data``, ``--tokenizer`` and ``--text-field`` agree; packed documents go to a model and a loop
        that keep them apart (NOTE [Packed documents] in memo/train/corpus.py)."""
        from memo.train.corpus import data_kind

        kind = None if self.data is None else data_kind(self.data)
        if kind == "jsonl" and self.tokenizer is None and self.hf_model is not None and _has_tokenizer(
                self.hf_model):
            self.tokenizer = self.hf_model  # a checkpoint as users have it holds its tokenizer
        if kind == "jsonl" and self.tokenizer is None:
            raise MemoError(f"memo.train: --data {self.data} is a JSONL corpus; add --tokenizer DIR (the "
                            "directory of the model's Hugging Face tokenizer)")
        if self.tokenizer is not None and kind != "jsonl":
            given = "no --data is given" if kind is None else f"--data {self.data} is {kind} data"
            raise MemoError(f"memo.train: --tokenizer tokenizes a JSONL corpus (--data FILE.jsonl); {given}")
        if not self.text_field:
            raise MemoError("memo.train: --text-field must name a JSON field, got an empty string")
        if kind not in ("jsonl", "indexed"):
            return
        if self.engine == "megatron":
            raise MemoError(f"memo.train: --data {self.data} packs documents, and --engine megatron is given "
                            "no position ids to mask them by; use --engine memo or fsdp2")
        if not self.hugging_face:
            raise MemoError(f"memo.train: --data {self.data} packs documents into rows, and memo's reference "
                            f"model {self.model!r} has no document masking (its tokens would attend across "
                            "documents); train a Hugging Face model (--hf-config/--hf-model) on it")
        if self.micro_batches > 1 or self.pipeline_parallel > 1:
            raise MemoError(f"memo.train: --data {self.data} packs documents, whose position ids the "
                            "pipelined loop (--micro-batches/--pp) does not carry; run without them")

    @property
    def hugging_face(self) -> bool:
        """Whether the model is a Hugging Face one (``hf_model`` or ``hf_config``), not ``model``."""
        return self.hf_model is not None or self.hf_config is not None

    def _hf_flag(self) -> str:
        return "--hf-model" if self.hf_model is not None else "--hf-config"

    def _check_hf_model(self) -> None:
        """``hf_model``, the rope flags and ``export``: one model source, a checkpoint that is one (NOTE
        [Loading a checkpoint] in memo/engines.py), an engine that takes it, rope parameters for a
        Hugging Face model, an export path that is new and no input."""
        if self.hf_model is not None:
            if self.hf_config is not None:
                raise MemoError("memo.train: --hf-model loads a checkpoint with its own config; --hf-config "
                                "builds a model from a config alone: give one of them")
            if self.engine == "megatron" and (self.pipeline_parallel > 1 or self.micro_batches > 1):
                raise MemoError("memo.train: --hf-model under --engine megatron loads the checkpoint into "
                                "one GPTModel per rank; --pp and --micro-batches > 1 split it into stages it "
                                "is not loaded into: run with --pp 1 --micro-batches 1")
            from memo.engines import check_hf_checkpoint

            check_hf_checkpoint(self.hf_model)
        if isinstance(self.rope_scaling, str):
            self.rope_scaling = _json_object(self.rope_scaling, "--rope-scaling")
        if self.rope_scaling is not None and (
                not isinstance(self.rope_scaling, dict) or not isinstance(
                    self.rope_scaling.get("rope_type", self.rope_scaling.get("type")), str)):
            raise MemoError("memo.train: --rope-scaling must be a JSON object with a \"rope_type\" (linear, "
                            f"dynamic, yarn, llama3, longrope), got {self.rope_scaling!r:.120}")
        if self.rope_theta is not None and (isinstance(self.rope_theta, bool) or not isinstance(
                self.rope_theta, (int, float)) or not math.isfinite(self.rope_theta) or self.rope_theta <= 0):
            raise MemoError(f"memo.train: --rope-theta must be a positive number, got "
                            f"{self.rope_theta!r:.40}")
        if (self.rope_theta is not None or self.rope_scaling is not None) and not self.hugging_face:
            raise MemoError("memo.train: --rope-theta and --rope-scaling change a Hugging Face model's "
                            "config (--hf-model or --hf-config); memo's models take rope_theta in their "
                            "CONFIG.json")
        if self.export is not None:
            self._check_export()

    def _check_export(self) -> None:
        """NOTE [Exporting the trained model] in memo/train/export.py: a Hugging Face model, to a new
        directory that is no input."""
        from memo.train.export import check_export_path

        where = f"memo.train: --export {self.export!r}"
        if self.engine == "megatron" and not self.hugging_face:
            arch = get_config(self.model).arch
            if arch != "llama":
                raise MemoError(f"{where}: megatron's GPTModel of the {arch} model "
                                f"{self.model!r} has no Hugging Face class to export to; --export writes "
                                "llama-arch megatron models, and those of --hf-model or --hf-config")
        elif not self.hugging_face:
            raise MemoError(f"{where}: memo's model {self.model!r} has no Hugging Face layout to export to; "
                            "--export writes the model of --hf-model or --hf-config (or a llama-arch "
                            "model under --engine megatron)")
        if self.engine == "megatron" and (self.pipeline_parallel > 1 or self.micro_batches > 1):
            raise MemoError(f"{where}: a megatron model is exported from the one GPTModel per rank of a run "
                            "with --pp 1 --micro-batches 1; run without them")
        check_export_path(str(self.export), [("--hf-model", self.hf_model), ("--hf-config", self.hf_config),
                                             ("--data", self.data), ("--tokenizer", self.tokenizer)])

    def _check_run_options(self) -> None:
        """What a real run adds around the steps (memo/train/run_control.py): one MemoError line for a bad
        value or a flag that needs another, before any process group or model exists."""
        import os

        from memo.train.run_options import LR_SCHEDULES, check_tensorboard

        if self.lr_schedule not in LR_SCHEDULES:
            raise MemoError(f"memo.train: --lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got "
                            f"{self.lr_schedule!r}")
        for name in ("save_every", "eval_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise MemoError(f"memo.train: --{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("keep", "eval_batches"):
            if getattr(self, name) < 1:
                raise MemoError(f"memo.train: --{name.replace('_', '-')} must be >= 1, got "
                                f"{getattr(self, name)}")
        if self.warmup_steps < 0:
            raise MemoError(f"memo.train: --warmup-steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr <= self.lr:
            raise MemoError(f"memo.train: --min-lr must be in [0, --lr {self.lr:g}], got {self.min_lr:g}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise MemoError(f"memo.train: --clip-grad must be a positive norm, got {self.clip_grad}")
        if self.save_every is not None and self.save is None:
            raise MemoError("memo.train: --save-every N writes checkpoints to --save DIR; give --save too")
        if self.eval_every is not None and self.eval_data is None:
            raise MemoError("memo.train: --eval-every N evaluates on --eval-data FILE; give --eval-data too")
        if self.eval_data is not None and not os.path.isfile(self.eval_data):
            raise MemoError(f"memo.train: --eval-data {self.eval_data!r} is not a file")
        if self.tensorboard is not None:
            check_tensorboard()
        if self.resume is not None and not os.path.isdir(self.resume):
            raise MemoError(f"memo.train: --resume {self.resume!r} is not a folder; give the --save DIR of "
                            "an earlier run (or one of its step-N folders)")

    def _check_head_chunks(self) -> None:
        """--ulysses-head-chunks runs memo's Ulysses core attention on memo's models under FSDP2, over a
        count of chunks the heads split into; refused by name elsewhere, before any process group."""
        flag = f"--ulysses-head-chunks {self.ulysses_head_chunks}"
        if self.context_parallel == 1 or self.cp_comm != CPComm.A2A:
            raise MemoError(f"memo.train: {flag} chunks Ulysses context parallelism's heads; it needs --cp "
                            f"> 1 and --cp-comm a2a (got --cp {self.context_parallel} --cp-comm "
                            f"{self.cp_comm})")
        if self.engine != "fsdp2" or self.hugging_face:
            what = f"{self._hf_flag()} (its own attention)" if self.hugging_face else \
                f"--engine {self.engine}"
            raise MemoError(f"memo.train: {flag} runs under --engine fsdp2 on memo's models, whose core "
                            f"attention is memo's Ulysses; not with {what}")
        from memo.models.ulysses_attention import head_chunk_slices

        shapes = get_config(self.model)
        head_chunk_slices(shapes.n_heads, shapes.n_kv_heads or shapes.n_heads, self.context_parallel,
                          self.ulysses_head_chunks)


def _has_tokenizer(directory: str) -> bool:
    """Whether a Hugging Face checkpoint directory holds a tokenizer ``AutoTokenizer`` can load."""
    import os

    return any(os.path.isfile(os.path.join(directory, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _json_object(text: str, flag: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise MemoError(f"memo.train: {flag} {text!r:.120} is not JSON; give e.g. '{{\"rope_type\": "
                        "\"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 4096}'") from None


@dataclass
class StepMetrics:
    """What one step measured."""

    step: int
    loss: float
    step_time_s: float
    tgs: float
    """Tokens per second per device (one device here)."""
    mfu: float | None
    """Model FLOPs utilisation, ``None`` when the peak is unknown."""
    peak_memory_bytes: int | None
    extras: dict = field(default_factory=dict)
    """What the strategy measured after this step (host bytes, allocator counters, ...)."""
    lr: float | None = None
    """The learning rate the step ran at (memo/train/lr.py)."""
    grad_norm: float | None = None
    """The global gradient norm before clipping (NOTE [Global gradient norm] in memo/train/grad_norm.py)."""
    eval_loss: float | None = None
    """The mean loss on ``--eval-data`` after this step, when it evaluated (memo/train/evaluation.py)."""


@dataclass
class TrainResult:
    """A finished run: its config, per-step metrics and the constants they were computed from."""

    config: TrainConfig
    steps: list[StepMetrics] = field(default_factory=list)
    num_parameters: int = 0
    flops_per_sample: float = 0.0
    peak_flops: float | None = None
    peak_memory_kind: str = "unavailable"
    model_fingerprint: str = ""
    strategy: Strategy | None = None
    """The :class:`memo.train.Strategy` the run used."""
    world: int = 1
    """Processes (devices) the job's tokens are shared by: TGS is per device."""
    parallel: dict[str, Any] | None = None
    """A parallel run's layout (tp, cp, sp, dp, world) and every rank's device peak and host bytes
    (``ranks``); None for one process."""


def step_line(metrics: StepMetrics, memory_kind: str) -> str:
    """The log line of one step."""
    mfu_text = "n/a" if metrics.mfu is None else f"{100 * metrics.mfu:.1f}%"
    return (
        f"step {metrics.step:>4}  loss {metrics.loss:.4f}  time {metrics.step_time_s * 1e3:.0f} ms  "
        f"tgs {metrics.tgs:,.0f} tok/s  mfu {mfu_text}  peak mem {format_mib(metrics.peak_memory_bytes)} "
        f"({memory_kind})" + extras_text(metrics.extras)
    )


def token_source(config: TrainConfig, model_config: ModelConfig
                 ) -> SyntheticTokens | ByteFileTokens | PackedDocuments:
    """The batches of ``config.data`` by its kind (:func:`memo.train.corpus.data_kind`): packed documents of a
    JSONL corpus or an indexed dataset, the bytes of a file, or synthetic tokens."""
    from memo.train.corpus import IndexedDocuments, JsonlDocuments, PackedDocuments, data_kind

    kind = None if config.data is None else data_kind(config.data)
    if kind in ("jsonl", "indexed"):
        vocab = model_config.vocab_size
        documents = (IndexedDocuments(config.data, vocab) if kind == "indexed"
                     else JsonlDocuments(config.data, config.tokenizer, config.text_field, vocab))
        return PackedDocuments(documents, config.seq_len, config.micro_batch, config.seed)
    if config.data is not None:
        return ByteFileTokens(config.data, model_config.vocab_size, config.seq_len, config.micro_batch,
                              config.seed)
    return SyntheticTokens(model_config.vocab_size, config.seq_len, config.micro_batch, config.seed)


def new_result(config: TrainConfig, model: torch.nn.Module, model_config: ModelConfig, device: torch.device,
                dtype: torch.dtype, strategy: Any) -> TrainResult:
    """The run's result before any step: the model's size and FLOPs, the device's peak FLOPS."""
    return TrainResult(
        config=config,
        num_parameters=sum(p.numel() for p in model.parameters()),
        flops_per_sample=flops_per_sample(model_config, config.seq_len),
        peak_flops=detect_peak_flops(device, dtype,
                                     None if config.peak_tflops is None else config.peak_tflops * 1e12),
        model_fingerprint=fingerprint(model_config),
        strategy=strategy,
    )


def extras_text(extras: dict[str, Any]) -> str:
    if not extras:
        return ""
    alloc = extras.get("allocator", {})
    return (
        f"  host pinned {format_mib(extras.get('host_pinned_bytes', 0))}"
        f"  alloc planned/fallback/unplanned {alloc.get('planned', 0)}/{alloc.get('fallback', 0)}/"
        f"{alloc.get('unplanned', 0)}"
        + (f"  copy wait {extras['copy_wait_s'] * 1e3:.1f} ms" if "copy_wait_s" in extras else "")
    )
