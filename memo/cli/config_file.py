"""``--config FILE``: a command's flags from a YAML or TOML file (NOTE [Flags from a config file])."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from memo.errors import MemoError

__all__ = ["load_config_file", "take_config_file"]


# NOTE [Flags from a config file]
# A file may hold any of a command's flags, each by its dest name (``seq_len``) or its flag name
# (``seq-len``, ``--seq-len``); YAML (.yaml, .yml; pyyaml's safe loader) or TOML (.toml; tomllib), one
# table of keys. A value goes through the flag's own type and choices (``seq_len: 128K`` is read as
# ``--seq-len 128K`` is), a switch takes true or false, and a flag that takes several values a list. The
# file's values become the parser's defaults and the command line is parsed again, so every flag given
# on the command line wins over the file, wherever it stands. A key that names no flag is refused with
# every such key named.
def take_config_file(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` read ``--config FILE`` (added here) as NOTE [Flags from a config file] says."""
    parser.add_argument("--config", metavar="FILE",
                        help="read flags from a YAML or TOML file (keys: the flags' names, e.g. seq_len or "
                        "seq-len); flags on the command line win")
    parse = parser.parse_known_args

    # argparse calls a subcommand's parser through this method; the instance's own is wrapped so that
    # the file is read wherever the command line is parsed (memo's main, a test, an example).
    def parse_known_args(args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = parse(args, namespace)
        if getattr(parsed, "config", None) is None:
            return parsed, rest
        parser.set_defaults(**load_config_file(parsed.config, parser))
        return parse(args, namespace)

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign,assignment]


def _read(path: str) -> Any:
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            import tomllib

            with open(path, "rb") as f:
                return tomllib.load(f)
        if ext in (".yaml", ".yml"):
            import yaml

            with open(path, encoding="utf-8") as f:
                return yaml.safe_load(f)
    except OSError as err:
        raise MemoError(f"memo: --config {path!r}: cannot read it: {err}") from None
    except Exception as err:  # noqa: BLE001 - the parsers' own errors (yaml.YAMLError, TOMLDecodeError)
        raise MemoError(f"memo: --config {path!r} is not valid {ext[1:].upper()}: "
                        f"{str(err).splitlines()[0]}") from None
    raise MemoError(f"memo: --config {path!r}: give a .yaml, .yml or .toml file")


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flags' values ``path`` holds, by dest, each checked by its flag's type and choices."""
    data = _read(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MemoError(f"memo: --config {path!r} must hold one table of flags (key: value), not a "
                        f"{type(data).__name__}")
    actions = {}
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its flags only here
        if action.option_strings and action.dest not in ("help", "config"):
            actions[action.dest] = action
            for flag in action.option_strings:
                actions[flag.lstrip("-")] = actions[flag] = action
    unknown = [str(k) for k in data if k not in actions]
    if unknown:
        raise MemoError(f"memo: --config {path!r}: no such flag(s): {', '.join(sorted(unknown))}")
    return {actions[k].dest: _value(actions[k], v, path, str(k)) for k, v in data.items()}


def _value(action: argparse.Action, value: Any, path: str, key: str) -> Any:
    where = f"memo: --config {path!r}: {key}"
    if action.nargs == 0:  # a switch (store_true / store_false)
        if not isinstance(value, bool):
            raise MemoError(f"{where} is a switch: give true or false, not {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value  # noqa: SLF001
    many = action.nargs in ("*", "+") or isinstance(action.nargs, int)
    if many and not isinstance(value, list):
        raise MemoError(f"{where} takes a list of values, not {value!r}")
    values = value if many else [value]
    out = []
    for v in values:
        if isinstance(v, (dict, list)) or v is None:
            raise MemoError(f"{where} must be a value, not {v!r}")
        text = str(v).lower() if isinstance(v, bool) else str(v)
        try:
            converted = action.type(text) if callable(action.type) else text
        except (argparse.ArgumentTypeError, TypeError, ValueError) as err:
            raise MemoError(f"{where}: {err or 'invalid value'} ({v!r})") from None
        if action.choices is not None and converted not in action.choices:
            raise MemoError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {v!r}")
        out.append(converted)
    return out if many else out[0]
