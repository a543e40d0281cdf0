"""benchmarks/runtime_memory.py on a small configuration: memo's device bytes and host bytes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "runtime_memory.py"


def _load():
    spec = importlib.util.spec_from_file_location("runtime_memory", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_memo_device_bytes_within_full_recompute_and_host_bytes_as_planned() -> None:
    bench = _load()
    rows = bench.measure(n_layers=56, s=64, b=1, host_fraction=0.4,
                         strategies=("none", "full", "memo0", "solved"))
    table = bench.format_table(rows)
    by_name = {r.strategy.split(" (")[0]: r for r in rows}
    full = by_name["full recompute"].device_bytes
    memo_rows = [r for r in rows if r.strategy.startswith("memo")]
    assert len(memo_rows) == 2
    assert 0.0 < memo_rows[1].alpha <= 0.4 + 1e-9, table  # solve_alpha's host-memory bound
    for r in memo_rows:
        assert r.device_bytes <= full, table
        assert r.device_bytes < by_name["no recompute"].device_bytes, table
        # Each saved tensor starts on a 256-byte slot (NOTE [Slot alignment] in memo/runtime/buffers.py);
        # at this toy size (64 tokens) the padding is visible, at real sizes tensors fill whole slots.
        assert r.planned_host_bytes <= r.host_bytes <= 1.01 * r.planned_host_bytes, table
