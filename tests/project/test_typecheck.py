"""The torch-free planner and the memo modules it imports are `mypy --strict` clean (issue 32).

The same check as `make typecheck` (Makefile), so that pytest alone also catches a regression: mypy
with mypy.ini, which names what is checked and how planner/ is seen as memo.planner (NOTE
[Type-checking the planner as memo.planner] there, which also explains the symlink made below).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _link_planner() -> None:
    """build/typecheck/memo/planner -> ../../../planner, as `make typecheck` makes it."""
    folder = os.path.join(ROOT, "build", "typecheck", "memo")
    os.makedirs(folder, exist_ok=True)
    link = os.path.join(folder, "planner")
    if os.path.islink(link) and os.readlink(link) == os.path.join("..", "..", "..", "planner"):
        return
    if os.path.lexists(link):
        os.unlink(link)
    try:
        os.symlink(os.path.join("..", "..", "..", "planner"), link)
    except FileExistsError:  # made by a concurrent `make typecheck` or test worker meanwhile
        pass


def test_planner_is_mypy_strict_clean() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed, and it is a test dependency (tests/project/test_typecheck.py, "
                    "`make typecheck`): `pip install 'mypy>=1.10'`, or `pip install -e .[test]`, or "
                    "`make install`", pytrace=False)
    _link_planner()
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (
        f"mypy --strict found type errors in memo.planner or the memo modules it imports (mypy.ini; "
        f"run `make typecheck`):\n{result.stdout}{result.stderr}")
