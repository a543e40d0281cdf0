"""The rounding-buffer pieces on their own: C++ copy worker, host arena, buffer state machine."""

from __future__ import annotations

import pytest
import torch

from memo import _C
from memo.errors import MemoError
from memo.runtime.buffers import BufferState, LayerSlot, RoundingBuffers, RuntimeStats
from memo.runtime.copy_engines import CpuCopyEngine


def test_copy_worker_copies_in_order_and_tickets_complete() -> None:
    worker = _C.rounding.CopyWorker("t", 200, 1)
    src = [torch.full((1000,), float(i)) for i in range(8)]
    dst = [torch.zeros(1000) for _ in range(8)]
    tickets = [worker.submit(d, s) for d, s in zip(dst, src, strict=True)]
    assert tickets == sorted(tickets) and tickets[0] >= 1
    worker.wait(tickets[-1])
    assert all(worker.query(t) for t in tickets)
    for i, d in enumerate(dst):
        assert torch.equal(d, src[i])
    assert worker.bytes_copied == 8 * 4000


def test_copy_worker_dependency_on_other_worker() -> None:
    slow = _C.rounding.CopyWorker("slow", 20000, 2)
    fast = _C.rounding.CopyWorker("fast", 0, 3)
    a, mid, out = torch.arange(4096.0), torch.zeros(4096), torch.zeros(4096)
    t1 = slow.submit(mid, a)
    t2 = fast.submit(out, mid, slow, t1)  # like cudaStreamWaitEvent
    fast.wait(t2)
    assert torch.equal(out, a)


def test_a_queued_job_outlives_the_worker_it_depends_on() -> None:
    """NOTE [Copy worker lifetimes]: the job holds the other worker's progress, not the worker, and a
    worker's destructor completes every ticket it issued before its members go."""
    for seed in range(20):
        slow = _C.rounding.CopyWorker("slow", 5000, seed)
        fast = _C.rounding.CopyWorker("fast", 5000, seed + 100)
        a, mid, out = torch.arange(4096.0) + seed, torch.zeros(4096), torch.zeros(4096)
        scratch, ones = torch.zeros(16), torch.ones(16)
        first = fast.submit(scratch, ones)  # fast's thread is busy (a delay) ...
        t1 = slow.submit(mid, a)
        t2 = fast.submit(out, mid, slow, t1)  # ... while its next job, waiting on slow, is queued
        del slow  # drains slow's queue (t1 completes) and joins its thread
        fast.wait(t2)
        assert fast.query(first) and torch.equal(out, a)


def test_a_dependency_on_a_ticket_never_issued_is_refused_at_submit() -> None:
    # It would wait forever on the worker's thread; refused on the caller's instead.
    other, worker = _C.rounding.CopyWorker("other", 0, 0), _C.rounding.CopyWorker("t", 0, 0)
    with pytest.raises(RuntimeError, match="ticket 5 that worker 'other' never issued"):
        worker.submit(torch.zeros(4), torch.ones(4), other, 5)
    assert worker.submitted == 0


def test_copy_worker_rejects_bad_copies() -> None:
    worker = _C.rounding.CopyWorker("t", 0, 0)
    with pytest.raises(RuntimeError, match="bytes"):
        worker.submit(torch.zeros(3), torch.zeros(4))
    with pytest.raises(RuntimeError, match="contiguous"):
        worker.submit(torch.zeros(4, 4).t(), torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match="never issued"):
        worker.wait(99)


def test_host_arena_is_a_uint8_tensor_that_outlives_its_handle() -> None:
    arena = _C.rounding.host_arena(1 << 16)
    assert arena.dtype == torch.uint8 and arena.numel() == 1 << 16
    view = arena[128:256]
    del arena
    view.fill_(7)
    assert int(view.sum()) == 7 * 128


def test_buffer_state_transitions_are_checked() -> None:
    slot = LayerSlot(0)
    for state in (BufferState.OFFLOADING, BufferState.OFFLOADED, BufferState.PREFETCHING, BufferState.READY,
                  BufferState.IDLE):
        slot.transition(state)
    with pytest.raises(MemoError, match="idle to ready"):
        slot.transition(BufferState.READY)
    slot.transition(BufferState.OFFLOADING)
    with pytest.raises(MemoError, match="the layer ran twice within one forward of the model"):
        slot.transition(BufferState.OFFLOADING)


def test_rounding_buffers_round_trip_two_layers_per_buffer() -> None:
    stats = RuntimeStats()
    bufs = RoundingBuffers(CpuCopyEngine(debug_delay_us=500), n_layers=4, layer_bytes=256, stats=stats)
    data = [torch.randn(64) for _ in range(4)]
    for i, t in enumerate(data):
        bufs.begin_forward(i)
        assert bufs.pack(i, t) == 0
        bufs.end_forward(i)
        assert bufs.state(i) is BufferState.OFFLOADING
    assert bufs.state(0) is BufferState.OFFLOADED  # layer 2 waited for it before reusing buffer 0
    for i in reversed(range(4)):
        if i > 0:
            bufs.prefetch(i - 1)  # what the gradient hook of layer i's output does
        bufs.begin_backward(i)
        assert torch.equal(bufs.view(i, 0), data[i])
        bufs.end_backward(i)
        assert bufs.state(i) is BufferState.IDLE
    assert stats.bytes_offloaded == stats.bytes_prefetched == 4 * 256
    assert stats.late_prefetches == 1  # layer 3 had no later layer to prefetch it


def test_rounding_buffers_refuse_what_host_memory_cannot_hold() -> None:
    with pytest.raises(MemoError, match=r"needs 4,096 bytes .* only 1,000 bytes"):
        RoundingBuffers(CpuCopyEngine(), n_layers=4, layer_bytes=1024, stats=RuntimeStats(),
                        host_memory_limit=1000)
