"""Parsing of human-sized counts such as ``--seq-len 128K`` (byte counts and durations for the screen
are in :mod:`memo.units`)."""

from __future__ import annotations

import re

from memo.errors import MemoError

__all__ = ["parse_count"]

# Binary multipliers: sequence lengths are powers of two in practice, and "1M tokens" in the
# paper is 1,048,576.
_SUFFIX = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_COUNT_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)


def parse_count(text: str, what: str = "value") -> int:
    """``"4096" -> 4096``, ``"128K" -> 131072``, ``"1M" -> 1048576`` (K=1024, M=1024²).

    Only positive integers; anything else raises a MemoError that shows the accepted forms.
    """
    match = _COUNT_RE.match(str(text))
    if match is None:
        raise MemoError(
            f"memo: {what} must be a positive integer, optionally with K (x1024) or M (x1048576), "
            f"e.g. 4096, 128K, 1M; got {text!r}"
        )
    value = int(match.group(1)) * _SUFFIX[match.group(2).upper()]
    if value < 1:
        raise MemoError(f"memo: {what} must be positive, got {text!r}")
    return value
