"""PuLP glue for the planner's MIPs: solver choice, its command, and PuLP's notices kept quiet."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from memo.errors import MemoError

if TYPE_CHECKING:
    from pulp import LpSolver  # untyped (mypy.ini): Any to mypy, named for the reader

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["quiet_pulp", "require_solver", "solver_command"]


def quiet_pulp(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` without PuLP 3.x's notices about its 4.0 API.

    memo uses the 3.x API and its bundled CBC (docs/formats.md, "Solvers").
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*PuLP 4", category=DeprecationWarning)
            return fn(*args, **kwargs)

    return wrapper


def require_solver(solver: str) -> None:
    """Raise a clear error now when ``solver`` is unknown or not installed (not minutes into a plan)."""
    if solver == "cbc":
        return
    if solver == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError:
            raise MemoError("memo.planner: solver 'highs' needs the highspy package "
                            "(`pip install highspy`, or `pip install memo[highs]`); or use --solver cbc") \
                from None
        return
    raise MemoError(f"memo.planner: unknown solver {solver!r}; choose 'cbc' or 'highs'")


def solver_command(solver: str, time_limit: float, threads: int, msg: bool) -> LpSolver:
    """The PuLP command for ``solver`` (checked by :func:`require_solver`), warm-started, gap 0."""
    import pulp

    require_solver(solver)
    if solver == "cbc":
        return pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit, threads=threads, warmStart=True, gapRel=0.0)
    return pulp.HiGHS(msg=msg, timeLimit=time_limit, threads=threads, warmStart=True, gapRel=0.0)
