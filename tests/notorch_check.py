"""`make test`'s check that memo.planner works where torch is not installed (issue 17).

The planner is the lower, torch-free layer (NOTE [A torch-free planner module] in
csrc/planner/module.cpp). The Makefile runs this file with `python -S` (no site-packages) and
PYTHONPATH holding this checkout and a folder of links to the planner's own requirements, numpy,
PuLP and tqdm, which `--make-site DIR` makes from the environment that runs it (a venv and a pip
install each time took half a minute of every `make test`): so there is no torch to import.
tests/planner/test_torch_free_planner.py runs it with torch made unimportable. It imports memo.planner,
makes a plan whose exact search runs (a guillotine packing, which greedy misses) and checks that the
native search made it and that no torch was loaded. Not a pytest file: it stands alone so that it
runs without pytest and without torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHAT = "memo.planner must work where torch is not installed (issues 17, 32)"
#: A plan `memo profile --model tiny --seq-len 512 --device cpu --dtype float32 --device-mem-gb 0.02`
#: wrote (with its layer policy).
PLAN = os.path.join(ROOT, "tests", "data", "plan-tiny-512-policy.json")


def _fail(message: str) -> None:
    raise SystemExit(f"torch-free planner check failed: {WHAT}: {message}")


def _check_memo_is_this_checkout() -> None:
    """memo must come from this checkout, where memo.planner is its planner/ (NOTE [The planner in
    a checkout] in memo/__init__.py): no install maps it here."""
    import memo

    if not os.path.realpath(memo.__file__).startswith(os.path.join(os.path.realpath(ROOT), "")):
        _fail(f"memo was imported from {memo.__file__}, not from this checkout ({ROOT}); "
              "put the checkout on PYTHONPATH")


def _check_a_profile_plan_loads_and_shows() -> None:
    """A plan `memo profile` wrote, with a layer policy, loads and `memo show` prints it (issue 32:
    the policy's check once imported the runtime, and with it torch)."""
    from memo.planner import load_plan

    plan = load_plan(PLAN)
    if not plan.policy:
        _fail(f"{PLAN} records no layer policy, so this check would prove nothing")
    # The same interpreter as this one: without site-packages when this one is (the Makefile's run).
    no_site = ["-S"] if sys.flags.no_site else []
    shown = subprocess.run([sys.executable, *no_site, "-m", "memo", "show", PLAN], capture_output=True,
                           text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or ROOT})
    if shown.returncode != 0 or "policy" not in shown.stdout:
        _fail(f"`python -m memo show {PLAN}` failed (exit {shown.returncode}):\n{shown.stderr[-2000:]}")


def main() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        _fail("torch is importable here, so this check proves nothing; run it where torch is not installed")
    _check_memo_is_this_checkout()
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
    _check_a_profile_plan_loads_and_shows()
    loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] == "torch")
    if loaded:
        _fail(f"loading a plan loaded {loaded}")
    print(f"torch-free planner check: ok (memo.planner without torch; 40 items planned by the exact "
          f"search in {seconds:.2f} s, peak {plan.peak} bytes = the lower bound; a profile's plan "
          "with a layer policy loads, and `memo show` prints it)")


#: The planner's requirements (setup.py's, less torch and matplotlib): what --make-site links.
REQUIREMENTS = ("numpy", "pulp", "tqdm")


def make_site(folder: str) -> None:
    """A folder of links to REQUIREMENTS' packages (and the shared libraries wheels keep beside
    them, such as numpy.libs) in the environment running this: with it on PYTHONPATH, `python -S`
    finds them and nothing else that is installed."""
    import importlib.util

    os.makedirs(folder, exist_ok=True)
    for name in REQUIREMENTS:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise SystemExit(f"notorch_check --make-site: {name} is not installed here; `make install` "
                             "installs it")
        package = os.path.dirname(spec.origin)
        for path in (package, package + ".libs"):
            if os.path.exists(path):
                os.symlink(path, os.path.join(folder, os.path.basename(path)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-site"] and len(sys.argv) == 3:
        make_site(sys.argv[2])
    else:
        main()
