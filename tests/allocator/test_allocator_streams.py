"""Stream-safe reuse in the native allocator core (NOTE [Stream-safe reuse], csrc/core/stream_order.h).

``memo._C.allocator.StreamTestHarness`` is a core PlannedAllocator over host memory whose backend
has fake streams (plain ints) and logs every stream hook the core calls. The rule under test:
memory freed by its owner on stream T and handed to a request on stream S != T makes S wait on an
event recorded on T; same-stream reuse makes no call at all. The randomized test replays the log
against a happens-before model, so it fails for any missing wait, not only for the cases spelled
out here.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict

import pytest
import torch

import memo.allocator._backends as backends
from memo import _C
from memo.errors import MemoError

A = _C.allocator
KIB = 1024
MIB = 1 << 20
GRANULE = A.BLOCK_ALIGNMENT


class Log:
    """The harness's calls, read as facts about streams: who waited on which stream's event."""

    def __init__(self) -> None:
        self.event_stream: dict[int, int] = {}

    def read(self, h: A.StreamTestHarness) -> dict[str, list]:
        out: dict[str, list] = defaultdict(list)
        for call, a, b in h.take_calls():
            if call == "record_event":
                self.event_stream[b] = a
                out["records"].append(a)  # the stream the event was recorded on
            elif call == "stream_wait_event":
                out["waits"].append((a, self.event_stream[b]))  # (waiting stream, stream waited for)
            elif call == "event_done":
                out["queries"].append((self.event_stream[a], bool(b)))
            else:
                assert call == "destroy_event", call
                out["destroyed"].append(b)
        return dict(out)


def harness() -> A.StreamTestHarness:
    return A.StreamTestHarness(MIB, 0)


# ---------------------------------------------------------------- fallback blocks


@pytest.mark.parametrize("stream", [0, 7])
def test_same_stream_reuse_makes_no_call(stream: int) -> None:
    h = harness()
    p = h.allocate(4 * KIB, stream)
    h.free(p)
    assert h.allocate(4 * KIB, stream) == p  # the freed block is reused at once...
    assert h.take_calls() == []  # ...with no event: stream order already serialises the owners
    s = h.stats()
    assert s["events_recorded"] == 0 and s["stream_waits"] == 0


def test_cross_stream_reuse_waits_on_an_event_recorded_on_the_freeing_stream() -> None:
    h = harness()
    p = h.allocate(4 * KIB, 1)
    h.free(p)
    assert h.take_calls() == []  # the event is recorded lazily, not at the free
    q = h.allocate(4 * KIB, 2)
    assert q == p
    assert h.take_calls() == [("record_event", 1, 1), ("stream_wait_event", 2, 1)]
    s = h.stats()
    assert s["events_recorded"] == 1 and s["stream_waits"] == 1
    # Stream 2 frees and reallocates: its own use needs nothing, and the remainder of the segment
    # (which still carries stream 1's use) is covered by the event stream 2 already waited on.
    h.free(q)
    assert h.allocate(4 * KIB, 2) == p
    assert h.take_calls() == []


def test_coalesced_block_makes_the_requester_wait_on_both_streams() -> None:
    h = harness()
    log = Log()
    a, b, c = h.allocate(64 * KIB, 1), h.allocate(64 * KIB, 2), h.allocate(64 * KIB, 1)
    h.free(a)
    h.free(b)  # coalesces with a: one free 128 KiB block that streams 1 and 2 used
    got = h.allocate(128 * KIB, 3)
    assert got == a  # best fit: the coalesced block, not the segment's unused tail
    calls = log.read(h)
    assert sorted(calls["waits"]) == [(3, 1), (3, 2)]
    assert sorted(calls["records"]) == [1, 2]
    assert h.stats()["stream_waits"] == 2
    h.free(c)


def test_split_remainder_keeps_its_streams() -> None:
    h = harness()
    log = Log()
    p = h.allocate(64 * KIB, 1)
    h.free(p)
    h.allocate(16 * KIB, 2)  # takes the head of the block stream 1 used; the rest stays free
    assert log.read(h)["waits"] == [(2, 1)]
    h.allocate(16 * KIB, 3)  # the remainder still carries stream 1's use: 3 waits too
    calls = log.read(h)
    assert calls["waits"] == [(3, 1)] and "records" not in calls  # stream 1's event is shared


def test_completed_events_are_dropped() -> None:
    h = harness()
    log = Log()
    blocks = []
    for _ in range(4):  # four 64 KiB blocks used by stream 1, kept apart by live separators
        blocks.append(h.allocate(64 * KIB, 1))
        h.allocate(512, 1)
    for p in blocks:
        h.free(p)
    assert h.allocate(64 * KIB, 2) == blocks[0]
    assert log.read(h) == {"records": [1], "waits": [(2, 1)]}
    # Not complete yet: the next stream waits on the same event, recorded after all four frees.
    assert h.allocate(64 * KIB, 3) == blocks[1]
    assert log.read(h) == {"queries": [(1, False)], "waits": [(3, 1)]}
    h.complete(1)  # stream 1's queued work has run
    assert h.allocate(64 * KIB, 4) == blocks[2]
    assert log.read(h) == {"queries": [(1, True)], "destroyed": [1]}  # no wait, event dropped
    assert h.live_events() == 0
    # Known complete now: the last block freed before that event needs no call at all.
    assert h.allocate(64 * KIB, 5) == blocks[3]
    assert h.take_calls() == []
    assert h.stats()["events_recorded"] == 1 and h.stats()["stream_waits"] == 2


# ---------------------------------------------------------------- planned arena slots


def planned(tables: dict[str, list[tuple[int, int | None]]], peak: int) -> A.StreamTestHarness:
    h = harness()
    h.load_plan(tables, peak)
    return h


def run_slot(h: A.StreamTestHarness, phase: str, size: int, stream: int) -> int:
    h.set_phase(phase)
    hits = h.stats()["planned_hits"]
    p = h.allocate(size, stream)
    assert h.stats()["planned_hits"] == hits + 1, f"{phase} was not served from the arena"
    return p


def test_planned_slot_reused_by_another_stream_waits() -> None:
    h = planned({"a": [(4 * KIB, 0)], "b": [(8 * KIB, 0)], "c": [(4 * KIB, 0)]}, 16 * KIB)
    log = Log()
    p = run_slot(h, "a", 4 * KIB, 1)
    h.free(p)
    q = run_slot(h, "b", 8 * KIB, 2)  # overlaps all of a's freed range
    assert q == p
    assert log.read(h) == {"records": [1], "waits": [(2, 1)]}
    h.free(q)
    # Stream 2's slot was cut out of stream 1's freed range and now stands for it: a new owner on
    # stream 1 waits for stream 2 only.
    run_slot(h, "c", 4 * KIB, 1)
    assert log.read(h) == {"records": [2], "waits": [(1, 2)]}


@pytest.mark.parametrize(
    ("offset", "waits"),
    [
        (4 * KIB, []),  # adjacent to the freed range: disjoint bytes, no wait
        (8 * KIB, []),  # far from it
        (3 * KIB + 512, [(2, 1)]),  # one 512-byte granule in common
        (0, [(2, 1)]),  # the same bytes
    ],
)
def test_planned_slot_waits_only_when_ranges_overlap(offset: int, waits: list[tuple[int, int]]) -> None:
    h = planned({"a": [(4 * KIB, 0)], "b": [(4 * KIB, offset)]}, 16 * KIB)
    log = Log()
    h.free(run_slot(h, "a", 4 * KIB, 1))
    run_slot(h, "b", 4 * KIB, 2)
    assert log.read(h).get("waits", []) == waits


def test_planned_slot_over_two_freed_ranges_waits_on_both_streams() -> None:
    h = planned({"a": [(4 * KIB, 0), (4 * KIB, 4 * KIB)], "b": [(8 * KIB, 0)]}, 8 * KIB)
    log = Log()
    h.set_phase("a")
    p1, p2 = h.allocate(4 * KIB, 1), h.allocate(4 * KIB, 2)
    h.free(p1)
    h.free(p2)
    run_slot(h, "b", 8 * KIB, 3)
    assert sorted(log.read(h)["waits"]) == [(3, 1), (3, 2)]


def test_planned_partial_overlap_leaves_the_rest_of_the_range_pending() -> None:
    h = planned({"a": [(8 * KIB, 0)], "b": [(4 * KIB, 0)], "c": [(4 * KIB, 4 * KIB)]}, 8 * KIB)
    log = Log()
    h.free(run_slot(h, "a", 8 * KIB, 1))
    run_slot(h, "b", 4 * KIB, 2)  # the head of a's bytes
    assert log.read(h)["waits"] == [(2, 1)]
    run_slot(h, "c", 4 * KIB, 3)  # the tail still carries stream 1's use
    assert log.read(h)["waits"] == [(3, 1)]


# ---------------------------------------------------------------- the rule, checked against a model


class HappensBefore:
    """Vector clocks over fake streams, fed by the allocator's calls.

    Each allocation and free is one unit of work queued on its stream. A reused byte is safe when
    its last owner's stream is the requester's, or the requester waited on an event recorded on
    that stream after the free, or such an event was reported complete.
    """

    def __init__(self) -> None:
        self.work: dict[int, int] = defaultdict(int)  # work items queued so far per stream
        self.seen: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.done: dict[int, int] = defaultdict(int)
        self.event_at: dict[int, tuple[int, int]] = {}  # event -> (stream, work covered)
        self.last_use: dict[int, tuple[int, int]] = {}  # granule address -> (stream, work at free)

    def absorb(self, h: A.StreamTestHarness) -> None:
        for call, a, b in h.take_calls():
            if call == "record_event":
                self.event_at[b] = (a, self.work[a])
            elif call == "stream_wait_event":
                stream, covered = self.event_at[b]
                self.seen[a][stream] = max(self.seen[a][stream], covered)
            elif call == "event_done" and b:
                stream, covered = self.event_at[a]
                self.done[stream] = max(self.done[stream], covered)

    def check_allocation(self, ptr: int, size: int, stream: int) -> None:
        for g in range(ptr, ptr + size, GRANULE):
            if g not in self.last_use:
                continue
            owner, at = self.last_use[g]
            safe = owner == stream or self.seen[stream][owner] >= at or self.done[owner] >= at
            assert safe, f"bytes at {g:#x} freed by stream {owner} handed to stream {stream} unordered"
        self.work[stream] += 1

    def free(self, ptr: int, size: int, stream: int) -> None:
        self.work[stream] += 1
        for g in range(ptr, ptr + size, GRANULE):
            self.last_use[g] = (stream, self.work[stream])


@pytest.mark.parametrize("seed", range(8))
def test_random_reuse_is_always_ordered(seed: int) -> None:
    """Random requests on six streams over a plan whose slots overlap each other partly.

    Few live blocks and rare completions keep freed memory with pending uses around, so reuse
    crosses streams often and cuts freed arena ranges and fallback blocks in pieces.
    """
    rng = random.Random(seed)
    streams = 6
    sizes = [rng.choice([4 * KIB, 16 * KIB, 64 * KIB]) for _ in range(12)]
    offsets, at = [], 0
    for _ in sizes:  # each slot shifted from the last by less than most sizes: partial overlaps
        offsets.append(at)
        at = max(0, at + rng.choice([-12, -4, 4, 12]) * KIB)
    peak = max(o + n for o, n in zip(offsets, sizes, strict=True))
    h = planned({"p": [(n, o) for n, o in zip(sizes, offsets, strict=True)]}, peak)
    model = HappensBefore()
    live: list[tuple[int, int, int]] = []
    for step in range(800):
        if step % len(sizes) == 0:
            h.set_phase(rng.choice(["p", None]))  # planned slots, or fallback blocks only
        if live and (rng.random() < 0.6 or len(live) > 4):
            ptr, size, stream = live.pop(rng.randrange(len(live)))
            h.free(ptr)
            model.free(ptr, size, stream)
        else:
            size, stream = sizes[step % len(sizes)], rng.randrange(streams)
            ptr = h.allocate(size, stream)
            model.absorb(h)
            model.check_allocation(ptr, size, stream)
            live.append((ptr, size, stream))
        if rng.random() < 0.02:
            h.complete(rng.randrange(streams))
    s = h.stats()
    assert s["planned_hits"] > 0 and s["stream_waits"] > 0  # both paths were exercised


# ---------------------------------------------------------------- statistics and the CUDA library


def test_stream_counters_in_every_backend() -> None:
    stats = A.PlannedAllocator(MIB, 0).stats()
    assert stats["events_recorded"] == 0 and stats["stream_waits"] == 0
    # Both backends name their counters from the core's one list (NOTE [Stat names]).
    assert {"events_recorded", "stream_waits"} <= set(A.library().stat_names())


def _cuda_library() -> A.Library:
    path = backends.cuda_library_path()
    if not os.path.exists(path):
        pytest.skip("the CUDA backend library is not built (MEMO_BUILD_CUDA=1 builds it)")
    try:
        return A.load_library(path)
    except OSError as exc:  # libcudart not on the loader path
        pytest.skip(f"cannot load the CUDA library here: {exc}")


def test_cuda_library_reports_its_runtime_version() -> None:
    lib = _cuda_library()
    version = lib.runtime_version("cuda")
    assert version >= 11000 and version % 10 == 0, version


def test_cuda_runtime_major_must_match_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _cuda_library()
    major = lib.runtime_version("cuda") // 1000
    monkeypatch.setattr(backends, "_cuda_lib", None)
    monkeypatch.setattr(torch.version, "cuda", f"{major - 1}.8")
    with pytest.raises(MemoError) as info:
        backends._load_cuda_library()
    msg = str(info.value)
    assert f"CUDA runtime {major}." in msg and f"CUDA {major - 1}.8" in msg
    assert "rebuild memo against this torch (pip install --no-build-isolation -e .)" in msg.lower()
    monkeypatch.setattr(backends, "_cuda_lib", None)
    monkeypatch.setattr(torch.version, "cuda", f"{major}.0")
    assert backends._load_cuda_library() is not None
