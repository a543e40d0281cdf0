"""Reading and writing memo's files (traces, plans, reports) with errors that say what to do.

NOTE [Atomic writes]
Every file memo writes goes to a temporary file in the same folder first and replaces the
target only once it is complete (``os.replace``), so a failed write, a full disk or Ctrl-C
never leaves a truncated plan or trace where a good one was. Commands check their output
paths before any work (:func:`check_writable`), so a long run does not end in an error that
loses its results.

NOTE [Reading untrusted JSON]
Python's ``json`` reads more than JSON: ``NaN`` and ``Infinity`` literals, ``1e400`` as an
infinite float, integers of thousands of digits (then fails with a ``ValueError`` that asks
for ``sys.set_int_max_str_digits``) and nesting as deep as the stack (then a ``RecursionError``).
:func:`read_json` refuses all of these with one :class:`MemoError` line that says where, so the
validators of each format only ever see finite numbers and at most :data:`MAX_DEPTH` levels of
nesting (plans and traces nest 4). Integers are left to the validators, which bound every count
(NOTE [Byte counts are bounded] in memo/units.py); only one past Python's digit limit is refused
here, found by a second, slower read so the message can say where. The depth is checked after
parsing, without recursion, because json's own parser recurses and would let ~900 levels through
to code (``repr``, ``json.dumps``) that recurses too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

from memo.errors import MemoError

__all__ = ["MAX_DEPTH", "atomic_write", "check_writable", "read_json"]

#: Deepest nesting of arrays and objects :func:`read_json` accepts (NOTE [Reading untrusted JSON]).
MAX_DEPTH = 64
_TOO_DEEP = f"arrays or objects nest more than {MAX_DEPTH} levels deep"


class _Refused:
    """Stands in for a number the parser must not return, so :func:`read_json` can say where it is."""

    def __init__(self, what: str) -> None:
        self.what = what


def _parse_constant(name: str) -> _Refused:
    return _Refused(f"{name}, which JSON does not allow; memo files hold finite numbers only")


def _parse_float(text: str) -> float | _Refused:
    value = float(text)
    return _Refused(f"{text}, beyond the range of a float") if value in (math.inf, -math.inf) else value


def _parse_long_int(text: str) -> int | _Refused:
    # Only on the slow path, to say where the integer that json refused is.
    digits = len(text.lstrip("-"))
    if digits > 20:
        return _Refused(f"an integer of {digits} digits; no count in a memo file has more than 20")
    return int(text)


def _too_deep(data: Any) -> bool:
    """Whether ``data`` nests arrays/objects more than :data:`MAX_DEPTH` levels (iterative: no recursion)."""
    stack = [(data, 1)]
    containers = {dict, list}
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        children = node.values() if type(node) is dict else node
        # The types of a node's children in one C-level pass: most nodes of a large file (the rows
        # of a plan's allocations) hold numbers only, and are not walked element by element.
        if containers.isdisjoint(set(map(type, children))):
            continue
        for child in children:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return False


def _where(path: tuple[str | int, ...]) -> str:
    """``events[3].size``; a key that is not plain text shows as its repr, so the message stays one line."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        elif re.fullmatch(r"[\w.\-\[\]]+", key, re.ASCII):
            out += f".{key}" if out else key
        else:
            out += f"[{key!r:.40}]"
    return out or "the top level"


def _find_refused(data: Any, path: tuple[str | int, ...] = ()) -> str | None:
    """``"<where> is <what>"`` for the first refused number in ``data`` (depth already checked)."""
    if isinstance(data, _Refused):
        return f"{_where(path)} is {data.what}"
    if isinstance(data, (dict, list)):
        for key, child in data.items() if isinstance(data, dict) else enumerate(data):
            found = _find_refused(child, (*path, key))
            if found is not None:
                return found
    return None


def _load(f: IO[str], parse_int: Callable[[str], Any] | None = None) -> tuple[Any, list[_Refused]]:
    refused: list[_Refused] = []

    def keep(sentinel_or_value: Any) -> Any:
        if isinstance(sentinel_or_value, _Refused):
            refused.append(sentinel_or_value)
        return sentinel_or_value

    data = json.load(f, parse_constant=lambda name: keep(_parse_constant(name)),
                     parse_float=lambda text: keep(_parse_float(text)),
                     parse_int=None if parse_int is None else lambda text: keep(parse_int(text)))
    return data, refused


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


def _umask() -> int:
    """The process's umask (reading it means setting it: set it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
        # mkstemp makes the file 0600; the file we leave gets what open() would give it under the
        # umask (0666 & ~umask), so another user's job, or a container's, can read a plan we wrote.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
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
    naming ``subsystem`` (e.g. ``"memo.plan"``) and, for a missing one, ``how_to_make`` it. So is a
    file with NaN, Infinity, a float beyond range, an integer of thousands of digits or nesting
    deeper than :data:`MAX_DEPTH` levels (NOTE [Reading untrusted JSON])."""
    name = repr(os.fspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            try:
                data, refused = _load(f)
            except ValueError as err:
                if isinstance(err, json.JSONDecodeError) or "integer string conversion" not in str(err):
                    raise
                # An integer past Python's digit limit: read again, slowly, to say where it is.
                f.seek(0)
                data, refused = _load(f, _parse_long_int)
    except FileNotFoundError:
        raise MemoError(f"{subsystem}: {name} does not exist; {how_to_make}") from None
    except json.JSONDecodeError as err:
        raise MemoError(f"{subsystem}: {name} is not valid JSON (line {err.lineno}, column {err.colno}: "
                        f"{err.msg}); was it truncated?") from None
    except RecursionError:  # json's parser recursed past the stack: far deeper than MAX_DEPTH
        raise MemoError(f"{subsystem}: in {name}, {_TOO_DEEP}; the file is damaged or edited by "
                        "hand") from None
    except UnicodeDecodeError as err:
        raise MemoError(f"{subsystem}: {name} is not UTF-8 text ({err})") from None
    except OSError as err:
        raise MemoError(f"{subsystem}: cannot read {name}: {err}") from None
    defect = _TOO_DEEP if isinstance(data, (dict, list)) and _too_deep(data) else \
        _find_refused(data) if refused else None
    if defect is not None:
        raise MemoError(f"{subsystem}: in {name}, {defect}; the file is damaged or edited by hand")
    return data
