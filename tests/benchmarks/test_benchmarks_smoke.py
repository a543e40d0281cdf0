"""Smoke tests of benchmarks/strategies.py and benchmarks/max_seq_len.py in tiny configurations.

Each benchmark runs as a user would run it (a subprocess), writes its JSON, and the tests check
the measured values against each other (never against fixed figures): recompute needs less
device memory than plain autograd, every row is present, and a strategy that keeps less on the
device trains at least as long a sequence.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ALL_ROWS = ("none", "full-recompute", "full-offload", "memo", "offloaded-checkpoint", "torchtune-offload",
            "save-on-cpu")
PEERS = ("offloaded-checkpoint", "torchtune-offload", "save-on-cpu", "full-offload")


def _run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def strategies_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "strategies.json"
    # gpt-mini (12 layers) so that full-offload and memo offload ten of them; 256 tokens keeps it quick.
    done = _run("strategies.py", "--model", "gpt-mini", "--seq-len", "256", "--steps", "2", "--device", "cpu",
                "--time-limit", "1", "--json", str(out))
    return json.loads(out.read_text()), done.stdout


def test_strategies_every_row_and_table(strategies_run: tuple[dict, str]) -> None:
    report, stdout = strategies_run
    assert report["kind"] == "memo.benchmark.strategies"
    rows = {r["row"]: r for r in report["rows"]}
    assert set(rows) == set(ALL_ROWS)
    for name in ALL_ROWS:
        assert any(line.startswith(name + " ") for line in stdout.splitlines()), f"no table row for {name}"
    assert "time/FR" in stdout and "peak/FR" in stdout and "time/BP" in stdout and "peak/BP" in stdout
    # The best peer is named in the header: the peer with the lowest device peak.
    peak = {r["row"]: r["peak_device_bytes"] for r in report["rows"]}
    assert report["best_peer"] in PEERS and peak[report["best_peer"]] == min(peak[p] for p in PEERS)
    assert f"BP: {report['best_peer']}, the lowest device peak" in stdout
    assert any("CUDA only" in line for line in report["skipped"])  # CPU run: PyTorch allocator rows skipped


def test_strategies_measurements_agree(strategies_run: tuple[dict, str]) -> None:
    rows = {r["row"]: r for r in strategies_run[0]["rows"]}
    peak = {name: rows[name]["peak_device_bytes"] for name in ALL_ROWS}
    assert all(isinstance(v, int) and v > 0 for v in peak.values()), peak
    assert peak["full-recompute"] < peak["none"], peak
    assert peak["full-offload"] < peak["none"], peak
    # Only the strategies that move activations hold host bytes.
    assert rows["none"]["host_bytes"] == 0 and rows["full-recompute"]["host_bytes"] == 0
    assert rows["full-offload"]["host_bytes"] > 0 and rows["save-on-cpu"]["host_bytes"] > 0
    # The peers that checkpoint every layer hold its inputs on the host (gpt-mini: 12 layers of 256 tokens
    # x 128 fp32); torchtune's rule also offloads the token ids the embedding saved (2 KiB).
    assert rows["offloaded-checkpoint"]["host_bytes"] == 12 * 256 * 128 * 4
    assert rows["torchtune-offload"]["host_bytes"] == 12 * 256 * 128 * 4 + 256 * 8
    assert rows["save-on-cpu"]["host_bytes"] > rows["torchtune-offload"]["host_bytes"]
    assert rows["full-offload"]["alpha"] == 1.0
    # Without a budget memo's policy is capped at full recompute's need: far below keeping everything.
    assert peak["memo"] < peak["none"], peak
    assert rows["memo"]["planned"] > 0
    # The same seed and data: every strategy computes the same first loss (fp32 on CPU).
    first = rows["none"]["first_loss"]
    for name in ALL_ROWS:
        assert math.isclose(rows[name]["first_loss"], first, rel_tol=1e-5), (name, rows[name]["first_loss"])
        assert rows[name]["mean_step_time_s"] > 0 and rows[name]["mean_mfu"] is None  # no CPU peak FLOPS


def test_at_scale_orders_strategies(tmp_path: Path) -> None:
    # benchmarks/at_scale.py on a small model: meta profiles of one tensor-parallel rank at two short
    # lengths, under a budget that the plain model outgrows, and the longest-sequence search.
    out = tmp_path / "at_scale.json"
    budget_gb = 0.01
    done = _run("at_scale.py", "--model", "tiny", "--tensor-parallel", "2", "--seq-lens", "1K", "2K",
                "--device-mem-gb", str(budget_gb), "--granularity", "512", "--max-seq", "16K",
                "--layer-ms", "2", "--layer-ms-at", "2K", "--host-mem-gb", "64", "--time-limit", "1",
                "--json", str(out), timeout=300)
    report = json.loads(out.read_text())
    assert report["kind"] == "memo.benchmark.at_scale" and report["version"] == 1
    assert report["job"]["tensor_parallel"] == 2 and report["budget_bytes"] == int(budget_gb * 1e9)
    budget = report["budget_bytes"]
    assert [r["seq_len"] for r in report["rows"]] == [1024, 2048]
    for row in report["rows"]:
        s = row["strategies"]
        none, fr, memo = (s[k]["total_bytes"] for k in ("none", "full recompute", "memo"))
        assert all(isinstance(v, int) and v > 0 for v in (none, fr, memo)), row
        assert fr <= none, row  # full recompute keeps only the layers' inputs
        # memo is the planner's choice within the budget: it fits wherever full recompute does.
        if s["full recompute"]["fits"]:
            assert s["memo"]["fits"] and memo <= report["usable_bytes"], row
        for r in s.values():
            assert r["fits"] == (r["total_bytes"] <= report["usable_bytes"] < budget)
            assert r["states_bytes"] < r["total_bytes"]
    assert report["rows"][1]["strategies"]["none"]["total_bytes"] > report["rows"][0]["strategies"]["none"][
        "total_bytes"]
    longest = {r["strategy"]: r["longest"] for r in report["longest"]}
    assert 0 < longest["none"] <= longest["full recompute"] <= longest["memo"], longest
    for r in report["longest"]:
        assert r["longest"] % 512 == 0 and r["longest"] in r["tries"]
        if r["first_failure"] is not None:
            assert r["first_failure"] - r["longest"] <= 512
    for header in ("lower=better", "<1 better", "higher=better", ">1 better"):
        assert header in done.stdout
    assert "memo" in done.stdout.split("Predicted longest sequence")[1]
