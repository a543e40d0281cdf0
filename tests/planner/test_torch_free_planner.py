"""The planner is the lower, torch-free layer (issue 17): importing it, and making a plan with its
exact search, loads no torch; its native module links no libtorch; memo._C holds no second binding.

`make test` also runs tests/notorch_check.py where torch is not installed at all (Makefile,
``notorch-check``); these tests run in the ordinary environment, with torch installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

# A plan of a guillotine packing (greedy misses its optimum, so the exact search runs) through
# the planner's public API; then which modules the process loaded.
_PLAN = """
import sys
import memo.planner as planner
from memo.planner.synthetic import guillotine_instance, items_to_trace

trace = items_to_trace(guillotine_instance(40, seed=0))
plan = planner.make_plan(trace, method="flat", time_limit=30)
assert plan.solver["total"]["method"] == "search", plan.solver
assert plan.peak == planner.lower_bound(trace), (plan.peak, planner.lower_bound(trace))
assert "memo._planner_native" in sys.modules, "the plan did not use the native search"
loaded = sorted(m for m, mod in sys.modules.items()
                if mod is not None and (m == "torch" or m.startswith("torch.") or m == "memo._C"))
assert not loaded, loaded
print("ok")
"""

# sys.modules["torch"] = None makes every `import torch` fail, as where torch is not installed.
_BLOCK_TORCH = 'sys.modules["torch"] = None'
_CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notorch_check.py")


def _run(code: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_a_plan_with_the_exact_search_loads_no_torch(tmp_path) -> None:
    out = _run(_PLAN, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_make_tests_check_passes_where_torch_cannot_be_imported(tmp_path) -> None:
    code = f"import runpy, sys; {_BLOCK_TORCH}; runpy.run_path({_CHECK!r}, run_name='__main__')"
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("torch-free planner check: ok"), out.stdout


def test_make_tests_check_refuses_to_run_where_torch_is_installed(tmp_path) -> None:
    out = subprocess.run([sys.executable, _CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "torch is importable here, so this check proves nothing" in out.stderr, out.stderr


def test_errors_json_units_and_phase_names_load_no_torch(tmp_path) -> None:
    code = ("import sys\n" + _BLOCK_TORCH + "\n"
            "import memo, memo.errors, memo.jsonio, memo.units, memo.phase_names\n"
            "assert memo.phase_names.parse_phase('layer.bwd[2]') == ('layer.bwd', 2)\n"
            "print('ok')\n")
    out = _run(code, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_phases_re_exports_the_names() -> None:
    import memo.phase_names as names
    import memo.phases as phases

    for name in names.__all__:
        assert getattr(phases, name) is getattr(names, name), name
        assert name in phases.__all__, name


def test_the_native_module_links_no_libtorch() -> None:
    spec = importlib.util.find_spec("memo._planner_native")
    assert spec is not None and spec.origin is not None, "memo._planner_native is not built"
    with open(spec.origin, "rb") as f:
        binary = f.read()
    # A library the module links is named in its dynamic string table.
    for lib in (b"libtorch", b"libc10", b"libtorch_python"):
        assert lib not in binary, f"{spec.origin} names {lib.decode()}"


def test_one_binding_of_the_search() -> None:
    from memo import _C as native  # memo's __getattr__ loads torch first: memo._C links libtorch

    assert not hasattr(native, "planner")
    # build_info lists exactly the components the extension holds (each one a submodule).
    submodules = {name for name in dir(native) if isinstance(getattr(native, name), types.ModuleType)}
    assert sorted(native.build_info()["components"]) == sorted(submodules)
    assert "planner" not in submodules
