"""The ``memo`` command line: one subcommand per module in :data:`COMMANDS`.

Each module named there defines ``add_parser(subparsers) -> argparse.ArgumentParser``
and sets ``func`` on the parser it adds (``parser.set_defaults(func=run)``),
where ``run(args) -> int`` is the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence

from memo.errors import MemoError

__all__ = ["COMMANDS", "build_parser", "main"]

#: Subcommand modules under memo.cli, in the order `memo --help` lists them.
COMMANDS = ("env", "profile", "plan", "show", "plot", "train", "estimate")


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` for people: descriptions keep their paragraphs (each wrapped to the terminal,
    indented blocks such as examples kept as written), reStructuredText's double backticks (the
    docstrings' markup) print as single ones, and every option with a real default says it,
    unless its help text already does."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = textwrap.dedent(text).strip().split("\n\n")
        out = []
        for para in paragraphs:
            if any(line.startswith(" ") for line in para.splitlines()[1:]) or para.rstrip().endswith("::"):
                out.append(textwrap.indent(para, indent))  # an example block: as written
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS
                or isinstance(action, argparse._HelpAction) or "default" in text.lower()
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"

    def format_help(self) -> str:
        return super().format_help().replace("``", "`")


class ArgumentParser(argparse.ArgumentParser):
    """Every memo parser and subparser formats its help with :class:`HelpFormatter`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` just that subcommand's parser: each subcommand's
    module imports what it needs (torch for most), and ``memo plan`` needs no torch, so the
    seconds of importing it would count against ``--time-limit`` for nothing."""
    parser = ArgumentParser(
        prog="memo",
        description="memo: train transformers on million-token sequences on few GPUs "
        "(token-wise offload/recompute + planned activation memory).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    sub.required = True
    for name in COMMANDS if only is None else (only,):
        importlib.import_module(f"memo.cli.{name}").add_parser(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, like Ctrl-C's KeyboardInterrupt (what schedulers send
    at a job's time limit): the same cleanup runs, and main says so in one line."""


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` while a command runs (main thread only: Python runs
    signal handlers there, and only there may one be installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# NOTE [OpenMP threads that sleep]
# A `memo` process waits passively at OpenMP barriers (OMP_WAIT_POLICY=PASSIVE, unless the
# environment sets it or GOMP_SPINCOUNT): libgomp's default spins for about 3 ms before sleeping.
# memo's runtime runs a layer as many small tiles, each op of which opens a parallel region; where
# another job shares the cores, the partner thread is often descheduled, and every region then spins
# away its time slice: gpt-mini at 2K on a 2-core machine at a load of 8 took 32 s a step with the
# default and 5.4 s with passive waits (benchmarks/contention.py). libgomp reads the variable once,
# when torch loads it, so it is set here, before any subcommand imports torch.
def _openmp_threads_sleep() -> None:
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def main(argv: Sequence[str] | None = None) -> int:
    # When the command started: a subcommand with a time limit (memo plan) counts from here.
    started = time.monotonic()
    _openmp_threads_sleep()
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        args = build_parser(only).parse_args(argv)
    except MemoError as err:  # a --config file's bad key or value (memo/cli/config_file.py)
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.started = started
    try:
        with _sigterm_as_interrupt():
            return int(args.func(args) or 0)
    except MemoError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Terminated:
        print("memo: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt as err:
        # A run that stopped at a step and saved (memo.train.stop.StopRequested) says so, with its status.
        status = getattr(err, "exit_status", None)
        if status is not None:
            print(err, file=sys.stderr)
            return int(status)
        # Ctrl-C: one line, no traceback; files are written atomically, so none is left half-written.
        print("memo: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `memo show plan.json | head`: the reader left; not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
