"""Byte units: the block alignment and the byte bound every part of memo agrees on, and
human-readable byte counts and durations for what memo prints (one unit per quantity, chosen for
the size at hand; exact byte counts belong in the JSON files, not on the screen). Parsing counts
such as ``128K`` from the command line is :mod:`memo.profiler.counts`."""

from __future__ import annotations

__all__ = ["ALIGNMENT", "GB", "GiB", "MAX_BYTES", "MiB", "format_bytes", "format_mib", "format_ms"]

# NOTE [Block alignment]
# Every planned offset, and every size the planner places, is a multiple of ALIGNMENT bytes:
# the planner works in these units (memo.planner), the plan files record it and refuse another
# (planner/plan.py), the allocator's core refuses offsets off it (NOTE [Plan tables are checked in the
# core] in csrc/core/planned_allocator.h), and the
# synthetic traces count sizes in it (planner/synthetic.py). 512 is what PyTorch's CUDA caching
# allocator hands out, so kernels may assume it. Defined here once, in a module that imports
# nothing, for all of them; the native allocator's own constant (kBlockAlignment in
# csrc/core/alloc_backend.h, exposed as memo._C.allocator.BLOCK_ALIGNMENT) is checked equal to it
# by tests/allocator/test_block_alignment.py.
ALIGNMENT = 512

# NOTE [Byte counts are bounded]
# The planner adds sizes and offsets in int64 (numpy, and the exact search in csrc/) and the
# native allocator in 64-bit integers, so a trace or plan with sizes near 2**62 overflowed the
# planner's clash check. Every byte count memo reads from a file or is given as a phase table (a
# size, an offset, a peak) must be below MAX_BYTES, and so must a trace's total of all its
# allocation sizes: then any offset + size a plan can hold stays below 2**63. 2**62 bytes is
# 4 EiB, beyond any machine, so no real trace or plan is refused.
MAX_BYTES = 2**62

# NOTE [GB and GiB]
# Flags and link speeds count in decimal units, as vendors do (--device-mem-gb 80, --host-mem-gb,
# --bandwidth-gbps: 10**9); what memo prints and plots of memory counts in binary ones (GiB, MiB).
# Defined here once for every part.
GB = 10**9
GiB = 2**30
MiB = 2**20

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float | None) -> str:
    """``format_bytes(3 * 2**30) -> "3.00 GiB"``; ``None`` -> ``"unknown"``."""
    if n is None:
        return "unknown"
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def format_mib(n: float | None) -> str:
    """``format_mib(3 * 2**20) -> "3.0 MiB"``: the one unit per-step lines and tables use, so
    their columns compare at a glance; ``None`` -> ``"n/a"``."""
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def format_ms(ms: float | None) -> str:
    """``format_ms(19100) -> "19.1 s"``, ``format_ms(56.44) -> "56.4 ms"``,
    ``format_ms(0.42) -> "0.42 ms"``."""
    if ms is None:
        return "unknown"
    if abs(ms) >= 1000:
        return f"{ms / 1000:,.3g} s" if abs(ms) < 100_000 else f"{ms / 1000:,.0f} s"
    return f"{ms:.3g} ms"
