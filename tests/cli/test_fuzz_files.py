"""Fuzzing trace and plan files (issue 12): a mutated file loads, or it is refused with one
:class:`MemoError` line; never another exception, and never a partial output file.

The valid files come from ``memo profile`` of the ``tiny`` model on the meta device (a few
seconds, once per module). Each example applies one to three mutations to the parsed JSON (delete,
duplicate, shuffle, rename, nudge a number by +-1, +-512, x2 or /2, or replace a value by an odd
one: a wrong type, a negative or huge number, NaN, Infinity, a 5000-digit integer, deep nesting)
and maybe one to the text (truncate, insert a character), then loads the file through the Python
loader and the command line. ``MEMO_FUZZ_EXAMPLES=2000`` runs more examples, with a random seed.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memo.planner import load_plan, load_trace

from memo.cli.main import main
from memo.errors import MemoError

MACHINE = ["--bandwidth-gbps", "10", "--layer-ms", "1", "--host-mem-gb", "8"]
# Hypothesis's own examples are reproducible (derandomize) so the suite never flakes; run it with
# more examples and a random seed when changing a loader.
FUZZ = settings(max_examples=int(os.environ.get("MEMO_FUZZ_EXAMPLES", "80")), deadline=None,
                derandomize="MEMO_FUZZ_EXAMPLES" not in os.environ, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Markers json.dumps cannot write; replaced in the text after serialising.
BIG_INT, DEEP, VERY_DEEP = "__fuzz_big_int__", "__fuzz_deep__", "__fuzz_very_deep__"
MARKERS = {f'"{BIG_INT}"': "9" * 5000, f'"{DEEP}"': "[" * 100 + "]" * 100,
           f'"{VERY_DEEP}"': '{"a": ' * 5000 + "1" + "}" * 5000}

ODD = st.one_of(
    # What Python's json reads but JSON has not, and what overflows 64 bits: the cases.
    st.sampled_from([float("nan"), float("inf"), float("-inf"), BIG_INT, DEEP, VERY_DEEP, 2**62, 2**64,
                     10**40, 1e40]),
    st.sampled_from([None, True, False, 0, -1, -512, 1, 513, 2**31, 2**62 - 512, 2**63, 0.5, -0.0, 1e308,
                     "", "x", "a\nb", "layer.fwd[0]", "layer.bwd[-1]", "embed.fwd\n", "memo", [], {}, [1, 2],
                     {"a": 1}, [[0, 0, 512, 0, 1, 0]]]),
    st.integers(), st.floats(), st.text(max_size=8),
)


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("valid")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE,
                     "-o", str(d / "p.json"), "--trace-out", str(d / "t.json"), "--quiet"]) == 0
    return {"plan": json.loads((d / "p.json").read_text()), "trace": json.loads((d / "t.json").read_text())}


def _slot(draw: st.DrawFn, data: Any) -> tuple[Any, Any]:
    """A (container, key) of the JSON tree: a walk down from the top that stops at each level with
    even odds, so top-level fields are hit as often as the hundreds of events or allocations."""
    node = data
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = keys[draw(st.integers(0, len(keys) - 1))]
        child = node[key]
        if not (isinstance(child, (dict, list)) and child and draw(st.booleans())):
            return node, key
        node = child


@st.composite
def mutated(draw: st.DrawFn, data: Any) -> str:
    data = copy.deepcopy(data)
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        parent, key = _slot(draw, data)
        op = draw(st.sampled_from(["replace", "replace", "nudge", "delete", "duplicate", "shuffle",
                                   "rename"]))
        if op == "nudge" and type(parent[key]) is int:  # a plausible but wrong number: sizes, offsets, times
            parent[key] = draw(st.sampled_from([parent[key] + 1, parent[key] - 1, parent[key] + 512,
                                                parent[key] - 512, 2 * parent[key], parent[key] // 2]))
        elif op == "replace":
            parent[key] = draw(ODD)
        elif op == "delete":
            del parent[key]
        elif op == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif op == "shuffle" and isinstance(parent[key], list):
            draw(st.randoms(use_true_random=False)).shuffle(parent[key])
        elif op == "rename" and isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = parent.pop(key)
    text = json.dumps(data)
    for marker, replacement in MARKERS.items():
        text = text.replace(marker, replacement)
    edit = draw(st.sampled_from(["none", "none", "none", "truncate", "insert"]))
    at = draw(st.integers(0, len(text)))
    if edit == "truncate":
        text = text[:at]
    elif edit == "insert":
        text = text[:at] + draw(st.sampled_from(list('{}[],:"0-e.\\ xN'))) + text[at:]
    return text


def _cli(argv: list[str]) -> tuple[int, str]:
    """``memo <argv>`` in this process: its exit status and what it printed to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def _refused(rc: int, err: str) -> None:
    assert rc == 2, err
    assert err.startswith("error: memo") and err.count("\n") == 1, err


def _load(loader: Any, path: Path) -> bool:
    """True when ``loader`` accepts the file; a refusal must be one MemoError line."""
    try:
        loader(path)
    except MemoError as err:
        assert "\n" not in str(err), str(err)
        return False
    return True


@FUZZ
@given(data=st.data())
def test_mutated_plan_loads_or_is_refused_in_one_line(valid: dict[str, Any], tmp_path_factory: Any,
                                                       data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(data.draw(mutated(valid["plan"])))
    ok = _load(load_plan, path)
    rc, err = _cli(["show", str(path)])
    if ok:
        assert rc == 0, err
    else:
        _refused(rc, err)


@FUZZ
@given(data=st.data())
def test_mutated_trace_plans_or_is_refused_in_one_line(valid: dict[str, Any], tmp_path_factory: Any,
                                                        data: st.DataObject) -> None:
    folder = tmp_path_factory.mktemp("trace")
    path, out = folder / "trace.json", folder / "plan.json"
    path.write_text(data.draw(mutated(valid["trace"])))
    ok = _load(load_trace, path)
    extra = data.draw(st.sampled_from([[], ["--for-allocator"], ["--flat"], ["--device-mem-gb", "1"],
                                       ["--expand"]]))
    rc, err = _cli(["plan", str(path), "-o", str(out), "--no-mip", *extra])
    if rc == 0:
        assert ok
        if "--expand" not in extra:
            assert _load(load_plan, out)
            assert _cli(["show", str(out)])[0] == 0
    else:
        _refused(rc, err)
        assert not out.exists()  # nothing, not a partial plan
    # Nothing else either: no temporary file left behind.
    assert sorted(p.name for p in folder.iterdir()) == (["plan.json"] if rc == 0 else []) + ["trace.json"]
