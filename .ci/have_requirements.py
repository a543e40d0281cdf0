"""Exit 0 when every requirement given on the command line is installed at a version it allows, else 1.

`make install` asks this before running pip: on a machine that has them all (CI's, a developer's)
pip's own resolution of ~20 requirements takes ~9 s of every `make test`, to install nothing.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement


def missing(specs: list[str]) -> list[str]:
    out = []
    for spec in specs:
        req = Requirement(spec)
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{spec} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{spec} (installed: {version})")
    return out


if __name__ == "__main__":
    absent = missing(sys.argv[1:])
    for line in absent:
        print(f"make install: needs {line}")
    sys.exit(1 if absent else 0)
