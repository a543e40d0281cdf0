"""`make test`'s check that memo.planner works where torch is not installed (issue 17).

The planner is the lower, torch-free layer (NOTE [A torch-free planner module] in
csrc/planner/module.cpp). The Makefile runs this file in a venv that has numpy and PuLP but no
torch, with this checkout on PYTHONPATH; tests/test_torch_free_planner.py runs it with torch
made unimportable. It imports memo.planner, makes a plan whose exact search runs (a guillotine
packing, which greedy misses) and checks that the native search made it and that no torch was
loaded. Not a pytest file: it stands alone so that it runs without pytest and without torch.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHAT = "memo.planner must work where torch is not installed (issue 17)"


def _fail(message: str) -> None:
    raise SystemExit(f"torch-free planner check failed: {WHAT}: {message}")


def _map_planner() -> None:
    """Import ``memo.planner`` from ``planner/``, as setup.py's ``package_dir`` maps it.

    An install (editable or not) makes that mapping; a checkout on PYTHONPATH alone does not."""
    import memo

    if not os.path.realpath(memo.__file__).startswith(os.path.join(os.path.realpath(ROOT), "")):
        _fail(f"memo was imported from {memo.__file__}, not from this checkout ({ROOT}); "
              "put the checkout on PYTHONPATH")
    if importlib.util.find_spec("memo.planner") is not None:
        return
    folder = os.path.join(ROOT, "planner")
    spec = importlib.util.spec_from_file_location("memo.planner", os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["memo.planner"] = module
    spec.loader.exec_module(module)
    memo.planner = module


def main() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        _fail("torch is importable here, so this check proves nothing; run it where torch is not installed")
    _map_planner()
    import memo.planner as planner
    from memo.planner.synthetic import guillotine_instance, items_to_trace

    trace = items_to_trace(guillotine_instance(40, seed=0))
    t0 = time.perf_counter()
    plan = planner.make_plan(trace, method="flat", time_limit=30)
    seconds = time.perf_counter() - t0
    method = plan.solver["total"]["method"]
    if method != "search":
        _fail(f"the plan was made by {method!r}, expected the exact search ('search'): {plan.solver}")
    if "memo._planner_native" not in sys.modules:
        _fail("the exact search ran without memo._planner_native")
    bound = planner.lower_bound(trace)
    if plan.peak != bound:
        _fail(f"the exact search's peak is {plan.peak} bytes, expected the lower bound {bound}")
    loaded = sorted(m for m, mod in sys.modules.items()
                    if mod is not None and (m == "torch" or m.startswith("torch.") or m == "memo._C"))
    if loaded:
        _fail(f"importing and planning loaded {loaded}")
    print(f"torch-free planner check: ok (memo.planner without torch; 40 items planned by the exact "
          f"search in {seconds:.2f} s, peak {plan.peak} bytes = the lower bound)")


if __name__ == "__main__":
    main()
