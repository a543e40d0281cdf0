"""Unit tests of the native allocator core (memo._C.allocator), driven from Python.

A standalone PlannedAllocator over host memory is used, so these never touch the
allocator behind PyTorch's tensors.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

import memo.allocator as ma
from memo import _C
from memo.errors import MemoError

A = _C.allocator
KIB = 1024
MIB = 1 << 20


def make(min_segment: int = MIB, limit: int = 0) -> A.PlannedAllocator:
    return A.PlannedAllocator(min_segment, limit)


# ---------------------------------------------------------------- fallback caching allocator


def test_fallback_rounds_and_aligns() -> None:
    a = make()
    ptrs = [a.malloc(n) for n in (1, 100, 513, 4096)]
    assert all(p % A.BLOCK_ALIGNMENT == 0 for p in ptrs)
    f = a.stats()["fallback"]
    assert f["allocated_bytes"] == 512 + 512 + 1024 + 4096
    assert f["segment_allocs"] == 1 and f["reserved_bytes"] == MIB


def test_fallback_split_and_coalesce() -> None:
    a = make()
    p1, p2, p3 = a.malloc(64 * KIB), a.malloc(64 * KIB), a.malloc(64 * KIB)
    assert p2 == p1 + 64 * KIB and p3 == p2 + 64 * KIB  # split from one segment, in address order
    f = a.stats()["fallback"]
    assert f["free_blocks"] == 1 and f["largest_free_block"] == MIB - 192 * KIB
    a.free(p2)
    assert a.stats()["fallback"]["free_blocks"] == 2  # hole between two live blocks
    a.free(p1)  # coalesces with p2's hole
    f = a.stats()["fallback"]
    assert f["free_blocks"] == 2 and f["largest_free_block"] == MIB - 192 * KIB
    a.free(p3)  # everything merges back into the whole segment
    f = a.stats()["fallback"]
    assert f["free_blocks"] == 1 and f["largest_free_block"] == MIB and f["allocated_bytes"] == 0


def test_fallback_best_fit_reuse() -> None:
    a = make()
    small, sep1, big, sep2 = a.malloc(8 * KIB), a.malloc(512), a.malloc(32 * KIB), a.malloc(512)
    a.free(small)
    a.free(big)
    # A 6 KiB request fits both holes; best fit takes the 8 KiB one.
    assert a.malloc(6 * KIB) == small
    # A 20 KiB request reuses the 32 KiB hole, not fresh segment space.
    assert a.malloc(20 * KIB) == big
    assert a.stats()["fallback"]["segment_allocs"] == 1
    for p in (sep1, sep2):
        a.free(p)


def test_fallback_steady_state_makes_no_backend_calls() -> None:
    a = make()
    for _ in range(200):
        ps = [a.malloc(n) for n in (3000, 70000, 512, 123456)]
        for p in reversed(ps):
            a.free(p)
    f = a.stats()["fallback"]
    assert f["segment_allocs"] == 1 and f["segment_releases"] == 0 and f["num_allocs"] == 800


def test_fallback_large_request_gets_own_segment_and_empty_cache_releases() -> None:
    a = make()
    small = a.malloc(KIB)
    big = a.malloc(5 * MIB)
    f = a.stats()["fallback"]
    assert f["segment_allocs"] == 2 and f["reserved_bytes"] == MIB + 6 * MIB  # rounded to 2 MiB
    a.free(big)
    assert a.empty_cache() == 6 * MIB  # the wholly free segment goes back
    f = a.stats()["fallback"]
    assert f["segment_releases"] == 1 and f["reserved_bytes"] == MIB
    assert a.empty_cache() == 0  # the segment holding `small` stays
    a.free(small)
    assert a.empty_cache() == MIB


def test_fragmentation_accounting_reserved_vs_allocated() -> None:
    a = make()
    ptrs = [a.malloc(64 * KIB) for _ in range(16)]  # fills the 1 MiB segment
    for p in ptrs[::2]:
        a.free(p)
    f = a.stats()["fallback"]
    assert f["allocated_bytes"] == 8 * 64 * KIB
    assert f["reserved_bytes"] == MIB
    assert f["reserved_bytes"] - f["allocated_bytes"] == 8 * 64 * KIB
    assert f["largest_free_block"] == 64 * KIB  # fragmented: 8 holes of 64 KiB
    # 128 KiB does not fit any hole: a new segment even though 512 KiB are free.
    p = a.malloc(128 * KIB)
    assert a.stats()["fallback"]["segment_allocs"] == 2
    for q in [*ptrs[1::2], p]:
        a.free(q)
    assert a.stats()["fallback"]["allocated_bytes"] == 0


def test_fallback_limit_error_has_numbers() -> None:
    a = make(limit=2 * MIB)
    a.set_phase("layer.fwd[1]")
    a.malloc(MIB)
    with pytest.raises(A.OutOfMemory) as info:
        a.malloc(3 * MIB)
    msg = str(info.value)
    assert "fallback" in msg and "layer.fwd[1]" in msg
    assert str(3 * MIB) in msg and "limit 2097152" in msg and "reserved 1048576" in msg
    assert isinstance(info.value, RuntimeError)


def test_fallback_limit_releases_free_segments_first() -> None:
    a = make(limit=2 * MIB)
    p = a.malloc(2 * MIB)
    a.free(p)
    q = a.malloc(MIB + 1)  # the cached 2 MiB block serves it
    a.free(q)
    a.set_min_segment(4 * MIB)
    with pytest.raises(A.OutOfMemory):
        a.malloc(3 * MIB)
    a.malloc(512)  # the free 2 MiB segment is still there to serve small requests


def test_invalid_free_is_counted_not_fatal() -> None:
    a = make()
    a.free(12345 * 4096)
    assert a.stats()["invalid_frees"] == 1


# ---------------------------------------------------------------- planned arena


def tables_two_layers() -> dict[str, list[tuple[int, int | None]]]:
    return {
        "layer.fwd[0]": [(4096, 0), (1000, 4096), (8192, None)],
        "layer.fwd[1]": [(4096, 0), (1000, 4096)],
    }


def test_planned_hits_and_offsets() -> None:
    a = make()
    a.load_plan(tables_two_layers(), 8192)
    s = a.stats()
    assert s["arena_bytes"] == 8192 and s["arena_reservations"] == 1
    a.set_phase("layer.fwd[0]")
    p0 = a.malloc(4096)
    p1 = a.malloc(1000)
    p2 = a.malloc(8192)  # offset None: fallback, not a deviation
    assert p1 - p0 == 4096 and p0 % 4096 == 0
    for p in (p0, p1, p2):
        a.free(p)
    a.set_phase("layer.fwd[1]")
    assert a.malloc(4096) == p0  # same offsets reused by the next layer
    s = a.stats()
    assert s["planned_hits"] == 3 and s["unplanned_requests"] == 1 and s["deviations"] == 0
    assert s["arena_high_water"] == 5096


def test_outside_phases_goes_to_fallback() -> None:
    a = make()
    a.load_plan(tables_two_layers(), 8192)
    p = a.malloc(4096)
    assert not (a.stats()["planned_hits"])
    a.set_phase("optimizer")  # phase without a table
    a.malloc(4096)
    s = a.stats()
    assert s["unplanned_requests"] == 2 and s["deviations"] == 0
    a.free(p)


def test_size_deviation_sends_rest_of_phase_to_fallback() -> None:
    a = make()
    a.load_plan(tables_two_layers(), 8192)
    a.set_phase("layer.fwd[0]")
    a.malloc(2048)  # expected 4096
    a.malloc(1000)  # in sync by size, but the phase instance already deviated
    s = a.stats()
    assert s["planned_hits"] == 0 and s["deviations"] == 2
    assert s["first_deviation"] == {"phase": "layer.fwd[0]", "index": 0, "expected": 4096, "actual": 2048,
                                    "reason": "size"}
    a.set_phase("layer.fwd[1]")  # the next phase is in sync again
    a.malloc(4096)
    assert a.stats()["planned_hits"] == 1
    assert a.take_deviation_report()["index"] == 0
    assert a.take_deviation_report() is None  # reported once


def test_count_deviation() -> None:
    a = make()
    a.load_plan(tables_two_layers(), 8192)
    a.set_phase("layer.fwd[1]")
    a.malloc(4096)
    a.malloc(1000)
    a.malloc(64)
    s = a.stats()
    assert s["planned_hits"] == 2 and s["deviations"] == 1
    assert s["first_deviation"]["reason"] == "count" and s["first_deviation"]["expected"] == 0


def test_live_slot_is_never_handed_out_again() -> None:
    a = make()
    a.load_plan(tables_two_layers(), 8192)
    a.set_phase("layer.fwd[0]")
    kept = a.malloc(4096)  # kept alive past its planned lifetime
    a.set_phase("layer.fwd[1]")
    other = a.malloc(4096)  # planned at the same offset: must not alias `kept`
    in_sync = a.malloc(1000)  # order still in sync: served from the plan
    assert other != kept and not (kept <= other < kept + 4096)
    s = a.stats()
    assert s["slot_busy"] == 1 and s["deviations"] == 1 and s["planned_hits"] == 2
    assert in_sync == kept + 4096
    a.free(kept)
    a.set_phase("layer.fwd[1]")
    assert a.malloc(4096) == kept  # free again: planned
    a.free(other)


def test_partial_overlap_is_detected() -> None:
    a = make()
    a.load_plan({"layer.fwd[0]": [(8192, 0)], "layer.fwd[1]": [(1024, 4096)]}, 8192)
    a.set_phase("layer.fwd[0]")
    big = a.malloc(8192)
    a.set_phase("layer.fwd[1]")
    small = a.malloc(1024)
    assert not (big <= small < big + 8192)
    assert a.stats()["slot_busy"] == 1


def test_frees_found_by_pointer_after_unload() -> None:
    a = make()
    a.load_plan(tables_two_layers(), 8192)
    a.set_phase("layer.fwd[0]")
    p = a.malloc(4096)
    a.unload_plan()  # the arena is retired, not released, while p lives
    s = a.stats()
    assert s["retired_arenas"] == 1 and s["arena_releases"] == 0 and a.owns(p)
    a.free(p)
    s = a.stats()
    assert s["retired_arenas"] == 0 and s["arena_releases"] == 1 and s["invalid_frees"] == 0


def test_poison_fills_freed_planned_memory() -> None:
    a = make()
    a.load_plan(tables_two_layers(), 8192)
    a.set_poison(True)
    a.set_phase("layer.fwd[0]")
    p = a.malloc(4096)
    assert ctypes.string_at(p, 16) == b"\xff" * 16  # idle arena poisoned at set_poison
    ctypes.memset(p, 0, 4096)
    a.free(p)
    assert ctypes.string_at(p, 4096) == b"\xff" * 4096
    assert torch.frombuffer(bytearray(ctypes.string_at(p, 16)), dtype=torch.float32).isnan().all()


def test_logging_records_phases_and_ids() -> None:
    a = make()
    a.start_logging()
    p = a.malloc(100)
    a.set_phase("layer.bwd[2]")
    q = a.malloc(200)
    a.free(p)
    a.free(q)
    events, names = a.stop_logging()
    assert names == ["layer.bwd[2]"]
    assert events == [(True, 0, 100, -1), (True, 1, 200, 0), (False, 0, 0, 0), (False, 1, 0, 0)]


def test_arena_reservation_failure_has_numbers() -> None:
    a = make()
    huge = (1 << 62) - 4096  # the largest peak the core takes (NOTE [Byte counts are bounded])
    with pytest.raises(A.OutOfMemory, match=re.escape(str(huge))):
        a.load_plan({"layer.fwd[0]": [(4096, 0)]}, huge)
    assert not a.has_plan()


#: Plan tables the core refuses, and its message (NOTE [Plan tables are checked in the core]);
#: tests/allocator/test_cuda_build.py checks the CUDA library gives the same ones.
CORE_TABLE_ERRORS = [
    ({"layer.fwd[0]": [(0, 0)]}, 4096, "size must be a positive int"),
    ({"layer.fwd[0]": [(4096, 100)]}, 8192, "multiple of 512"),
    ({"layer.fwd[0]": [(4096, 4096)]}, 6000, "exceeds the plan's peak"),
    ({"layer.fwd[0]": [(4096, -5)]}, 8192, "offset must be an int >= 0"),
    ({"": [(4096, 0)]}, 8192, "non-empty phase names"),
    ({"layer.fwd[0]": [(4096, 0)]}, -1, "peak must be"),
]


@pytest.mark.parametrize(
    ("tables", "peak", "pattern"),
    [
        *CORE_TABLE_ERRORS,
        # What the Python side's conversion refuses before the core sees it.
        ({"layer.fwd[0]": [(4096,)]}, 8192, r"\(size, offset-or-None\)"),
        ({"layer.fwd[0]": [("4096", 0)]}, 8192, "size must be a positive int"),
    ],
)
def test_bad_tables_are_clear_errors(tables: dict, peak: int, pattern: str) -> None:
    with pytest.raises(MemoError, match=pattern):
        with ma.planned(tables, peak=peak):
            pass
    assert not _C.allocator.cpu_installed()


def test_bad_tables_native_check() -> None:
    a = make()
    with pytest.raises(A.AllocatorError, match="exceeds the plan's peak"):
        a.load_plan({"layer.fwd[0]": [(4096, 4096)]}, 6000)
    with pytest.raises(A.AllocatorError, match="multiple of 512"):
        a.load_plan({"layer.fwd[0]": [(4096, 100)]}, 8192)


def test_plan_input_forms() -> None:
    t = {"layer.fwd[0]": [(4096, 0)]}
    assert ma.normalize_plan({"tables": t, "peak": 4096}) == (t, 4096)
    assert ma.normalize_plan(t, peak=4096) == (t, 4096)

    class FakePlan:
        peak = 4096

        def phase_tables(self) -> dict:
            return t

    assert ma.normalize_plan(FakePlan()) == (t, 4096)
    with pytest.raises(MemoError, match="peak"):
        ma.normalize_plan(t)
    with pytest.raises(MemoError, match="expected a memo.planner.Plan"):
        ma.normalize_plan([1, 2])


def test_requests_from_other_threads_are_unplanned() -> None:
    import threading

    a = make()
    a.load_plan(tables_two_layers(), 8192)
    a.start_logging()
    a.set_phase("layer.fwd[0]")
    got: list[int] = []
    worker = threading.Thread(target=lambda: got.append(a.malloc(4096)))
    worker.start()
    worker.join()
    p = a.malloc(4096)  # the phase's own thread still gets request 0's slot
    s = a.stats()
    assert s["other_thread_requests"] == 1 and s["planned_hits"] == 1 and s["deviations"] == 0
    events, _ = a.stop_logging()
    assert events[0][3] == -1 and events[1][3] == 0  # the worker's request carries no phase
    a.free(p)
    a.free(got[0])


def test_concurrent_malloc_free_is_consistent() -> None:
    import random
    import threading

    a = make(min_segment=256 * KIB)
    a.load_plan(tables_two_layers(), 8192)
    a.set_phase("layer.fwd[0]")
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        live: list[int] = []
        try:
            for _ in range(3000):
                if live and rng.random() < 0.5:
                    a.free(live.pop(rng.randrange(len(live))))
                else:
                    live.append(a.malloc(rng.choice((512, 4096, 70000, 300000))))
            for p in live:
                a.free(p)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = a.stats()
    assert s["bytes_in_use"] == 0 and s["invalid_frees"] == 0 and s["fallback"]["live_blocks"] == 0
    a.empty_cache()
    assert a.stats()["fallback"]["reserved_bytes"] == 0
