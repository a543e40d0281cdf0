"""Damaged plan and trace files are refused with one line (issue 12, items 7 and 8)."""

from __future__ import annotations

import json

import pytest
from memo.planner import load_plan, load_trace
from memo.planner.dsa import Item, check_placement

import memo.allocator as ma
from memo import _C
from memo.cli.main import main
from memo.errors import MemoError

MACHINE = ["--bandwidth-gbps", "10", "--layer-ms", "1", "--host-mem-gb", "8"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    assert main(["profile", "--model", "tiny", "--seq-len", "256", "--device", "meta", *MACHINE, "-o",
                 str(d / "p.json"), "--trace-out", str(d / "t.json"), "--quiet"]) == 0
    return d


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("alpha", float("nan"), "alpha is NaN, which JSON does not allow"),  # refused while parsing
    ("alpha", 7, "alpha must be a number in [0, 1], got 7"),
    ("host_bytes", -5, "host_bytes must be an integer >= 0, got -5"),
    ("end_time", -3, "end_time must be an integer >= 0, got -3"),
    ("version", True, "unknown plan version True"),
    ("version", 1.0, "unknown plan version 1.0"),
])
def test_a_damaged_plan_is_refused(files, tmp_path, field, value, needle, capsys) -> None:
    data = json.loads((files / "p.json").read_text())
    data[field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(MemoError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_plan(bad)
    assert main(["show", str(bad)]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_trace_version_must_be_the_integer_1(files, tmp_path, version) -> None:
    data = json.loads((files / "t.json").read_text())
    data["version"] = version
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(MemoError, match="unknown trace version"):
        load_trace(bad)


# ------------------------------------------------- numbers Python's json reads but JSON has not (item 7)
def _plan_text(files, field: str, literal: str) -> str:
    """The profile's plan with ``field``'s value replaced by ``literal``, written as is."""
    data = json.loads((files / "p.json").read_text())
    data[field] = "@@"
    return json.dumps(data).replace('"@@"', literal)


def _refused_in_one_line(loader, path, argv, needle: str, capsys) -> None:
    with pytest.raises(MemoError) as err:
        loader(path)
    assert str(err.value) == needle
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {needle}\n"


@pytest.mark.parametrize(("literal", "what"), [
    ("Infinity", "Infinity, which JSON does not allow; memo files hold finite numbers only"),
    ("-Infinity", "-Infinity, which JSON does not allow; memo files hold finite numbers only"),
    ("NaN", "NaN, which JSON does not allow; memo files hold finite numbers only"),
    ("1e400", "1e400, beyond the range of a float"),
])
def test_a_non_finite_number_is_refused_with_its_place(files, tmp_path, literal, what, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(_plan_text(files, "lower_bound", literal))
    needle = f"memo.plan: in {str(bad)!r}, lower_bound is {what}; the file is damaged or edited by hand"
    _refused_in_one_line(load_plan, bad, ["show", str(bad)], needle, capsys)


def test_a_5000_digit_integer_is_refused_with_its_place(files, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(_plan_text(files, "peak", "9" * 5000))
    needle = (f"memo.plan: in {str(bad)!r}, peak is an integer of 5000 digits; no count in a memo file has "
              "more than 20; the file is damaged or edited by hand")
    _refused_in_one_line(load_plan, bad, ["show", str(bad)], needle, capsys)
    trace = (files / "t.json").read_text().replace('"size": 512,', f'"size": {"1" * 5000},', 1)
    bad.write_text(trace)
    with pytest.raises(MemoError, match=r"in '.*', events\[\d+\]\.size is an integer of 5000 digits"):
        load_trace(bad)


@pytest.mark.parametrize("depth", [100, 100_000])  # parsed, then refused; past json's own recursion
def test_deep_nesting_is_refused(files, tmp_path, depth, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(_plan_text(files, "meta", '{"a": ' * depth + "1" + "}" * depth))
    needle = (f"memo.plan: in {str(bad)!r}, arrays or objects nest more than 64 levels deep; the file is "
              "damaged or edited by hand")
    _refused_in_one_line(load_plan, bad, ["show", str(bad)], needle, capsys)
    data = json.loads((files / "t.json").read_text())
    data["events"] = "@@"
    bad.write_text(json.dumps(data).replace('"@@"', "[" * depth + "]" * depth))
    out = tmp_path / "plan.json"
    _refused_in_one_line(load_trace, bad, ["plan", str(bad), "-o", str(out)],
                         needle.replace("plan", "trace", 1), capsys)
    assert not out.exists()


# ---------------------------------------------------------- plan fields are what they say (item 8)
@pytest.mark.parametrize(("mutate", "needle"), [
    # A negative phase index read another phase by Python's negative indexing.
    (lambda d: d["allocations"][0].__setitem__(0, -2),
     "allocations[0][0] (phase index) must be an integer >= -1, got -2"),
    (lambda d: d.update(peak=str(d["peak"])), "peak must be an integer >= 0, got '"),
    (lambda d: d.update(lower_bound=float(d["lower_bound"])), "lower_bound must be an integer >= 0, got "),
    (lambda d: d.update(alpha=True), "alpha must be a number in [0, 1], got True"),
    (lambda d: d["level1"]["layer.fwd"].__setitem__(0, "0"), "level1.layer.fwd[0] must be an integer >= 0"),
    (lambda d: d.update(solver={"seconds": "fast"}), "solver.seconds must be a number, got 'fast'"),
    (lambda d: d.update(meta={"tensor_parallel": "2"}), "meta.tensor_parallel: must be int, got '2'"),
])
def test_plan_fields_are_not_coerced(files, tmp_path, mutate, needle, capsys) -> None:
    data = json.loads((files / "p.json").read_text())
    assert data["level1"]["layer.fwd"][0] is not None
    mutate(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(MemoError) as err:
        load_plan(bad)
    assert needle in str(err.value)
    assert main(["show", str(bad)]) == 2
    assert needle in capsys.readouterr().err


# ------------------------------------------------- sizes near 2**62 (item 8: the clash check overflowed)
def _trace(sizes: list[int]) -> dict:
    events = [{"op": "malloc", "id": i, "size": s, "phase": "embed.fwd"} for i, s in enumerate(sizes)]
    return {"version": 1, "events": events + [{"op": "free", "id": i} for i in range(len(sizes))]}


@pytest.mark.parametrize(("sizes", "needle"), [
    ([10**40], "memo.trace: event 0: malloc of id 0 has size 10000000000000000000000000000000000000000; "
               "sizes must be below 2**62 bytes (4 EiB): the trace is damaged"),
    ([2**62, 2**62], "memo.trace: event 0: malloc of id 0 has size 4611686018427387904; sizes must be below "
                     "2**62 bytes (4 EiB): the trace is damaged"),
    # Each below 2**62, live together: the planner's peak reached 2**63 and its int64 sums wrapped.
    ([2**61] * 4, "memo.trace: events: the mallocs total 9223372036854775808 bytes; a trace must total below "
                  "2**62 bytes (4 EiB): the trace is damaged"),
])
def test_trace_sizes_are_bounded(tmp_path, sizes, needle, capsys) -> None:
    path, out = tmp_path / "t.json", tmp_path / "p.json"
    path.write_text(json.dumps(_trace(sizes)))
    _refused_in_one_line(load_trace, path, ["plan", str(path), "-o", str(out), "--no-mip"], needle, capsys)
    assert not out.exists()


def test_the_clash_check_does_not_overflow() -> None:
    # Overlapping in time and in memory ([2**62, 2**63) holds [2**62 + 512, 2**62 + 1024)); the int64 end
    # of the first wrapped to -2**63 and the clash was missed.
    items = [Item(2**62, 0, 2), Item(512, 0, 2)]
    assert check_placement(items, [2**62, 2**62 + 512], 2**63) == \
        "the arena [0, 9223372036854775808) is beyond 2**63, more than int64 can address"
    assert check_placement(items, [0, 2**62], 2**62 + 512) is None  # no clash, and no overflow to hide one


def test_the_allocator_refuses_sizes_past_64_bits() -> None:
    # Before: the Python checks passed these on to the native allocator, whose binding failed to cast them.
    with pytest.raises(MemoError, match=r"peak must be an int >= 0 and below 2\*\*62 \(bytes\), got "
                       "36893488147419103232$"):
        with ma.planned({"layer.fwd[0]": [(2**64, 0)]}, peak=2**65):
            pass
    with pytest.raises(MemoError, match=r"entry layer\.fwd\[0\]\[0\] \(size 4611686018427387904, offset "
                       r"None\): size is not below 2\*\*62 bytes"):
        with ma.planned({"layer.fwd[0]": [(2**62, None)]}, peak=8192):
            pass
    a = _C.allocator.PlannedAllocator()
    # Before: pybind11's "Unable to cast Python instance of type <class 'int'>" (a plain RuntimeError).
    with pytest.raises(_C.allocator.AllocatorError, match=r"size must be a positive int up to 2\*\*62, got "
                       "9223372036854775808"):
        a.load_plan({"layer.fwd[0]": [(2**63, 0)]}, 8192)
    with pytest.raises(_C.allocator.AllocatorError, match=r"size is not below 2\*\*62 bytes"):
        a.load_plan({"layer.fwd[0]": [(2**62 + 512, 0)]}, 2**62 - 4096)
    with pytest.raises(_C.allocator.AllocatorError, match=r"plan peak must be an int >= 0 and below 2\*\*62"):
        a.load_plan({"layer.fwd[0]": [(512, 0)]}, 2**62)
    assert not a.has_plan()


# -------------------------------------------------- what the fuzzer (tests/cli/test_fuzz_files.py) found
def test_a_phase_name_with_a_trailing_newline_is_refused(tmp_path) -> None:
    # re's "$" also matches before a final newline: "embed.fwd\n" passed as a phase of its own, whose
    # allocations the allocator could never match at run time.
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 1, "events": [{"op": "malloc", "id": 0, "size": 512,
                                                          "phase": "embed.fwd\n"}]}))
    with pytest.raises(MemoError) as err:
        load_trace(path)
    assert str(err.value) == ("memo.trace: event 0: memo.phases: 'embed.fwd\\n' is not a phase name; "
                              "expected one of embed.fwd, layer.fwd[i], head.fwd, head.bwd, layer.bwd[i], "
                              "embed.bwd, optimizer (a pipeline stage's with the micro-batch after '@': "
                              "layer.fwd[i]@k)")


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d.update(alignment="a\nb"), "memo.plan: plan alignment 'a\\nb' != 512"),
    (lambda d: d["level2"].update({"x\ny": 0}),
     "memo.plan: a key of level2: memo.phases: 'x\\ny' is not a phase name"),
    (lambda d: d.update(meta={"a\nb": float("nan")}), "meta['a\\nb'] is NaN"),
])
def test_errors_stay_on_one_line(files, tmp_path, mutate, needle) -> None:
    data = json.loads((files / "p.json").read_text())
    mutate(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(MemoError) as err:
        load_plan(bad)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
