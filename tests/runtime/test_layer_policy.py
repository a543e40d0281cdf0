"""Per-layer policy (NOTE [Layer policy]): memo / full recompute / keep, mixed in one model.

Every mix must give the unwrapped model's loss and gradients (fp32, relative error < 1e-5),
and each policy must leave on the device what it promises between forward and backward.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import memo.runtime as mr
from memo.errors import MemoError, PlanMismatchError
from memo.models import get_config
from tests.grads import assert_same_step, random_batch, small_model, train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


POLICIES = [
    ["memo", "memo", "recompute", "keep"],
    ["memo", "recompute", "recompute", "recompute"],
    ["recompute", "keep", "recompute", "keep"],
    ["memo", "memo", "memo", "memo"],
    ["keep", "keep", "keep", "keep"],
]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: "-".join(x[0] for x in p))
def test_mixed_policy_matches_unwrapped(arch: str, policy: list[str]) -> None:
    model = small_model(arch, len(policy), seed=0)
    ref = copy.deepcopy(model)
    ids, labels = random_batch(model, 2, 48, seed=3)
    ref_loss, ref_grads = train_step(ref, ids, labels)
    assert ref_grads.keys() == {n for n, _ in ref.named_parameters()}  # every parameter has a gradient
    mr.wrap(model, alpha=0.375, policy=policy, debug_copy_delay_us=200)
    rt = mr.runtime_of(model)
    assert rt.policy == policy and rt.n_offloaded == policy.count("memo")
    for _ in range(2):  # the second step reuses the buffers
        assert_same_step(train_step(model, ids, labels), (ref_loss, ref_grads), rtol=1e-5)
    assert rt.stats.recomputed_layers == 2 * policy.count("recompute")
    assert rt.stats.layer_forwards == 2 * policy.count("memo")
    assert rt.host_bytes == (0 if rt.buffers is None else policy.count("memo") * rt.layer_bytes)
    mr.unwrap(model)


def _saved_bytes_between_forward_and_backward(policy: list[str]) -> int:
    """Bytes of distinct storages autograd holds for backward after the forward of the whole model."""
    model = small_model("gpt", len(policy), seed=0)
    mr.wrap(model, alpha=0.0, policy=policy)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and t.device.type == "cpu":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = model.embedding(ids)
        for layer in model.layers:
            h = layer(h)
    total = sum(seen.values())
    h.sum().backward()
    mr.unwrap(model)
    return total


def test_each_policy_keeps_what_it_promises() -> None:
    # Outside memo's own hooks only "keep" layers save whole activations and "recompute" layers
    # save their input; "memo" layers save nothing visible to autograd's hooks.
    memo = _saved_bytes_between_forward_and_backward(["memo"] * 4)
    recompute = _saved_bytes_between_forward_and_backward(["recompute"] * 4)
    keep = _saved_bytes_between_forward_and_backward(["keep"] * 4)
    assert memo < recompute < keep
    s, h = 64, get_config("tiny").hidden
    # Full recompute keeps each layer's input (shared with the previous layer's output).
    assert recompute >= 4 * s * h * 4


def test_bad_policies_are_refused() -> None:
    model = small_model("gpt", 3, seed=0)
    with pytest.raises(MemoError, match="must come first"):
        mr.wrap(model, alpha=0.5, policy=["keep", "memo", "memo"])
    with pytest.raises(MemoError, match="unknown layer policy 'swap'"):
        mr.wrap(model, alpha=0.5, policy=["memo", "swap", "keep"])
    with pytest.raises(MemoError, match="2 entries but the model has 3 layers"):
        mr.wrap(model, alpha=0.5, policy=["memo", "keep"])
    assert not mr.is_wrapped(model)
    with pytest.raises(PlanMismatchError, match="the plan was made for"):
        mr.wrap(model, plan={"alpha": 0.5, "host_bytes": 1, "policy": ["memo", "keep", "keep"]},
                policy=["keep", "keep", "keep"])


def test_default_policy_is_the_papers_rule() -> None:
    assert mr.default_policy(5) == ["memo", "memo", "memo", "keep", "keep"]
    assert mr.default_policy(1) == ["keep"]


# --- the planner's choice (NOTE [Policy cost model]) -------------------------------------------

def _costs(**kw):
    from memo.planner import LayerCosts

    base = dict(n_layers=12, s_input=2 << 20, s_attn=2 << 20, s_others=28 << 20, layer_time=3e-3,
                attn_fraction=0.3, base_bytes=50 << 20, bandwidth=4e9, host_memory=8 << 30)
    base.update(kw)
    return LayerCosts(**base)


def test_policy_never_needs_more_than_full_recompute() -> None:
    from memo.planner import choose_policy, device_need

    for n_layers in (1, 2, 4, 12, 32):
        c = _costs(n_layers=n_layers)
        sol = choose_policy(c)
        fr = sum(device_need(c, 0, n_layers, 0, 0.0).values())
        assert sol.full_recompute_bytes == fr
        assert sol.device_bytes <= fr
        assert len(sol.policy) == n_layers


def test_a_larger_budget_keeps_layers_and_a_smaller_one_offloads() -> None:
    from memo.planner import choose_policy

    c = _costs()
    roomy = choose_policy(c, device_budget=10 << 30)
    assert roomy.policy == ["keep"] * 12 and roomy.extra_seconds == 0
    tight = choose_policy(dataclasses.replace(c, bandwidth=1e12), device_budget=95 << 20)
    assert tight.counts["memo"] > 0 and tight.device_bytes <= 95 << 20
    assert tight.binding == "device_memory"


def test_forwards_in_flight_multiply_what_layers_hold_to_their_backward() -> None:
    """NOTE [Forwards in flight in the policy]: with a pipeline stage's F forwards in flight, kept layers
    and recomputed inputs are held F times and memo's host regions F times; the transient and the two
    rounding buffers once. So a budget that keeps every layer of one forward keeps fewer of two, and the
    host-bound alpha of two forwards fills the host with twice the regions."""
    from memo.planner import choose_policy, device_need

    one, two = _costs(), _costs(in_flight=2)
    parts1, parts2 = device_need(one, 4, 4, 4, 0.5), device_need(two, 4, 4, 4, 0.5)
    for part in ("kept layers", "recomputed layers' inputs"):
        assert parts2[part] == 2 * parts1[part]
    for part in ("base (model states, other activations)", "rounding buffers", "one layer's backward"):
        assert parts2[part] == parts1[part]
    budget = sum(device_need(one, 0, 0, 12, 0.0).values())
    assert choose_policy(one, device_budget=budget).policy == ["keep"] * 12
    assert choose_policy(two, device_budget=budget).counts["keep"] < 12
    host = 200 << 20
    for f, want_alpha in ((1, (200 / 12 - 4) / 28), (2, (200 / 24 - 4) / 28)):
        sol = choose_policy(_costs(host_memory=host, in_flight=f, bandwidth=1e12))
        assert sol.counts["memo"] == 12 and sol.binding == "host_memory", sol
        assert sol.alpha == pytest.approx(want_alpha, rel=1e-3)
        assert 12 * f * _costs().copy_bytes(sol.alpha) == pytest.approx(host, rel=1e-3)


def test_too_small_a_budget_names_the_smallest_need() -> None:
    from memo.planner import choose_policy

    with pytest.raises(MemoError, match=r"smallest need is .* rounding buffers"):
        choose_policy(_costs(), device_budget=40 << 20)
    for bad in (0, -5):
        with pytest.raises(MemoError, match="positive number of bytes"):
            choose_policy(_costs(), device_budget=bad)


def test_full_recompute_wins_where_it_is_faster() -> None:
    from memo.planner import choose_policy

    # A link so slow that memo's copies stall far longer than recomputing the layer.
    sol = choose_policy(_costs(bandwidth=1e6), device_budget=None)
    assert sol.counts["memo"] == 0 and sol.counts["recompute"] == 12


def test_fallback_headroom_is_at_least_one_segment() -> None:
    """NOTE [Fallback headroom]: 5% of the budget, or one segment of the fallback pool where that is
    more (under 16 MiB, 5% is less than one segment's rounding); the segment is the core's."""
    import re
    from pathlib import Path

    from memo.pipeline import FALLBACK_SEGMENT_BYTES, usable_device_bytes

    header = (Path(__file__).resolve().parents[2] / "csrc/core/fallback_allocator.h").read_text()
    match = re.search(r"kSegmentGranularity = (\d+)u << (\d+);", header)
    assert match and int(match.group(1)) << int(match.group(2)) == FALLBACK_SEGMENT_BYTES
    assert usable_device_bytes(80 * 10**9) == 76 * 10**9  # 5% kept free
    assert usable_device_bytes(16 << 20) == 14 << 20  # 2 MiB of 16 MiB: one segment, 12.5%
    assert usable_device_bytes(40 << 20) == 38 << 20  # where the two meet
    assert usable_device_bytes(1 << 20) == 0  # a budget below one segment leaves nothing usable


def test_input_only_layers_take_over_where_host_memory_binds() -> None:
    """NOTE [Input-only layers]: with host memory for every layer's input but not for memo's input and
    attention output, the policy offloads inputs alone on as many layers as it must, says that host
    memory binds, and still fits the device budget; with the host memory to spare it keeps memo."""
    from memo.planner import choose_policy

    c = _costs(bandwidth=1e12)
    budget = 90 << 20  # every layer must offload: no room to keep one, or to hold three layers' inputs
    ample = choose_policy(c, device_budget=budget)
    assert ample.counts["input-only"] == 0 and ample.counts["memo"] > 0
    memo_host = 12 * c.copy_bytes(0.0)
    tight = dataclasses.replace(c, host_memory=int(memo_host * 0.75))
    sol = choose_policy(tight, device_budget=budget)
    n_memo, n_in = sol.counts["memo"], sol.counts["input-only"]
    assert n_in > 0 and sol.binding == "host_memory"
    assert n_memo * tight.copy_bytes(sol.alpha) + n_in * tight.s_input <= tight.host_memory
    assert sol.device_bytes <= budget and sol.device_bytes <= sol.full_recompute_bytes
    # Every layer under memo at alpha = 0 would not fit the host: the policy is not all memo.
    assert n_memo * tight.copy_bytes(0.0) < memo_host
    # Host memory for the inputs alone: every offloading layer is input-only.
    inputs_only = dataclasses.replace(c, host_memory=12 * c.s_input)
    sol = choose_policy(inputs_only, device_budget=budget)
    assert sol.counts["memo"] == 0 and sol.counts["input-only"] > 0 and sol.binding == "host_memory"


def test_the_policy_chooses_a_smaller_tile_to_fit_the_budget() -> None:
    """NOTE [Tiles bounded by memory]: where a layer's backward in the runtime's tiles does not fit,
    a smaller tile of ``tile_choices`` does, and the plan records it; where it fits, the default stays."""
    from memo.planner import choose_policy

    c = _costs(bandwidth=1e12, s_others=400 << 20, recompute_chunks=1,
               tile_choices=((512, 2), (256, 4), (128, 8)))
    roomy = choose_policy(c, device_budget=4 << 30)
    assert roomy.tile_tokens is None
    with pytest.raises(MemoError, match="no layer policy fits"):
        choose_policy(dataclasses.replace(c, tile_choices=()), device_budget=300 << 20)
    tight = choose_policy(c, device_budget=300 << 20)
    assert tight.tile_tokens in (512, 256, 128) and tight.device_bytes <= (300 << 20) + 2  # buffers round up
