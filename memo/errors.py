"""Error types shared by memo's parts.

Every user-facing error names the subsystem, what was expected, what was
seen, and what to do. Internal invariants use :func:`internal_assert`, never a
bare ``assert`` on user input.
"""

from __future__ import annotations

__all__ = ["MemoError", "PlanMismatchError", "internal_assert"]


class MemoError(RuntimeError):
    """A user-facing error: bad input, a mismatched file, memory that cannot be had."""


class DeviceBudgetError(MemoError):
    """No layer policy fits the device budget: the message gives the smallest need and its parts."""


class PlanMismatchError(MemoError):
    """A plan or trace was made for another model, sequence length or dtype."""


def internal_assert(condition: bool, message: str) -> None:
    """Check an internal invariant; failing means a bug in memo, not in the caller's input."""
    if not condition:
        raise AssertionError(
            f"memo internal error: {message}. This is a bug in memo; please report it with `memo env`."
        )
