"""`memo plan`, `memo show`, `memo plot` on a small trace."""

from __future__ import annotations

import json

from memo.planner import Trace, load_plan, save_trace, validate_plan
from memo.planner.synthetic import layered_trace

from memo.cli.main import main
from memo.units import format_bytes


def _trace_file(tmp_path, **kw):
    trace = Trace.from_dict(layered_trace(3, **kw))
    path = tmp_path / "trace.json"
    save_trace(trace, path)
    return trace, path


def test_plan_show_plot(tmp_path, capsys):
    trace, tpath = _trace_file(tmp_path)
    ppath = tmp_path / "plan.json"
    assert main(["plan", str(tpath), "-o", str(ppath), "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    plan = load_plan(ppath)
    validate_plan(plan, trace)
    assert f"peak          {format_bytes(plan.peak)}" in out  # one human unit; exact bytes in the file
    assert f"lower bound   {format_bytes(plan.lower_bound)}" in out
    assert f"wrote {ppath}" in out

    assert main(["show", str(ppath)]) == 0
    shown = capsys.readouterr().out
    assert "alpha         not solved" in shown
    assert f"ratio         {plan.peak / plan.lower_bound:.4f}" in shown
    assert "layer.fwd[2]" in shown and "level 1       layer.fwd: block" in shown
    assert "heuristic fallback: False" in shown

    png = tmp_path / "plan.png"
    assert main(["plot", str(ppath), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"({len(trace.allocations)} allocations)" in capsys.readouterr().out


def test_plan_no_mip_and_flat(tmp_path, capsys):
    _, tpath = _trace_file(tmp_path)
    ppath = tmp_path / "plan.json"
    assert main(["plan", str(tpath), "-o", str(ppath), "--no-mip", "--flat"]) == 0
    assert "flat heuristic only" in capsys.readouterr().out
    assert load_plan(ppath).solver["kind"] == "flat"


def test_expand_writes_every_address(tmp_path, capsys):
    trace, tpath = _trace_file(tmp_path)
    out = tmp_path / "addresses.json"
    assert main(["plan", str(tpath), "--expand", "-o", str(out), "--no-mip"]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"peak", "lower_bound", "addresses"}
    assert set(data["addresses"]) == {str(a.id) for a in trace.allocations}
    assert all(v % 512 == 0 and 0 <= v < data["peak"] for v in data["addresses"].values())
    assert data["lower_bound"] <= data["peak"]


def test_errors_are_reported_not_raised(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "events": [{"op": "free", "id": 4}]}))
    assert main(["plan", str(bad), "-o", str(tmp_path / "p.json")]) == 2
    assert "event 0: free of id 4" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_capacity_is_a_target_and_a_miss_exits_1_with_the_numbers(tmp_path, capsys):
    trace, tpath = _trace_file(tmp_path)
    ppath = tmp_path / "plan.json"
    assert main(["plan", str(tpath), "-o", str(ppath), "--time-limit", "5"]) == 0
    best = load_plan(ppath)
    capsys.readouterr()
    # Room to spare: the plan is within it and the command succeeds.
    assert main(["plan", str(tpath), "-o", str(ppath), "--time-limit", "5", "--capacity",
                 str(2 * best.peak)]) == 0
    assert load_plan(ppath).peak <= 2 * best.peak
    capsys.readouterr()
    # Below the lower bound: no placement can fit; the best plan is still written, exit 1, and
    # the message says how much was needed against what was given.
    small = best.lower_bound - 512
    assert main(["plan", str(tpath), "-o", str(ppath), "--time-limit", "5", "--capacity", str(small)]) == 1
    err = capsys.readouterr().err
    assert f"over the capacity of {format_bytes(small)} ({small:,} bytes)" in err
    assert f"the lower bound is {format_bytes(best.lower_bound)}" in err
    validate_plan(load_plan(ppath), trace)


def test_capacity_accepts_units_and_refuses_nonsense(capsys):
    import argparse

    import pytest

    from memo.cli.args import byte_count

    assert byte_count("1048576") == 1 << 20
    assert byte_count("1MiB") == byte_count("1 mib") == 1 << 20
    assert byte_count("1.5GiB") == 3 << 29
    assert byte_count("80GB") == 80 * 10**9
    for bad in ("", "-1", "0", "1 parsec", "MiB", "1e3"):
        with pytest.raises(argparse.ArgumentTypeError, match="number of bytes|at least one byte"):
            byte_count(bad)


def test_time_limit_counts_from_the_command_start(tmp_path, capsys, monkeypatch):
    """--time-limit covers the whole command: time already spent comes off the planner's share,
    and a limit spent before planning is an error that says so."""
    import memo.cli.plan as cli_plan

    _, tpath = _trace_file(tmp_path)
    seen = {}
    real = cli_plan.make_plan

    def spy(*args, **kwargs):
        seen["time_limit"] = kwargs["time_limit"]
        return real(*args, **kwargs)

    monkeypatch.setattr(cli_plan, "make_plan", spy)
    assert main(["plan", str(tpath), "-o", str(tmp_path / "p.json"), "--time-limit", "5"]) == 0
    assert 5 - 2 < seen["time_limit"] <= 5 - cli_plan._WRITE_RESERVE
    capsys.readouterr()
    assert main(["plan", str(tpath), "-o", str(tmp_path / "p.json"), "--time-limit", "0.1"]) == 2
    assert "--time-limit 0.1 s was spent before planning began" in capsys.readouterr().err


def test_memo_plan_imports_no_torch(tmp_path):
    """`memo plan` builds only its own parser, so torch's import does not eat its time limit."""
    import subprocess
    import sys

    _, tpath = _trace_file(tmp_path)
    code = ("import sys, runpy; sys.argv = ['memo', 'plan', sys.argv[1], '-o', sys.argv[2], '--no-mip']\n"
            "try:\n    runpy.run_module('memo', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nassert 'torch' not in sys.modules, 'memo plan imported torch'\n")
    out = str(tmp_path / "p.json")
    subprocess.run([sys.executable, "-c", code, str(tpath), out], check=True, timeout=120)
