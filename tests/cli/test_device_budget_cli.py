"""Bad inputs around the device budget, through the command line (issue 10, "Device memory"):
a budget too small, a budget that is not positive, a model JSON with missing or inconsistent
fields, a plan made for another budget; and `memo plan --device-mem-gb`.

Each case asserts the exit status and what the one error line names, never only that it ran.
Byte figures are read from the files memo writes, never hard-coded: the runtime's memory changes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from memo.planner import Trace, load_plan, save_trace
from memo.planner.synthetic import layered_trace

from memo.cli.main import main
from memo.pipeline import FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES

MACHINE = ["--bandwidth-gbps", "32", "--layer-ms", "1", "--host-mem-gb", "64"]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _error_line(err: str) -> str:
    """The one line memo's CLI prints for a MemoError (progress lines may come before it)."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def _exit_code(argv: list[str]) -> int:
    """main's status, or argparse's (it exits 2 for a value its type refuses)."""
    try:
        return main(argv)
    except SystemExit as done:
        return int(done.code)


def _bytes_of(text: str) -> int:
    """``"65.78 MiB"`` -> bytes (memo.units.format_bytes's form)."""
    number, unit = text.split()
    return int(float(number.replace(",", "")) * UNITS[unit])


# ---------------------------------------------------------------------------- a budget too small
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_profile_with_too_small_a_budget_names_the_smallest_need(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE, "-o", str(out),
            "--quiet"]
    # Above the parameters and one layer's input (a budget below those is refused before recording,
    # NOTE [Least memory, checked first]), far below what any layer policy needs.
    assert main([*argv, "--device-mem-gb", "0.0015"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "device budget of 1.43 MiB" in line, line  # the budget it was given
    found = re.search(r"smallest need is ([\d.,]+ (?:B|KiB|MiB|GiB|TiB))", line)
    assert found, line
    need = _bytes_of(found.group(1))
    assert need > 10**6  # far beyond the budget: the message gives the need, not the budget again
    assert "--device-mem-gb" in line or "Give" in line, line  # what to do
    assert not out.exists()  # nothing is written for a job that cannot run
    # The need it names is a need: a budget a little above the budget it names for it (the need
    # plus the headroom kept free for the fallback allocator: 5%, or one segment of its pool where
    # that is more, NOTE [Fallback headroom]) is enough.
    least = re.search(r"a budget of at least ([\d.,]+ (?:B|KiB|MiB|GiB|TiB))", line)
    headroom = max(need / (1 - FALLBACK_HEADROOM), need + FALLBACK_SEGMENT_BYTES)
    assert least and need < _bytes_of(least.group(1)) < 1.01 * headroom, line
    assert main([*argv, "--device-mem-gb", f"{1.02 * _bytes_of(least.group(1)) / 1e9:.9f}"]) == 0, \
        capsys.readouterr().err
    device = load_plan(out).device
    assert device["total_bytes"] <= device["budget_bytes"]


# ------------------------------------------------------------------------ a budget not positive
@pytest.mark.parametrize("bad", ["0", "-1", "-0.5", "nan", "inf", "lots"])
@pytest.mark.parametrize("command", ["profile", "plan"])
def test_a_budget_must_be_a_positive_number(command: str, bad: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # `memo train --device-mem-gb 0 / -1` is test_device_budget_must_be_positive in
    # tests/cli/test_newcomer_messages.py.
    if command == "profile":
        argv = ["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE]
    else:
        trace = tmp_path / "trace.json"
        save_trace(Trace.from_dict(layered_trace(3)), trace)
        argv = ["plan", str(trace)]
    out = tmp_path / "p.json"
    assert _exit_code([*argv, "-o", str(out), f"--device-mem-gb={bad}"]) == 2
    err = capsys.readouterr().err
    assert "--device-mem-gb" in err and "must be a positive number" in err and repr(bad) in err, err
    assert not out.exists()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True])
def test_profile_api_refuses_a_budget_that_is_not_positive(bad: object) -> None:
    from memo.errors import MemoError
    from memo.pipeline import profile

    with pytest.raises(MemoError, match=r"--device-mem-gb\) must be a positive number of GB"):
        profile("tiny", 256, device="meta", bandwidth_gbps=32, layer_ms=1.0, host_mem_gb=64,
                device_mem_gb=bad)


# ------------------------------------------------------- model JSON with missing or inconsistent fields
# tests/models/test_model_config_file.py checks load_config's messages from Python; these go through the
# commands a user types, with fields it does not cover.
@pytest.mark.parametrize(("data", "needle"), [
    ({"hidden": 64, "n_heads": 4}, "missing field(s) arch, n_layers"),
    ({"arch": "gpt", "n_layers": 4, "hidden": 64, "n_heads": 4, "rope_theta": 10000.0},
     "rope_theta=10000.0 given for a GPT config"),
    ({"arch": "llama", "n_layers": 4, "hidden": 48, "n_heads": 16}, "rotary needs an even head_dim, got 3"),
    ({"arch": "llama", "n_layers": 4, "hidden": 64, "n_heads": 4, "n_kv_heads": 8},
     "n_heads=4 must be a multiple of n_kv_heads=8"),
    ({"arch": "gpt", "n_layers": 4, "hidden": 64, "n_heads": 4, "ffn_hidden": 0},
     "ffn_hidden must be a positive int, got 0"),
    ({"arch": "gpt", "n_layers": 4, "hidden": -64, "n_heads": 4}, "hidden must be a positive int, got -64"),
    ({"arch": "gpt", "n_layers": 4, "hidden": 64, "n_heads": 4, "vocab_size": 0},
     "vocab_size must be a positive int, got 0"),
    ({"arch": "gpt", "n_layers": 4, "hidden": 64, "n_heads": 4, "norm_eps": 0}, "norm_eps must be > 0"),
    ({"arch": "gpt", "n_layers": 4, "hidden": 64, "n_heads": 4, "name": ""}, "name must be a non-empty"),
])
@pytest.mark.parametrize("command", ["profile", "train"])
def test_a_bad_model_json_is_refused_by_the_commands(command: str, data: dict, needle: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    if command == "profile":
        argv = ["profile", "--model", str(path), "--seq-len", "256", "--device", "meta", *MACHINE,
                "-o", str(tmp_path / "p.json")]
    else:
        argv = ["train", "--model", str(path), "--seq-len", "64", "--steps", "1", "--no-progress"]
    assert _exit_code(argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert needle in line and "memo.models" in line and str(path) in line, line
    assert not (tmp_path / "p.json").exists()


# ------------------------------------------------------------------ a plan made for another budget
def _profile_cpu(tmp_path: Path, name: str, budget: str | None) -> Path:
    out = tmp_path / name
    argv = ["profile", "--model", "tiny", "--seq-len", "256", "--device", "cpu", "--dtype", "float32",
            *MACHINE, "-o", str(out), "--quiet", *(["--device-mem-gb", budget] if budget else [])]
    assert main(argv) == 0
    return out


TRAIN = ["train", "--model", "tiny", "--seq-len", "256", "--steps", "1", "--no-progress"]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_plan_for_another_budget_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _profile_cpu(tmp_path, "p1.json", "1")
    capsys.readouterr()
    assert main([*TRAIN, "--plan", str(plan), "--device-mem-gb", "2"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "made for --device-mem-gb 1," in line and "this run has --device-mem-gb 2" in line, line
    assert "memo profile --device-mem-gb 2" in line, line  # what to do
    # A plan made without a budget is refused for a run with one, saying so.
    free = _profile_cpu(tmp_path, "p0.json", None)
    capsys.readouterr()
    assert main([*TRAIN, "--plan", str(free), "--device-mem-gb", "1"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "made for no device budget" in line and "--device-mem-gb 1" in line, line
    # The same budget is accepted: the check refuses a mismatch, not every plan.
    report = tmp_path / "r.json"
    assert main([*TRAIN, "--plan", str(plan), "--device-mem-gb", "1", "--report", str(report)]) == 0
    assert json.loads(report.read_text())["peak_device_bytes"] <= 10**9


# ------------------------------------------------------------------------ memo plan --device-mem-gb
def _trace(tmp_path: Path, **meta: object) -> tuple[Trace, Path]:
    data = layered_trace(3)
    data["meta"] = {**data.get("meta", {}), **meta}
    trace = Trace.from_dict(data)
    path = tmp_path / "trace.json"
    save_trace(trace, path)
    return trace, path


def _states(params: int, grads: int, opt: int) -> dict:
    return {"optimizer_states": "same",
            "parameters": {"count": params // 4, "bytes": params, "dtype": "float32"},
            "gradients": {"bytes": grads, "dtype": "float32"},
            "optimizer": {"bytes": opt, "dtype": "float32", "what": "AdamW exp_avg, exp_avg_sq"}}


def test_plan_records_the_budget_and_show_prints_it(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _, tpath = _trace(tmp_path)
    ppath = tmp_path / "plan.json"
    assert main(["plan", str(tpath), "-o", str(ppath), "--device-mem-gb", "1", "--no-mip"]) == 0
    out = capsys.readouterr().out
    plan = load_plan(ppath)
    d = plan.device
    assert d["budget_bytes"] == 10**9 and d["activations_bytes"] == plan.peak
    # This trace records no model states: the total is the iteration's alone, and both commands say so.
    assert d["model_states"] is None and d["total_bytes"] == d["iteration_peak_bytes"] >= plan.peak
    assert "states      not recorded in the trace" in out and "(fits)" in out, out
    assert main(["show", str(ppath)]) == 0
    shown = capsys.readouterr().out
    assert "GPU memory (fits)" in shown and "not recorded in the trace" in shown, shown
    # Without the flag nothing is checked or recorded, as before.
    assert main(["plan", str(tpath), "-o", str(ppath), "--no-mip"]) == 0
    assert load_plan(ppath).device is None


def test_plan_adds_the_model_states_the_trace_records(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    states = _states(3 << 20, 3 << 20, 6 << 20)
    _, tpath = _trace(tmp_path, model_states=states)
    ppath = tmp_path / "plan.json"
    assert main(["plan", str(tpath), "-o", str(ppath), "--device-mem-gb", "1", "--no-mip"]) == 0
    d = load_plan(ppath).device
    # Parameters and optimizer states live across iterations; gradients are in the trace already.
    assert d["model_states"]["parameters"]["bytes"] == 3 << 20
    assert d["total_bytes"] == d["iteration_peak_bytes"] + (3 << 20) + (6 << 20)
    assert main(["show", str(ppath)]) == 0
    assert "parameters 3.00 MiB float32" in capsys.readouterr().out
    # A budget between the iteration alone and the total is refused: the states count.
    gb = (d["iteration_peak_bytes"] + (1 << 20)) / 1e9
    assert main(["plan", str(tpath), "-o", str(tmp_path / "no.json"), "--device-mem-gb", f"{gb:.9f}",
                 "--no-mip"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"({d['total_bytes']:,} bytes)" in line and "parameters and optimizer states" in line, line
    assert not (tmp_path / "no.json").exists()


def test_plan_refuses_a_budget_it_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, tpath = _trace(tmp_path)
    ppath = tmp_path / "plan.json"
    assert main(["plan", str(tpath), "-o", str(ppath), "--no-mip"]) == 0
    peak = load_plan(ppath).peak
    capsys.readouterr()
    budget = peak // 2
    for extra in ([], ["--expand"]):
        out = tmp_path / f"small{len(extra)}.json"
        assert main(["plan", str(tpath), "-o", str(out), "--device-mem-gb", f"{budget / 1e9:.9f}", "--no-mip",
                     *extra]) == 2
        line = _error_line(capsys.readouterr().err)
        need = re.search(r"needs [\d.,]+ \w+ \(([\d,]+) bytes\)", line)
        assert need and int(need.group(1).replace(",", "")) >= peak, line  # the need, in bytes
        assert f"{budget:,} bytes" in line, line  # the budget
        assert "trace records no model states" in line, line  # what the need leaves out
        assert "larger --device-mem-gb" in line and "memo profile --device-mem-gb" in line, line  # what to do
        assert not out.exists()


def test_plan_refuses_malformed_model_states(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, tpath = _trace(tmp_path, model_states={"parameters": {"bytes": 10}})
    assert main(["plan", str(tpath), "-o", str(tmp_path / "p.json"), "--device-mem-gb", "1"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "meta.model_states" in line and "gradients" in line, line


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_plan_of_a_profiled_trace_agrees_with_profile(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`memo plan --for-allocator --device-mem-gb` of `memo profile`'s trace, given the model states
    the profile recorded, finds the device total the profile found, and refuses the plan for another
    budget in `memo train` the same way."""
    made, trace = tmp_path / "profiled.json", tmp_path / "trace.json"
    assert main(["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE,
                 "--device-mem-gb", "1", "-o", str(made), "--trace-out", str(trace), "--quiet"]) == 0
    profiled = load_plan(made).device
    data = json.loads(trace.read_text())
    data["meta"].setdefault("model_states", profiled["model_states"])
    trace.write_text(json.dumps(data))
    replanned = tmp_path / "replanned.json"
    assert main(["plan", str(trace), "-o", str(replanned), "--for-allocator", "--device-mem-gb", "1"]) == 0
    d = load_plan(replanned).device
    assert d["budget_bytes"] == profiled["budget_bytes"] == 10**9
    assert d["model_states"] == profiled["model_states"]
    assert d["iteration_peak_bytes"] >= profiled["iteration_peak_bytes"]
    assert d["total_bytes"] <= 1.01 * profiled["total_bytes"], (d, profiled)
    capsys.readouterr()
    # `memo train` refuses a `memo plan` plan made for another budget as it does a profiled one.
    assert main(["train", "--model", "tiny", "--seq-len", "256", "--dtype", "bfloat16", "--steps", "1",
                 "--no-progress", "--plan", str(replanned), "--device-mem-gb", "3"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "--device-mem-gb 1," in line and "--device-mem-gb 3" in line, line
