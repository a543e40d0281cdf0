"""The gradient of a layer's input written over its incoming gradient where memo alone holds that
(NOTE [Gradient of x over the incoming one] in memo/runtime/owned_grad.py): the same gradients, one
layer input's bytes less at the peak, and a gradient someone else sees is left alone."""

from __future__ import annotations

import copy

import pytest
import torch

import memo.runtime as mr
import memo.runtime.layer as layer_module
from tests.grads import assert_same_step, grads_of, random_batch, rel_err, small_model, train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def decisions(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each layer backward wrote over its incoming gradient, in backward order."""
    seen: list[bool] = []
    real = layer_module.owned_incoming

    def spy(grad: torch.Tensor, refs: int, like: torch.Tensor) -> bool:
        seen.append(real(grad, refs, like))
        return seen[-1]

    monkeypatch.setattr(layer_module, "owned_incoming", spy)
    return seen


@pytest.mark.parametrize("arch,policy", [("gpt", ["input-only", "memo", "input-only"]),
                                         ("llama", ["memo", "input-only", "segment"])])
def test_written_over_and_exact(arch: str, policy: list[str], decisions: list[bool]) -> None:
    model = small_model(arch, len(policy), seed=0)
    ref = copy.deepcopy(model)
    ids, labels = random_batch(model, 2, 48, seed=3)
    want = train_step(ref, ids, labels)
    mr.wrap(model, alpha=0.375, policy=policy)
    assert_same_step(train_step(model, ids, labels), want)
    assert decisions == [True] * len(policy)  # the loss's gradient (a view) and every layer's
    mr.unwrap(model)


def test_a_gradient_others_see_is_left_alone(decisions: list[bool]) -> None:
    model = small_model("llama", 3, seed=0)
    ref = copy.deepcopy(model)
    ids, labels = random_batch(model, 1, 48, seed=3)
    wrapped = copy.deepcopy(model)
    mr.wrap(wrapped, alpha=0.0, policy=["input-only"] * 3)

    def outputs(m: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        kept: list[torch.Tensor] = []
        handle = m.layers[1].register_forward_hook(lambda _m, _i, out: kept.append(out))
        loss = m(ids, labels)
        handle.remove()
        return loss, kept

    # a hook that keeps the gradient of layer 1's output (the tensor itself)
    stashed: dict[str, torch.Tensor] = {}
    steps = {}
    for name, m in (("ref", ref), ("memo", wrapped)):
        m.zero_grad(set_to_none=True)
        loss, (out,) = outputs(m)
        out.register_hook(lambda g, name=name: stashed.__setitem__(name, g))
        loss.backward()
        steps[name] = (loss.detach(), grads_of(m))
    assert_same_step(steps["memo"], steps["ref"])
    assert decisions == [True, False, True]
    assert rel_err(stashed["memo"], stashed["ref"]) < 1e-6

    # torch.autograd.grad capturing layer 1's output beside the parameters below it
    decisions.clear()
    got = {}
    for name, m in (("ref", ref), ("memo", wrapped)):
        loss, (out,) = outputs(m)
        got[name] = torch.autograd.grad(loss, [out, m.layers[0].qkv.weight])
    assert decisions == [True, False, True]
    for mine, theirs in zip(got["memo"], got["ref"], strict=True):
        assert rel_err(mine, theirs) < 1e-5
    mr.unwrap(wrapped)


def test_the_peak_drops_by_one_layer_input(monkeypatch: pytest.MonkeyPatch) -> None:
    from memo.estimate.rank_numbers import analyse_trace
    from memo.profiler.record import record

    def peak() -> int:
        model = small_model("llama", 3, seed=0)
        ids, labels = random_batch(model, 1, 256, seed=3)
        mr.wrap(model, alpha=0.0, policy=["input-only"] * 3)
        train_step(model, ids, labels)  # sizes the rounding buffers
        out = analyse_trace(record(model, ids, labels).trace).iteration
        mr.unwrap(model)
        return out

    lean = peak()
    monkeypatch.setattr(layer_module, "owned_incoming", lambda *_: False)
    assert peak() - lean == 256 * small_model("llama", 1).config.hidden * 4  # one float32 layer input


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_attention_gradients_over_recomputed_qkv(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [Gradients written over q, k, v] in memo/models/causal_attention.py: an input-only layer's
    # recomputed q, k, v (several chunks: its own rows) take dq, dk, dv, with the same gradients; with one
    # chunk they are the kept chunk's graph's outputs, and are not written over.
    import memo.models.causal_attention as ca

    model = small_model(arch, 2, seed=0)
    ids, labels = random_batch(model, 1, 256, seed=3)
    want = train_step(copy.deepcopy(model), ids, labels)
    real, over = ca._backward_kernels, []

    def spy(*args: object, **kw: object) -> object:
        grads = real(*args, **kw)
        over.append(all(g.data_ptr() == t.data_ptr() for g, t in zip(grads, args[2:5], strict=True)))
        return grads

    monkeypatch.setattr(ca, "_backward_kernels", spy)
    for chunk, written in ((64, True), (None, False)):
        m = copy.deepcopy(model)
        mr.wrap(m, alpha=0.0, policy=["input-only"] * 2, recompute_chunk_tokens=chunk)
        over.clear()
        assert_same_step(train_step(m, ids, labels), want)
        assert over == [written] * 2
        mr.unwrap(m)


def test_the_first_probe_inside_a_recorded_iteration_leaves_the_plan_whole() -> None:
    """The ownership probe runs once per process, first inside some layer's backward, which may be the
    iteration a CPU profile records: it allocates nothing there, so the run (probe cached) serves every
    planned request from the plan (a probe on the CPU put its 16-byte tensors in the plan, and memo train's
    first memo layer backward left the plan)."""
    from memo.runtime import owned_grad
    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    owned_grad._probed.cache_clear()  # as in a fresh process
    machine = StrategyOptions(alpha=0.5, layer_ms=1.0, bandwidth_gbps=10.0, host_mem_gb=64.0, time_limit=0.3)
    result = train(TrainConfig(model="tiny", seq_len=64, micro_batch=2, steps=2), progress=False,
                   strategy=make_strategy(machine), log=lambda line: None)
    counts = [s.extras["allocator"] for s in result.steps]
    assert all(c["fallback"] == 0 and c["planned"] > 0 for c in counts), counts
