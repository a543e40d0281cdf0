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


def test_every_producer_writes_traces_with_the_one_builder() -> None:
    """The profiler's recorder, memo's allocator's logging and the synthetic traces all go through
    memo.trace_format.TraceBuilder (issue 17): no producer spells out a trace header itself."""
    import ast
    import inspect

    import memo.allocator._api as api
    import memo.profiler.record as record
    import planner.synthetic as synthetic
    from memo import trace_format

    def header_literals(source: str) -> list[int]:
        """Lines of dict literals that spell out a trace header ("kind": "memo.trace" or TRACE_KIND)."""
        found = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "kind" and (
                            (isinstance(value, ast.Constant) and value.value == "memo.trace")
                            or (isinstance(value, ast.Name) and value.id == "TRACE_KIND")):
                        found.append(node.lineno)
        return found

    for module in (api, record, synthetic):
        source = inspect.getsource(module)
        assert "TraceBuilder(" in source, module.__name__
        assert header_literals(source) == [], module.__name__
    assert header_literals('t = {"version": 1, "kind": "memo.trace"}') == [1]  # the check can fail
    assert TraceBuilder is trace_format.TraceBuilder and TRACE_KIND == trace_format.TRACE_KIND
