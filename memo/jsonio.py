"""Reading memo's JSON files (traces, plans, reports) with errors that say what to do."""

from __future__ import annotations

import json
import os
from typing import Any

from memo.errors import MemoError

__all__ = ["read_json"]


def read_json(path: str | os.PathLike[str], subsystem: str, how_to_make: str) -> Any:
    """The parsed JSON of ``path``; a missing, non-UTF-8 or malformed file is a :class:`MemoError`
    naming ``subsystem`` (e.g. ``"memo.plan"``) and, for a missing one, ``how_to_make`` it."""
    name = repr(os.fspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise MemoError(f"{subsystem}: {name} does not exist; {how_to_make}") from None
    except json.JSONDecodeError as err:
        raise MemoError(f"{subsystem}: {name} is not valid JSON (line {err.lineno}, column {err.colno}: "
                        f"{err.msg}); was it truncated?") from None
    except UnicodeDecodeError as err:
        raise MemoError(f"{subsystem}: {name} is not UTF-8 text ({err})") from None
    except OSError as err:
        raise MemoError(f"{subsystem}: cannot read {name}: {err}") from None
