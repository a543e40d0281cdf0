"""Reading and writing memo's files (traces, plans, reports) with errors that say what to do.

NOTE [Atomic writes]
Every file memo writes goes to a temporary file in the same folder first and replaces the
target only once it is complete (``os.replace``), so a failed write, a full disk or Ctrl-C
never leaves a truncated plan or trace where a good one was. Commands check their output
paths before any work (:func:`check_writable`), so a long run does not end in an error that
loses its results.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from memo.errors import MemoError

__all__ = ["atomic_write", "check_writable", "read_json"]


def check_writable(path: str | os.PathLike[str], what: str) -> None:
    """Raise a :class:`MemoError` naming ``what`` (e.g. ``"memo train --report"``) unless ``path``
    can be written: its folder exists and is writable, and it is not a folder itself."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    if os.path.isdir(target):
        raise MemoError(f"{what}: {target!r} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise MemoError(f"{what}: the folder {folder!r} does not exist; create it first (nothing was run)")
    if not os.access(folder, os.W_OK):
        raise MemoError(f"{what}: the folder {folder!r} is not writable (nothing was run)")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], what: str, mode: str = "w") -> Iterator[IO[Any]]:
    """Write ``path`` through a temporary file that replaces it when complete (NOTE [Atomic writes])."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    except OSError as err:
        raise MemoError(f"{what}: cannot write {target!r}: {err}") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, target)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise MemoError(f"{what}: cannot write {target!r}: {err}") from None
        raise


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
