"""benchmarks/one_gpu.py on a tiny Llama: the peer's recording on meta, its depth extrapolation, the
memo row as the pipeline chooses it (both calibrations), and the longest-sequence search (the 8B
table takes ~25 minutes with --memo-full; see benchmarks/results/one_gpu.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "one_gpu_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "one_gpu.py")
assert _SPEC is not None and _SPEC.loader is not None
one_gpu = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(one_gpu)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

def _bench(*extra: str) -> one_gpu.OneGPU:
    args = one_gpu._parser().parse_args(["--model", "llama-tiny", "--device-mem-gb", "0.03", "--host-mem-gib",
                                         "0.01", "--granularity", "512", *extra])
    return one_gpu.OneGPU(args, lambda _line: None)


def test_peer_on_meta_offloads_every_layer_input_and_extrapolates_exactly() -> None:
    bench = _bench("--peer-depths", "1", "2")
    s = 1024
    row = bench.run("offloaded-checkpoint", s)
    n, h = bench.config.n_layers, bench.config.hidden
    assert row["host_bytes"] == n * s * h * 2  # the layer inputs, bf16, on the host
    full, host = bench.record_peer(s, n)
    assert host == row["host_bytes"]
    assert full + bench.static == row["device_bytes"]
    assert row["device_bytes"] > bench.static


def _deep(tmp_path: Path, n_layers: int = 8) -> str:
    """llama-tiny with ``n_layers`` layers: deep enough that every layer's input on the device (full
    recompute) holds more than memo's two rounding buffers."""
    path = tmp_path / "llama-tiny-deep.json"
    path.write_text(json.dumps({"arch": "llama", "n_layers": n_layers, "hidden": 64, "n_heads": 4,
                                "n_kv_heads": 2, "ffn_hidden": 176, "vocab_size": 512, "norm_eps": 1e-5,
                                "rope_theta": 10000.0}))
    return str(path)


@pytest.mark.parametrize("full", [False, True], ids=["extrapolated", "memo-full"])
def test_memo_row_is_the_pipelines_calibrated_choice(tmp_path: Path, full: bool) -> None:
    # 8 layers at 16K tokens: S_input 2 MiB, S_attn 2.25 MiB per layer. The host's 0.8 share of
    # 0.025 GiB holds every layer's input (16.8 MB) but not every layer at alpha 0 (35.7 MB), so the
    # pipeline calibrates against every layer input-only (NOTE [One-GPU memo row]); the 88 MB GPU's
    # usable 83.6 MB holds that (76.2 MB recorded) and not full recompute (88.5 MB recorded; memo's
    # lean RMSNorm keeps no float32 copies of the layer input, which took 8 MiB off both, and an
    # input-only layer writes grad x over its incoming gradient, NOTE [Gradient of x over the incoming
    # one] in memo/runtime/owned_grad.py: one S_input, 2 MiB, off memo's).
    s = 16 * 1024
    bench = _bench("--model", _deep(tmp_path), "--device-mem-gb", "0.088", "--host-mem-gib", "0.025",
                   "--peer-depths", "1", "2", *(["--memo-full"] if full else []))
    n = bench.config.n_layers
    memo = bench.run("memo", s)
    cal = memo["memo_calibration"]
    assert cal is not None and cal["policy"] == f"{n} input-only" and "every layer input-only" in memo["how"]
    rec = bench.run(one_gpu.INPUT_ONLY, s)
    assert cal["recorded_bytes"] == rec["device_bytes"] == 76_156_548  # one recording serves both
    assert rec["host_bytes"] == cal["host_bytes"] == n * s * bench.config.hidden * 2
    # full recompute, pass 1, then input-only at 1 and 2 layers (or at all 8)
    assert bench.profiles == (3 if full else 4)
    fr = bench.run("full recompute", s)
    assert fr["device_bytes"] == 88_520_836 > bench.usable >= rec["device_bytes"]
    # The estimate of every layer input-only is now its recording, and it is the choice.
    assert memo["policy"] == ["input-only"] * n and memo["probe_is_calibration"] and memo["fits"]
    assert memo["device_bytes"] == rec["device_bytes"] == sum(memo["parts"].values())
    # (4,412,928 before grad x went over the incoming gradient: the recording 2 MiB lower, the estimate not)
    assert memo["parts"]["measured correction"] == cal["correction_bytes"] == 2_315_776
    assert memo["calibration_bytes"] == fr["device_bytes"] - memo["full_recompute_estimate_bytes"]
    # --check-memo: the pipeline's probe, the chosen policy at every layer; extrapolated or not, the
    # calibration's total is what all 8 layers record.
    check = bench.check_memo(memo)
    assert check is not None and check["same_as_calibration"]
    assert check["recorded_bytes"] == memo["device_bytes"] <= check["cap_bytes"] == bench.usable
    assert bench.profiles == (3 if full else 5)
    # The pipeline itself, every recording at full depth, chooses the same policy and need.
    r = bench._profile(s, device_mem_gb=bench.args.device_mem_gb)
    assert r.policy.policy == memo["policy"] and r.policy.device_bytes == memo["device_bytes"]
    assert r.policy.tile_tokens is None
    assert r.trace["meta"]["tile_tokens"] == memo["tile_tokens"] == bench.tile(s)


def test_memo_row_uncalibrated_where_the_host_holds_no_layer_inputs() -> None:
    # 0.8 x 0.0001 GiB (86 KB) holds neither layer's input at 1K tokens (128 KiB each): the pipeline
    # records no calibration of memo, and the choice keeps the layers on the device.
    bench = _bench("--peer-depths", "1", "2", "--host-mem-gib", "0.0001")
    memo = bench.run("memo", 1024)
    assert memo["memo_calibration"] is None and "input-only" not in memo["how"]
    assert bench.profiles == 2  # full recompute and pass 1: nothing of memo's runtime is recorded
    assert memo["policy"] == ["keep", "keep"] and memo["host_bytes"] == 0


def _search_linear_need(monkeypatch: pytest.MonkeyPatch, *flags: str) -> dict:
    """one_gpu.search for full recompute where the device need grows linearly in the length and
    reaches the usable budget just past 9K tokens (no recording: every row is this line)."""
    bench = _bench(*flags)
    limit = 9 * 1024 + 100

    def run(strategy: str, length: int) -> dict:
        need = bench.usable * length // limit
        row = {"device_bytes": need, "host_bytes": 0, "fits": need <= bench.usable, "strategy": strategy}
        bench.cache[(strategy, length)] = row
        return row

    monkeypatch.setattr(bench, "run", run)
    return one_gpu.search(bench, "full recompute")


def test_search_brackets_to_the_granularity(monkeypatch: pytest.MonkeyPatch) -> None:
    found = _search_linear_need(monkeypatch, "--start", "4K", "--step", "2K")
    assert found["longest"] == 9 * 1024 and found["first_failure"] == 9 * 1024 + 512


def test_search_steps_down_by_the_secant(monkeypatch: pytest.MonkeyPatch) -> None:
    found = _search_linear_need(monkeypatch, "--start", "64K", "--step", "4K")
    assert found["longest"] == 9 * 1024 and found["first_failure"] == 9 * 1024 + 512
    assert len(found["tried"]) <= 5  # 64K, 60K, then the secant: not 14 steps of 4K down
