"""benchmarks/host_share.py: the tile bound of NOTE [Host work per tile] and the table, on made-up rows."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # after the repo's packages
import host_share  # noqa: E402


def test_the_tile_that_hides_the_host() -> None:
    # 6·t·P / (peak·MFU) >= host: 1 ms of host per tile, P = 60M, 1 PFLOPS at 25% -> t >= 695.
    t = host_share.min_tile_tokens_hidden(1e-3, 60_000_000, 1e15, 0.25)
    assert t == 695
    assert 6 * t * 60e6 / (1e15 * 0.25) >= 1e-3 > 6 * (t - 1) * 60e6 / (1e15 * 0.25)
    assert host_share.min_tile_tokens_hidden(0.0, 60_000_000) == 1


def test_ops_are_counted() -> None:
    counter = host_share.OpCounter()
    with counter:
        x = torch.ones(3)
        (x + x).sum()
    assert counter.ops == 3  # ones, add, sum


def test_the_table() -> None:
    rows = [{"strategy": "none", "seq_len": 131072, "tile_tokens": None, "tiles": None, "ops_per_layer": 300,
             "host_s_per_layer": 0.01},
            {"strategy": "memo", "seq_len": 131072, "tile_tokens": 8192, "tiles": 16, "ops_per_layer": 6000,
             "host_s_per_layer": 0.05}]
    text = host_share.format_markdown(rows)
    # memo: (6000 - 300) / 16 ops and (50 - 10) / 16 ms per tile.
    assert "| memo | 128K | 16 (8,192) | 6,000 | 50.0 |" in text and "| 356 | 2.50 |" in text
    assert "work floor for this layer: 8,192 tokens" in text
