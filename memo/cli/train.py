"""``memo train``: from nothing to a memo-trained model in one command.

Profile (or load ``--plan``), solve alpha, plan, wrap the layers, install the planned
allocator, train; per step print loss, step time, tokens per device per second (TGS),
MFU, peak device memory, pinned host bytes and planned/fallback allocations.

Examples::

    memo train --model tiny --seq-len 1K --steps 20 --report memo.json
    memo train --model tiny --seq-len 1K --steps 20 --strategy full-recompute --report base.json \\
        --plot loss.png --compare memo.json
    torchrun --standalone --nproc-per-node 2 -m memo train --engine megatron --tp 2 --sp --model tiny \\
        --seq-len 2K --steps 10 --report tp2.json
    torchrun --standalone --nproc-per-node 2 -m memo train --engine fsdp2 --offload-states --model tiny \\
        --seq-len 1K --micro-batch 2 --steps 10 --report fsdp2.json
    memo train --model tiny --seq-len 1K --steps 1000 --lr-schedule cosine --warmup-steps 50 \\
        --clip-grad 1.0 --save ck --save-every 100 --metrics run.jsonl --config run.yaml
    memo train ... --resume ck    # after a crash, SIGTERM or Ctrl-C: continues with the same losses

Several processes (``torchrun``): NOTE [Parallel layout] in memo/distributed/layout.py. Every rank
profiles and plans its own shard and trains; only rank 0 prints and writes the report, which
records the layout and every rank's device peak and host bytes.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from memo.cli.args import (
    add_machine_arguments,
    figure_path,
    positive_float,
    positive_int,
    seq_len,
    train_device,
)
from memo.cli.config_file import take_config_file
from memo.errors import MemoError
from memo.planner.vocab import StrategyName
from memo.train import STRATEGIES
from memo.train.report import build_report, load_report, save_report
from memo.units import format_mib

if TYPE_CHECKING:
    from memo.train.config import TrainConfig
    from memo.train.strategies import StrategyOptions

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    from memo.train.loop import train
    from memo.train.plots import plot_losses
    from memo.train.strategies import make_strategy

    compare = _checked_inputs(args)
    options, config = _options(args), _config(args)
    if config.device.startswith("cuda") and args.strategy == StrategyName.MEMO and options.planned_allocator:
        from memo import allocator

        # memo's CUDA allocator must be PyTorch's before the first CUDA tensor exists.
        if not allocator.cuda_installed():
            allocator.install_cuda()
    result = train(config, progress=not args.no_progress, strategy=make_strategy(options))
    if result.parallel is not None and result.parallel["ranks"][0]["rank"] != _rank():
        return 0  # NOTE [Parallel layout]: rank 0 prints and writes the report
    report = build_report(result)
    _print_summary(report)
    if result.parallel is not None:
        print(_ranks_line(result.parallel))
    if args.report:
        save_report(report, args.report)
        print(f"report written to {args.report}")
    if args.plot:
        plot_losses([report, *compare], args.plot)
        print(f"loss curves written to {args.plot}")
    return 0


def _checked_inputs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Refuse bad paths and flags before training; the reports ``--compare`` adds to the plot."""
    from memo.jsonio import check_writable
    from memo.train.corpus import indexed_prefix

    _check_paths(args)
    if args.data and not os.path.isfile(args.data) and indexed_prefix(args.data) is None:
        raise MemoError(f"memo train: --data {args.data!r} is not a file (nor a megatron indexed "
                        "dataset's prefix); give a FILE.jsonl (with --tokenizer), the PREFIX of "
                        "PREFIX.bin/.idx, or a file to train on its bytes, or leave --data out for synthetic "
                        "tokens")
    for path, flag in ((args.report, "--report"), (args.plot, "--plot"), (args.metrics, "--metrics")):
        if path:  # before training, so that a long run does not end in an error that loses it
            check_writable(path, f"memo train {flag}")
    compare = [load_report(p) for p in args.compare]  # refuse bad files before training
    if args.compare and not args.plot:
        raise MemoError("memo train: --compare adds curves to --plot; give --plot out.png as well")
    if args.plan and args.engine == "fsdp2":  # NOTE [memo under FSDP2] in memo/distributed/fsdp2.py
        raise MemoError("memo train: --engine fsdp2 plans each rank from its own sharded model (FSDP2's "
                        "gathered parameters and reduce-scatter buffers in the trace); `memo profile` "
                        "records the unsharded model, so its --plan does not describe this run: drop --plan")
    return compare


def _options(args: argparse.Namespace) -> StrategyOptions:
    from memo.allocator.host import local_world_size
    from memo.train.strategies import StrategyOptions

    return StrategyOptions(
        strategy=args.strategy,
        alpha=args.alpha,
        plan=args.plan,
        save_plan=args.save_plan,
        planned_allocator=not args.no_planned_allocator,
        bandwidth_gbps=args.bandwidth_gbps,
        layer_ms=args.layer_ms,
        host_mem_gb=args.host_mem_gb,
        # NOTE [Host memory is per node]: the ranks torchrun started on this node share its RAM
        gpus_per_node=args.gpus_per_node or local_world_size(),
        host_safety=args.host_safety,
        time_limit=args.time_limit,
        device_mem_gb=args.device_mem_gb,
    )


def _config(args: argparse.Namespace) -> TrainConfig:
    from memo.train.config import TrainConfig

    sources = [flag for flag, value in (("--model", args.model), ("--hf-config", args.hf_config),
                                        ("--hf-model", args.hf_model)) if value is not None]
    if len(sources) > 1:
        raise MemoError(f"memo train: {' and '.join(sources)} each name the model to train; give one of them")
    return TrainConfig(
        model=args.model if args.model is not None else TrainConfig.model,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        steps=args.steps,
        device=args.device,
        dtype=args.dtype,
        lr=args.lr,
        seed=args.seed,
        peak_tflops=args.peak_tflops,
        data=args.data,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        engine=args.engine,
        offload_states=args.offload_states,
        hf_config=args.hf_config,
        hf_model=args.hf_model,
        rope_theta=args.rope_theta,
        rope_scaling=args.rope_scaling,
        export=args.export,
        tensor_parallel=args.tp,
        context_parallel=args.cp,
        data_parallel=args.dp,
        sequence_parallel=args.sp,
        cp_comm=args.cp_comm,
        pipeline_parallel=args.pp,
        virtual_pipeline=args.vpp,
        micro_batches=args.micro_batches,
        ulysses_head_chunks=args.ulysses_head_chunks,
        **{name: getattr(args, name) for name in RUN_FLAGS},
    )


def _print_summary(report: dict[str, Any]) -> None:
    s = report["summary"]
    print(
        f"memo train: {report['strategy']}"
        + ("" if report["alpha"] is None else f" alpha={report['alpha']:.4f}")
        + f": loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, "
        f"peak device {format_mib(report['peak_device_bytes'])}, "
        f"host pinned {format_mib(report['host_pinned_bytes'])}, "
        f"allocations planned/fallback/unplanned {report['allocator']['planned']}/"
        f"{report['allocator']['fallback']}/{report['allocator'].get('unplanned', 0)}"
    )
    offload = report.get("offload")
    if offload:
        planned = offload["planned_bytes_per_layer"]
        print(f"memo train: offload per layer ({offload['offloaded_layers']} layers): planned "
              f"{'unknown' if planned is None else format_mib(planned)}, actual "
              f"{format_mib(offload['actual_bytes_per_layer'])}")
        if planned is not None:
            from memo.planner import offload_difference

            warning = offload_difference(offload)
            if warning is not None:
                print(f"warning: {warning}")


def _ranks_line(par: dict[str, Any]) -> str:
    """A parallel run's layout and every rank's device peak and host bytes (against its plan's)."""
    ranks = "1 rank" if par["world"] == 1 else f"{par['world']} ranks"
    fsdp2 = "" if par.get("engine") != "fsdp2" else (
        " fsdp2" + (" offload-states" if par.get("offload_states") else ""))
    pp = "" if par.get("pp", 1) == 1 else (f" pp={par['pp']}"
                                             + (f" vpp={par['vpp']}" if par["vpp"] > 1 else ""))
    return (f"memo train: {ranks} (tp={par['tp']} cp={par['cp']} dp={par['dp']}{pp}"
            f"{' sp' if par['sp'] else ''}{fsdp2}"
            f"{' cp_comm=' + par['cp_comm'] if par['cp'] > 1 and 'cp_comm' in par else ''}): "
            + ", ".join(f"rank {r['rank']}" + (f" (stage {r['pp_rank']})" if pp else "")
                        + f" peak device {format_mib(r['peak_device_bytes'])}"
                        + (f" (plan {format_mib(r['plan_device_total_bytes'])})"
                           if r.get("plan_device_total_bytes") is not None else "")
                        + f" host pinned {format_mib(r['host_pinned_bytes'])}"
                        + (f" (plan {format_mib(r['plan_host_bytes'])})"
                           if r.get("plan_host_bytes") is not None else "")
                        + (f", forwards in flight {r['forwards_in_flight']}" if r.get("forwards_in_flight")
                           else "") for r in par["ranks"]))


#: The most ranks whose stage-plan files are compared with the other paths (NOTE [Outputs are not inputs]).
_MAX_COMPARED_RANKS = 1024


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse a stage-plan pattern with fields other than {stage} and {rank} (NOTE [Stage-plan patterns]),
    and an output that is an input or another output (NOTE [Outputs are not inputs]), before any work."""
    from memo.paths import check_distinct, check_stage_pattern

    pipelined = args.pp > 1 or args.micro_batches > 1
    if args.save_plan:
        check_stage_pattern(args.save_plan, "--save-plan", args.pp)
    if args.plan and pipelined:
        check_stage_pattern(args.plan, "--plan", args.pp)
    hf = args.hf_config
    if hf and os.path.isdir(hf):
        hf = os.path.join(hf, "config.json")
    checkpoint = [(f"--hf-model {args.hf_model!r} (its {name})", os.path.join(args.hf_model, name))
                  for name in ("config.json", "model.safetensors")] if args.hf_model else []
    inputs = [*_plan_files("--plan", args.plan, pipelined, args), ("--data", args.data),
              ("--hf-config", hf if hf and os.path.isfile(hf) else None), *checkpoint,
              ("--model", args.model if args.model and os.path.isfile(args.model) else None),
              *(("--compare", path) for path in args.compare), ("--eval-data", args.eval_data)]
    outputs = [("--report", args.report), ("--plot", args.plot), ("--metrics", args.metrics),
               *_plan_files("--save-plan", args.save_plan, True, args)]
    check_distinct("memo train", inputs, outputs)


def _plan_files(flag: str, pattern: str | None, is_pattern: bool, args: argparse.Namespace
                ) -> list[tuple[str, str]]:
    """The files a --plan or --save-plan pattern names for this job's stages and ranks."""
    if not pattern:
        return []
    if not is_pattern:
        return [(flag, pattern)]
    launched = os.environ.get("WORLD_SIZE", "")
    world = max(args.tp * args.cp * (args.dp or 1) * args.pp, int(launched) if launched.isdigit() else 1)
    ranks = range(min(world, _MAX_COMPARED_RANKS)) if "{rank" in pattern else range(1)
    files = {pattern.format(stage=stage, rank=rank) for stage in range(args.pp) for rank in ranks}
    return [(flag, path) for path in sorted(files)]


def _rank() -> int:
    from memo.distributed.layout import LaunchEnv

    return LaunchEnv.from_environ().rank


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from memo.models import list_configs
    from memo.models.ulysses_attention import CP_COMM_TYPES
    from memo.train.loop import DTYPES, TrainConfig

    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="profile, plan and train a model with memo (or a baseline strategy)",
        description="Train a reference model with one activation-memory strategy: profile one "
        "iteration (or load --plan), solve alpha, plan the activation addresses, wrap the layers, "
        "install the planned allocator and train, printing per-step loss, step time, TGS, MFU, "
        "peak device memory, pinned host bytes and planned/fallback allocations.",
        epilog="Strategies: none (plain autograd); full-recompute (torch.utils.checkpoint per layer); "
        "full-offload (memo with alpha=1: every skeletal tensor to host, nothing recomputed); "
        "memo (token-wise offload/recompute with the solved alpha and the planned allocator); "
        "offloaded-checkpoint (ALST's recipe with PyTorch's APIs: every layer under torch.utils.checkpoint, "
        "its input offloaded to pinned host memory, its MLP run over ceil(s/hidden) token tiles); "
        "torchtune-offload (torchtune's activation offloading as its recipes configure it: every layer "
        "checkpointed, every saved tensor of 1 KiB or more in the forward offloaded to pinned host memory, "
        "the head kept on the device; an equivalent of torchtune's OffloadActivations, not torchtune "
        "itself). Every strategy runs under the same --device-mem-gb budget and reports the same numbers.",
    )
    p.add_argument("--model", default=None,
                   help=f"memo's model to train: a name ({', '.join(list_configs())}) or a CONFIG.json "
                   f"with memo.models.ModelConfig's fields; not with --hf-model or --hf-config (default: "
                   f"{d.model})")
    p.add_argument("--seq-len", type=seq_len, default=d.seq_len, help="tokens per sequence: 4096, 128K, 1M")
    p.add_argument("--micro-batch", type=positive_int, default=d.micro_batch, help="sequences per step")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimizer steps")
    p.add_argument("--device", type=train_device, default=d.device, help="cpu or cuda[:i]")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="parameter/activation dtype; auto (the default): the --hf-model checkpoint's own, "
                   "else float32")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for initialisation and data")
    p.add_argument(
        "--peak-tflops", type=positive_float, help="device peak TFLOPS for MFU (default: known GPUs)"
    )
    data = p.add_argument_group("your data (default: synthetic tokens)")
    data.add_argument("--data", metavar="FILE",
                      help="what to train on, by its kind: FILE.jsonl, one JSON object per line, "
                      "{\"text\": ...} or {\"prompt\": ..., \"completion\": ...} (loss on the completion "
                      "only), tokenized with --tokenizer; a megatron indexed dataset, PREFIX or "
                      "PREFIX.bin/.idx (each sequence a document); both are packed into rows of "
                      "--seq-len with their document boundaries kept (a Hugging Face model: --hf-model, "
                      "--hf-config). Any other file: its bytes are the tokens")
    data.add_argument("--tokenizer", metavar="DIR",
                      help="--data FILE.jsonl: the directory of a Hugging Face tokenizer (the model's; "
                      "AutoTokenizer, local files only; default: the --hf-model checkpoint's own); documents "
                      "get its BOS when it adds one, and its EOS")
    data.add_argument("--text-field", default=d.text_field, metavar="NAME",
                      help="the field of a JSONL record holding its text (default: text)")
    p.add_argument("--engine", choices=("memo", "megatron", "fsdp2"), default="memo",
                   help="who builds --model: memo's reference model, a megatron-core GPTModel of the same "
                   "shapes with memo's layer spec, or memo's (or the --hf-config) model with its states "
                   "sharded by PyTorch FSDP2 over data-parallel ranks (fully_shard per layer and on the "
                   "root; under torchrun or as one process); all go through the same profile, plan and "
                   "training")
    p.add_argument("--offload-states", action="store_true",
                   help="--engine fsdp2: FSDP2's CPUOffloadPolicy, the parameter shards, gradients and "
                   "optimizer states in host memory (each layer's parameters gathered to the device for its "
                   "forward and backward)")
    par = p.add_argument_group("several processes (launch with torchrun; --engine megatron, --dp also "
                               "--engine fsdp2)")
    par.add_argument("--tp", type=positive_int, default=1,
                     help="tensor-parallel ranks: each layer's weights split over this many processes")
    par.add_argument("--cp", type=positive_int, default=1,
                     help="context-parallel ranks: each sequence split over this many processes in "
                     "megatron's load-balanced causal layout")
    par.add_argument("--cp-comm", choices=CP_COMM_TYPES, default="all_gather",
                     help="how the context-parallel ranks' attention communicates: all_gather (K and V "
                     "gathered, the default) or a2a (Ulysses: an all-to-all gives each rank all tokens of "
                     "1/cp of the heads; --cp must divide the heads per --tp rank)")
    par.add_argument("--ulysses-head-chunks", type=positive_int, default=None, metavar="N",
                     help="--cp-comm a2a, --engine fsdp2 (memo's models): Ulysses over N chunks of heads, "
                     "one at a time (default: one per key/value head a rank receives). More split the query "
                     "heads (UPipe): a rank holds 1/N of the head shards during attention, for N/default "
                     "times the key/value traffic")
    par.add_argument("--dp", type=positive_int, default=None,
                     help="data-parallel ranks: --micro-batch (the global batch) split over this many model "
                     "replicas (default: WORLD_SIZE / (tp·cp))")
    par.add_argument("--sp", action="store_true",
                     help="megatron sequence parallelism inside each tensor-parallel group (needs --tp > 1)")
    par.add_argument("--pp", type=positive_int, default=1,
                     help="pipeline stages: each process holds L/pp layers, steps run by megatron's 1F1B "
                     "schedule over --micro-batches")
    par.add_argument("--vpp", type=positive_int, default=1,
                     help="model chunks per pipeline stage: megatron's interleaved schedule (needs --pp > 1; "
                     "--micro-batches a multiple of --pp)")
    par.add_argument("--micro-batches", type=positive_int, default=1,
                     help="micro-batches of --micro-batch sequences per optimizer step, gradients "
                     "accumulated (more than 1, or --pp > 1: megatron's schedules, --engine megatron)")
    p.add_argument("--hf-config", metavar="PATH_OR_JSON",
                   help="train a Hugging Face causal LM (Llama, Qwen2, Mistral) built from this config "
                   "instead of --model: a config.json, a directory holding one (no weights are loaded), or "
                   "inline JSON with a model_type; random weights, no download")
    hf = p.add_argument_group("your own Hugging Face model")
    hf.add_argument("--hf-model", metavar="DIR",
                    help="fine-tune the Hugging Face causal LM saved in DIR (config.json and safetensors "
                    "weights, as save_pretrained writes them; Llama, Qwen2, Mistral), loaded with "
                    "from_pretrained offline in its own dtype unless --dtype is given; --engine memo or "
                    "fsdp2 (with --offload-states, --dp, --cp C --cp-comm a2a), or --engine megatron for "
                    "Llama, Mistral and Qwen3 (converted into megatron-core's GPTModel, each rank reading "
                    "its --tp/--cp/--dp share; not with --pp or --micro-batches); not with --model or "
                    "--hf-config")
    hf.add_argument("--rope-theta", type=positive_float, metavar="F",
                    help="--hf-model/--hf-config: the rotary base, set in the config before the model is "
                    "built and written into --export's config.json")
    hf.add_argument("--rope-scaling", metavar="JSON",
                    help="--hf-model/--hf-config: context extension, the config's rope parameters as "
                    "transformers spells them, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                    "\"original_max_position_embeddings\": 4096}' (or linear, dynamic, llama3 with their "
                    "factor); keeps the config's rope_theta unless --rope-theta is given; written into "
                    "--export's config.json")
    hf.add_argument("--export", metavar="DIR",
                    help="at the end of training, write the trained --hf-model/--hf-config model to DIR (new "
                    "or empty) with save_pretrained: safetensors, config.json (with the rope flags), the "
                    "generation config and the checkpoint's tokenizer files; under FSDP2 the shards are "
                    "gathered and rank 0 writes; under --engine megatron the tensor-parallel shards are "
                    "gathered and converted back (also memo's llama-arch --model); written whole or not "
                    "at all")
    p.add_argument("--strategy", choices=STRATEGIES, default="memo", help="activation-memory strategy")
    p.add_argument(
        "--alpha", default="auto",
        help="'auto' solves the alpha LP from measured (or given) machine numbers; or a number in [0, 1]",
    )
    p.add_argument("--plan", metavar="PLAN.json",
                   help="use a plan from `memo profile` instead of profiling; under --pp/--micro-batches, "
                        "the stages' plans from --save-plan (the same pattern)")
    p.add_argument("--save-plan", metavar="PATTERN",
                   help="under --pp/--micro-batches: write each stage's plan of its step to PATTERN, "
                        "{stage} filled in by the stage's number ({rank} by the rank's, where each rank "
                        "should write its own), e.g. plans/stage{stage}.json")
    p.add_argument(
        "--no-planned-allocator", action="store_true",
        help="memo strategy without the planned allocator (wrapper only; all allocations via the fallback)",
    )
    p.add_argument("--time-limit", type=positive_float, default=5.0,
                   help="seconds the planner's search and MIP stages may take in all "
                        "(5; the greedy plan is immediate)")
    p.add_argument("--device-mem-gb", type=positive_float, default=None,
                   help="device memory budget in GB (10^9 bytes), enforced by memo's allocator for every "
                   "strategy: a step that needs more fails with an out-of-memory error giving the numbers "
                   "(default: the device's own memory)")
    p.add_argument("--report", metavar="OUT.json", help="write the versioned JSON report")
    p.add_argument("--plot", metavar="OUT.png", type=figure_path,
                   help="draw the loss curve(s) of this run (and --compare)")
    p.add_argument("--compare", nargs="*", default=[], metavar="REPORT.json", help="more reports to plot")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_machine_arguments(p, "processes sharing the host memory (default: torchrun's LOCAL_WORLD_SIZE, "
                             "else 1)")
    _add_run_arguments(p, d)
    take_config_file(p)
    p.set_defaults(func=run)
    return p


#: The flags of a real run, by their TrainConfig field (memo/train/run_control.py).
RUN_FLAGS = ("save", "save_every", "keep", "resume", "lr_schedule", "warmup_steps", "min_lr", "clip_grad",
             "eval_data", "eval_every", "eval_batches", "metrics", "tensorboard")


def _add_run_arguments(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    from memo.train.run_options import LR_SCHEDULES

    ck = p.add_argument_group("checkpoints (torch.distributed.checkpoint; SIGTERM or Ctrl-C saves one and "
                              "exits 143 / 130)")
    ck.add_argument("--save", metavar="DIR", help="write checkpoints to DIR/step-N (after the last step, "
                    "every --save-every steps, and on SIGTERM or Ctrl-C)")
    ck.add_argument("--save-every", type=positive_int, metavar="N", help="a checkpoint every N steps")
    ck.add_argument("--keep", type=positive_int, default=d.keep, help="checkpoints kept in --save DIR")
    ck.add_argument("--resume", metavar="DIR",
                    help="continue from the latest whole checkpoint in DIR (a --save DIR) or from a "
                    "DIR/step-N folder; its losses are the uninterrupted run's")
    opt = p.add_argument_group("optimization")
    opt.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=d.lr_schedule,
                     help="learning rate after the warmup: constant, or cosine / linear decay to --min-lr at "
                     "the last step")
    opt.add_argument("--warmup-steps", type=int, default=d.warmup_steps, metavar="N",
                     help="the learning rate rises linearly to --lr over the first N steps")
    opt.add_argument("--min-lr", type=float, default=d.min_lr, help="the learning rate at the last step "
                     "(cosine, linear)")
    opt.add_argument("--clip-grad", type=positive_float, metavar="MAX_NORM",
                     help="scale the gradients to a global norm of at most MAX_NORM (default: no clipping)")
    ev = p.add_argument_group("evaluation and metrics")
    ev.add_argument("--eval-data", metavar="FILE", help="held-out data, read as --data is; its mean loss is "
                    "printed and in the metrics")
    ev.add_argument("--eval-every", type=positive_int, metavar="N",
                    help="evaluate every N steps (default: after the last step)")
    ev.add_argument("--eval-batches", type=positive_int, default=d.eval_batches, metavar="K",
                    help="the fixed batches of --eval-data each evaluation averages over")
    ev.add_argument("--metrics", metavar="FILE.jsonl", help="one JSON line per step: step, loss, lr, "
                    "grad_norm, tokens_per_s, mfu, peak_memory_bytes, eval_loss")
    ev.add_argument("--tensorboard", metavar="DIR",
                    help="the same scalars as TensorBoard events in DIR (needs the tensorboard package)")
