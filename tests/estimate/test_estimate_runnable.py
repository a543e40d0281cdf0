"""memo estimate answers only with what `memo train` launches, and prints the command that launches it
(NOTE [Layouts memo train launches] in memo/estimate/layout.py, NOTE [The launch command of an answer]
in memo/estimate/command.py); --fit-limit-gib holds every strategy to one limit (NOTE [Fit limits]).

The checks of the search and the commands are arithmetic (the formula method, tiny models). The launch
check runs, for each layout family a search returns, its printed command scaled down to CPU processes.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from memo.planner.engines import engine_for_layout, layout_problem

from memo.cli.main import main
from memo.errors import MemoError
from memo.estimate import Estimator, Layout, launch_argv, launch_command, search_layouts, valid_layouts
from memo.estimate.layout import CP_COMMS, SHARDINGS
from memo.estimate.plan_method import PLAN_STRATEGIES
from memo.estimate.search import strategy_limit
from memo.models import get_config
from memo.units import GiB

ROOT = Path(__file__).resolve().parents[2]

#: The layout families memo train launches, one launch each: (engine, features). A feature is a
#: parallelism a layout uses: "tp", "pp", "cp-<comm>", and "offload" for FSDP2's states on the host.
FAMILIES: dict[str, tuple[str, frozenset[str]]] = {
    "megatron-tp-sp": ("megatron", frozenset({"tp"})),
    "megatron-pp": ("megatron", frozenset({"pp"})),
    "megatron-cp-all_gather": ("megatron", frozenset({"cp-all_gather"})),
    "megatron-cp-a2a": ("megatron", frozenset({"cp-a2a"})),
    "fsdp2": ("fsdp2", frozenset()),
    "fsdp2-cp-a2a-offload": ("fsdp2", frozenset({"cp-a2a", "offload"})),
}
#: And one a search of memo's plans adds (NOTE [Head chunks in the search]): Ulysses over the finest
#: count of head chunks, "head-chunks" among its features (``--ulysses-head-chunks``).
HEAD_CHUNKS_FAMILY = ("fsdp2-cp-a2a-head-chunks", ("fsdp2", frozenset({"cp-a2a", "head-chunks"})))


def _features(lay: dict[str, Any]) -> frozenset[str]:
    out = set()
    if lay["tp"] > 1:
        out.add("tp")
    if lay["pp"] > 1:
        out.add("pp")
    if lay["cp"] > 1:
        out.add(f"cp-{lay['cp_comm']}")
    if lay["sharding"] == "full-offload":
        out.add("offload")
    if lay.get("head_chunks") is not None:
        out.add("head-chunks")
    return frozenset(out)


def _estimate_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _runnable(lay: Layout) -> bool:
    engine = engine_for_layout(tp=lay.tp, cp=lay.cp, pp=lay.pp, cp_comm=lay.cp_comm, sharding=lay.sharding)
    return engine is not None and layout_problem(engine, tp=lay.tp, cp=lay.cp, pp=lay.pp, cp_comm=lay.cp_comm,
                                                 sharding=lay.sharding) is None


# ------------------------------------------------------------------ only what memo train launches


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_valid_layouts_are_only_those_an_engine_launches(model: str, gpus: int) -> None:
    config = get_config(model)
    for dp_one in (False, True):
        layouts = valid_layouts(config, gpus, 1024, (1, 2), data_parallel_one=dp_one, shardings=SHARDINGS,
                                cp_comms=CP_COMMS)
        refused = [lay.short() for lay in layouts if not _runnable(lay)]
        assert not refused, refused
        assert all(lay.engine == engine_for_layout(tp=lay.tp, cp=lay.cp, pp=lay.pp, cp_comm=lay.cp_comm,
                                                   sharding=lay.sharding) for lay in layouts)
    # Not empty-handed: from 2 GPUs on, every family of the table is among them (4 heads, 2 layers).
    if gpus >= 2:
        everything = valid_layouts(config, gpus, 1024, (1,), shardings=SHARDINGS, cp_comms=CP_COMMS)
        found = {(lay.engine, _features(lay.to_dict())) for lay in everything}
        assert set(FAMILIES.values()) <= found, set(FAMILIES.values()) - found


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_the_search_ranks_only_launchable_layouts(model: str, gpus: int) -> None:
    est = Estimator(model, method="formula", dtype="float32")
    rows = search_layouts(est, 1024, gpus, "full-recompute", (1, 2), shardings=SHARDINGS, cp_comms=CP_COMMS)
    assert rows and all(_runnable(r["layout"]) for r in rows), [r["layout"].short() for r in rows]
    # Every sharding is tried where it runs: FSDP2's with TP 1 and PP 1 only, megatron's everywhere.
    fsdp2 = {r["layout"].sharding for r in rows if r["layout"].engine == "fsdp2"}
    assert fsdp2 == {"full", "full-offload"}
    assert all(r["layout"].tp == r["layout"].pp == 1 for r in rows if r["layout"].engine == "fsdp2")


def test_every_output_path_answers_with_launchable_layouts_and_their_commands(
        capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", "llama-tiny", "--gpus", "4", "--method", "formula"]
    one = _estimate_json([*common, "--seq-len", "1K", "--cp", "4", "--sharding", "full-offload",
                          "--strategy", "none"], capsys)
    # No --cp-comm: FSDP2's states with CP 4 take the CP communication FSDP2 runs.
    assert (one["cp_comm"], one["engine"]) == ("a2a", "fsdp2")
    assert one["command"] == launch_command(Estimator("llama-tiny", method="formula"),
                                            Layout(4, cp=4, cp_comm="a2a", sharding="full-offload"), 1024,
                                            "none")
    search = _estimate_json([*common, "--seq-len", "1K", "--search", "--strategy", "none"], capsys)
    assert len(search["layouts"]) == 18  # as valid_layouts: 12 megatron, 3 + 3 FSDP2
    for row in search["layouts"]:
        lay = Layout(**{k: row[k] for k in ("gpus", "tp", "cp", "pp", "micro_batch", "cp_comm", "sharding")})
        assert _runnable(lay) and row["engine"] == lay.engine
        assert row["command"] == launch_command(Estimator("llama-tiny", method="formula"), lay, 1024, "none")
    longest = _estimate_json([*common, "--max-seq", "--search", "--granularity", "1K", "--seq-cap", "64K"],
                             capsys)
    for row in longest["strategies"]:
        assert row["command"] is not None and f"--seq-len {row['longest']} " in row["command"]
        assert f"--strategy {row['strategy']} " in row["command"]
        for lay in row["layouts"]:
            assert engine_for_layout(tp=lay["tp"], cp=lay["cp"], pp=lay["pp"], cp_comm=lay["cp_comm"],
                                     sharding=lay["sharding"]) is not None, lay
    # The text says the same commands.
    assert main(["estimate", *common, "--seq-len", "1K", "--search", "--strategy", "none"]) == 0
    out = capsys.readouterr().out
    best = search["layouts"][0]
    assert f", {best['engine']}): {best['command']}\n" in out and "\nlaunch the best (" in out


@pytest.mark.parametrize(("flags", "engine_says"), [
    (["--tp", "2", "--sharding", "full"],
     [layout_problem("megatron", tp=2, sharding="full"), layout_problem("fsdp2", tp=2, sharding="full")]),
    (["--pp", "2", "--sharding", "full-offload"],
     [layout_problem("fsdp2", pp=2, sharding="full-offload")]),
    (["--cp", "2", "--cp-comm", "all_gather", "--sharding", "full"],
     [layout_problem("fsdp2", cp=2, cp_comm="all_gather", sharding="full")]),
])
def test_a_layout_no_engine_launches_is_refused_with_the_tables_reasons(
        flags: list[str], engine_says: list[str | None], capsys: pytest.CaptureFixture[str]) -> None:
    for mode in (["--seq-len", "1K"], ["--max-seq"]):
        assert main(["estimate", "--model", "tiny", "--gpus", "4", *flags, *mode, "--method", "formula",
                     "--strategy", "none"]) == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.startswith("error: memo estimate: memo train launches no TP"), error
        for reason in engine_says:
            assert reason and reason in error, (reason, error)
        assert "What it launches: megatron: --tp any, --pp any" in error
        assert error.endswith("--search ranks only those")
    args = dict(zip(flags[::2], flags[1::2], strict=True))
    lay = Layout(4, tp=int(args.get("--tp", 1)), cp=int(args.get("--cp", 1)), pp=int(args.get("--pp", 1)),
                 cp_comm=args.get("--cp-comm", "all_gather"), sharding=args["--sharding"])
    with pytest.raises(MemoError, match="memo train launches no"):  # the Python API refuses it too
        Estimator("tiny", method="formula").estimate(1024, lay, "none")
    with pytest.raises(MemoError, match="memo train launches no"):
        launch_argv(Estimator("tiny", method="formula"), lay, 1024, "none")


def test_the_peer_on_pipeline_stages_is_refused() -> None:
    # memo train's pipelined steps run none, full-recompute and memo (memo/train/pipelined.py).
    est = Estimator("tiny", dtype="float32")
    with pytest.raises(MemoError, match="not offloaded-checkpoint; it runs with PP 1"):
        est.estimate(1024, Layout(2, pp=2), "offloaded-checkpoint")


# ------------------------------------------------------------------ the command


@pytest.mark.parametrize(("layout", "gpus_per_node", "strategy", "expected"), [
    (Layout(8, tp=2, pp=2, micro_batch=2), 8, "memo",
     "torchrun --standalone --nproc-per-node 8 -m memo train --engine megatron --tp 2 --sp --pp 2 "
     "--micro-batches 2 --dp 2 --model llama-3.1-8b --seq-len 131072 --micro-batch 4 --strategy memo "
     "--dtype bfloat16 --device cuda --device-mem-gb 80 --host-mem-gb 2048"),
    (Layout(8, cp=8, cp_comm="a2a", sharding="full-offload"), 8, "memo",
     "torchrun --standalone --nproc-per-node 8 -m memo train --engine fsdp2 --cp 8 --cp-comm a2a "
     "--offload-states --model llama-3.1-8b --seq-len 131072 --strategy memo --dtype bfloat16 --device cuda "
     "--device-mem-gb 80 --host-mem-gb 2048"),
    (Layout(32, tp=8, cp=2, pp=2), 8, "full-recompute",
     "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m memo train "
     "--engine megatron --tp 8 --sp --cp 2 --cp-comm all_gather --pp 2 --micro-batches 2 "
     "--model llama-3.1-8b --seq-len 131072 --strategy full-recompute --dtype bfloat16 --device cuda "
     "--device-mem-gb 80 --host-mem-gb 2048"),
    # 12 GPUs on nodes of 8: two nodes of 6, the host still shared as by 8 GPUs, as the estimate shares it
    (Layout(12, sharding="full"), 8, "none",
     "torchrun --nnodes 2 --nproc-per-node 6 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m memo train "
     "--engine fsdp2 --dp 12 --model llama-3.1-8b --seq-len 131072 --micro-batch 12 --strategy none "
     "--dtype bfloat16 --device cuda --device-mem-gb 80 --host-mem-gb 2048 --gpus-per-node 8"),
])
def test_the_command_launches_the_layout(layout: Layout, gpus_per_node: int, strategy: str,
                                         expected: str) -> None:
    from memo.estimate import Machine

    est = Estimator("llama-3.1-8b", method="formula", machine=Machine(gpus_per_node=gpus_per_node))
    assert launch_command(est, layout, 131072, strategy) == expected


# ------------------------------------------------------------------ --fit-limit-gib


def test_fit_limit_holds_every_strategy_to_one_limit(capsys: pytest.CaptureFixture[str]) -> None:
    from memo.estimate import Machine

    machine = Machine(device_mem_gb=0.5, host_mem_gb=8)
    own = Estimator("tiny", dtype="float32", machine=machine)
    assert len({strategy_limit(own, s) for s in PLAN_STRATEGIES}) == 2  # memo's plan budget, the 80% rule
    given = Estimator("tiny", dtype="float32", machine=machine, fit_limit_bytes=int(0.3 * GiB))
    assert {strategy_limit(given, s) for s in PLAN_STRATEGIES} == {int(0.3 * GiB)}
    assert {given.limit_rule(s) for s in PLAN_STRATEGIES} == {"given"}
    memo = given.estimate(1024, Layout(1), "memo")
    assert (memo.limit_bytes, memo.limit_rule, memo.to_dict()["limit_bytes"]) == (int(0.3 * GiB), "given",
                                                                                 int(0.3 * GiB))
    with pytest.raises(MemoError, match="at most the GPU's memory, --device-mem-gb 0.5"):
        Estimator("tiny", machine=machine, fit_limit_bytes=GiB)

    common = ["--model", "llama-tiny", "--gpus", "2", "--method", "formula", "--max-seq", "--search",
              "--granularity", "1K", "--seq-cap", "64K", "--device-mem-gb", "0.5"]
    out = _estimate_json([*common, "--fit-limit-gib", "0.25"], capsys)
    assert [(r["strategy"], r["limit_bytes"], r["limit_rule"]) for r in out["strategies"]] == [
        ("none", GiB // 4, "given"), ("full-recompute", GiB // 4, "given")]
    assert out["fit_limit_bytes"] == GiB // 4
    assert all(r["estimate"]["limit_bytes"] == GiB // 4 for r in out["strategies"])
    assert main(["estimate", *common, "--fit-limit-gib", "0.25"]) == 0
    text = capsys.readouterr().out
    assert text.count("0.25 (--fit-limit-gib)") == 2 and "fit limit 0.25 GiB for every strategy" in text
    out = _estimate_json(common, capsys)  # without it: each strategy's own rule, the 80% rule here
    assert {(r["limit_bytes"], r["limit_rule"]) for r in out["strategies"]} == {(int(0.4e9), "fraction")}
    assert main(["estimate", *common, "--fit-limit-gib", "0.25", "--fit-fraction", "0.9"]) == 2
    assert "give one of them" in capsys.readouterr().err


# ------------------------------------------------------------------ the commands run


@pytest.mark.parametrize("gpus", [4, 8])
def test_the_launched_families_cover_every_layout_the_search_returns(gpus: int) -> None:
    # A layout whose engine uses a parallelism no family of that engine launches below (a new row of the
    # table, say) fails here until test_the_printed_command_trains launches it.
    covered: dict[str, set[str]] = {}
    for engine, features in FAMILIES.values():
        covered.setdefault(engine, set()).update(features)
    for model in ("tiny", "llama-tiny"):
        for lay in valid_layouts(get_config(model), gpus, 1024, (1,), shardings=SHARDINGS, cp_comms=CP_COMMS):
            assert lay.engine in covered and _features(lay.to_dict()) <= covered[lay.engine], lay.short()


def _scaled_down(command: str) -> tuple[list[str], int]:
    """A printed command as CPU processes: every parallel size above 1 made 2, the micro-batches the
    stages' count, the model llama-tiny, 512 tokens, float32 on the CPU, one step. Returns the argv and
    the world size."""
    argv = shlex.split(command)
    assert argv[0] == "torchrun" and argv[argv.index("-m") + 1: argv.index("-m") + 3] == ["memo", "train"]
    train = argv[argv.index("-m") + 3:]
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(train):
        if i + 1 < len(train) and not train[i + 1].startswith("--"):
            flags[train[i]], i = train[i + 1], i + 2
        else:
            flags[train[i]], i = None, i + 1
    sizes = {k: min(int(flags[k] or 1), 2) for k in ("--tp", "--cp", "--pp", "--dp") if k in flags}
    if "--dp" in sizes and len(sizes) > 1:  # data parallelism beside another dimension: one launch of 2
        sizes["--dp"] = 1
    per_rank = int(flags.get("--micro-batch") or 1) // int(flags.get("--dp") or 1)
    flags.update({k: str(v) for k, v in sizes.items()})
    if "--micro-batches" in flags:
        flags["--micro-batches"] = flags["--pp"]
    if "--micro-batch" in flags:
        flags["--micro-batch"] = str(per_rank * sizes.get("--dp", 1))
    # the machine numbers given and a short planner limit: nothing measured, the plan in a second
    flags.update({"--model": "llama-tiny", "--seq-len": "512", "--dtype": "float32", "--device": "cpu",
                  "--steps": "1", "--no-progress": None, "--layer-ms": "1", "--bandwidth-gbps": "10",
                  "--time-limit": "1"})
    world = 1
    for v in sizes.values():
        world *= v
    out = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "memo", "train"]
    for k, v in flags.items():
        out += [k] if v is None else [k, v]
    return out, world


@pytest.fixture(scope="module")
def searched_commands() -> dict[str, str]:
    """Per family, the printed command of the row with the fewest data-parallel ranks (then the best
    ranked) of memo estimate --search for llama-tiny on 4 GPUs under memo's strategy (meta profiles,
    a few seconds)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        assert main(["estimate", "--model", "llama-tiny", "--gpus", "4", "--seq-len", "1K", "--search",
                     "--strategy", "memo", "--device-mem-gb", "1", "--host-mem-gb", "8", "--json"]) == 0
    rows = json.loads(buf.getvalue())["layouts"]
    out = {}
    for name, family in [*FAMILIES.items(), HEAD_CHUNKS_FAMILY]:
        fits = [r for r in rows if (r["engine"], _features(r)) == family]
        assert fits, name
        out[name] = min(fits, key=lambda r: (r["dp"], r["rank"]))["command"]
    return out


def printed_commands_train(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    """On each rank of a launch (tests/dist_harness.py), every family's scaled-down command as ``memo
    train`` in this process: exit 0 and a loss line. One launch for all of them: a torchrun per family
    cost ~25 s here, mostly importing torch and megatron-core again."""
    import contextlib
    import io

    from tests.dist_harness import check

    def run(argv: list[str]) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = main(argv)
        assert code == 0, (argv, out.getvalue()[-2000:])
        if rank != 0:  # rank 0 speaks for the job
            return f"exit {code}"
        line = re.search(r"^step\s+1\s+loss \d+\.\d+", out.getvalue(), re.MULTILINE)
        assert line, out.getvalue()[-2000:]
        return line.group(0)

    for family, argv in spec["commands"].items():
        check(record, family, lambda argv=argv: run(argv))


@pytest.fixture(scope="module")
def trained(searched_commands: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    from tests import dist_harness

    commands = {}
    for family, command in searched_commands.items():
        argv, world = _scaled_down(command)
        assert world == 2, (family, argv)
        commands[family] = argv[argv.index("train"):]
        commands[family].remove("--no-progress")
    try:
        results = dist_harness.launch("tests.estimate.test_estimate_runnable:printed_commands_train", 2,
                                      {"commands": commands}, timeout_s=400)
    except dist_harness.LaunchError as e:
        table = dist_harness.by_name(e.results)
        table["<launch>"] = [{"name": "<launch>", "ok": False, "detail": str(e)}]
        return table
    return dist_harness.by_name(results)


@pytest.mark.parametrize("family", [pytest.param(name, marks=[pytest.mark.megatron] * (engine == "megatron"))
                                    for name, (engine, _) in FAMILIES.items()])
def test_the_printed_command_trains(family: str, trained: dict[str, list[dict[str, Any]]]) -> None:
    """Each family the search returns: its printed command, scaled down to two CPU processes (gloo), trains
    a step on every rank."""
    from tests import dist_harness

    dist_harness.assert_passed(trained, family, 2)


def test_the_printed_command_with_head_chunks_trains(trained: dict[str, list[dict[str, Any]]]) -> None:
    """The search's Ulysses row at the finest head chunks: its printed command, with
    ``--ulysses-head-chunks``, scaled down likewise, trains a step on every rank."""
    from tests import dist_harness

    dist_harness.assert_passed(trained, HEAD_CHUNKS_FAMILY[0], 2)
