"""The pieces of a training run: one step, metrics, the measured loop (its data sources are in
memo/train/data.py, what a rank of a parallel job adds in memo/train/parallel.py).

``examples/train_gpt.py`` is a thin shell around :func:`add_train_arguments`,
:func:`train_config_from_args` and :func:`train`; ``memo train`` (memo/cli/train.py) builds a
:class:`TrainConfig` and a strategy (memo/train/strategies.py) and calls :func:`train`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from memo.errors import MemoError, internal_assert
from memo.models import DEFAULT_MAX_SEQ_LEN, build_model, get_config, hf_shapes, list_configs
from memo.models.dtypes import DTYPES
from memo.planner.job import JobSpec
from memo.profiler.bounds import check_least_memory, least_memory
from memo.train.config import StepMetrics, TrainConfig, TrainResult, new_result, step_line, token_source
from memo.train.data import Batch, ByteFileTokens, SyntheticTokens
from memo.train.evaluation import eval_loss
from memo.train.grad_norm import GradNorm
from memo.train.optim import adamw, rank_optimizer
from memo.train.parallel import ParallelLoss as _ParallelLoss
from memo.train.parallel import Sharded as _Sharded
from memo.train.parallel import agree as _agree
from memo.train.parallel import parallel_record as _parallel_record
from memo.train.parallel import ranks_text as _ranks
from memo.train.parallel import start_parallel as _start_parallel
from memo.train.plan_checks import TrainRun
from memo.train.run_control import RunControl
from memo.utils.flops import mfu

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelRun
    from memo.models import ModelConfig
    from memo.train.parallel import ParallelLoss
    from memo.train.strategies import Strategy

__all__ = [
    "DTYPES",
    "ByteFileTokens",
    "StepMetrics",
    "SyntheticTokens",
    "TrainConfig",
    "TrainResult",
    "adamw",
    "add_train_arguments",
    "peak_memory",
    "reset_peak_memory",
    "summarize",
    "train",
    "train_config_from_args",
    "train_step",
]

#: ``--dtype`` choices.

def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only; CPU peak RSS cannot be reset).

    With memo's CUDA allocator installed, PyTorch's own counters raise (a pluggable allocator has
    none), so memo's allocator restarts its peak instead (NOTE [Measuring device memory]).
    """
    if device.type != "cuda":
        return
    from memo import allocator

    if allocator.cuda_installed():
        allocator.reset_stats(device)
    else:
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    """Peak memory so far and what the number is.

    CUDA: bytes of live tensors at the peak since the last reset, from memo's allocator when it
    is PyTorch's CUDA allocator, else ``torch.cuda.max_memory_allocated``.
    CPU: the process's peak resident set size from ``getrusage`` (everything the process
    ever touched: Python, torch's libraries, tensors; never reset), Linux and macOS only.
    """
    if device.type == "cuda":
        from memo import allocator

        if allocator.cuda_installed():
            return int(allocator.stats(device)["peak_bytes_in_use"]), "memo_allocator_peak_in_use"
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    if device.type == "cpu":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is KiB on Linux and bytes on macOS.
        return (rss if sys.platform == "darwin" else rss * 1024), "process_peak_rss"
    return None, "unavailable"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    labels: torch.Tensor,
    iteration: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    step_loss: ParallelLoss | None = None,
    positions: torch.Tensor | None = None,
    grad_norm: GradNorm | None = None,
) -> torch.Tensor:
    """One forward + backward + optimizer step; returns the (detached) loss.

    ``iteration()`` wraps forward + backward only (a strategy's phase tracking): the
    optimizer step is no layer's work and must not be attributed to the last backward phase.
    ``step_loss``: one rank's share of a parallel job (NOTE [Parallel layout]): its ``loss(model,
    ids, labels)`` gives ``(to_backward, global_loss)``, ``zero_grads()`` and ``finish_grads(model)``
    bracket the gradients; None: the model adapter's loss, one process. ``positions``: ``[b, s]`` position
    ids of packed documents (NOTE [Packed documents] in memo/train/corpus.py), one process (a parallel
    rank's are in ``step_loss``). ``grad_norm``: measures (and clips) the reduced gradients before the
    optimizer steps (memo/train/grad_norm.py).
    """
    if step_loss is None:
        from memo.adapters.model import adapter_loss, model_adapter_for

        adapter = model_adapter_for(model, "memo.train")
        optimizer.zero_grad(set_to_none=True)
        with iteration():
            loss = adapter_loss(adapter, model, ids, labels, positions)
            loss.backward()
        if grad_norm is not None:
            grad_norm(model.parameters())
        optimizer.step()
        return loss.detach()
    optimizer.zero_grad(set_to_none=True)
    step_loss.zero_grads()
    with iteration():
        to_backward, loss = step_loss.loss(model, ids, labels)
        to_backward.backward()
    step_loss.finish_grads(model)
    if grad_norm is not None:
        grad_norm(model.parameters())
    optimizer.step()
    return loss


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the training flags (the fields of :class:`TrainConfig`) to ``parser``."""
    d = TrainConfig()
    parser.add_argument("--model", default=d.model, help=f"model name: {', '.join(list_configs())}")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per step")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps to run")
    parser.add_argument("--device", default=d.device, help="cpu or cuda[:i]")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=d.dtype,
        help="dtype of parameters, activations and AdamW state (no float32 master weights)",
    )
    parser.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (constant)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for initialisation and data")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="device peak TFLOPS for MFU; default: looked up for known GPUs, MFU 'n/a' otherwise",
    )
    parser.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="train on the bytes of FILE (token id = byte; model vocab must be >= 256) instead of "
        "synthetic tokens (a fixed random cycle whose loss falls quickly)",
    )


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build a :class:`TrainConfig` from flags added by :func:`add_train_arguments`."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})




def train(
    config: TrainConfig,
    *,
    log: Callable[[str], None] | None = None,
    progress: bool = True,
    strategy: Strategy | None = None,
) -> TrainResult:
    """Train ``config.model`` for ``config.steps`` steps with AdamW and measure every step.

    Args:
        config: the run.
        log: where per-step lines go (default: ``tqdm.write`` so they do not break the bar).
        progress: show a tqdm progress bar (on stderr).
        strategy: a :class:`memo.train.Strategy` (default: :class:`memo.train.NoStrategy`); it
            prepares the model (recompute, wrapping, profiling and planning), wraps every step and
            measures it. It is closed when training ends, also when a step fails.
    """
    from tqdm import tqdm

    if config.micro_batches > 1 or config.pipeline_parallel > 1:
        from memo.train.pipelined import train_pipelined

        return train_pipelined(config, log=log, progress=progress, strategy=strategy)
    if getattr(getattr(strategy, "options", None), "save_plan", None):
        raise MemoError("memo.train: --save-plan writes the stages' plans of a pipelined run "
                        "(--micro-batches or --pp); `memo profile -o PLAN.json` writes the plan of one "
                        "iteration")
    if strategy is None:
        from memo.train.strategies import NoStrategy

        strategy = NoStrategy()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MemoError(f"memo.train: --device {config.device} asked for CUDA, but torch sees no CUDA device")
    dtype = DTYPES[config.dtype]
    parallel = _start_parallel(config)  # None: one process
    try:
        if parallel is not None:
            device = parallel.device
            if not parallel.is_first:
                log, progress = (lambda _line: None), False  # NOTE [Parallel layout]: rank 0 speaks
        torch.manual_seed(config.seed)
        model, model_config = _build(config, device, dtype, strategy.device_budget_bytes, parallel)
        control = RunControl(config, strategy, parallel, log if log is not None else tqdm.write)
        source = token_source(config, model_config)
        control.begin(model_config, source, {"world": 1} if parallel is None else parallel.as_dict())
        batches = iter(source)
        optimizer = None
        if parallel is not None:
            parallel.wrap(model)  # with --ulysses-head-chunks (NOTE [Ulysses over chunks of heads])
            batches = _Sharded(batches, parallel)
            # before the profile: its plan counts the optimizer states this rank holds (NOTE [ZeRO-1
            # under megatron] in memo/train/optim.py)
            optimizer = rank_optimizer(model.parameters(), config.lr, parallel.optimizer_group())
        first = tuple(t.to(device) for t in next(batches))
        if parallel is not None:  # the profile records the step's own loss (use_model_adapter)
            from memo.adapters.model import use_model_adapter

            use_model_adapter(model, parallel.model_adapter(first[2], batches.count, *first[3:]))
        elif len(first) > 2:  # packed documents: the profile records a packed step (with_positions)
            from memo.adapters.model import model_adapter_for, use_model_adapter, with_positions

            use_model_adapter(model, with_positions(model_adapter_for(model, "memo.train"), first[2]))
        emit = log if log is not None else tqdm.write
        result = new_result(config, model, model_config, device, dtype, strategy)
        result.world = 1 if parallel is None else parallel.layout.world
        job = JobSpec(model=model_config.name, fingerprint=result.model_fingerprint, seq_len=config.seq_len,
                      micro_batch=config.micro_batch, dtype=config.dtype, tensor_parallel=1,
                      context_parallel=1, sequence_parallel=False)
        if parallel is not None:
            job = dataclasses.replace(job, micro_batch=config.micro_batch // parallel.layout.data_parallel,
                                      tensor_parallel=parallel.layout.tensor_parallel,
                                      context_parallel=parallel.layout.context_parallel,
                                      sequence_parallel=parallel.layout.sequence_parallel)
        run = TrainRun(job, parallel)
        try:
            control.reuse_plan(job)
            strategy.prepare(model, first[0], first[1], run, log=emit)
            control.prepared()
            if parallel is not None:
                _agree(parallel, strategy, emit)
            _steps(config, model, model_config, strategy, result, batches, first, emit, progress, parallel,
                   optimizer, control)
        finally:
            control.close()
            strategy.close()
        if config.export is not None:  # every rank: FSDP2 gathers the shards (memo/train/export.py)
            from memo.train import export

            export.export_trained(model, config.export, parallel, config.hf_model, emit)
        if parallel is not None:
            result.parallel = _parallel_record(parallel, result)
    finally:
        if parallel is not None:
            parallel.close()
    return result


def _steps(config: TrainConfig, model: torch.nn.Module, model_config: ModelConfig, strategy: Strategy,
           result: TrainResult, batches: Iterator[Batch], first: Batch | None, emit: Callable[[str], None],
           progress: bool, parallel: ParallelRun | None = None,
           optimizer: torch.optim.Optimizer | None = None, control: RunControl | None = None) -> None:
    """The measured steps of :func:`train`, inside the prepared strategy (``parallel``: this rank's
    :class:`memo.distributed.layout.ParallelRun`, whose batches are ``(ids, labels, positions)``;
    ``optimizer``: its optimizer, else AdamW over the model's parameters; ``control``: the run's schedule,
    clipping, evaluation, metrics and checkpoints, memo/train/run_control.py)."""
    from tqdm import tqdm

    device = first[0].device
    if optimizer is None:
        optimizer = adamw(model.parameters(), lr=config.lr)
    peak = result.peak_flops
    emit(
        f"memo.train: {_model_name(config, model_config)} ({result.num_parameters / 1e6:.2f}M params), "
        f"seq {config.seq_len} x "
        f"batch {config.micro_batch}, {config.dtype} on {device}, {_run_kind(strategy)}, "
        + ("" if parallel is None else f"{_ranks(parallel.layout.world)} ({parallel.layout}), ")
        + ("MFU n/a (no peak FLOPS known for this device; --peak-tflops sets one)" if peak is None
           else f"MFU against a peak of {peak / 1e12:.0f} TFLOPS")
    )
    internal_assert(control is not None, "memo.train: _steps runs under train()'s RunControl")
    session = getattr(getattr(strategy, "meter", None), "session", None)
    resumed_at = control.attach(getattr(parallel, "root", None) or model, optimizer,
                                lambda evals: eval_loss(model, evals, parallel, device, session))
    reset_peak_memory(device)
    # A bar on a terminal; in a redirected log the step lines below say the same without the noise.
    bar = tqdm(range(resumed_at + 1, config.steps + 1), desc="train", unit="step", file=sys.stderr,
               disable=not progress or not sys.stderr.isatty())
    for step in bar:
        if first is not None:
            batch, first = first, None
        else:
            batch = tuple(t.to(device, non_blocking=True) for t in next(batches))
        ids, labels = batch[0], batch[1]
        # (ids, labels[, document positions]) from a source; (ids, labels, shard positions[, the shard's
        # document positions]) from a parallel rank's Sharded
        positions = batch[2] if parallel is None and len(batch) > 2 else None
        step_loss = None if parallel is None else _ParallelLoss(parallel, batch[2], batches.count,
                                                                 batch[3] if len(batch) > 3 else None)
        _synchronize(device)
        start = time.perf_counter()
        loss = _run_step(model, optimizer, ids, labels, strategy, step, step_loss, positions,
                         control.grad_norm)
        _synchronize(device)
        seconds = time.perf_counter() - start
        if not math.isfinite(loss):
            raise MemoError(
                f"memo.train: loss became {loss} at step {step}; lower --lr or use --dtype float32/bfloat16"
            )
        metrics = _step_metrics(config, strategy, result, step, loss, seconds, device)
        result.steps.append(metrics)
        bar.set_postfix(loss=f"{loss:.3f}")
        emit(step_line(metrics, result.peak_memory_kind))
        control.end_step(step, metrics)
    bar.close()


def _run_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
              labels: torch.Tensor, strategy: Strategy, step: int,
              step_loss: ParallelLoss | None = None, positions: torch.Tensor | None = None,
              grad_norm: GradNorm | None = None) -> float:
    """One training step under the strategy, its loss as a float (``.item()`` waits for the step).

    A request memo's allocator refused (its budget, NOTE [Device budget], or the device) is
    raised as one MemoError line with its numbers, not a traceback from deep inside autograd.
    """
    try:
        return train_step(model, optimizer, ids, labels, strategy.step, step_loss,
                          positions, grad_norm).float().item()  # waits
    except RuntimeError as err:
        if "memo allocator:" not in str(err) and not isinstance(err, torch.cuda.OutOfMemoryError):
            raise
        # memo's allocator refused a request (its budget, NOTE [Device budget], or the device):
        # one line with its numbers, not a traceback from deep inside autograd.
        message = str(err).splitlines()[0]
        if "fallback limit" in message:
            message += (" (with --device-mem-gb the limit is the budget less the parameters and the "
                        "plan's arena: give a larger budget or a shorter sequence)")
        raise MemoError(f"memo.train: step {step} ran out of device memory: {message}") from None


def _step_metrics(config: TrainConfig, strategy: Strategy, result: TrainResult, step: int, loss: float,
                  seconds: float, device: torch.device) -> StepMetrics:
    """The measurements of one step; the peak memory is the strategy's where it measures the
    device, else the process's own (``result.peak_memory_kind`` says which)."""
    extras = strategy.step_stats()
    if extras.get("peak_device_bytes") is not None:
        mem, result.peak_memory_kind = extras["peak_device_bytes"], extras["peak_device_kind"]
    else:  # a strategy that cannot measure the device: the process's own numbers
        mem, result.peak_memory_kind = peak_memory(device)
    return StepMetrics(
        step=step,
        loss=loss,
        step_time_s=seconds,
        tgs=config.micro_batch * config.seq_len / seconds / result.world,
        mfu=mfu(result.flops_per_sample, config.micro_batch, seconds, result.peak_flops),
        peak_memory_bytes=mem,
        extras=extras,
    )


def _build(config: TrainConfig, device: torch.device, dtype: torch.dtype, budget_bytes: int | None,
           parallel: Any = None) -> tuple[torch.nn.Module, Any]:
    """The model to train and a memo ModelConfig of its shapes (for FLOPs, the fingerprint and plans)."""
    from memo import engines

    if config.hf_model is not None:  # NOTE [Loading a checkpoint] in memo/engines.py
        hf = engines.hf_checkpoint_config(config.hf_model, config.rope_theta, config.rope_scaling)
        if config.engine == "megatron":
            return engines.load_megatron_from_hf(config.hf_model, hf, config.seq_len, device, dtype,
                                                 None if parallel is None else parallel.layout)
        return engines.load_hf_causal_lm(config.hf_model, hf, device, dtype), hf_shapes(hf)
    if config.hf_config is not None:
        hf = engines.hf_config(config.hf_config)
        engines.apply_rope(hf, config.rope_theta, config.rope_scaling)  # NOTE [Context extension]
        model = engines.build_hf_causal_lm(hf, device, dtype)
        return model, hf_shapes(hf)
    model_config = get_config(config.model)
    max_seq_len = max(config.seq_len, DEFAULT_MAX_SEQ_LEN) if model_config.arch == "gpt" else None
    # NOTE [Least memory, checked first]: refuse a length the device cannot hold before building the
    # model for real (GPT's position table alone can exceed the machine) or profiling it.
    if parallel is None:  # a rank of a parallel job: its profile checks its own shard
        sizing = build_model(model_config, device="meta", dtype=dtype, max_seq_len=max_seq_len)
        check_least_memory(least_memory(sizing, config.seq_len, config.micro_batch), device, budget_bytes,
                           "memo.train", config.seq_len)
        del sizing
    if config.engine == "megatron":
        model = engines.build_megatron_gpt(model_config, max_seq_len or config.seq_len, device, dtype,
                                           None if parallel is None else parallel.layout)
        return model, model_config
    model = build_model(
        model_config, device=device, dtype=dtype, max_seq_len=max_seq_len
    )
    return model, model_config


def _model_name(config: TrainConfig, model_config: ModelConfig) -> str:
    if config.hugging_face:
        fsdp2 = ", FSDP2" + (", states offloaded" if config.offload_states else "")
        source = "" if config.hf_model is None else f" from {config.hf_model}"
        if config.engine == "megatron":
            return f"{model_config.name}{source} (converted into a megatron-core GPTModel)"
        return f"{model_config.name}{source} (Hugging Face{fsdp2 if config.engine == 'fsdp2' else ''})"
    if config.engine == "fsdp2":
        return f"{config.model} (FSDP2{', states offloaded' if config.offload_states else ''})"
    return config.model if config.engine == "memo" else f"{config.model} (megatron-core GPTModel)"


def _run_kind(strategy: Strategy) -> str:
    """What the header says about activation memory: the strategy, with its alpha when it has one."""
    alpha = strategy.alpha
    if alpha is None:
        return f"strategy {strategy.name}"
    if strategy.offloaded_layers == 0:
        return f"strategy {strategy.name} (no layer offloads: alpha {alpha:.4f} has no effect)"
    return f"strategy {strategy.name} (alpha {alpha:.4f})"


def summarize(result: TrainResult) -> dict:
    """First/last loss, peak memory and means over the steps after the first (warm-up)."""
    steps = result.steps
    timed = steps[1:] if len(steps) > 1 else steps  # step 1 includes one-time warm-up work
    mfus = [s.mfu for s in timed if s.mfu is not None]
    return {
        "first_loss": steps[0].loss if steps else None,
        "last_loss": steps[-1].loss if steps else None,
        "mean_step_time_s": sum(s.step_time_s for s in timed) / len(timed) if timed else None,
        "mean_tgs": sum(s.tgs for s in timed) / len(timed) if timed else None,
        "mean_mfu": sum(mfus) / len(mfus) if mfus else None,
        "peak_memory_bytes": max((s.peak_memory_bytes or 0) for s in steps) if steps else None,
    }
