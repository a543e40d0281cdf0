"""The ``memo`` command line: one subcommand per module in :data:`COMMANDS`.

Each module named there defines ``add_parser(subparsers) -> argparse.ArgumentParser``
and sets ``func`` on the parser it adds (``parser.set_defaults(func=run)``),
where ``run(args) -> int`` is the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from memo.errors import MemoError

__all__ = ["COMMANDS", "build_parser", "main"]

#: Subcommand modules under memo.cli, in the order `memo --help` lists them.
COMMANDS = ("env", "profile", "plan", "show", "plot", "train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memo",
        description="memo: train transformers on million-token sequences on few GPUs "
        "(token-wise offload/recompute + planned activation memory).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"memo.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MemoError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `memo show plan.json | head`: the reader left; not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
