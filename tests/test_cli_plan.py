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
