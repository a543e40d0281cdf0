"""NOTE [Replicated tiles in a meta recording]: a meta recording that copies a steady tile's events
instead of running its repeats gives the trace a recording of every tile gives, event for event and id
for id, and the same plan; a tile that keeps something, or frees what an earlier tile made, is not
copied."""

from __future__ import annotations

from typing import Any

import pytest

from memo import repeated_tiles
from memo.models import ModelConfig, register_config
from memo.pipeline import profile
from memo.profiler.recorder import DispatchRecorder
from memo.profiler.replicate import Mark, steady_template

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

# Small widths and a large vocabulary: several loss chunks and 256-token layer tiles (the CPU's floor,
# which meta keeps) at a few thousand tokens, in a second or two on meta.
CONFIGS = {
    "gpt": ModelConfig(name="rep-gpt", arch="gpt", n_layers=3, hidden=128, n_heads=4, vocab_size=131072),
    "llama": ModelConfig(name="rep-llama", arch="llama", n_layers=3, hidden=128, n_heads=4, n_kv_heads=2,
                         ffn_hidden=384, vocab_size=131072),
}
for config in CONFIGS.values():
    register_config(config)
MACHINE = {"bandwidth_gbps": 32.0, "host_mem_gb": 64.0, "layer_ms": 3.0}


def _malloc(ident: int, size: int) -> dict[str, Any]:
    return {"op": "malloc", "id": ident, "size": size, "phase": "layer.bwd[0]"}


def _free(ident: int) -> dict[str, Any]:
    return {"op": "free", "id": ident}


def _tiles(*tiles: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Mark]]:
    """The events of ``tiles`` one after another, and the marks between them."""
    events: list[dict[str, Any]] = []
    marks, next_id = [], 0
    for tile in tiles:
        marks.append(Mark(len(events), next_id, 0, 0))
        events += tile
        next_id += sum(ev["op"] == "malloc" for ev in tile)
    marks.append(Mark(len(events), next_id, 0, 0))
    return events, marks


def test_a_steady_tile_is_a_template_and_a_tile_that_keeps_something_is_not() -> None:
    # tile 0 makes an accumulator (id 0); each later tile a scratch and a new accumulator, and frees
    # the scratch and the accumulator before it
    events, m = _tiles([_malloc(0, 8)],
                       [_malloc(1, 4), _malloc(2, 8), _free(1), _free(0)],
                       [_malloc(3, 4), _malloc(4, 8), _free(3), _free(2)])
    template = steady_template(events, {}, m[1], m[2], m[3])
    assert template is not None and template.mallocs == 2
    assert template.events(5) == [_malloc(5, 4), _malloc(6, 8), _free(5), _free(4)]
    # a tile that keeps its accumulator: the live state grows from tile to tile
    events, m = _tiles([_malloc(0, 8)], [_malloc(1, 4), _malloc(2, 8), _free(1)],
                       [_malloc(3, 4), _malloc(4, 8), _free(3)])
    assert steady_template(events, {}, m[1], m[2], m[3]) is None
    # tile 2 frees what tile 0 made (tile 1 freed nothing older): not what tile 1 did
    events, m = _tiles([_malloc(0, 8), _malloc(1, 8)], [_malloc(2, 4), _free(2)],
                       [_malloc(3, 4), _free(3), _free(0)])
    assert steady_template(events, {}, m[1], m[2], m[3]) is None
    # other sizes, or another op behind a malloc
    events, m = _tiles([], [_malloc(0, 4), _free(0)], [_malloc(1, 6), _free(1)])
    assert steady_template(events, {}, m[1], m[2], m[3]) is None
    events, m = _tiles([], [_malloc(0, 4), _free(0)], [_malloc(1, 4), _free(1)])
    assert steady_template(events, {0: ("mm", set()), 1: ("mm", set())}, m[1], m[2], m[3]) is not None
    assert steady_template(events, {0: ("mm", set()), 1: ("add", set())}, m[1], m[2], m[3]) is None


@pytest.mark.parametrize("arch,seq,kwargs", [
    # memo's [a:s] tiles in forward and backward, an input-only layer's, and the loss's chunks
    ("llama", 4096, {"alpha": 0.3, "policy": ["memo", "input-only", "memo"]}),
    # tensor parallel: the tiles around the sequence-parallel gathers, a segment of two layers
    ("llama", 4096, {"tensor_parallel": 2, "alpha": 0.2, "policy": ["input-only", "segment", "memo"]}),
    # a length the tile does not divide (the last tile is shorter), full recompute beside memo
    ("gpt", 3000, {"alpha": 0.45, "policy": ["memo", "memo", "recompute"]}),
])
def test_a_replicated_recording_is_the_full_recording_and_plans_the_same(
        arch: str, seq: int, kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def run() -> Any:
        return profile(CONFIGS[arch].name, seq, dtype="float32", device="meta", time_limit=5, **MACHINE,
                       **kwargs)

    before = repeated_tiles.replicated
    fast = run()
    assert repeated_tiles.replicated > before
    monkeypatch.setattr(DispatchRecorder, "replicate", lambda self, first, second, copies: False)
    before = repeated_tiles.replicated
    every = run()
    assert repeated_tiles.replicated == before
    assert fast.trace["events"] == every.trace["events"]
    plans = [r.plan.to_dict() for r in (fast, every)]
    for plan in plans:
        plan["solver"] = None  # how long each solve took
    assert plans[0] == plans[1]
