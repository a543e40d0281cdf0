"""The paths memo's commands read and write: stage-plan patterns, and outputs that are not inputs.

NOTE [Stage-plan patterns]
``--save-plan`` and ``--plan`` under a pipeline take a pattern that each rank fills with its stage
and rank (NOTE [A stage's address plan] in memo/pipeline/stage_plan.py). ``str.format`` fills far
more than that: ``{stage.__class__}`` wrote a file named ``<class 'int'>``, ``{0}`` or ``{x}`` fail
with a KeyError or IndexError deep in training, ``{stage!r}`` converts, and ``{stage:>999999999}``
builds a string of a gigabyte. So a pattern may hold only the fields ``{stage}`` and ``{rank}``, with
at most a zero-padded width (``{stage:02d}``), and ``{{``/``}}`` for literal braces; anything else is
refused before any work, naming the field and what is allowed.

NOTE [Outputs are not inputs]
``memo plan t.json -o t.json`` would replace the trace with its plan, ``memo train --plan p.json
--report p.json`` the plan with a report: the atomic write (NOTE [Atomic writes] in memo/jsonio.py) only makes
the loss complete. Every command compares its output paths with its input paths, and with each other,
before it reads or writes anything: the same path once symbolic links and ``..`` are resolved
(``os.path.realpath``), or, where both exist, the same file by another name (``os.path.samefile``:
a hard link, a bind mount, a case-insensitive file system).
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Iterable, Sequence

from memo.errors import MemoError

__all__ = ["PATTERN_FIELDS", "check_distinct", "check_stage_pattern", "fill_stage_pattern"]

#: The fields a stage-plan pattern may hold (NOTE [Stage-plan patterns]).
PATTERN_FIELDS = ("stage", "rank")
#: A format spec a pattern field may carry: a zero-padded width of at most two digits (``02d``).
_SPEC = re.compile(r"(0[1-9][0-9]?)?d?")


def check_stage_pattern(pattern: str, flag: str, stages: int = 1) -> None:
    """Raise a MemoError unless ``pattern`` holds only ``{stage}`` and ``{rank}`` (NOTE [Stage-plan
    patterns]); with more than one ``stages``, ``{stage}`` must be among them, or every stage would
    write (or read) the one file."""
    allowed = "only {stage} and {rank} are filled in (e.g. plans/stage{stage}-rank{rank:02d}.json)"
    try:
        fields = list(string.Formatter().parse(pattern))
    except ValueError as err:
        raise MemoError(f"memo.train: {flag} {pattern!r}: not a pattern ({err}); {allowed}, and "
                        "{{ or }} stand for a brace") from None
    names = set()
    for _literal, name, spec, conversion in fields:
        if name is None:
            continue
        field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if name not in PATTERN_FIELDS:
            raise MemoError(f"memo.train: {flag} {pattern!r}: the field {field} is not allowed; {allowed}")
        if conversion is not None or not _SPEC.fullmatch(spec or ""):
            raise MemoError(f"memo.train: {flag} {pattern!r}: {field}: a field takes at most a width such as "
                            f"{{{name}:02d}}; {allowed}")
        names.add(name)
    if stages > 1 and "stage" not in names:
        raise MemoError(f"memo.train: {flag} {pattern!r} has no {{stage}}: the {stages} pipeline stages "
                        "would share one file; put {stage} in the file name")


def fill_stage_pattern(pattern: str, stage: int, rank: int, flag: str = "--save-plan") -> str:
    """``pattern`` with ``{stage}`` and ``{rank}`` filled in, checked first (NOTE [Stage-plan patterns])."""
    check_stage_pattern(pattern, flag)
    return pattern.format(stage=int(stage), rank=int(rank))


def _same(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same file
        return False


def check_distinct(command: str, inputs: Iterable[tuple[str, str | None]],
                   outputs: Sequence[tuple[str, str | None]]) -> None:
    """Raise a MemoError when an output path is an input path or another output's (NOTE [Outputs are
    not inputs]). ``inputs`` and ``outputs`` are ``(flag, path)`` pairs; a None path is not given."""
    given_outputs = [(flag, os.fspath(path)) for flag, path in outputs if path]
    for flag, path in (pair for pair in inputs if pair[1]):
        for out_flag, out in given_outputs:
            if _same(os.fspath(path), out):
                raise MemoError(f"{command}: {out_flag} {out!r} is also the input {flag} {path!r}; "
                                f"writing it would overwrite the input: give {out_flag} another path "
                                "(nothing was run)")
    for i, (flag, path) in enumerate(given_outputs):
        for other_flag, other in given_outputs[i + 1:]:
            if _same(path, other):
                raise MemoError(f"{command}: {flag} {path!r} and {other_flag} {other!r} are the same file; "
                                "one would overwrite the other: give them different paths (nothing was run)")
