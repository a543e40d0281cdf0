"""Damaged plan and trace files are refused with one line (issue 12, item 8 in part)."""

from __future__ import annotations

import json

import pytest
from memo.planner import load_plan, load_trace

from memo.cli.main import main
from memo.errors import MemoError

MACHINE = ["--bandwidth-gbps", "10", "--layer-ms", "1", "--host-mem-gb", "8"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    assert main(["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE, "-o",
                 str(d / "p.json"), "--trace-out", str(d / "t.json"), "--quiet"]) == 0
    return d


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("alpha", float("nan"), "alpha must be a number in [0, 1], got nan"),
    ("alpha", 7, "alpha must be a number in [0, 1], got 7"),
    ("host_bytes", -5, "host_bytes must be an integer >= 0, got -5"),
    ("end_time", -3, "end_time must be an integer >= 0, got -3"),
    ("version", True, "unknown plan version True"),
    ("version", 1.0, "unknown plan version 1.0"),
])
def test_a_damaged_plan_is_refused(files, tmp_path, field, value, needle, capsys) -> None:
    data = json.loads((files / "p.json").read_text())
    data[field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(MemoError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_plan(bad)
    assert main(["show", str(bad)]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_trace_version_must_be_the_integer_1(files, tmp_path, version) -> None:
    data = json.loads((files / "t.json").read_text())
    data["version"] = version
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(MemoError, match="unknown trace version"):
        load_trace(bad)
