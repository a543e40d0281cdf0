"""One device pool: the fallback borrows idle arena ranges.

NOTE [One device pool] in csrc/core/planned_allocator.h.

The plan's arena and the fallback share the device budget. A request the fallback cannot serve
within its limit is served from a range of the current arena that no live planned block and no
other borrowed block overlaps; a planned request whose slot overlaps a live borrowed block goes to
the fallback as a deviation. Most tests drive a standalone core PlannedAllocator over host memory
(its own fallback pool, so the numbers are exact); the last ones go through PyTorch's CPU tensors.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import memo.allocator as ma
from memo import _C
from tests.allocator.test_allocator_e2e import Run, assert_same, make_plan, profile, reference
from tests.allocator.test_allocator_streams import HappensBefore, Log

A = _C.allocator
KIB = 1024
MIB = 1 << 20
ALIGN = A.BLOCK_ALIGNMENT
LENT = "arena range lent to an unplanned request"  # kReasonSlotLent in csrc/core/planned_allocator.h


def round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def full_fallback(limit: int = MIB, tables: dict | None = None, peak: int = 256 * KIB) -> tuple:
    """An allocator whose fallback pool is exactly full: the next fallback request must borrow."""
    a = A.PlannedAllocator(limit, limit)  # one segment of `limit` bytes is all the pool may hold
    a.load_plan(tables if tables is not None else {"a": [(64 * KIB, 0)]}, peak)
    filler = a.malloc(limit)
    f = a.stats()["fallback"]
    assert f["reserved_bytes"] == limit and f["allocated_bytes"] == limit
    return a, filler


def in_arena(a: A.PlannedAllocator, ptr: int) -> bool:
    base, size = a.arena_extent()
    return base <= ptr < base + size


# ---------------------------------------------------------------- borrowing


def test_request_over_the_limit_is_served_from_an_idle_arena_range() -> None:
    a, filler = full_fallback()
    base, arena = a.arena_extent()
    assert arena == 256 * KIB and base % 4096 == 0
    p = a.malloc(100 * KIB + 1)  # unplanned (no phase); the fallback is at its limit
    assert p == base  # the whole arena is idle: best fit is its one gap, from offset 0
    assert a.owns(p)
    s = a.stats()
    borrowed = round_up(100 * KIB + 1)
    assert s["borrowed_allocs"] == 1 and s["borrowed_blocks"] == 1
    assert s["borrowed_bytes"] == borrowed and s["peak_borrowed_bytes"] == borrowed
    assert s["fallback_requests"] == 2 and s["unplanned_requests"] == 2 and s["deviations"] == 0
    f = s["fallback"]
    assert f["allocated_bytes"] == MIB and f["reserved_bytes"] == MIB  # the pool did not grow
    assert s["arena_in_use"] == borrowed and s["arena_high_water"] == 0  # high water: planned slots only
    # Counted once: in use = fallback + borrowed; the device holds the arena + the pool, nothing more.
    assert s["bytes_in_use"] == MIB + borrowed and s["peak_bytes_in_use"] == MIB + borrowed
    assert s["device_reserved_bytes"] == MIB + arena and s["peak_device_reserved_bytes"] == MIB + arena
    a.free(p)
    s = a.stats()
    assert s["borrowed_blocks"] == 0 and s["borrowed_bytes"] == 0 and s["peak_borrowed_bytes"] == borrowed
    assert s["bytes_in_use"] == MIB and s["frees"] == 1 and s["invalid_frees"] == 0 and not a.owns(p)
    a.free(filler)


def test_fallback_within_its_limit_does_not_borrow() -> None:
    a = A.PlannedAllocator(MIB, 2 * MIB)
    a.load_plan({"a": [(64 * KIB, 0)]}, 256 * KIB)
    p = a.malloc(MIB)
    q = a.malloc(MIB)  # a second segment, still within the 2 MiB limit
    assert not in_arena(a, p) and not in_arena(a, q)
    assert a.stats()["borrowed_allocs"] == 0


def test_without_a_limit_nothing_is_borrowed() -> None:
    a = A.PlannedAllocator(MIB, 0)  # 0: no limit (memo.allocator.planned(fallback_limit=None))
    a.load_plan({"a": [(64 * KIB, 0)]}, 256 * KIB)
    ptrs = [a.malloc(MIB) for _ in range(4)]
    s = a.stats()
    assert s["borrowed_allocs"] == 0 and s["fallback"]["reserved_bytes"] == 4 * MIB
    assert not any(in_arena(a, p) for p in ptrs)


def test_borrowing_keeps_the_pools_cached_segments() -> None:
    """Releasing the pool's free segments cannot make room for this request: they stay cached
    (on CUDA a release synchronises the device) and the request borrows."""
    a = A.PlannedAllocator(256 * KIB, MIB)
    a.load_plan({"a": [(64 * KIB, 0)]}, 512 * KIB)
    a.malloc(768 * KIB)  # its own segment, exactly 768 KiB (2 MiB would pass the limit)
    a.free(a.malloc(256 * KIB))  # a second segment of 256 KiB, now wholly free
    f = a.stats()["fallback"]
    assert f["reserved_bytes"] == MIB and f["segment_allocs"] == 2
    p = a.malloc(300 * KIB)  # 768 KiB + 300 KiB > 1 MiB even without the free segment
    assert in_arena(a, p)
    s = a.stats()
    assert s["borrowed_allocs"] == 1 and s["fallback"]["segment_releases"] == 0
    assert s["fallback"]["reserved_bytes"] == MIB
    q = a.malloc(200 * KIB)  # the cached segment serves it
    assert not in_arena(a, q) and a.stats()["fallback"]["segment_allocs"] == 2


def test_best_fit_between_live_planned_blocks_aligned() -> None:
    tables = {"a": [(8 * KIB, 8 * KIB), (1000, 20 * KIB), (8 * KIB, 40 * KIB)]}
    a, _ = full_fallback(tables=tables, peak=64 * KIB)
    base, _ = a.arena_extent()
    a.set_phase("a")
    planned = [a.malloc(8 * KIB), a.malloc(1000), a.malloc(8 * KIB)]
    assert [p - base for p in planned] == [8 * KIB, 20 * KIB, 40 * KIB]
    a.set_phase(None)
    # Idle gaps: [0, 8K) 8K, [16K, 20K) 4K, [20K + 1024, 40K) 19K (after the 1000-byte slot, aligned),
    # [48K, 64K) 16K.
    assert a.malloc(10 * KIB) - base == 48 * KIB  # best fit: the 16K gap, not the 19K one
    assert a.malloc(3 * KIB) - base == 16 * KIB  # the 4K gap
    assert a.malloc(7 * KIB + 1) - base == 0  # rounds to 7.5K: the 8K gap
    assert a.malloc(19 * KIB) - base == 20 * KIB + 1024  # the gap after the unaligned planned end
    s = a.stats()
    assert s["borrowed_allocs"] == 4 and s["planned_hits"] == 3
    assert s["borrowed_bytes"] == 10 * KIB + 3 * KIB + round_up(7 * KIB + 1) + 19 * KIB


def test_planned_slot_lent_to_an_unplanned_request_goes_to_the_fallback() -> None:
    a, filler = full_fallback(tables={"a": [(64 * KIB, 0), (32 * KIB, 64 * KIB)]}, peak=128 * KIB)
    base, _ = a.arena_extent()
    lent = a.malloc(48 * KIB)  # borrowed at offset 0: covers most of a[0]'s slot
    assert lent == base
    a.free(filler)  # the pool has room again for the deviating request
    a.set_phase("a")
    p0 = a.malloc(64 * KIB)  # its slot [0, 64K) overlaps the borrowed block
    p1 = a.malloc(32 * KIB)  # the order is still in sync: a[1] keeps its slot
    assert not in_arena(a, p0) and p1 == base + 64 * KIB
    s = a.stats()
    assert s["slot_lent"] == 1 and s["slot_busy"] == 0 and s["deviations"] == 1 and s["planned_hits"] == 1
    assert s["first_deviation"] == {"phase": "a", "index": 0, "expected": 64 * KIB, "actual": 64 * KIB,
                                    "reason": LENT}
    assert a.take_deviation_report()["reason"] == LENT
    a.free(lent)
    a.free(p0)
    a.set_phase("a")
    assert a.malloc(64 * KIB) == base  # returned: the slot is the plan's again


def test_deviating_request_may_borrow_too() -> None:
    """A lent slot's request goes to the fallback; with the pool full it borrows another idle range."""
    a, _ = full_fallback(tables={"a": [(64 * KIB, 0)]}, peak=192 * KIB)
    base, _ = a.arena_extent()
    lent = a.malloc(32 * KIB)
    a.set_phase("a")
    p = a.malloc(64 * KIB)
    assert p == base + 32 * KIB  # best fit: the one gap after the borrowed block
    s = a.stats()
    assert s["slot_lent"] == 1 and s["borrowed_allocs"] == 2 and s["borrowed_blocks"] == 2
    assert not (lent <= p < lent + 32 * KIB)


def test_out_of_memory_when_no_idle_range_holds_the_request() -> None:
    a, _ = full_fallback(tables={"a": [(64 * KIB, 64 * KIB)]}, peak=192 * KIB)
    a.set_phase("a")
    a.malloc(64 * KIB)  # planned at [64K, 128K): idle gaps of 64K on each side
    a.set_phase("layer.fwd[3]")  # a phase without a table: unplanned
    a.malloc(16 * KIB)  # borrowed at 0
    with pytest.raises(A.OutOfMemory) as info:
        a.malloc(100 * KIB)
    msg = str(info.value)
    assert "layer.fwd[3]" in msg and "fallback limit is reached" in msg
    assert f"request of {100 * KIB} B" in msg  # requested
    assert f"allocated {MIB} B" in msg and f"limit {MIB} B" in msg  # the pool's use and what it may hold
    assert "idle ranges of the plan's arena were tried" in msg
    assert f"arena {192 * KIB} B" in msg and f"{64 * KIB} B (0.0625 MiB) in live planned blocks" in msg
    assert f"{16 * KIB} B (0.015625 MiB) lent" in msg and f"largest idle range {64 * KIB} B" in msg
    assert f"in use in all {MIB + 80 * KIB} B" in msg
    assert msg.endswith("Raise the fallback limit, or re-profile so that the plan covers these requests.")
    s = a.stats()
    assert s["borrowed_allocs"] == 1 and s["requests"] == 4 and s["fallback_requests"] == 2
    assert a.malloc(64 * KIB) is not None  # a request that fits a gap still succeeds


def test_out_of_memory_without_an_arena_keeps_the_fallback_message() -> None:
    a = A.PlannedAllocator(MIB, MIB)
    a.malloc(MIB)
    with pytest.raises(A.OutOfMemory) as info:
        a.malloc(MIB)
    msg = str(info.value)
    assert f"request of {MIB} B" in msg and "arena" not in msg
    assert re.search(r"limit 1048576 B .*\. Raise the fallback limit", msg)


def test_retired_arena_keeps_borrowed_blocks() -> None:
    a, filler = full_fallback()
    p = a.malloc(100 * KIB)
    assert in_arena(a, p)
    a.load_plan({"a": [(64 * KIB, 0)]}, 256 * KIB)  # same size, but a borrowed block lives: not reused
    s = a.stats()
    assert s["retired_arenas"] == 1 and s["arena_reservations"] == 2 and s["arena_releases"] == 0
    assert not in_arena(a, p) and a.owns(p)
    assert s["device_reserved_bytes"] == MIB + 2 * 256 * KIB and s["borrowed_bytes"] == 100 * KIB
    q = a.malloc(8 * KIB)  # borrows from the new arena, never from the retired one
    assert in_arena(a, q)
    a.unload_plan()
    assert a.stats()["retired_arenas"] == 2
    with pytest.raises(A.OutOfMemory, match=f"request of {KIB} B"):  # no arena now: nothing to borrow
        a.malloc(KIB)
    a.free(p)
    a.free(q)
    s = a.stats()
    assert s["retired_arenas"] == 0 and s["arena_releases"] == 2 and s["invalid_frees"] == 0
    assert s["borrowed_blocks"] == 0 and s["device_reserved_bytes"] == MIB
    a.free(filler)


def test_poisoned_free_of_a_borrowed_block() -> None:
    import ctypes

    a, _ = full_fallback()
    a.set_poison(True)
    p = a.malloc(4 * KIB)
    ctypes.memset(p, 0, 4 * KIB)
    a.free(p)  # back to the idle arena: poisoned like a freed planned slot
    assert ctypes.string_at(p, 4 * KIB) == b"\xff" * (4 * KIB)


def test_reset_stats_keeps_live_borrowed_bytes() -> None:
    a, _ = full_fallback()
    p = a.malloc(8 * KIB)
    a.malloc(4 * KIB)
    a.free(p)
    a.reset_stats()
    s = a.stats()
    assert s["borrowed_allocs"] == 0 and s["borrowed_blocks"] == 1 and s["borrowed_bytes"] == 4 * KIB
    assert s["peak_borrowed_bytes"] == 4 * KIB and s["peak_bytes_in_use"] == MIB + 4 * KIB


# ---------------------------------------------------------------- no overlap, ever


@pytest.mark.parametrize("seed", range(6))
def test_random_requests_never_overlap(seed: int) -> None:
    """Random planned and unplanned requests over a small pool and a plan whose slots overlap across
    phases: every live block is disjoint from every other, each request is served where the rule says
    (planned at its offset, borrowed inside the arena, fallback outside it), an out-of-memory error
    comes only when no idle arena range holds the request, and the counters match the model."""
    rng = random.Random(seed)
    limit = 256 * KIB
    a = A.PlannedAllocator(64 * KIB, limit)
    sizes = [rng.choice([4 * KIB, 16 * KIB, 40 * KIB, 3000]) for _ in range(16)]
    tables: dict[str, list[tuple[int, int | None]]] = {}
    peak = 192 * KIB
    for phase in ("p0", "p1"):
        tables[phase] = [(n, rng.randrange(0, (peak - n) // ALIGN + 1) * ALIGN) for n in sizes]
    a.load_plan(tables, peak)
    base, arena = a.arena_extent()
    live: dict[int, tuple[int, str]] = {}  # ptr -> (size, "planned" | "borrowed" | "fallback")
    ooms = 0
    phase, index = None, 0
    for step in range(1500):
        if step % 9 == 0:
            phase = rng.choice(["p0", "p1", None])
            a.set_phase(phase)
            index = 0
        if live and (rng.random() < 0.45 or len(live) > 24):
            ptr = rng.choice(list(live))
            del live[ptr]
            a.free(ptr)
            continue
        size = sizes[index % len(sizes)] if rng.random() < 0.8 else rng.choice([512, 20 * KIB, 90 * KIB])
        before = a.stats()
        try:
            ptr = a.malloc(size)
        except A.OutOfMemory:
            ooms += 1
            gaps = idle_gaps(base, arena, [(p, n) for p, (n, _) in live.items() if base <= p < base + arena])
            assert all(e - b < round_up(size) for b, e in gaps), "an idle range would have held it"
            continue
        finally:
            index += 1
        after = a.stats()
        if after["planned_hits"] > before["planned_hits"]:
            kind = "planned"
            assert ptr == base + tables[phase][index - 1][1]  # request index - 1 of this phase
        elif after["borrowed_allocs"] > before["borrowed_allocs"]:
            kind = "borrowed"
            assert base <= ptr and ptr + round_up(size) <= base + arena
        else:
            kind = "fallback"
            assert not (base <= ptr < base + arena)
        assert ptr % ALIGN == 0
        live[ptr] = (size, kind)
        check_disjoint(live)
        check_counters(a, live, base, arena, limit)
    s = a.stats()
    assert s["borrowed_allocs"] > 0 and s["slot_lent"] > 0 and s["planned_hits"] > 0 and ooms > 0
    for ptr in list(live):
        a.free(ptr)
    s = a.stats()
    assert s["bytes_in_use"] == 0 and s["borrowed_blocks"] == 0 and s["invalid_frees"] == 0


def idle_gaps(base: int, arena: int, blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    gaps, cursor = [], 0
    for ptr, size in sorted(blocks):
        start = round_up(cursor)
        if ptr - base > start:
            gaps.append((start, ptr - base))
        cursor = max(cursor, ptr - base + size)
    if arena > round_up(cursor):
        gaps.append((round_up(cursor), arena))
    return gaps


def check_disjoint(live: dict[int, tuple[int, str]]) -> None:
    spans = sorted((p, p + (n if kind == "planned" else round_up(n))) for p, (n, kind) in live.items())
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start, "two live blocks overlap"


def check_counters(a: A.PlannedAllocator, live: dict, base: int, arena: int, limit: int) -> None:
    s = a.stats()
    borrowed = [round_up(n) for n, kind in live.values() if kind == "borrowed"]
    assert s["borrowed_blocks"] == len(borrowed) and s["borrowed_bytes"] == sum(borrowed)
    in_use = sum(n if kind == "planned" else round_up(n) for n, kind in live.values())
    assert s["bytes_in_use"] == in_use
    assert s["fallback"]["reserved_bytes"] <= limit  # the pool never grows past its limit ...
    assert s["device_reserved_bytes"] == arena + s["fallback"]["reserved_bytes"]  # ... borrowing adds nothing
    assert s["bytes_in_use"] <= s["device_reserved_bytes"] and s["peak_bytes_in_use"] >= in_use


# ---------------------------------------------------------------- stream safety


def test_borrowed_range_waits_for_the_slot_freed_on_another_stream() -> None:
    h = A.StreamTestHarness(MIB, MIB)
    h.load_plan({"a": [(64 * KIB, 0)]}, 64 * KIB)
    base, _ = h.arena_extent()
    log = Log()
    h.set_phase("a")
    slot = h.allocate(64 * KIB, 1)
    h.free(slot)
    h.set_phase(None)
    h.allocate(MIB, 0)  # fills the pool
    log.read(h)
    p = h.allocate(16 * KIB, 2)  # borrowed over the slot stream 1 freed
    assert p == base and h.stats()["borrowed_allocs"] == 1
    assert log.read(h) == {"records": [1], "waits": [(2, 1)]}
    h.free(p)
    h.set_phase("a")
    # The slot again: it waits for the borrower (its head) and for stream 1 (its tail).
    assert h.allocate(64 * KIB, 3) == base
    assert sorted(log.read(h)["waits"]) == [(3, 1), (3, 2)]


@pytest.mark.parametrize("seed", range(4))
def test_random_borrowing_is_always_ordered(seed: int) -> None:
    """Random requests on five streams with a fallback pool that is often full: borrowed ranges and
    planned slots hand bytes back and forth, and every cross-stream reuse is ordered."""
    rng = random.Random(seed)
    h = A.StreamTestHarness(64 * KIB, 128 * KIB)
    sizes = [rng.choice([4 * KIB, 16 * KIB, 32 * KIB]) for _ in range(10)]
    peak = 128 * KIB
    h.load_plan({"p": [(n, rng.randrange(0, (peak - n) // ALIGN + 1) * ALIGN) for n in sizes]}, peak)
    model = HappensBefore()
    live: list[tuple[int, int, int]] = []
    for step in range(800):
        if step % len(sizes) == 0:
            h.set_phase(rng.choice(["p", None]))
        if live and (rng.random() < 0.5 or len(live) > 10):
            ptr, size, stream = live.pop(rng.randrange(len(live)))
            h.free(ptr)
            model.free(ptr, size, stream)
        else:
            size, stream = sizes[step % len(sizes)], rng.randrange(5)
            try:
                ptr = h.allocate(size, stream)
            except A.OutOfMemory:
                model.absorb(h)
                continue
            model.absorb(h)
            model.check_allocation(ptr, round_up(size), stream)
            live.append((ptr, round_up(size), stream))
        if rng.random() < 0.02:
            h.complete(rng.randrange(5))
    s = h.stats()
    assert s["borrowed_allocs"] > 0 and s["planned_hits"] > 0 and s["stream_waits"] > 0


# ---------------------------------------------------------------- through PyTorch (CPU)


def fallback_headroom_limit(extra: int) -> int:
    """A fallback limit that leaves the process-wide CPU pool `extra` bytes beyond what it holds now.

    The CPU allocator is one per process: earlier tests may have left live blocks in it."""
    ma.empty_cache()
    return ma.stats()["fallback"]["reserved_bytes"] + extra


def test_python_stats_expose_the_borrowed_counters() -> None:
    s = ma.stats()
    for key in ("slot_lent", "borrowed_allocs", "borrowed_blocks", "borrowed_bytes", "peak_borrowed_bytes",
                "device_reserved_bytes", "peak_device_reserved_bytes"):
        assert isinstance(s[key], int), key


def test_training_like_sequence_under_a_budget_borrows() -> None:
    """forward (planned activation) -> optimizer state outside phases, larger than the pool's room ->
    backward, whose slot the state now lies on: the state is borrowed from the idle arena, the
    backward request deviates to the pool, and the numbers match plain PyTorch."""
    n = 64 * KIB  # floats: 256 KiB per activation
    act = 4 * n
    w = torch.randn(n)
    want_state = w * 2 + 1
    want = (w.sin() * want_state).sum()
    tables = {"layer.fwd[0]": [(act, 0)], "layer.bwd[0]": [(act, act)]}
    largest = ma.stats()["fallback"]["largest_free_block"]
    state_bytes = round_up(max(2 * act, largest + act), 4096)  # fits no cached hole and passes the limit
    peak = act + state_bytes + act
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ma.planned(tables, peak=peak, fallback_limit=fallback_headroom_limit(act)):
            ma.set_phase("layer.fwd[0]")
            h = w.sin()  # planned at offset 0
            ma.set_phase(None)
            state = torch.empty(state_bytes // 4)  # "optimizer state": borrowed at offset `act`
            torch.mul(w, 2, out=state[:n]).add_(1)
            ma.set_phase("layer.bwd[0]")
            g = h * state[:n]  # its slot [act, 2 act) is lent to `state`: served by the pool
            ma.set_phase(None)
            got = g.sum()
            s = ma.stats()
            base, size = _C.allocator.library().device_allocator("cpu", 0).arena_extent()
            assert base <= state.data_ptr() < base + size
            assert not (base <= g.data_ptr() < base + size)
    assert torch.equal(got, want) and torch.equal(state[:n], want_state)
    assert s["planned_hits"] == 1 and s["borrowed_allocs"] >= 1 and s["slot_lent"] == 1
    assert s["first_deviation"]["reason"] == LENT
    dev = [w for w in caught if issubclass(w.category, ma.PlanDeviationWarning)]
    assert len(dev) == 1 and LENT in str(dev[0].message) and "larger fallback limit" in str(dev[0].message)
    # The tensors outlive the context: their arena is retired, and released with the last of them.
    assert ma.stats()["retired_arenas"] == 1
    del h, g, got
    assert ma.stats()["retired_arenas"] == 1  # `state`, borrowed, still holds it
    del state
    s = ma.stats()
    assert s["retired_arenas"] == 0 and s["borrowed_blocks"] == 0 and s["invalid_frees"] == 0


def test_model_training_under_a_budget_succeeds_thanks_to_borrowing() -> None:
    """The tiny model, profiled and planned, replayed with a fallback limit that leaves the pool about
    half of what a step's unplanned requests need: each borrowed allocation is one that failed with
    out-of-memory before the one device pool. Loss and gradients equal plain PyTorch's.

    The CPU pool is process-wide, and the holes earlier tests leave in it could serve a whole step,
    so that nothing is borrowed: the step runs in a fresh interpreter, whatever ran before."""
    root = Path(__file__).resolve().parents[2]
    code = (f"import sys; sys.path.insert(0, {str(root)!r}); "
            "from tests.allocator.test_fallback_borrows_arena import _train_under_a_budget; "
            "_train_under_a_budget(); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout + done.stderr)[-4000:]


def _train_under_a_budget() -> None:
    want = reference("tiny", 4)
    run = Run("tiny")
    try:
        run.step(0)
        trace, _ = profile(run, 1)
        del _
        plan = make_plan(trace)
        for p in run.model.parameters():
            p.grad = None
        ma.empty_cache()
        clean = ma.stats()["fallback"]
        with ma.planned(plan):  # measure: the pool's growth over one step, no limit
            assert_same(run.step(2), want[2])
            demand = ma.stats()["fallback"]["peak_allocated_bytes"] - clean["allocated_bytes"]
        for p in run.model.parameters():
            p.grad = None
        ma.empty_cache()
        clean = ma.stats()["fallback"]
        cached = clean["reserved_bytes"] - clean["allocated_bytes"]  # holes earlier tests left in the pool
        assert cached + ALIGN < demand, f"a fresh pool caches {cached} B, more than a step needs ({demand} B)"
        limit = clean["reserved_bytes"] + max(ALIGN, round_up(demand // 2) - cached)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ma.PlanDeviationWarning)  # lent slots deviate, by design
            with ma.planned(plan, fallback_limit=limit):
                for i in (3, 2):  # no optimizer: a batch gives the same result every time
                    assert_same(run.step(i), want[i])
                s = ma.stats()
        assert s["borrowed_allocs"] > 0 and s["peak_borrowed_bytes"] > 0 and s["invalid_frees"] == 0
        assert s["fallback"]["peak_reserved_bytes"] <= limit
        assert s["peak_device_reserved_bytes"] <= s["arena_bytes"] + limit  # the budget held
        assert s["peak_bytes_in_use"] <= s["peak_device_reserved_bytes"]
        # At its peak the step held more than the pool could: the difference was lent by the arena.
        assert s["peak_bytes_in_use"] - clean["allocated_bytes"] > limit - clean["reserved_bytes"] + cached
    finally:
        run.close()
    for p in run.model.parameters():  # gradients outlive the context; a borrowed one keeps its arena retired
        p.grad = None
    s = ma.stats()
    assert s["retired_arenas"] == 0 and s["borrowed_blocks"] == 0 and s["invalid_frees"] == 0
