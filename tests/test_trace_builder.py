"""planner/trace.py's TraceBuilder, the one writer of memo.trace dicts, and the synthetic traces
made with it."""

from __future__ import annotations

import itertools

from memo.planner.dsa import Item
from memo.planner.synthetic import items_to_trace, layered_trace
from memo.planner.trace import TRACE_KIND, TRACE_VERSION, Trace, TraceBuilder


def test_the_builder_writes_the_documented_format() -> None:
    b = TraceBuilder(meta={"model": "m"})
    b.malloc(7, 4096, "layer.fwd[0]")
    b.malloc(8, 512)
    b.free(7)
    assert b.finish(layers={"S_input": 1}) == {
        "version": TRACE_VERSION, "kind": TRACE_KIND, "meta": {"model": "m"}, "layers": {"S_input": 1},
        "events": [{"op": "malloc", "id": 7, "size": 4096, "phase": "layer.fwd[0]"},
                   {"op": "malloc", "id": 8, "size": 512}, {"op": "free", "id": 7}, {"op": "end"}]}
    t = Trace.from_dict(b.finish())
    # id 8 is never freed: it lives until the end marker (NOTE [Trace time]).
    lives = [(a.id, a.start, a.end, a.phase) for a in t.allocations]
    assert lives == [(7, 0, 2, "layer.fwd[0]"), (8, 1, 3, None)]


def test_items_to_trace_keeps_which_items_overlap() -> None:
    items = [Item(2, 0, 3), Item(1, 3, 5), Item(4, 1, 4), Item(1, 4, 6)]
    t = Trace.from_dict(items_to_trace(items, phase="optimizer"))
    by_id = {a.id: a for a in t.allocations}
    for i, j in itertools.combinations(range(len(items)), 2):
        in_items = items[i].start < items[j].end and items[j].start < items[i].end
        a, b = by_id[i], by_id[j]
        assert (a.start < b.end and b.start < a.end) == in_items, (i, j)
    assert all(a.phase == "optimizer" for a in t.allocations)


def test_layered_trace_round_trips() -> None:
    data = layered_trace(2)
    assert data["events"][-1] == {"op": "end"}
    assert Trace.from_dict(data).to_dict() == data
