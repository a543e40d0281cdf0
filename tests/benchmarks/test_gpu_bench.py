"""benchmarks/gpu_bench.py --dry-run: the code `make gpu-bench` runs on a GPU, on the CPU in miniature.

One run as a user would start it (a subprocess, its strategies in child interpreters) of a headline
stage, its JSON checked against itself; then its records file cut in the middle of a line with memo's
row gone, and resumed: only memo's row runs, from the plan cache. In-process: the resume logic with
stand-in children (which stage asks for which rows), the attention kernels' timings, the prediction's
model, and a records file of another job refused.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from memo.errors import MemoError

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.append(str(BENCHMARKS))  # after the repo: benchmarks/planner.py is not the planner
import gpu_bench  # noqa: E402

HEADLINE = ("none", "full-recompute", "memo", "offloaded-checkpoint")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_bench.py"), "--dry-run", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"gpu_bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


MEASURED = ("none", "full-recompute", "memo")
FLAGS = ("--seq-lens", "256", "--only", *MEASURED, "--time-budget-s", "600")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gpu_bench") / "gpu_bench.md"
    # The headline stage at 256 tokens alone (none runs out of memory in the 10 MiB emulated device,
    # full recompute and memo fit); the budget is far above what it needs.
    _run(*FLAGS, "--stages", "256", "--plan-dir", str(out.parent / "plans"), "--out", str(out))
    return out, json.loads(out.with_suffix(".json").read_text())


def test_dry_run_measures_the_headline_rows(dry_run: tuple[Path, dict]) -> None:
    out, report = dry_run
    assert report["kind"] == "memo.benchmark.gpu_bench" and report["dry_run"] is True
    assert 0 < report["used_s"] < report["time_budget_s"]
    assert report["peak_tflops"] == 1.0 and "nominal" in report["peak_source"]
    by_name = {s["strategy"]: s for s in report["strategies"]}
    assert set(by_name) == set(MEASURED)
    for name, result in by_name.items():
        assert result["ended"] == "ok", (name, result["ended"])
        [row] = result["rows"]
        assert row["seq_len"] == 256
        if name == "none":
            # NOTE [Rows that cannot fit]: plain autograd's estimate is over the emulated 10 MiB, so the
            # row is reported with the estimate's numbers and not run.
            assert row["status"] == "does not fit" and row["device_bytes"] == 10 * 2**20
            assert row["need_bytes"] > row["device_bytes"] and "step_times_s" not in row, row
            continue
        assert row["status"] == "ok" and row["mean_step_time_s"] > 0 and row["peak_device_bytes"] > 0
        # MFU is model FLOPs per step / step time / peak (1 TFLOPS in a dry run).
        assert math.isclose(row["mfu"], row["flops_per_step"] / row["mean_step_time_s"] / 1e12)
    assert by_name["memo"]["rows"][0]["plan_source"] == "profiled"
    [m] = report["memo_vs_plan"]
    assert isinstance(m["peak_over_plan"], float) and 0.5 < m["peak_over_plan"] < 2, m
    assert m["within_bar"] == (abs(m["peak_over_plan"] - 1) <= report["plan_bar"])
    assert m["peak_over_full_recompute"] > 0
    text = out.read_text()
    for heading in ("Step time", "memo's device peak against its plan"):
        assert heading in text
    assert "| 256 | none | does not fit: needs 11.0 MiB of 10.0 MiB (estimated, not run) |" in text


def test_a_cut_records_file_resumes_with_the_missing_rows_only(dry_run: tuple[Path, dict]) -> None:
    out, _ = dry_run
    lines = out.with_suffix(".records.jsonl").read_text().splitlines(keepends=True)
    # A loan that ended during memo's row: its row gone, the last line cut in half.
    kept = [line for line in lines if not ('"strategy": "memo"' in line and '"type": "row"' in line)]
    assert len(kept) == len(lines) - 1
    cut = out.parent / "cut.records.jsonl"
    cut.write_text("".join(kept) + kept[-1][:15])
    done = _run(*FLAGS, "--stages", "256", "--plan-dir", str(out.parent / "plans"),
                "--out", str(out.parent / "resumed.md"), "--resume", str(cut))
    assert "already measured" in done.stdout
    new = [json.loads(line) for line in cut.read_text().splitlines()[len(kept) + 1:]]
    rows = [r for r in new if r["type"] == "row"]
    assert [(r["strategy"], r["seq_len"]) for r in rows] == [("memo", 256)], new
    assert rows[0]["status"] == "ok" and rows[0]["plan_source"] == "cache"  # NOTE [Plan cache]
    report = json.loads((out.parent / "resumed.json").read_text())
    assert all(len(s["rows"]) == 1 for s in report["strategies"]) and len(report["strategies"]) == 3


def test_kernel_timings_on_the_cpu() -> None:
    record = gpu_bench._kernel_timings(gpu_bench.DRY_RUN_MODEL, "cpu", "float32")
    assert record["chosen"]["kernel"] == "aten_cpu" and record["heads"] == [4, 2, 16]
    [row] = record["rows"]
    assert row["kernel"] == "aten_cpu" and row["matches_reference"]
    assert row["forward_s"] > 0 and row["backward_s"] > 0 and max(row["errors"].values()) < 1e-4
    text = "\n".join(gpu_bench._kernel_table(record))
    assert "| aten_cpu (chosen) | 256 |" in text


# ---------------------------------------------------------------- in process


def _args(*argv: str):
    args = gpu_bench._parser().parse_args(["--dry-run", *argv])
    gpu_bench._defaults(args)
    return args


class _Children:
    """Stand-in children: what each was asked to run, answered with made-up records."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple[str, tuple[str, ...], list[int], dict]] = []
        self.stop_after = stop_after
        self.rows = 0

    def __call__(self, cmd: list[str], timeout: float, on_record) -> str:
        def values(flag: str) -> list[str]:
            i = cmd.index(flag) + 1
            j = next((k for k in range(i, len(cmd)) if cmd[k].startswith("--")), len(cmd))
            return cmd[i:j]

        names, phase = tuple(values("--child")), values("--phase")[0]
        lengths, known = [int(n) for n in values("--seq-lens")], json.loads(values("--known")[0])
        self.calls.append((phase, names, lengths, known))
        if self.stop_after is not None and self.rows >= self.stop_after:
            return "stopped after 1 s (its share of the time budget)"  # the loan has ended
        on_record({"type": "info", "torch": "x", "cuda": None, "peak_tflops": 1.0, "strategy": None,
                   "t": 0.0})
        for name in names:
            if phase == "kernels":
                on_record({"type": "kernels", "strategy": "kernels", "chosen": {"kernel": "aten_cpu"},
                           "rows": []})
            for n in lengths if phase == "rows" else []:
                if str(n) in known[name]["rows"]:
                    continue
                if self.stop_after is not None and self.rows == self.stop_after:
                    return "stopped after 1 s (its share of the time budget)"
                self.rows += 1
                oom = name == "none" and n > 128
                on_record({"type": "row", "strategy": name, "seq_len": n, "steps": 2, "mfu": None,
                           "status": "out of memory" if oom else "ok", "detail": "out of memory",
                           "mean_step_time_s": 0.1, "setup_s": 0.1, "peak_device_bytes": 1, "host_bytes": 0})
            if phase == "search":
                on_record({"type": "search", "strategy": name, "longest": 256})
            on_record({"type": "done", "strategy": name, "seconds": 0.1})
        return "ok"


def test_resume_runs_what_the_records_lack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bench.md"
    argv = ["--dry-run", "--seq-lens", "128", "256", "--stages", "128", "256", "longest", "--out", str(out),
            "--jobs", "1"]
    first = _Children(stop_after=6)  # the loan ends during the 256 stage
    monkeypatch.setattr(gpu_bench, "_run_child", first)
    gpu_bench.main(argv)
    records = out.with_suffix(".records.jsonl")
    rows = [json.loads(line) for line in records.read_text().splitlines()[1:]]
    assert sum(r["type"] == "row" for r in rows) == 6  # on disk, row by row
    again = _Children()
    monkeypatch.setattr(gpu_bench, "_run_child", again)
    gpu_bench.main([*argv, "--resume", str(records)])
    asked = [(phase, names, [n for n in lengths if str(n) not in known[names[0]]["rows"]])
             for phase, names, lengths, known in again.calls]
    # 128 was done (four rows); at 256 none ran out of memory, full recompute trained: offloaded-checkpoint
    # and memo are left, each stage's strategies in two children, memo's alone (NOTE [One interpreter for
    # memo, one for the rest]); then every strategy's search (torchtune-offload's too).
    assert asked[:2] == [("rows", ("offloaded-checkpoint",), [256]), ("rows", ("memo",), [256])], asked
    rest = [n for n in gpu_bench.RUN_ORDER if n != "memo"]
    assert [a[1] for a in asked[2:]] == [tuple(rest), ("memo",)] and {a[0] for a in asked[2:]} == {"search"}
    # The search of each strategy is told what its rows found.
    search_known = {n: c[3] for c in again.calls if c[0] == "search" for n in c[1]}
    assert search_known["none"]["none"]["rows"]["256"]["fits"] is False
    assert search_known["memo"]["memo"]["rows"]["128"]["fits"] is True
    report = json.loads(out.with_suffix(".json").read_text())
    assert all(len(s["rows"]) == (2 if s["strategy"] in HEADLINE else 0) and s["search"]["complete"]
               for s in report["strategies"])
    # Resuming again runs nothing.
    idle = _Children()
    monkeypatch.setattr(gpu_bench, "_run_child", idle)
    gpu_bench.main([*argv, "--resume", str(records)])
    assert idle.calls == []


def test_resume_refuses_another_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = tmp_path / "r.records.jsonl"
    records.write_text(json.dumps({"kind": gpu_bench.RECORDS_KIND, "version": gpu_bench.BENCH_VERSION,
                                   "job": gpu_bench._portable(gpu_bench._job(_args("--steps", "3")))}) + "\n")
    with pytest.raises(SystemExit, match="written for another job: {'steps': \\(3, 2\\)}"):
        gpu_bench.read_records(records, _args())
    records.write_text('{"kind": "other"}\n')
    with pytest.raises(SystemExit, match="not a gpu_bench records file"):
        gpu_bench.read_records(records, _args())


def test_a_kernel_that_fails_its_check_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    from memo.models import attention_kernels as ak

    args = _args("--device", "cuda", "--jobs", "1")
    row = {"kernel": "cudnn", "matches_reference": False}
    gpu_bench._pin_after_kernels(args, [{"type": "kernels", "chosen": {"kernel": "cudnn"}, "rows": [row]}])
    assert args.attention_kernel == "aten_cuda"
    fine = _args("--device", "cuda", "--jobs", "1")
    gpu_bench._pin_after_kernels(fine, [{"type": "kernels", "chosen": {"kernel": "cudnn"},
                                         "rows": [{**row, "matches_reference": True}]}])
    assert fine.attention_kernel is None
    # The pin overrides the rule on every CUDA device, and refuses a kernel the device lacks.
    monkeypatch.setattr(torch_cuda(), "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(ak, "_cudnn_attention_present", lambda: True)
    monkeypatch.setattr(ak, "flash_attn_module", lambda: None)
    try:
        ak.pin_kernel("aten_cuda")
        assert ak.describe_kernel("cuda:0").kernel == "aten_cuda"
        ak.pin_kernel("flash_attn")
        with pytest.raises(MemoError, match="'flash_attn' was pinned, but cuda:0 offers only cudnn"):
            ak.describe_kernel("cuda:0")
        with pytest.raises(MemoError, match="cannot pin kernel 'aten_cpu'"):
            ak.pin_kernel("aten_cpu")
        ak.pin_kernel(None)
        assert ak.describe_kernel("cuda:0").kernel == "cudnn"
    finally:
        ak.pin_kernel(None)


def torch_cuda():
    import torch

    return torch.cuda


def test_the_prediction_is_its_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from memo.utils.flops import flops_per_sample

    args = gpu_bench._parser().parse_args(["--plan-dir", str(tmp_path)])
    gpu_bench._defaults(args)
    plan = gpu_bench.stages(args, (*gpu_bench.WANTED, "kernels"))
    assert [s.name for s in plan] == ["kernels", "64K", "128K", "torchtune", "longest", "wide"]
    rows = gpu_bench.predict(args, plan[:3], "H200")  # no plans in the folder
    # 64K: one child for none, full recompute and offloaded-checkpoint, one for memo (NOTE [One interpreter
    # for memo, one for the rest]); a set-up and two steps a row; memo's set-up is its profile and plan.
    step = {n: flops_per_sample("llama-3.2-1b", 65536) / (989e12 * gpu_bench.PRIOR_MFU[n])
            for n in gpu_bench.HEADLINE}
    setup = {n: 42.0 * 2 if n == "memo" else gpu_bench.OTHER_SETUP_S for n in gpu_bench.HEADLINE}
    expect = 2 * gpu_bench.STARTUP_S + sum(setup[n] + 2 * step[n] for n in gpu_bench.HEADLINE)
    assert math.isclose(rows[1]["seconds"], expect) and rows[1]["does_not_fit"] == []
    assert math.isclose(rows[1]["total_with_build_s"], gpu_bench.BUILD_S + gpu_bench.KERNELS_S + expect)
    # 128K: plain autograd needs more than the H200's 139.8 GiB (memo.estimate's meta profile): not run.
    assert rows[2]["does_not_fit"] == ["none @ 128K"]
    # memo's plans made ahead (make gpu-bench-plans) cost a load, not a profile; the headline rows then
    # end within issue 45's 8 minutes of the build's start.
    ahead = set(gpu_bench.plans_ahead(plan[:3]))
    assert ahead == {("llama-3.2-1b", 65536), ("llama-3.2-1b", 131072)}
    cached = gpu_bench.predict(args, plan[:3], "H200", ahead)
    assert math.isclose(rows[1]["seconds"] - cached[1]["seconds"], 84.0 - gpu_bench.PLAN_LOAD_S)
    assert cached[2]["total_with_build_s"] <= gpu_bench.HEADLINE_MINUTES * 60, cached
    # On an H100 (79.2 GiB) plain autograd does not fit at 64K either.
    h100 = gpu_bench.predict(args, plan[:3], "H100", ahead)
    assert h100[1]["does_not_fit"] == ["none @ 64K"]
    assert h100[2]["total_with_build_s"] < cached[2]["total_with_build_s"]
    gpu_bench.main(["--dry-run", "--predict", "--stages", "kernels", "64K", "128K",
                    "--plan-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "predicted device time on an H200" in printed
    assert "predicted not to fit, not run: none @ 128K" in printed
    assert "plans made ahead for the H200" in printed and "0 of 2" in printed
    minutes = cached[2]["total_with_build_s"] / 60
    assert f"with them (make gpu-bench-plans first) the headline rows end {minutes:.1f} min" in printed


def test_plans_made_ahead_are_found_and_a_row_that_cannot_fit_is_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    # make gpu-bench-plans, for the dry run's model at 128 tokens: memo's plan on meta for an H200 and the
    # headline strategies' predicted needs.
    args = _args("--seq-lens", "128", "--plan-dir", str(tmp_path), "--predict-gpu", "h200")
    assert gpu_bench.main(["--dry-run", "--make-plans", "--seq-lens", "128", "--stages", "128",
                           "--plan-dir", str(tmp_path), "--predict-gpu", "h200"]) == 0
    assert "memo @ 128 (llama-dry-run): alpha" in capsys.readouterr().out
    assert gpu_bench.cached_plans(args, gpu_bench.stages(args, ("memo",)), "H200") == {(args.model, 128)}
    # A child on an H200 finds it (NOTE [Plan cache]) ...
    monkeypatch.setattr(gpu_bench, "_plan_target", lambda msl: "cuda NVIDIA H200")
    msl = argparse.Namespace(model=args.model, device="cpu", dtype=args.dtype, time_limit=args.time_limit,
                             device_mem_mb=args.device_mem_mb)
    path, source = gpu_bench._cached_plan(str(tmp_path), msl, 128)
    assert source == "meta cache" and path.exists()
    # ... and a row whose need is over the device's is a "does not fit" row, never run: memo's from its
    # plan's total, the others' from memo.estimate (cached by make gpu-bench-plans).
    assert gpu_bench._unfit("full-recompute", 128, msl, str(tmp_path)) is None  # 10 MiB is enough
    monkeypatch.setattr(gpu_bench, "_device_bytes", lambda msl: 2**20)  # a 1 MiB device
    for name in ("memo", "none", "full-recompute"):
        row = gpu_bench._unfit(name, 128, msl, str(tmp_path))
        assert row["status"] == "does not fit" and row["need_bytes"] > row["device_bytes"] == 2**20, row
        assert row["detail"].startswith("does not fit: needs")
    monkeypatch.setattr(gpu_bench, "_row", lambda *a, **k: pytest.fail("a row that cannot fit ran"))
    emitted: list[dict] = []
    monkeypatch.setattr(gpu_bench, "_emit", emitted.append)
    child = argparse.Namespace(seq_lens=[128, 256], steps=2, plan_dir=str(tmp_path))
    budget = gpu_bench._Budget(float("inf"), args.model)
    assert gpu_bench._rows("none", child, msl, None, budget, {}) == 0
    # 128 is reported, not run; 256, longer than a length that cannot fit, is skipped with it.
    assert [(r["type"], r.get("status"), r["seq_len"]) for r in emitted] == [("row", "does not fit", 128),
                                                                            ("skip", None, 256)]
