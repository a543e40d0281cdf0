"""benchmarks/one_gpu.py on a tiny Llama: the peer's recording on meta, its depth extrapolation, and
the longest-sequence search (the 8B table takes ~20 minutes; see benchmarks/results/one_gpu.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "one_gpu_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "one_gpu.py")
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


def test_memo_row_and_input_only_recording() -> None:
    bench = _bench("--peer-depths", "1", "2")
    s = 1024
    memo = bench.run("memo", s)
    assert memo["policy"] and memo["device_bytes"] > bench.static
    rec = bench.run(one_gpu.INPUT_ONLY, s)
    assert rec["device_bytes"] > bench.static and rec["host_bytes"] >= bench.config.n_layers * s * 64 * 2


def test_search_brackets_to_the_granularity(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench("--start", "4K", "--step", "2K")
    limit = 9 * 1024 + 100

    def run(strategy: str, length: int) -> dict:
        need = bench.usable * length // limit
        row = {"device_bytes": need, "host_bytes": 0, "fits": need <= bench.usable, "strategy": strategy}
        bench.cache[(strategy, length)] = row
        return row

    monkeypatch.setattr(bench, "run", run)
    found = one_gpu.search(bench, "full recompute")
    assert found["longest"] == 9 * 1024 and found["first_failure"] == 9 * 1024 + 512
