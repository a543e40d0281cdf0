"""What a real run adds around the steps of either training loop (memo/train/loop.py, one step per batch;
memo/train/pipelined.py, megatron's schedules): the learning-rate schedule (memo/train/lr.py), the
gradient norm and clipping (memo/train/grad_norm.py), evaluation (memo/train/evaluation.py), metrics
(memo/train/metrics.py), checkpoints and resume (memo/train/checkpoint.py) and stopping on a signal
(memo/train/stop.py). Both loops drive one :class:`RunControl` the same way::

    control = RunControl(config, strategy, parallel, emit)
    control.begin(model_config, source, layout)     # before the first batch is read
    control.reuse_plan(job)                         # before the strategy profiles
    start = control.attach(module, optimizer, eval_fn)   # inside the Session, before the first step
    for step in range(start + 1, config.steps + 1):
        ... a step, with control.grad_norm called before the optimizer steps, its line printed ...
        control.end_step(step, metrics)
    control.close()

NOTE [Exact resume]
A resumed run's losses are the uninterrupted run's, bit for bit on the CPU, when everything a step reads
is what it was: the weights and the optimizer's states and step counts (DCP), the learning rate (the
scheduler's state), the batches (the token source's generator, restored before the run takes its first
batch, which memo's profile runs on), the generators (torch's, Python's, megatron's: restored after the
profile, which draws from them, so that the first step draws what the uninterrupted run's step k + 1
drew), and memo's choices: alpha, the layer policy and the address plan change which tokens a layer
recomputes and how its work is cut into chunks, and a new profile measures the machine again, so the
resumed run replays the plan its checkpoint saved instead of profiling again, wherever that plan fits the
run (the same job, ``--alpha auto`` or the plan's alpha, the same device budget; in a parallel run, every
rank's, and under one step per batch the same plan on every rank, as the ranks' agreement requires).
Otherwise it says why and profiles again, and its losses may differ in the last bits. Evaluation
leaves the generators as it found them (NOTE [Evaluation] in memo/train/evaluation.py).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memo.errors import MemoError
from memo.planner.vocab import StrategyName
from memo.train.checkpoint import Resume, TrainState, save_checkpoint
from memo.train.grad_norm import GradNorm
from memo.train.lr import lr_scheduler
from memo.train.metrics import MetricsLog, step_record
from memo.train.stop import StopRequested, StopSignals

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelRun
    from memo.models import ModelConfig
    from memo.planner.job import JobSpec
    from memo.train.config import StepMetrics, TrainConfig
    from memo.train.data import Batch
    from memo.train.strategies import Strategy

__all__ = ["RunControl"]

Emit = Callable[[str], None]


class RunControl:
    """One run's schedule, clipping, evaluation, metrics, checkpoints and stop signals (the module
    docstring). ``parallel``: this rank's ParallelRun (None in one process)."""

    def __init__(self, config: TrainConfig, strategy: Strategy, parallel: ParallelRun | None,
                 emit: Emit) -> None:
        self.config, self.strategy, self.parallel, self.emit = config, strategy, parallel, emit
        self.rank = 0 if parallel is None else parallel.rank
        self.resume = Resume(config.resume, self.rank) if config.resume is not None else None
        self.grad_norm = GradNorm(config.clip_grad,
                                  megatron=config.engine == "megatron" and parallel is not None)
        self.identity: dict[str, Any] = {}
        self.state: TrainState | None = None
        self.metrics: MetricsLog | None = None
        self.stop = StopSignals() if config.save is not None else None
        self.world = 1
        self._source: Any = None
        self._model_config: ModelConfig | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._evals: list[Batch] = []
        self._eval_fn: Callable[[list[Batch]], float] | None = None
        self._saved_at: int | None = None
        self._options: tuple[Any, Any] | None = None

    # ------------------------------------------------------------------------------ before the steps
    def begin(self, model_config: ModelConfig, source: Any, layout: dict[str, Any]) -> None:
        """Before the first batch: check ``--resume``'s checkpoint against this run and put ``source``
        where the saved run's was (NOTE [Exact resume])."""
        from memo.models import fingerprint

        c = self.config
        self.world = int(layout.get("world", 1))
        self.identity = {"model": model_config.name if c.hf_config is not None else c.model,
                         "model_fingerprint": fingerprint(model_config), "engine": c.engine,
                         "world": self.world,
                         "layout": {k: v for k, v in layout.items() if k != "offload_states"},
                         "seq_len": c.seq_len, "dtype": c.dtype, "micro_batch": c.micro_batch,
                         "micro_batches": c.micro_batches}
        self._source, self._model_config = source, model_config
        if self.resume is not None:
            self.resume.check(self.identity)
            if self.resume.step >= c.steps:
                raise MemoError(f"memo.train: --resume {self.resume.dir} is at step {self.resume.step}, and "
                                f"--steps is {c.steps}: nothing is left to run; give --steps > "
                                f"{self.resume.step}")
            self.resume.restore_data(source)

    def reuse_plan(self, job: JobSpec | None, per_rank: bool = False) -> None:
        """Before the strategy prepares: run on the checkpoint's plan where it fits (NOTE [Exact resume]).
        ``job``: what the plan must have been made for (None: the stage's checks, memo.pipeline, judge);
        ``per_rank``: the strategy takes a pattern with ``{rank}`` (a pipelined run's stages)."""
        if self.resume is None or self.strategy.name != StrategyName.MEMO:
            return
        opts = self.strategy.options  # type: ignore[attr-defined]
        if opts.plan is not None or not opts.planned_allocator:
            return
        reason = self._plan_problem(opts, job)
        if self.parallel is not None:
            everyone = self.parallel.gather(reason)
            reason = next((f"rank {i}: {r}" for i, r in enumerate(everyone) if r is not None), None)
        if reason is not None:
            self.emit(f"memo.train: resuming with a new profile ({reason}); the losses may differ from an "
                      "uninterrupted run's in the last bits")
            return
        self._options = (opts.plan, opts.alpha)
        name = "plan-rank{rank}.json" if per_rank else f"plan-rank{self.rank}.json"
        opts.plan, opts.alpha = str(self.resume.dir / name), "auto"
        self.emit(f"memo.train: resuming on the plan saved with step {self.resume.step} (no new profile)")

    def _plan_problem(self, opts: Any, job: JobSpec | None) -> str | None:
        """Why this rank's saved plan does not fit the run (None: it does)."""
        from memo.planner import load_plan
        from memo.planner.job import job_mismatch
        from memo.train.plan_checks import check_plan_budget

        path = self.resume.plan_path() if self.resume is not None else None
        if path is None:
            return "the checkpoint holds no plan"
        try:
            plan = load_plan(path)
            check_plan_budget(plan, opts.device_mem_gb)
        except MemoError as err:
            return str(err)
        if opts.alpha != "auto" and plan.alpha is not None and float(opts.alpha) != float(plan.alpha):
            return f"--alpha {opts.alpha} is not the plan's {plan.alpha}"
        return None if job is None else job_mismatch(getattr(plan, "meta", {}) or {}, job)

    def prepared(self) -> None:
        """The strategy has prepared: the caller's options back. The plan each rank runs is then its own
        profile's, as in the run that saved it (the ranks' agreement in memo/train/parallel.py lets the
        ranks of one step per batch run plans of their own recordings)."""
        if self._options is not None:
            opts = self.strategy.options  # type: ignore[attr-defined]
            opts.plan, opts.alpha = self._options
            self._options = None

    def attach(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               eval_fn: Callable[[list[Batch]], float]) -> int:
        """Inside the Session, before the first step: the scheduler, the resumed states, the evaluation
        batches, the metrics files and the signal handlers. Returns the step the run starts after."""
        self.prepared()
        c = self.config
        self._optimizer = optimizer
        local = _local_optimizer(optimizer)
        self.state = TrainState(module, local, lr_scheduler(optimizer, c), self._source)
        start = 0
        if self.resume is not None:
            start = self.resume.step
            self.resume.load(self.state)
            # the rate of this run's schedule at the saved step (NOTE [Learning-rate schedule]: the same
            # float as the saved one for the same flags), into the optimizer's groups (ZeRO-1 steps its
            # wrapper's groups into its local optimizer's)
            scheduler = self.state.scheduler
            for group, factor, base in zip(optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs,
                                           strict=True):
                group["lr"] = base * factor(scheduler.last_epoch)
            self.emit(f"memo.train: resumed from {self.resume.dir} at step {start}")
        if c.eval_data is not None:
            from memo.train.evaluation import eval_batches

            self._evals, self._eval_fn = eval_batches(c, self._model_config), eval_fn  # type: ignore[arg-type]
        if self.rank == 0 and (c.metrics is not None or c.tensorboard is not None):
            self.metrics = MetricsLog(c.metrics, c.tensorboard, start)
        if self.stop is not None:
            self.stop.install()
        return start

    # ------------------------------------------------------------------------------ after each step
    def end_step(self, step: int, metrics: StepMetrics) -> None:
        """The step's learning rate and gradient norm into ``metrics``, the scheduler stepped, then the
        evaluation, the metrics line and the checkpoint that are due, and the stop a signal asked for."""
        c = self.config
        if self.state is None or self._optimizer is None:
            raise MemoError("memo.train: RunControl.end_step before attach()")
        metrics.lr = float(self._optimizer.param_groups[0]["lr"])
        metrics.grad_norm = self.grad_norm.last
        self.state.scheduler.step()
        if self._eval_fn is not None and (step % c.eval_every == 0 if c.eval_every else step == c.steps):
            metrics.eval_loss = self._eval_fn(self._evals)
            self.emit(f"eval {step:>4}  loss {metrics.eval_loss:.4f}  ({len(self._evals)} batches of "
                      f"{c.eval_data})")
        if self.metrics is not None:
            self.metrics.write(step_record(metrics, self.world))
        due = step == c.steps or (c.save_every is not None and step % c.save_every == 0)
        if c.save is not None and due:
            self._save(step)
        self._check_stop(step)

    def _check_stop(self, step: int) -> None:
        """Stop every rank at this step if any got SIGTERM or SIGINT: save, then raise
        :class:`memo.train.stop.StopRequested` (NOTE [Stopping at a step] in memo/train/stop.py)."""
        if self.stop is None:
            return
        signum = self.stop.agreed(torch.distributed.is_initialized())
        if not signum:
            return
        if self._saved_at != step:
            self._save(step)
        name = signal.Signals(signum).name
        raise StopRequested(signum, f"memo.train: stopped by {name} after step {step}, its checkpoint saved; "
                                    f"continue with --resume {self.config.save}")

    def _save(self, step: int) -> None:
        if self.state is None:
            raise MemoError("memo.train: RunControl._save before attach()")
        self.state.plan = _plan_of_job(getattr(self.strategy, "plan", None), self.identity)
        manifest = {**self.identity, "strategy": self.strategy.name}
        path = save_checkpoint(self.config.save, step, self.state, manifest,  # type: ignore[arg-type]
                               self.config.keep)
        self._saved_at = step
        self.emit(f"memo.train: checkpoint of step {step} written to {path}")

    def close(self) -> None:
        """Close the metrics files, give the signals back their handlers, the caller its options."""
        self.prepared()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.stop is not None:
            self.stop.uninstall()


def _plan_of_job(plan: Any, identity: dict[str, Any]) -> Any:
    """``plan`` as the checkpoint keeps it: a plan whose profile could not name the model (megatron's
    GPTModel, recorded under its class name) is given the run's model and fingerprint, which the manifest
    vouches for, so that the resumed run's check of the plan against its job passes."""
    if plan is None or (getattr(plan, "meta", None) or {}).get("fingerprint") is not None:
        return plan
    import copy

    named = copy.copy(plan)
    named.meta = {**(plan.meta or {}), "model": identity["model"],
                  "fingerprint": identity["model_fingerprint"]}
    return named


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states: ZeRO-1's local one, else ``optimizer``. Only a process
    that imported torch.distributed.optim can hold a ZeroRedundancyOptimizer; importing it to ask costs
    every other run a second of CPU at start."""
    zero = sys.modules.get("torch.distributed.optim")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer
