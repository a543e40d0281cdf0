"""NOTE [Tiles bounded by memory] (memo/runtime/tiles.py), NOTE [Input-only layers] (memo/runtime/layer.py).

A memo layer's token-wise parts run over token tiles in both ranges and both directions, so its
peak grows with s only by the tensors that span the sequence; the input-only policy offloads the
layer input alone and recomputes the rest, attention included. Every mix of the four layer
policies gives the unwrapped model's loss and gradients, with dropout, odd lengths and any alpha.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memo.runtime as mr
from memo.adapters import AnatomyAdapter, register_adapter, unregister_adapter
from memo.models import ModelConfig, attention, build_model
from memo.profiler import record
from memo.runtime.layer import MIN_CPU_CHUNK_TOKENS, TILE_BYTES, token_chunks
from memo.runtime.tiles import MIN_CPU_CHUNK_WORK
from tests.grads import assert_same_step, random_batch, small_model, train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

#: A Llama-style layer whose MLP is 4x wider than its hidden size (GQA: 2 KV heads of 4).
WIDE_MLP = ModelConfig(name="wide-mlp", arch="llama", n_layers=3, hidden=64, n_heads=4, n_kv_heads=2,
                       ffn_hidden=256, vocab_size=64, rope_theta=10000.0)


def _phase_growth(trace: dict, phase: str) -> int:
    """The most bytes allocated during ``phase`` above what was live when it began."""
    live, sizes, base, peak = 0, {}, None, 0
    for ev in trace["events"]:
        if ev["op"] == "malloc":
            sizes[ev["id"]] = ev["size"]
            live += ev["size"]
            if ev.get("phase") == phase:
                base = live - ev["size"] if base is None else base
                peak = max(peak, live)
        elif ev["op"] == "free":
            live -= sizes.pop(ev["id"])
    return peak - base


def _layer_peaks(s: int, alpha: float, tile: int) -> tuple[int, int, int]:
    """Layer 1's forward and backward growth (meta device: exact bytes, no memory) and its offloaded
    bytes, every layer under memo with tiles of ``tile`` tokens."""
    model = build_model(WIDE_MLP, dtype=torch.float32, device="meta")
    mr.wrap(model, runtime=mr.MemoRuntime(alpha, recompute_chunk_tokens=tile, policy=["memo"] * 3))
    ids = torch.zeros(1, s, dtype=torch.long, device="meta")
    trace = record(model, ids, ids).trace
    return (_phase_growth(trace, "layer.fwd[1]"), _phase_growth(trace, "layer.bwd[1]"),
            mr.runtime_of(model).layer_bytes)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_a_layer_grows_with_s_only_by_the_tensors_that_span_the_sequence(alpha: float) -> None:
    """At s and 4s with a fixed tile: forward grows by x, y, q, k, v, o and the log-sum-exp (and at
    alpha = 1 by the offloaded bytes), backward by those and their gradients; not by the MLP's
    intermediates (3 x ffn = 12 hidden per token), which the same layer in one tile does grow by."""
    h, heads, kv = WIDE_MLP.hidden, WIDE_MLP.n_heads, WIDE_MLP.n_kv_heads
    width = 4 * (h + h + h + 2 * h * kv // heads + h)  # x, y, q, k, v, o per token, float32
    lse = 4 * heads
    s, tile = 256, 64
    small, large = _layer_peaks(s, alpha, tile), _layer_peaks(4 * s, alpha, tile)
    added = 3 * s
    offloaded = (large[2] - small[2]) / added  # the rounding buffer's bytes per token
    forward_allowance = (width + lse + (offloaded if alpha else 0)) * added
    backward_allowance = (2 * width + lse) * added  # the tensors and their gradients
    assert large[0] - small[0] <= forward_allowance
    assert large[1] - small[1] <= backward_allowance
    # The control: one tile of s tokens holds the MLP's intermediates of every token.
    whole_small, whole_large = _layer_peaks(s, alpha, s), _layer_peaks(4 * s, alpha, 4 * s)
    assert whole_large[1] - whole_small[1] > backward_allowance
    if alpha == 0.0:
        assert whole_large[0] - whole_small[0] > forward_allowance


def test_tiles_are_bounded_by_memory_and_grow_with_s() -> None:
    """Past s / 8 tokens a tile holds at most TILE_BYTES of transient tensors, so the count of tiles
    grows with s; the floor of NOTE [How small a chunk] still holds; short sequences keep 8 tiles."""
    token_bytes = 2 * (4 * 4096 + 3 * 14336)  # a Llama-3.1-8B layer in bf16, per token
    counts = [len(token_chunks(s, batch=1, hidden=4096, device_type="cuda", token_bytes=token_bytes))
              for s in (1 << 16, 1 << 18, 1 << 20)]
    tile = TILE_BYTES // token_bytes
    assert counts == [-(-s // tile) for s in (1 << 16, 1 << 18, 1 << 20)] and counts[0] > 8
    assert counts[0] < counts[1] < counts[2]
    assert len(token_chunks(4096, batch=1, hidden=4096, device_type="cuda", token_bytes=token_bytes)) == 2
    floor = token_chunks(1 << 20, batch=1, hidden=768, device_type="cuda", token_bytes=1 << 30)
    assert floor[0][1] == -(-(1 << 35) // 768**2)  # never below the work floor
    cpu = token_chunks(10_000, batch=1, hidden=4096, device_type="cpu", token_bytes=1 << 30)
    assert cpu[0][1] == MIN_CPU_CHUNK_TOKENS
    small = token_chunks(10_000, batch=1, hidden=64, device_type="cpu", token_bytes=1 << 30)
    assert small[0][1] == MIN_CPU_CHUNK_WORK // 64**2  # a small layer's work floor on the CPU




POLICY_MIXES = [
    ["input-only"] * 4,
    ["memo", "input-only", "recompute", "keep"],
    ["input-only", "memo", "memo", "keep"],
]


# Every mix at every alpha on the Llama layers (RoPE, GQA, SwiGLU); the GPT layers with every policy
# at once (their offloaded bytes differ: no rotary, an MLP of 4h).
CASES = [("llama", policy, alpha) for policy in POLICY_MIXES for alpha in (0.0, 0.3, 1.0)] + [
    ("gpt", POLICY_MIXES[1], alpha) for alpha in (0.0, 0.3, 1.0)]


@pytest.mark.parametrize(("arch", "policy", "alpha"), CASES, ids=lambda v: "+".join(v) if isinstance(v, list)
                         else str(v))
def test_every_policy_mix_matches_unwrapped(arch: str, policy: list[str], alpha: float) -> None:
    ref = small_model(arch)
    rt = mr.MemoRuntime(alpha, recompute_chunk_tokens=4, debug_copy_delay_us=200, policy=policy)
    model = mr.wrap(copy.deepcopy(ref), runtime=rt)
    ids, labels = random_batch(ref, 2, 23, seed=5)
    for _ in range(2):
        assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    n_in = policy.count("input-only")
    assert rt.stats.bytes_offloaded > 0
    # An input-only layer's host region holds its input alone: x of [23, 2, hidden], aligned.
    regions = rt.buffers.region_bytes
    x_bytes = 23 * 2 * ref.config.hidden * 4
    assert [r for r, k in zip(regions, policy, strict=False) if k == "input-only"] == [x_bytes] * n_in
    assert all(r > x_bytes for r, k in zip(regions, policy, strict=False) if k == "memo")


class DropoutLayer(nn.Module):
    """An anatomy layer with dropout in pre and in post."""

    def __init__(self, h: int = 8, n: int = 2) -> None:
        super().__init__()
        self.n, self.d = n, h // n
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.fc = nn.Linear(h, 4 * h)
        self.out = nn.Linear(4 * h, h)

    def pre(self, x: torch.Tensor, offset: int = 0):
        s, b, _ = x.shape
        q, k, v = nn.functional.dropout(self.qkv(x), 0.3, self.training).chunk(3, dim=-1)
        return tuple(t.reshape(s, b, self.n, self.d) for t in (q, k, v))

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x + nn.functional.dropout(self.proj(o), 0.5, self.training)
        return y + self.out(nn.functional.dropout(torch.tanh(self.fc(y)), 0.5, self.training))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(attention(*self.pre(x)).flatten(2), x)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_dropout_under_every_policy_equals_unwrapped(alpha: float) -> None:
    """The same seed draws the same masks as the unwrapped layers (NOTE [Dropout as unwrapped]) over
    tiles of 3 tokens of an odd length, under memo, input-only, recompute and keep."""
    register_adapter(DropoutLayer, AnatomyAdapter())
    try:
        torch.manual_seed(0)
        ref = nn.Sequential(*(DropoutLayer() for _ in range(4))).double()
        model = mr.wrap(copy.deepcopy(ref), runtime=mr.MemoRuntime(
            alpha, recompute_chunk_tokens=3, policy=["input-only", "memo", "recompute", "keep"]))
        x = torch.randn(13, 2, 8, dtype=torch.float64)
        weights = torch.linspace(-1, 1, 8, dtype=torch.float64)

        def step(net: nn.Module):
            net.zero_grad(set_to_none=True)
            torch.manual_seed(11)
            xi = x.clone().requires_grad_()
            loss = (net(xi) * weights).sum()
            loss.backward()
            return loss.detach(), {"x": xi.grad, **{n: p.grad.clone() for n, p in net.named_parameters()}}

        assert_same_step(step(model), step(ref))
    finally:
        unregister_adapter(DropoutLayer)
