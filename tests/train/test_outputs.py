"""NOTE [Atomic writes]: output paths are checked before any work, files are replaced only when
complete, and Ctrl-C prints one line."""

from __future__ import annotations

import json
import os

import pytest

from memo.cli.main import main
from memo.errors import MemoError
from memo.jsonio import atomic_write, check_writable

MACHINE = ["--bandwidth-gbps", "10", "--layer-ms", "1", "--host-mem-gb", "8"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["train", "--model", "tiny", "--seq-len", "64", "--steps", "1", "--no-progress", "--report",
      "{missing}/r.json"], "memo train --report: the folder"),
    (["train", "--model", "tiny", "--seq-len", "64", "--steps", "1", "--no-progress", "--plot",
      "{missing}/loss.png"], "memo train --plot: the folder"),
    (["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE, "-o",
      "{missing}/p.json"], "memo profile -o: the folder"),
    (["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE, "-o", "{tmp}/p.json",
      "--trace-out", "{tmp}"], "memo profile --trace-out: '"),
])
def test_output_paths_are_checked_before_any_work(argv, needle, tmp_path, capsys) -> None:
    argv = [a.format(missing=tmp_path / "nope", tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr()
    line = err.err.strip().splitlines()[-1]
    assert line.startswith("error: ") and needle in line, line
    assert "step" not in err.out and "pass 1" not in err.err  # refused before training or profiling
    assert not (tmp_path / "p.json").exists()


def test_plan_output_is_checked_before_planning(tmp_path, capsys) -> None:
    trace = tmp_path / "t.json"
    assert main(["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE, "-o",
                 str(tmp_path / "p.json"), "--trace-out", str(trace), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["plan", str(trace), "-o", str(tmp_path / "nope" / "q.json")]) == 2
    assert "memo plan -o: the folder" in capsys.readouterr().err


def test_a_failed_write_leaves_the_old_file_whole(tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"good": true}\n')
    with pytest.raises(RuntimeError, match="disk full"), atomic_write(path, "memo.plan") as f:
        f.write('{"half": ')
        raise RuntimeError("disk full")
    assert json.loads(path.read_text()) == {"good": True}
    assert os.listdir(tmp_path) == ["plan.json"]  # no temporary file left behind
    with atomic_write(path, "memo.plan") as f:
        f.write('{"new": 1}\n')
    assert json.loads(path.read_text()) == {"new": 1} and os.listdir(tmp_path) == ["plan.json"]


def test_check_writable_refuses_a_folder(tmp_path) -> None:
    with pytest.raises(MemoError, match="is a folder; give a file name"):
        check_writable(tmp_path, "memo plan -o")
    check_writable(tmp_path / "ok.json", "memo plan -o")


def test_ctrl_c_is_one_line(monkeypatch, capsys) -> None:
    import memo.cli.show as show

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(show, "run", interrupted)
    from memo.cli import main as cli

    parser = cli.build_parser()
    args = parser.parse_args(["show", "x.json"])
    fake = type("P", (), {"parse_args": lambda self, a: args})()
    monkeypatch.setattr(cli, "build_parser", lambda only=None: fake)
    args.func = interrupted
    assert cli.main(["show", "x.json"]) == 130
    assert capsys.readouterr().err == "memo: interrupted\n"
