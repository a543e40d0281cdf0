"""The stats dicts are built from the core's one list of counter names (NOTE [Stat names] in
csrc/core/planned_allocator.h), not from a list kept in step by hand. The CUDA library's side is in
tests/allocator/test_cuda_build.py (it needs the library compiled)."""

from __future__ import annotations

import memo.allocator as ma
from memo import _C

A = _C.allocator
MIB = 1 << 20


def _flat_keys(stats: dict) -> set[str]:
    keys: set[str] = set()
    for key, value in stats.items():
        if isinstance(value, dict) and key != "first_deviation":
            keys |= {f"{key}.{field}" for field in value}
        else:
            keys.add(key)
    return keys


def test_names_are_unique_and_cover_the_documented_counters() -> None:
    names = list(A.library().stat_names())
    assert len(names) == len(set(names))
    assert {"requests", "planned_hits", "peak_bytes_in_use", "fallback.reserved_bytes", "stream_waits",
            "borrowed_bytes", "segment_allocs"} <= set(names)


def test_cpu_stats_keys_are_the_library_names() -> None:
    expected = set(A.library().stat_names()) | {"first_deviation"}
    assert _flat_keys(ma.stats("cpu")) == expected
    assert _flat_keys(A.PlannedAllocator(MIB, 0).stats()) == expected
    assert _flat_keys(A.StreamTestHarness(MIB, 0).stats()) == expected


def test_values_follow_their_names() -> None:
    a = A.PlannedAllocator(MIB, 0)
    a.load_plan({"p": [(1024, 0), (4096, None)]}, 1024)
    a.set_phase("p")
    planned, unplanned = a.malloc(1024), a.malloc(4096)
    s = a.stats()
    assert (s["requests"], s["planned_hits"], s["unplanned_requests"]) == (2, 1, 1)
    assert s["fallback"]["num_allocs"] == 1 and s["fallback"]["segments"] == 1
    assert s["segment_allocs"] == s["fallback"]["segment_allocs"] == 1
    assert s["arena_bytes"] == 4096 and s["arena_high_water"] == 1024
    a.free(planned)
    a.free(unplanned)
    assert a.stats()["frees"] == 2
