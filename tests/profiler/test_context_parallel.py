"""Context parallelism in `memo profile` (NOTE [Context-parallel profile]).

A c-way context-parallel rank runs seq_len/c tokens: its per-layer sizes are the CP=1 ones over c,
its plan records context_parallel and the job's whole seq_len, lengths the ranks cannot share and
bad sizes are refused with messages that say what to use, and a plan made for another CP is
refused where plans are checked against jobs (memo train, memo.planner.load_plan).
"""

from __future__ import annotations

import json

import pytest
from memo.planner import load_plan, save_plan

from memo.cli.main import main
from memo.errors import MemoError, PlanMismatchError
from memo.models import num_parameters
from memo.pipeline import profile
from memo.profiler import rank_tokens, token_multiple

_MACHINE = {"bandwidth_gbps": 32.0, "layer_ms": 5.0, "host_mem_gb": 64.0}
_CLI_MACHINE = ["--bandwidth-gbps", "32", "--layer-ms", "5", "--host-mem-gb", "64"]


def _sizes(model: str, cp: int, tp: int = 1, seq_len: int = 256) -> tuple[int, int, int]:
    stats = profile(model, seq_len, 1, "float32", "meta", solve=False, tensor_parallel=tp,
                    context_parallel=cp).layer_stats[0]
    return stats.s_input, stats.s_attn, stats.s_others


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_a_cp_rank_holds_its_share_of_every_layer_size(model: str) -> None:
    one = _sizes(model, 1)
    two = _sizes(model, 2)
    four = _sizes(model, 4)
    assert all(x > 0 for x in one)
    # S_input is exactly half (and a quarter): [s/c, b, h]; so are the attention output and the rest.
    assert two == tuple(x // 2 for x in one), (one, two)
    assert four == tuple(x // 4 for x in one), (one, four)
    # With tensor parallelism too, the TP rank's sizes are divided the same way: its layer input is
    # [s/(c·t), b, h].
    tp_rank = _sizes(model, 1, tp=2)
    assert _sizes(model, 2, tp=2) == tuple(x // 2 for x in tp_rank), tp_rank
    assert tp_rank[0] == four[0] * 2


def test_the_plan_records_the_job_and_the_rank() -> None:
    result = profile("tiny", 256, 1, "float32", "meta", context_parallel=2, **_MACHINE)
    meta = result.plan.meta
    assert meta["context_parallel"] == 2 and meta["tensor_parallel"] == 1
    assert meta["seq_len"] == 256  # the job's whole sequence, not the rank's 128 tokens
    assert result.trace["meta"]["context_parallel"] == 2 and result.plain_trace["meta"]["seq_len"] == 256
    assert any("not counted" in note and "ring attention" in note for note in result.notes)
    # The rank's per-layer input is half the CP=1 one, so is what memo offloads per layer.
    single = profile("tiny", 256, 1, "float32", "meta", **_MACHINE)
    assert single.plan.meta["context_parallel"] == 1
    assert result.layer_stats[0].s_input * 2 == single.layer_stats[0].s_input


@pytest.mark.slow
def test_parameters_are_not_divided_by_cp() -> None:
    # CP replicates the weights; GPT's position table still covers every position of the job.
    # The model states come from pass 1 whatever the policy: a given policy and no address plan
    # skip the calibration passes and the MIP, which took seconds and decide nothing here.
    fixed = {"policy": ["keep"] * 4, "plan": False, **_MACHINE}
    one = profile("tiny", 8192, 1, "float32", "meta", **fixed).model_states
    two = profile("tiny", 8192, 1, "float32", "meta", context_parallel=2, **fixed).model_states
    assert one["parameters"] == two["parameters"] and one["optimizer"] == two["optimizer"]
    # 8,192 positions: more than the default table (4,096), which a rank's 4,096 tokens would get.
    assert one["parameters"]["count"] == num_parameters("tiny", max_seq_len=8192) > num_parameters("tiny")


@pytest.mark.slow
def test_cpu_profile_of_a_cp_rank() -> None:
    result = profile("llama-tiny", 256, 1, "float32", "cpu", context_parallel=2, recorder="allocator",
                     time_limit=2.0, **_MACHINE)
    assert result.plan.meta["context_parallel"] == 2 and result.plan.meta["device"] == "cpu"
    assert result.layer_stats[0].s_input == 128 * 64 * 4  # 128 tokens x hidden 64 x fp32
    assert result.plan.device["total_bytes"] > 0


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2", None])
def test_bad_context_parallel_sizes_are_refused(bad: object) -> None:
    with pytest.raises(MemoError, match="context_parallel must be a positive integer"):
        profile("tiny", 256, 1, "float32", "meta", solve=False, context_parallel=bad)


def test_lengths_the_ranks_cannot_share_are_refused() -> None:
    # Load-balanced causal CP cuts the sequence into 2·c chunks.
    with pytest.raises(MemoError, match=r"2·c = 4 load-balanced chunks.*multiple of 4; use 256 or 260"):
        profile("tiny", 258, 1, "float32", "meta", solve=False, context_parallel=2)
    # With tensor parallelism, every one of the c·t ranks holds seq_len/(c·t) tokens of a layer's input.
    with pytest.raises(MemoError, match="c·t = 8 ranks.*multiple of 8"):
        rank_tokens(260, 4, 2)
    with pytest.raises(MemoError, match="multiple of 6; use 6"):
        rank_tokens(4, 1, 3)
    assert token_multiple(1, 1) == 1 and token_multiple(8, 1) == 8
    assert token_multiple(1, 2) == 4 and token_multiple(8, 2) == 16 and token_multiple(2, 3) == 6
    assert rank_tokens(1 << 20, 8, 2) == 1 << 19 and rank_tokens(12, 2, 3) == 4


def test_cli_profile_and_show(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    code = main(["profile", "--model", "tiny", "--seq-len", "512", "--device", "meta", "--dtype", "float32",
                 "--context-parallel", "2", "--tensor-parallel", "2", "-o", str(out), "-q", *_CLI_MACHINE])
    assert code == 0
    printed = capsys.readouterr().out
    cp_line = ("CP       2-way context parallel [given]: the rank runs 256 of 512 tokens, its layer input "
               "holds 128")
    assert cp_line in printed
    # No --gpus-per-node on meta: the TP x CP group is assumed to share the node's host memory.
    assert "/ 4 GPU(s) per node [assumed: the TP x CP group of 4 ranks" in printed
    assert "note: context parallel 2-way" in printed and "not counted" in printed
    assert json.loads(out.read_text())["meta"]["context_parallel"] == 2
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "parallel      TP 2 x CP 2: one rank of 4 GPUs; it runs 256 of the 512 tokens" in shown


def test_cli_refuses_bad_context_parallel(tmp_path, capsys) -> None:
    out = str(tmp_path / "p.json")
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exc:
            main(["profile", "--model", "tiny", "--seq-len", "512", "--context-parallel", bad, "-o", out])
        assert exc.value.code == 2
        assert "--context-parallel" in capsys.readouterr().err
    code = main(["profile", "--model", "tiny", "--seq-len", "1000", "--device", "meta",
                 "--context-parallel", "3", "-o", out, *_CLI_MACHINE])
    assert code == 2
    assert "multiple of 6; use 996 or 1,002" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cp_plan(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cp") / "cp2.json"
    result = profile("tiny", 256, 1, "float32", "meta", context_parallel=2, **_MACHINE)
    save_plan(result.plan, path)
    return str(path)


def test_load_plan_checks_context_parallel(cp_plan: str) -> None:
    plan = load_plan(cp_plan, seq_len=256, context_parallel=2, tensor_parallel=1)
    assert plan.meta["context_parallel"] == 2
    with pytest.raises(PlanMismatchError, match="context_parallel=2, this run has context_parallel=1"):
        load_plan(cp_plan, context_parallel=1)


def test_memo_train_refuses_a_plan_for_another_cp(cp_plan: str, capsys) -> None:
    code = main(["train", "--model", "tiny", "--seq-len", "256", "--steps", "1", "--device", "cpu",
                 "--dtype", "float32", "--plan", cp_plan, "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "the plan was made for one rank of context_parallel=2, this run has context_parallel=1" in err
    assert "--context-parallel 1" in err
