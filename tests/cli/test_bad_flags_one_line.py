"""Bad flags give one line and exit status 2, never a traceback (issue 12, item 7)."""

from __future__ import annotations

import pytest
import torch

from memo.cli.main import main

TRAIN = ["train", "--model", "tiny", "--seq-len", "64", "--steps", "1", "--no-progress"]


@pytest.mark.parametrize(("argv", "needle"), [
    ([*TRAIN, "--device", "foo"], "argument --device: unknown device 'foo'; use cpu, cuda or cuda:<index>"),
    ([*TRAIN, "--device", "meta"], "argument --device: training needs real memory"),
    ([*TRAIN, "--data", "/nope/none.txt"], "memo train: --data '/nope/none.txt' is not a file"),
    ([*TRAIN, "--plot", "loss.txt"], "argument --plot: cannot draw a figure as 'loss.txt'"),
    (["plot", "plan.json", "-o", "out.txt"], "argument -o/--output: cannot draw a figure as 'out.txt'"),
    (["profile", "--model", "tiny", "--seq-len", "999999999999999999999", "--device", "meta", "-o", "p.json"],
     "--seq-len must be at most 17,179,869,184 tokens (16G)"),
])
def test_bad_flags_are_one_line(argv, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        assert main(argv) == 2  # a MemoError returns 2; an argparse error exits with 2
        raise SystemExit(2)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and needle in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*TRAIN, "--device", "cuda"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no CUDA device on this machine" in err and "use --device cpu" in err and "Traceback" not in err


# --------------------------------------- a length the machine cannot hold, refused at once (item 8)
def _machine_bytes() -> int:
    from memo.allocator.host import meminfo_bytes

    return (meminfo_bytes("MemTotal") or 0) + (meminfo_bytes("SwapTotal") or 0)


PROFILE = ["profile", "--model", "tiny", "--seq-len", "1000000000", "--bandwidth-gbps", "10",
           "--layer-ms", "1"]
LEAST = ("--seq-len 1,000,000,000 needs at least {total} {where} (the parameters, {half}, and one layer's "
         "input, 1 x 1,000,000,000 tokens x hidden 64 x {item} bytes = {half}), more than {limit}; nothing "
         "was run. Use a shorter --seq-len or a smaller --micro-batch")
RAM = "this machine's memory (RAM + swap)"


@pytest.mark.skipif(_machine_bytes() >= 256 * 10**9, reason="this machine could hold the profile")
@pytest.mark.parametrize(("argv", "needle"), [
    # Before: pass 1 recorded for about a minute, then PyTorch failed to allocate the position table.
    ([*PROFILE, "--device", "cpu"], "memo.profiler: " + LEAST.format(
        total="238.42 GiB", where="on cpu", half="119.21 GiB", item=2, limit=RAM)),
    # Before: a traceback from PyTorch's CPU allocator.
    (["train", "--model", "tiny", "--seq-len", "1000000000", "--steps", "1", "--no-progress"], "memo.train: "
     + LEAST.format(total="476.84 GiB", where="on cpu", half="238.42 GiB", item=4, limit=RAM)),
])
def test_a_length_the_machine_cannot_hold_is_refused_before_any_work(argv, needle, tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main([*argv, *(["-o", str(out)] if argv[0] == "profile" else [])]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    # What this machine has varies: the line up to it, and from it on.
    assert err.startswith(f"error: {needle.split(RAM)[0]}{RAM}, "), err
    assert err.endswith("; nothing was run. Use a shorter --seq-len or a smaller --micro-batch"), err
    assert not out.exists()


def test_a_length_beyond_the_device_budget_is_refused_before_recording(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    # Before: over a minute of recording on meta before the layer policy found no fit.
    assert main([*PROFILE, "--device", "meta", "--device-mem-gb", "80", "-o", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == "error: memo.profiler: " + LEAST.format(
        total="238.42 GiB", where="per device", half="119.21 GiB", item=2,
        limit="the --device-mem-gb 80 budget, 74.51 GiB"), err
    assert not out.exists()
