"""The README's Python snippet runs as written (every ```python block, verbatim)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_readme_python_snippets_run_verbatim(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "the README has no Python snippet"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})  # noqa: S102
    out = capsys.readouterr().out
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out  # it trains
    assert re.search(r"^\d+ bytes of host memory", out, flags=re.M), out
