"""No module of memo imports one above it in the data flow (issue 32, ../shared/STYLE.md's seams).

Every import in memo/ and planner/ (memo.planner), at module level or inside a function, is read
from the source and checked against LAYERS: a part may import its own modules and any part of a
lower layer, never one of its own layer or above. docs/architecture.md draws the same order.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: memo's parts, bottom (torch-free) first. A part is memo's first-level module or package; the
#: parts of one layer do not import each other.
LAYERS: list[set[str]] = [
    {"_version", "errors", "_planner_native", "_C"},  # memo's errors; the native modules
    # the torch-free vocabulary, file formats and the sequence-split rule
    {"units", "jsonio", "paths", "phase_names", "trace_format", "token_split", "repeated_tiles"},
    {"planner"},  # the torch-free planner (planner/, installed as memo.planner)
    {"machine", "models"},  # what the job runs on, and the models memo builds
    {"adapters", "allocator", "phases", "utils"},
    {"profiler"},
    {"runtime", "distributed"},
    {"pipeline", "engines"},  # the profile orchestration; the layer engines
    {"estimate", "session"},
    {"train"},
    {"cli"},
    {"__main__"},
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "planner":
        parts = ["memo", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _part(module: str) -> str | None:
    names = module.split(".")
    return names[1] if names[0] == "memo" and len(names) > 1 else None


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every memo module ``path`` imports (``from memo import x``: memo.x)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{alias.name}" if base == "memo" else base)
                      for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("memo.")]


def _sources() -> list[Path]:
    return sorted([*(ROOT / "memo").rglob("*.py"), *(ROOT / "planner").rglob("*.py")])


def test_every_part_of_memo_has_a_layer() -> None:
    parts = {_part(_module_name(p)) for p in _sources()} - {None}
    assert parts <= set(RANK), f"parts without a layer in LAYERS: {sorted(parts - set(RANK))}"


def test_no_module_imports_one_above_it_in_the_data_flow() -> None:
    upward = []
    for path in _sources():
        module = _module_name(path)
        mine = _part(module)
        if mine is None:
            continue  # memo/__init__.py: lazy attributes only (NOTE [Lazy package attributes])
        for line, name in _imports(path, module):
            theirs = _part(name)
            if theirs is not None and theirs != mine and RANK.get(theirs, len(LAYERS)) >= RANK[mine]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {mine} (layer {RANK[mine]}) imports {name} "
                              f"(layer {RANK.get(theirs, '?')})")
    assert not upward, "imports against the data flow:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path) -> None:
    # The check itself can fail: a profiler module that imported the runtime would be reported.
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from memo.runtime import wrap\n    from ..planner import plan\n")
    found = _imports(source, "memo.profiler.probe")
    assert found == [(2, "memo.runtime"), (3, "memo.planner")]
    assert RANK["runtime"] >= RANK["profiler"] > RANK["planner"]
