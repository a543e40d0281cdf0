"""Several forwards awaiting their backward (NOTE [Forwards in flight], memo/runtime/buffers.py):
DPO-style chosen/rejected passes, losses back-propagated in any order, an abandoned forward beside
live ones, the host-memory refusal, and a forced interleaving of two flights' backward at the
buffer level. Gradients must equal the unwrapped model's (fp32, 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memo.runtime as mr
from memo.errors import MemoError
from memo.runtime import BufferState
from memo.runtime.buffers import RoundingBuffers, RuntimeStats
from memo.runtime.copy_engines import CpuCopyEngine
from tests.grads import assert_same_step, grads_of, random_batch, small_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DELAY_US = 200


def _dpo(model: nn.Module, chosen: tuple, rejected: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A DPO-shaped step: two forwards of one model, one loss over both, one backward."""
    model.zero_grad(set_to_none=True)
    loss_c = model(*chosen)
    loss_r = model(*rejected)
    loss = -F.logsigmoid(2.0 * (loss_r - loss_c))
    loss.backward()
    return loss.detach(), grads_of(model)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_two_forwards_then_one_backward_match_unwrapped(alpha: float) -> None:
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=alpha, debug_copy_delay_us=DELAY_US)
    rt = mr.runtime_of(model)
    chosen, rejected = random_batch(ref, 2, 12, 1), random_batch(ref, 2, 12, 2)
    for _ in range(2):  # the second step reuses both flights
        assert_same_step(_dpo(model, chosen, rejected), _dpo(ref, chosen, rejected))
    assert rt.stats.max_forwards_in_flight == 2
    assert rt.buffers.n_flights == 2
    assert rt.host_bytes == 2 * rt.n_offloaded * rt.layer_bytes
    assert not rt.buffers.busy_flights()
    assert rt.stats.layer_backwards == rt.stats.layer_forwards == 4 * rt.n_offloaded


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2)])
def test_losses_back_propagated_in_any_order(order: tuple[int, ...]) -> None:
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, debug_copy_delay_us=DELAY_US)
    batches = [random_batch(ref, 2, 12, seed) for seed in (3, 4, 5)]

    def run(m: nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        losses = [m(*b) for b in batches]
        for j in order:
            losses[j].backward()
        return grads_of(m)

    got, want = run(model), run(ref)
    assert_same_step((torch.zeros(()), got), (torch.zeros(()), want))
    assert mr.runtime_of(model).stats.max_forwards_in_flight == 3


def test_an_abandoned_forward_beside_a_live_one() -> None:
    """A forward whose graph is freed is dropped by itself; the live one's backward stays exact."""
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.25, debug_copy_delay_us=DELAY_US)
    rt = mr.runtime_of(model)
    kept_batch, dropped, later = (random_batch(ref, 2, 12, seed) for seed in (6, 7, 8))
    kept = model(*kept_batch)
    model(*dropped)  # validation with autograd on: its graph is freed at once
    with pytest.warns(UserWarning, match="freed without its backward"):
        newer = model(*later)  # takes the dropped forward's flight
    assert rt.stats.abandoned_iterations == 1 and rt.buffers.n_flights == 2
    (kept + newer).backward()
    ref_loss = ref(*kept_batch) + ref(*later)
    ref_loss.backward()
    assert_same_step(((kept + newer).detach(), grads_of(model)), (ref_loss.detach(), grads_of(ref)))


def test_a_forward_host_memory_cannot_hold_is_refused_and_the_others_go_on() -> None:
    ref = small_model("gpt", 5)
    probe = mr.wrap(copy.deepcopy(ref), alpha=0.5)
    probe(*random_batch(ref, 2, 12, 1)).backward()
    one_flight = mr.runtime_of(probe).host_bytes

    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, host_memory_limit=one_flight + one_flight // 2)
    first = model(*random_batch(ref, 2, 12, 1))
    with pytest.raises(MemoError) as err:
        model(*random_batch(ref, 2, 12, 2))
    assert str(err.value) == (
        "memo.runtime: a forward started while 1 earlier forward(s) still await their backward (NOTE "
        f"[Forwards in flight]); it needs another {one_flight:,} bytes of host memory for its 3 offloaded "
        f"layers, but only {one_flight // 2:,} are available. Run the backward of a forward before the next "
        "one, free the graph of a forward you will not back-propagate (del its loss), lower alpha, or free "
        "host memory")
    first.backward()  # the forward in flight is untouched
    ref_loss = ref(*random_batch(ref, 2, 12, 1))
    ref_loss.backward()
    assert_same_step((first.detach(), grads_of(model)), (ref_loss.detach(), grads_of(ref)))


def test_a_layer_run_twice_in_one_forward_is_refused_with_the_cause() -> None:
    model = mr.wrap(small_model("gpt", 5), alpha=0.5)
    x = torch.randn(12, 2, model.config.hidden, requires_grad=True)
    layer = model.layers[1]
    with torch.enable_grad():
        model.layers[0](x)
        layer(x)
        with pytest.raises(MemoError, match=r"layer 1's rounding buffer cannot go from offloading to "
                                            r"offloading; the layer ran twice within one forward"):
            layer(x)


def test_interleaved_backward_of_two_flights_evicts_and_refetches() -> None:
    """The autograd engine may visit two flights' layers in any order: a backward that needs a device
    buffer holding another flight's prefetched layer takes it, and that layer is fetched again."""
    stats = RuntimeStats()
    engine = CpuCopyEngine(debug_delay_us=DELAY_US, seed=3)
    buffers = RoundingBuffers(engine, n_layers=2, layer_bytes=4096, stats=stats)
    data = {}
    for f in range(2):
        assert buffers.free_flight() == f
        for i in range(2):
            buffers.begin_forward(i, f)
            data[f, i] = torch.randn(64) + 10 * f + i
            buffers.pack(i, data[f, i], f)
            buffers.end_forward(i, f)
    assert buffers.n_flights == 2 and buffers.busy_flights() == [0, 1]
    assert buffers.prefetch(1, 1)  # flight 1's layer 1 is prefetched into buffer 1 ...
    assert not buffers.prefetch(1, 0)  # ... an early prefetch of flight 0's does not take it ...
    buffers.begin_backward(1, 0)  # ... but flight 0's backward of layer 1 does
    assert buffers.state(1, 1) is BufferState.OFFLOADED and stats.evicted_prefetches == 1
    assert torch.equal(buffers.view(1, 0, 0), data[0, 1])
    buffers.end_backward(1, 0)
    for f, i in [(1, 1), (1, 0), (0, 0)]:
        buffers.begin_backward(i, f)
        assert torch.equal(buffers.view(i, 0, f), data[f, i]), (f, i)
        buffers.end_backward(i, f)
    assert not buffers.busy_flights()
    engine.release()

