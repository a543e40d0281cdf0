"""memo under megatron-core pipeline parallelism (issue 29), two CPU processes over gloo.

One launch runs, for GPT and Llama styles, megatron's 1F1B schedule (PP = 2, two layers a stage) and
its interleaved schedule (PP = 2 x VPP = 2, one layer a chunk), each over 4 micro-batches:

* the unwrapped stages give the single-process model's per-micro-batch losses and every parameter
  gradient (fp32, 1e-5), with batched p2p off under gloo (NOTE [Batched p2p under gloo]);
* each chunk ``memo.wrap``-ped with every layer offloaded, alpha 0, 0.5 and 1, gives them too, and
  moves bytes to the host on every stage;
* ``memo.wrap`` without a policy offloads every layer of a chunk whose output goes to the next stage
  and keeps the paper's last two of the chunk that ends in the loss (NOTE [Pipeline stages]);
* the forwards each chunk holds in flight are :func:`memo.distributed.pipeline.in_flight`'s count.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from memo.distributed.pipeline import whole_model_name
from tests import dist_harness
from tests.dist_harness import check
from tests.grads import RTOL, rel_err

# Found, not imported: collecting this file in every worker must not import megatron-core.
if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

MODULE = "tests.distributed.test_pipeline_parallel"
STYLES = ("gpt", "llama")
ALPHAS = (0.0, 0.5, 1.0)
SCHEDULES = {"1f1b": 1, "interleaved": 2}  # name -> model chunks per stage
STAGES, LAYERS, MICRO_BATCHES, ROWS, SEQ = 2, 4, 4, 2, 16


# ----------------------------------------------------------------------------- rank side


def _config(style: str) -> Any:
    from memo.models import ModelConfig

    if style == "gpt":
        return ModelConfig(name="pp-gpt", arch="gpt", n_layers=LAYERS, hidden=32, n_heads=4, vocab_size=128)
    return ModelConfig(name="pp-llama", arch="llama", n_layers=LAYERS, hidden=32, n_heads=4, n_kv_heads=2,
                       ffn_hidden=64, vocab_size=128)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 128, (ROWS, SEQ), generator=g), torch.randint(0, 128, (ROWS, SEQ), generator=g))
            for _ in range(MICRO_BATCHES)]


def _positions() -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(ROWS, SEQ)


def _init(pp: int = 1, vpp: int = 1) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    model_parallel_cuda_manual_seed(0)


def _reference(style: str) -> dict[str, Any]:
    """The whole model in one process: each micro-batch's loss, and the gradients of their mean."""
    from memo.distributed.layout import ParallelLayout
    from memo.engines import build_megatron_gpt

    _init()
    torch.manual_seed(0)
    model = build_megatron_gpt(_config(style), SEQ, "cpu", torch.float32, ParallelLayout())
    losses = []
    for ids, labels in _batches():
        loss = model(ids, _positions(), None, labels=labels).mean()
        (loss / MICRO_BATCHES).backward()
        losses.append(loss.detach())
    named = list(model.named_parameters())
    return {"losses": torch.stack(losses), "params": {n: p.detach().clone() for n, p in named},
            "grads": {n: p.grad.clone() for n, p in named}}


def _stages(style: str, vpp: int, ref: dict[str, Any]) -> list[torch.nn.Module]:
    """This rank's chunks, holding the whole model's weights."""
    from memo.distributed.layout import ParallelLayout
    from memo.engines import build_megatron_stages

    chunks = build_megatron_stages(_config(style), SEQ, "cpu", torch.float32,
                                   ParallelLayout(pipeline_parallel=STAGES, virtual_pipeline=vpp))
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                p.copy_(ref["params"][whole_model_name(chunk, name)])
    return chunks


def _run_schedule(chunks: list[torch.nn.Module]) -> list[torch.Tensor]:
    """One step of megatron's schedule over the micro-batches; the losses the last stage saw."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        ids, labels = next(data_iterator)
        out = model(ids, _positions(), None, labels=labels)

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = per_token.mean()
            return loss, {"loss": loss.detach().clone()}  # megatron divides loss in place

        return out, loss_func

    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(_batches()) for _ in chunks],
        model=chunks, num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=ROWS)
    return [d["loss"] for d in out]


def _compare(chunks: list[torch.nn.Module], losses: list[torch.Tensor], ref: dict[str, Any]) -> str:
    from megatron.core import parallel_state

    if parallel_state.is_pipeline_last_stage():
        err = rel_err(torch.stack(losses), ref["losses"])
        if not err <= RTOL:
            raise AssertionError(f"the micro-batches' losses differ: relative error {err:.3g}")
    elif losses:
        raise AssertionError(f"a stage before the last reported losses: {losses}")
    worst = (0.0, "")
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.grad is None:
                raise AssertionError(f"{name} got no gradient")
            worst = max(worst, (rel_err(p.grad, ref["grads"][whole_model_name(chunk, name)]), name))
    if not worst[0] <= RTOL:
        raise AssertionError(f"gradient of {worst[1]} differs: relative error {worst[0]:.3g}")
    return f"worst parameter gradient {worst[1]}: {worst[0]:.2g}"


def _memo_run(chunks: list[torch.nn.Module], ref: dict[str, Any], alpha: float, policy: bool) -> str:
    """The schedule over the chunks, each wrapped (every layer offloaded, or memo's default policy)."""
    import memo.runtime as mr
    from memo.distributed.pipeline import in_flight

    for chunk in chunks:
        n = len(chunk.decoder.layers)
        mr.wrap(chunk, alpha=alpha, policy=["memo"] * n if policy else None)
    try:
        detail = _compare(chunks, _run_schedule(chunks), ref)
        moved = [mr.runtime_of(c).layer_bytes for c in chunks]
        flights = [mr.runtime_of(c).buffers.n_flights if mr.runtime_of(c).buffers else 0 for c in chunks]
        policies = [mr.runtime_of(c).policy for c in chunks]
    finally:
        for chunk in chunks:
            if mr.is_wrapped(chunk):
                mr.unwrap(chunk)
    from megatron.core import parallel_state

    stage, vpp = parallel_state.get_pipeline_model_parallel_rank(), len(chunks)
    if policy:
        if not all(moved):
            raise AssertionError(f"a chunk of stage {stage} offloaded nothing: layer bytes {moved}")
        want = in_flight(STAGES, stage, vpp, MICRO_BATCHES)
        if flights != want:
            raise AssertionError(f"stage {stage}'s chunks held {flights} forwards in flight, in_flight "
                                 f"says {want}")
    else:
        last = [c.post_process for c in chunks]
        kept = [min(2, len(c.decoder.layers)) if c.post_process else 0 for c in chunks]
        want_policies = [["memo"] * (len(c.decoder.layers) - k) + ["keep"] * k
                         for c, k in zip(chunks, kept, strict=True)]
        if policies != want_policies:
            raise AssertionError(f"default policies {policies} (post_process {last}), expected "
                                 f"{want_policies}")
    return f"{detail}; layer bytes {moved}; forwards in flight {flights}; policies {policies}"


def pipelines_world2(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    """Every check of this file, on each of the two stages."""
    from megatron.core import parallel_state

    from memo.distributed.cpu_shims import install_cpu_shims

    warnings.simplefilter("ignore")
    install_cpu_shims()
    for style in STYLES:
        ref = _reference(style)
        for schedule, vpp in SCHEDULES.items():
            _init(STAGES, vpp)
            chunks = _stages(style, vpp, ref)
            name = f"{schedule}/{style}"
            check(record, f"{name}/unwrapped",
                  lambda chunks=chunks, ref=ref: _compare(chunks, _run_schedule(chunks), ref))
            for alpha in ALPHAS:
                check(record, f"{name}/memo/alpha={alpha}",
                      lambda chunks=chunks, ref=ref, alpha=alpha: _memo_run(chunks, ref, alpha, True))
            check(record, f"{name}/memo/default-policy",
                  lambda chunks=chunks, ref=ref: _memo_run(chunks, ref, 0.5, False))
    parallel_state.destroy_model_parallel()
    trained: dict[str, str] = {}  # the runs' JSON, by schedule
    for schedule, vpp in SCHEDULES.items():
        def run(schedule: str = schedule, vpp: int = vpp) -> str:
            trained[schedule] = _train(STAGES, vpp, save=vpp == 1)
            return trained[schedule]

        check(record, f"train/{schedule}", run)
    for style, (model, device_gb) in PLANNED.items():
        check(record, f"train/1f1b/planned-policy/{style}",
              lambda model=model, device_gb=device_gb: pipelined_train(
                  {**AUTO, "device_mem_gb": device_gb}, _train={**AUTO_TRAIN, "model": model},
                  pipeline_parallel=STAGES))
    check(record, "train/1f1b/saved-plans", lambda: _saved_plans(trained["1f1b"]))


#: ``memo train --engine megatron --micro-batches 4 --alpha 0.5`` on the 4-layer ``tiny`` model.
TRAIN = {"engine": "megatron", "model": "tiny", "seq_len": 64, "micro_batch": 2, "steps": 2,
         "micro_batches": MICRO_BATCHES}


def _train(pp: int, vpp: int, save: bool = False) -> str:
    """``save``: the stages' plans are written too (the saved-plans check trains on them)."""
    import os

    options = {"alpha": 0.5, "time_limit": 1.0}
    if save:
        options["save_plan"] = os.path.join(plans_dir(os.getppid()), "stage{stage}.json")
    return pipelined_train(options, pipeline_parallel=pp, virtual_pipeline=vpp)


def plans_dir(launcher_pid: int) -> str:
    """Where a launch's ranks write their stages' plans: one folder per launching (pytest) process."""
    import os
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"memo-stage-plans-{launcher_pid}")


def _saved_plans(saved: str) -> str:
    """NOTE [A stage's address plan]: ``--save-plan`` wrote one plan per stage (the ``train/1f1b`` run,
    ``saved``: its JSON); ``--plan`` with the same pattern trains on them with the same losses; the other
    stage's plan, or one made for another micro-batch count, stops every rank with what differs."""
    import json
    import os

    from memo.errors import MemoError

    pattern = os.path.join(plans_dir(os.getppid()), "stage{stage}.json")
    saved_losses = json.loads(saved)["losses"]
    given = json.loads(pipelined_train({"plan": pattern}, pipeline_parallel=STAGES))
    if given["losses"] != pytest.approx(saved_losses, rel=1e-6):
        raise AssertionError(f"losses on the saved plans {given['losses']}, when saved {saved_losses}")
    counts = [r["allocator"] for r in given["ranks"]]
    if not all(c["planned"] > 0 for c in counts):
        raise AssertionError(f"the given plans served nothing: {counts}")
    refused = []
    other_count = f"micro_batches {MICRO_BATCHES} (this run: {MICRO_BATCHES // 2})"
    for plan, micro_batches, what in ((pattern.format(stage=1), MICRO_BATCHES, "stage 1 (this run: 0)"),
                                      (pattern, MICRO_BATCHES // 2, other_count)):
        try:
            train_with = {**TRAIN, "micro_batches": micro_batches}
            pipelined_train({"plan": plan}, pipeline_parallel=STAGES, _train=train_with)
        except MemoError as e:
            if what not in str(e) or "another stage or schedule" not in str(e):
                raise AssertionError(f"refused, but not with {what!r}: {e}") from None
            refused.append(str(e))
        else:
            raise AssertionError(f"--plan {plan} with {micro_batches} micro-batches was taken")
    return f"saved and given losses {given['losses']}; allocations {counts}; refused: {refused}"


#: memo's layer policy and alpha chosen per stage (NOTE [A stage's profile], NOTE [Forwards in flight in
#: the policy]) with host memory that binds: 3 MB per process, where stage 0's 1F1B holds 2 forwards.
AUTO = {"alpha": "auto", "layer_ms": 1.0, "bandwidth_gbps": 10.0, "host_mem_gb": 0.0075,
        "gpus_per_node": 2, "host_safety": 0.8, "time_limit": 0.25}
#: style -> (model, device GB): a device that does not hold stage 0's layers kept whole for its 2
#: forwards (tiny: 2 layers of 4.2 MB; llama-tiny: 1 layer of 6.3 MB).
PLANNED = {"gpt": ("tiny", 0.02), "llama": ("llama-tiny", 0.013)}
AUTO_HOST_BYTES = 3_000_000
#: Layers that hold MBs, so that memo's layers beat the rounding of its two buffers to 2 MiB segments.
AUTO_TRAIN = {**TRAIN, "seq_len": 1024, "micro_batch": 1}


def pipelined_train(options: dict[str, Any] | None = None, _train: dict[str, Any] | None = None,
                    **layout: Any) -> str:
    """``memo train`` pipelined (NOTE [Pipelined steps]) in this launch's world, ``layout`` the
    TrainConfig's parallel fields, ``options`` memo's (default alpha 0.5, each stage planning itself),
    ``_train`` the run (default TRAIN): JSON of its losses and every rank's stage record."""
    import json

    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    result = train(TrainConfig(**(_train or TRAIN), **layout), progress=False,
                   strategy=make_strategy(StrategyOptions(**(options or {"alpha": 0.5, "time_limit": 1.0}))),
                   log=lambda _line: None)
    return json.dumps({"losses": [s.loss for s in result.steps], "ranks": result.parallel["ranks"]})


_ONE_PROCESS: dict[str, list[float]] = {}


def pipelined_losses(run: dict[str, Any] | None = None, strategy: str = "memo") -> list[float]:
    """``memo train --engine megatron --micro-batches 4`` (``run``: TRAIN) in this process, ``--alpha 0.5``
    (or ``strategy``), once each: megatron's schedule without pipelining, the micro-batches' gradients
    accumulated."""
    import json

    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    key = json.dumps([run, strategy], sort_keys=True)
    if key not in _ONE_PROCESS:
        options = StrategyOptions(alpha=0.5) if strategy == "memo" else StrategyOptions(strategy=strategy)
        result = train(TrainConfig(**(run or TRAIN)), progress=False, strategy=make_strategy(options),
                       log=lambda _line: None)
        _ONE_PROCESS[key] = [s.loss for s in result.steps]
    return list(_ONE_PROCESS[key])


# ----------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def world2() -> Iterator[dict[str, list[dict[str, Any]]]]:
    import os
    import shutil

    try:
        yield dist_harness.launch_table(f"{MODULE}:pipelines_world2", 2, timeout_s=240)
    finally:
        shutil.rmtree(plans_dir(os.getpid()), ignore_errors=True)


#: NOTE [A stage's address plan]: a stage plan's device total against the peak its rank measured (the
#: bar of tests/runtime/test_plan_truth.py).
TOTAL_TOL = 0.03


def assert_stage_plans_hold(ranks: list[dict[str, Any]]) -> None:
    """Every rank's plan of its stage's step served its requests, its device total is within TOTAL_TOL of
    the rank's measured peak, and its host bytes (one forward's offload times the forwards in_flight
    counts, per chunk) are the arenas the rank's runtimes held."""
    for r in ranks:
        total, peak = r["plan_device_total_bytes"], r["peak_device_bytes"]
        assert total is not None and abs(peak - total) <= TOTAL_TOL * total, (
            f"rank {r['rank']} (stage {r['pp_rank']}): plan {total:,} B, measured {peak:,} B")
        assert r["plan_host_bytes"] == r["host_pinned_bytes"], r
        assert r["allocator"]["planned"] > 0, r


def test_saved_stage_plans_train_and_another_stages_is_refused(world2) -> None:
    """NOTE [A stage's address plan]: --save-plan, then --plan with the same pattern: the same losses, the
    plans served; stage 1's plan on stage 0, or a plan made for 4 micro-batches in a run of 2, is refused
    on every rank with what differs."""
    _assert_passed(world2, "train/1f1b/saved-plans")


def _assert_passed(table: dict[str, list[dict[str, Any]]], name: str) -> None:
    dist_harness.assert_passed(table, name, 2)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_stages_give_the_single_process_gradients(world2, schedule: str, style: str) -> None:
    """megatron's schedule over the unwrapped stages: one process's losses and gradients."""
    _assert_passed(world2, f"{schedule}/{style}/unwrapped")


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_memo_on_every_stage_gives_the_single_process_gradients(world2, schedule: str, style: str,
                                                                 alpha: float) -> None:
    """Every chunk wrapped, every layer offloaded: one process's losses and gradients, bytes offloaded on
    every stage, and the forwards in flight that in_flight counts."""
    _assert_passed(world2, f"{schedule}/{style}/memo/alpha={alpha}")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_default_policy_follows_the_stage(world2, schedule: str, style: str) -> None:
    """Without a policy: every layer of a chunk that feeds the next stage offloads; the chunk that ends in
    the loss keeps its last two (NOTE [Pipeline stages])."""
    _assert_passed(world2, f"{schedule}/{style}/memo/default-policy")


def test_forwards_in_flight_per_chunk() -> None:
    """NOTE [Pipeline stages]: 1F1B holds stages - stage forwards (at most the micro-batches); the
    interleaved schedule's counts per chunk, replayed by hand for 2 stages x 2 chunks x 4 micro-batches
    (stage 0 warms up with 4 forwards: chunk 0 twice, chunk 1 twice; its steady steps add two more to
    chunk 0 before chunk 0's first backward), are what the launch above measures."""
    from memo.distributed.pipeline import in_flight
    from memo.errors import MemoError

    assert [in_flight(4, r, 1, 8) for r in range(4)] == [[4], [3], [2], [1]]
    assert in_flight(4, 0, 1, 2) == [2]
    assert in_flight(2, 0, 2, 4) == [4, 2] and in_flight(2, 1, 2, 4) == [3, 1]
    with pytest.raises(MemoError, match="no stage 2 of 2"):
        in_flight(2, 2, 1, 4)


@pytest.fixture(scope="module")
def one_process_losses() -> list[float]:
    return pipelined_losses()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_memo_train_pipelined_gives_the_single_process_losses(world2, one_process_losses: list[float],
                                                              schedule: str) -> None:
    """``memo train --engine megatron --pp 2 [--vpp 2] --micro-batches 4``: the single-process losses
    (1e-5), the first stage's chunks offload, each rank holds the forwards in flight that in_flight counts,
    and rank 0's report has every stage (NOTE [Pipelined steps])."""
    import json

    _assert_passed(world2, f"train/{schedule}")
    runs = [json.loads(r["detail"]) for r in world2[f"train/{schedule}"]]
    for run in runs:
        assert run["losses"] == pytest.approx(one_process_losses, rel=1e-5), (run, one_process_losses)
    ranks = runs[0]["ranks"]
    assert [r["pp_rank"] for r in ranks] == [0, 1]
    assert all(r["forwards_in_flight"] == r["expected_in_flight"] for r in ranks), ranks
    assert ranks[0]["host_pinned_bytes"] > 0 and all(ranks[0]["offloaded_layers"]), ranks[0]
    assert_stage_plans_hold(ranks)


def test_pipeline_layouts_are_refused_with_what_to_change() -> None:
    """Each refusal is made from the arguments, before any process group (NOTE [Checks before any process
    group]): layers that the stages (and chunks) cannot share, a micro-batch count the interleaved schedule
    cannot group, an engine without stages, --vpp without --pp, a world the stages do not divide."""
    from memo.distributed.layout import ParallelLayout, check_layout, resolve_layout
    from memo.errors import MemoError

    shapes = {"n_heads": 4, "n_query_groups": 4, "vocab_size": 512, "seq_len": 256, "micro_batch": 2}
    check_layout(ParallelLayout(pipeline_parallel=2, virtual_pipeline=2), engine="megatron", n_layers=4,
                 micro_batches=4, **shapes)
    with pytest.raises(MemoError, match=r"6 layers cannot be split evenly over --pp 4 stages"):
        check_layout(ParallelLayout(pipeline_parallel=4), engine="megatron", n_layers=6, **shapes)
    with pytest.raises(MemoError, match=r"6 layers .* --pp 2 x --vpp 2 = 4 model chunks"):
        check_layout(ParallelLayout(pipeline_parallel=2, virtual_pipeline=2), engine="megatron", n_layers=6,
                     micro_batches=4, **shapes)
    with pytest.raises(MemoError, match=r"--micro-batches 3: .* groups of --pp 2 .* multiple of 2"):
        check_layout(ParallelLayout(pipeline_parallel=2, virtual_pipeline=2), engine="megatron", n_layers=4,
                     micro_batches=3, **shapes)
    with pytest.raises(MemoError, match="use --engine megatron"):
        check_layout(ParallelLayout(pipeline_parallel=2), engine="memo", n_layers=4, **shapes)
    check_layout(resolve_layout(world_size=4, pipeline_parallel=2), engine="megatron", n_layers=4,
                 **shapes)  # stages replicated over --dp 2
    with pytest.raises(MemoError, match="--vpp 2 interleaves model chunks"):
        resolve_layout(world_size=1, virtual_pipeline=2)
    with pytest.raises(MemoError, match=r"--tp 1 x --cp 1 x --pp 2 = 2 ranks per model replica does not "
                                        r"divide the world of 3"):
        resolve_layout(world_size=3, pipeline_parallel=2)


@pytest.mark.parametrize(("overrides", "options", "message"), [
    ({"engine": "memo"}, {}, "runs megatron-core's schedules; use --engine megatron"),
    ({}, {"plan": "plan.json", "planned_allocator": False}, "--no-planned-allocator does not use"),
    ({}, {"strategy": "full-offload"}, "--strategy full-offload is not run under megatron's schedules"),
])
def test_pipelined_runs_refuse_what_they_cannot_take(overrides: dict, options: dict, message: str) -> None:
    """NOTE [Pipelined steps]: refused before any model is built, with what to give instead."""
    from memo.errors import MemoError
    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    with pytest.raises(MemoError, match=message):
        train(TrainConfig(**{**TRAIN, **overrides}), progress=False,
              strategy=make_strategy(StrategyOptions(**options)), log=lambda _line: None)


@pytest.mark.parametrize("style", PLANNED)
def test_each_stage_plans_its_layer_policy_for_the_forwards_it_holds(world2, style: str) -> None:
    """``memo train --pp 2 --micro-batches 4`` with alpha auto (NOTE [A stage's profile]): each stage
    chooses its layer policy and alpha with its schedule's forwards in flight counted. Stage 0 (2
    forwards) cannot keep its layers on the device and offloads them with an alpha that its 3 MB of host
    memory bounds (an alpha for one forward would overflow it); the losses are the unwrapped single-process
    run's, and each stage's plan holds."""
    import json

    name = f"train/1f1b/planned-policy/{style}"
    _assert_passed(world2, name)
    run = json.loads(world2[name][0]["detail"])
    model = PLANNED[style][0]
    assert run["losses"] == pytest.approx(pipelined_losses({**AUTO_TRAIN, "model": model}, "none"), rel=1e-5)
    first = min(run["ranks"], key=lambda r: r["pp_rank"])
    assert all(kind == "memo" for kind in first["policy"][0]) and 0.0 < first["alpha"] < 1.0, first
    assert first["forwards_in_flight"] == [2] and 0 < first["host_pinned_bytes"] <= AUTO_HOST_BYTES, first
    assert_stage_plans_hold(run["ranks"])
