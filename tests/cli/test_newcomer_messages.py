"""What a newcomer reads first: run headers that say what runs, and every missing flag at once."""

from __future__ import annotations

import json

import pytest

from memo.cli.main import main
from memo.train import StrategyOptions, TrainConfig, make_strategy, train


@pytest.mark.parametrize(("strategy", "alpha", "expected"), [
    ("none", "auto", "strategy none,"),
    ("full-recompute", "auto", "strategy full-recompute,"),
    ("full-offload", "auto", "strategy full-offload (alpha 1.0000),"),
    ("memo", 0.5, "strategy memo (alpha 0.5000),"),
])
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.usefixtures("one_thread")
def test_run_header_names_the_strategy(strategy: str, alpha: object, expected: str) -> None:
    lines: list[str] = []
    options = StrategyOptions(strategy=strategy, alpha=alpha, bandwidth_gbps=10.0, layer_ms=1.0,
                              host_mem_gb=8.0)
    train(TrainConfig(model="tiny", seq_len=64, steps=1), log=lines.append, progress=False,
          strategy=make_strategy(options))
    header = next(line for line in lines if line.startswith("memo.train:"))
    assert expected in header, header
    assert "recompute=" not in header
    assert "MFU n/a (no peak FLOPS known for this device" in header  # a CPU has no known peak


def test_every_missing_machine_number_is_named_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta",
                               "--host-mem-gb", "64", "-o", "unused.json"]))
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "--bandwidth-gbps" in err and "--layer-ms" in err, err


def test_expected_layer_differences_are_one_note_not_warnings() -> None:
    from memo.cli.show import format_plan
    from memo.pipeline import profile

    plan = profile("tiny", 256, 1, device="meta", bandwidth_gbps=32, layer_ms=1.0, host_mem_gb=64).plan
    plan.warnings = [
        f"memo.planner: phase layer.{k}[2] differs from the other layer.{k} passes (...); "
        "it is planned on its own" for k in ("fwd", "bwd")
    ] + ["memo.planner: something a user must act on"]
    text = format_plan(plan)
    assert text.count("warning ") == 1 and "something a user must act on" in text
    notes = [line for line in text.splitlines() if line.startswith("note")]
    assert len(notes) == 1 and "layer.fwd[2], layer.bwd[2]" in notes[0] and "nothing to do" in notes[0]


def _demo_module():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "demo.py"
    spec = importlib.util.spec_from_file_location("memo_demo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(alpha: float | None, times: list[float], peak: int, host: int = 0) -> dict:
    return {"alpha": alpha, "device": "cpu", "peak_device_bytes": peak, "host_pinned_bytes": host,
            "allocator": {"planned": 0, "fallback": 0},
            "steps": [{"step_time_s": t} for t in times], "summary": {"first_loss": 6.0, "last_loss": 5.0}}


@pytest.mark.parametrize(("memo_times", "memo_peak", "faster", "less_memory"), [
    ([9.0, 1.0, 3.0, 1.2], 50 << 20, True, True),    # median 1.2 s: faster; half the memory
    ([1.0, 2.6, 2.4, 9.0], 300 << 20, False, False),  # median 2.6 s: slower; 3x the memory
])
def test_demo_ends_with_what_memo_saved_and_cost(memo_times, memo_peak, faster, less_memory) -> None:
    demo = _demo_module()
    reports = {"memo": _report(0.5, memo_times, memo_peak, 7 << 20),
               "full-recompute": _report(None, [5.0, 2.0, 2.0, 2.0], 100 << 20),
               "none": _report(None, [5.0, 1.5, 1.5, 1.5], 400 << 20)}
    plan = {"policy": ["memo"] * 10 + ["recompute"] * 2, "alpha_binding": "device_memory",
            "device": {"budget_bytes": 80 << 20}}
    text = " ".join(demo.summary(reports, plan).split())
    assert "a device budget of 80.0 MiB per GPU; full recompute would not fit in it (100.0 MiB)" in text
    assert "plain autograd would not either (400.0 MiB)" in text
    assert ("less time per step" in text) is faster and ("more time per step" in text) is not faster
    assert ("memo saved 50.0 MiB against full recompute (50% less" in text) is less_memory
    assert ("memo needed 200.0 MiB more than full recompute (3.00x" in text) is not less_memory
    assert "speed (higher is faster)" in text and "x; lower is better)" in text
    median = sorted(memo_times[1:])[1]
    assert f"median {median * 1e3:,.0f} ms" in text  # the median of the steps after the first, not a mean
    assert "The plan: 10 memo, 2 recompute (of 12 layers), alpha 0.500, bound by device memory." in text
    assert "7.0 MiB of pinned host memory" in text
    table = demo.table(reports)
    assert "higher=faster" in table and "lower=less" in table


@pytest.mark.parametrize("command", ["env", "profile", "plan", "show", "plot", "train"])
def test_help_reads_as_text_and_states_defaults(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "``" not in text  # no raw reStructuredText markup
    assert max(len(line) for line in text.splitlines()) <= 120
    if command == "train":  # --model, --seed; the words, wherever argparse wraps the lines (the list of
        # --model's configs grows with those another test module registered in this process)
        words = " ".join(text.split())
        assert "(default: tiny)" in words and "(default: 0)" in words


def test_one_human_unit_per_quantity() -> None:
    from memo.units import format_bytes, format_ms

    assert format_ms(19100) == "19.1 s" and format_ms(56.44) == "56.4 ms" and format_ms(0.42) == "0.42 ms"
    assert format_bytes(318541275136) == "296.66 GiB" and format_bytes(3 * 2**40) == "3.00 TiB"


def test_memo_plan_says_each_thing_once(tmp_path) -> None:
    import subprocess
    import sys

    from memo.planner import Trace, save_trace

    from memo.pipeline import profile

    trace = profile("gpt-mini", 512, 1, device="meta", bandwidth_gbps=32, layer_ms=1.0, host_mem_gb=64,
                    plan=False).trace
    path = tmp_path / "trace.json"
    save_trace(Trace.from_dict(trace), path)
    done = subprocess.run([sys.executable, "-m", "memo", "plan", str(path), "-o", str(tmp_path / "p.json")],
                          capture_output=True, text=True, check=True)
    assert "UserWarning" not in done.stderr, done.stderr  # printed once, by memo, not again by Python
    lines = done.stdout.splitlines()
    assert len(lines) == len(set(lines))
    for phase in ("layer.fwd[10]", "layer.fwd[11]"):
        assert sum(phase in line for line in lines) <= 1, done.stdout
    assert "--for-allocator" in done.stdout  # why it differs from `memo profile`'s plan


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("strategy", ["memo", "full-recompute"])
def test_device_budget_is_a_real_out_of_memory_error(strategy: str, tmp_path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    common = ["train", "--model", "tiny", "--seq-len", "512", "--steps", "2", "--no-progress", "--strategy",
              strategy, *(["--alpha", "0.5"] if strategy == "memo" else [])]
    report = tmp_path / "r.json"
    assert main([*common, "--device-mem-gb", "1", "--report", str(report)]) == 0
    peak = json.loads(report.read_text())["peak_device_bytes"]
    capsys.readouterr()
    # 60% of what the run needed: a real failed allocation, with the numbers.
    assert main([*common, "--device-mem-gb", f"{0.6 * peak / 1e9:.9f}"]) == 2
    err = capsys.readouterr().err
    if strategy == "full-recompute":  # no arena: the budget left for the pool is what runs out
        assert "ran out of device memory" in err and "cannot serve a request of" in err, err
    # memo's planner may refuse first: no layer policy fits, with the smallest need and its parts.
    refused = "no layer policy fits the device budget" in err and "smallest need is" in err
    assert "ran out of device memory" in err or "cannot hold the parameters" in err or refused, err
    assert main([*common, "--device-mem-gb", "0.0001"]) == 2
    err = capsys.readouterr().err
    # Below the parameters and one layer's input: refused before anything runs (NOTE [Least memory,
    # checked first]), whatever the strategy.
    assert "needs at least" in err and "more than the --device-mem-gb 0.0001 budget" in err, err


@pytest.mark.parametrize("bad", ["0", "-1", "many"])
def test_device_budget_must_be_positive(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--model", "tiny", "--device-mem-gb", bad])
    assert "--device-mem-gb" in capsys.readouterr().err
