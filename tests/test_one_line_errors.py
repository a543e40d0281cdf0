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
