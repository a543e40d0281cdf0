"""`memo profile`: flag parsing, clear errors, and plans that load and validate."""

from __future__ import annotations

import pytest

from memo.cli.main import main
from memo.errors import MemoError
from memo.profiler import parse_count

_MACHINE = ["--bandwidth-gbps", "32", "--layer-ms", "5", "--host-mem-gb", "64", "--gpus-per-node", "8"]


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("128K", 131072), ("128k", 131072), ("1M", 1048576), (" 2M ", 2097152), ("1G", 2**30)],
)
def test_seq_len_forms(text: str, value: int) -> None:
    assert parse_count(text, "--seq-len") == value


@pytest.mark.parametrize("text", ["0", "0K", "-5", "abc", "1.5M", "", "1T", "1MK"])
def test_seq_len_rejects(text: str) -> None:
    with pytest.raises(MemoError, match="--seq-len"):
        parse_count(text, "--seq-len")


@pytest.mark.parametrize("seq_len", ["0", "abc", "-1", "1.5K"])
def test_bad_seq_len_exits_2(seq_len: str, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--model", "tiny", "--seq-len", seq_len, "-o", str(tmp_path / "p.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--seq-len" in err and "positive" in err


def test_unknown_model_exits_2(tmp_path, capsys) -> None:
    code = main(
        ["profile", "--model", "gpt-9000", "--seq-len", "1K", "-o", str(tmp_path / "p.json"), *_MACHINE]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-9000'" in err and "gpt-7b" in err


def test_meta_needs_machine_numbers(tmp_path, capsys) -> None:
    code = main(
        ["profile", "--model", "tiny", "--seq-len", "1K", "--device", "meta", "-o", str(tmp_path / "p.json")]
    )
    assert code == 2
    assert "--bandwidth-gbps" in capsys.readouterr().err


def test_allocator_recorder_refused_on_meta(tmp_path, capsys) -> None:
    args = ["profile", "--model", "tiny", "--seq-len", "1K", "--device", "meta", "--recorder", "allocator"]
    code = main([*args, "-o", str(tmp_path / "p.json"), *_MACHINE])
    assert code == 2
    assert "meta" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["meta", pytest.param("cpu", marks=pytest.mark.slow)])
def test_profile_writes_a_plan_that_loads(device: str, tmp_path, capsys) -> None:
    from memo.planner import load_plan, load_trace, validate_plan

    plan_path, trace_path = tmp_path / "plan.json", tmp_path / "trace.json"
    args = ["profile", "--model", "tiny", "--seq-len", "256", "--device", device, "--dtype", "float32"]
    args += ["-o", str(plan_path), "--trace-out", str(trace_path), "--time-limit", "5", *_MACHINE]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "S_input" in out and "[given]" in out and "alpha" in out
    trace = load_trace(trace_path)
    assert trace.meta["seq_len"] == 256 and trace.meta["model"] == "tiny"
    assert trace.meta["recorder"] == ("dispatch" if device == "meta" else "allocator")
    plan = load_plan(plan_path)
    validate_plan(plan, trace)
    assert plan.peak >= plan.lower_bound > 0


def test_layer_time_estimated_from_gpu(tmp_path, capsys) -> None:
    args = ["profile", "--model", "tiny", "--seq-len", "2K", "--device", "meta", "--gpu", "h100"]
    args += [
        "--bandwidth-gbps",
        "32",
        "--host-mem-gb",
        "64",
        "-o",
        str(tmp_path / "p.json"),
        "--time-limit",
        "5",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "estimated" in out and "h100" in out
