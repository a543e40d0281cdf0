"""Argument types and flag groups shared by memo's commands (profile, train)."""

from __future__ import annotations

import argparse

from memo.errors import MemoError

__all__ = ["add_machine_arguments", "fraction", "positive_float", "positive_int", "seq_len"]


def seq_len(text: str) -> int:
    """``--seq-len``: 4096, 128K, 1M (K = 1024)."""
    from memo.profiler import parse_count

    try:
        return parse_count(text, "--seq-len")
    except MemoError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("memo: ")) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def add_machine_arguments(
    parser: argparse.ArgumentParser, gpus_per_node_help: str
) -> argparse._ArgumentGroup:
    """The numbers the alpha LP needs: B, T_layer, host memory and how it is shared."""
    from memo.profiler import gpu_names

    m = parser.add_argument_group("machine (for alpha; measured where possible when not given)")
    m.add_argument("--bandwidth-gbps", type=positive_float, help="host<->device copy bandwidth B in GB/s")
    m.add_argument("--layer-ms", type=positive_float, help="forward time of one layer T_layer in ms")
    m.add_argument("--gpu", help="estimate T_layer from FLOPs on this GPU: " + ", ".join(gpu_names()))
    m.add_argument("--efficiency", type=fraction, default=0.5, help="share of the GPU peak for --gpu (0.5)")
    m.add_argument(
        "--host-mem-gb", type=positive_float, help="host memory of the node in GB (default: this one's)"
    )
    m.add_argument("--gpus-per-node", type=positive_int, default=None, help=gpus_per_node_help)
    m.add_argument(
        "--host-safety", type=fraction, default=0.8, help="share of host memory memo may pin (0.8)"
    )
    return m
