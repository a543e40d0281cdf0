"""Argument types and flag groups shared by memo's commands (profile, train)."""

from __future__ import annotations

import argparse
import re

from memo.errors import MemoError

__all__ = ["add_machine_arguments", "fraction", "positive_float", "positive_int", "seq_len"]


#: The longest ``--seq-len`` accepted: 2^34 tokens (16G), far past any model's reach; longer
#: values only overflow sizes and dtypes downstream.
MAX_SEQ_LEN = 1 << 34


def seq_len(text: str) -> int:
    """``--seq-len``: 4096, 128K, 1M (K = 1024), at most MAX_SEQ_LEN."""
    from memo.profiler import parse_count

    try:
        value = parse_count(text, "--seq-len")
    except MemoError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("memo: ")) from None
    if value > MAX_SEQ_LEN:
        raise argparse.ArgumentTypeError(f"--seq-len must be at most {MAX_SEQ_LEN:,} tokens (16G), "
                                         f"got {text}")
    return value


def device(text: str) -> str:
    """``--device``: a torch device string this machine has (``cpu``, ``cuda``, ``cuda:1``, ``meta``)."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda or cuda:<index>") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: no CUDA device on this machine (torch {torch.__version__}"
                + (", built without CUDA" if torch.version.cuda is None else "") + "); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA "
                                             "device(s)")
    elif dev.type not in ("cpu", "meta"):
        raise argparse.ArgumentTypeError(f"device {text!r} is not supported; use cpu or cuda[:i]")
    return text


def train_device(text: str) -> str:
    """``memo train --device``: :func:`device`, but not meta (training needs real memory)."""
    if device(text).startswith("meta"):
        raise argparse.ArgumentTypeError("training needs real memory: use cpu or cuda[:i] (meta is for "
                                         "`memo profile`)")
    return text


def figure_path(text: str) -> str:
    """An output path for a matplotlib figure whose extension matplotlib can write."""
    import os

    ext = os.path.splitext(text)[1].lstrip(".").lower()
    supported = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")
    if ext not in supported:
        raise argparse.ArgumentTypeError(f"cannot draw a figure as {text!r}: give a file ending in "
                                         f"{', '.join('.' + e for e in supported)}")
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_count(text: str) -> int:
    """A positive number of bytes: ``1048576``, ``1MiB``, ``1.5 GiB``, ``80GB`` (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"must be a number of bytes such as 1048576, 1MiB or 80GB, "
                                         f"got {text!r}")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
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
