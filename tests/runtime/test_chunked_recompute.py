"""NOTE [Chunked recompute]: the recomputed token range runs in chunks.

Loss and every gradient still match the unwrapped model at any chunk size; dropout inside
``post`` draws the same masks in each chunk's recompute as in its forward (checked against
finite differences in float64, where a changed mask shows as a wrong directional derivative);
and the backward holds less than the unchunked one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memo.runtime as mr
from memo.adapters import AnatomyAdapter, register_adapter, unregister_adapter
from memo.errors import MemoError
from memo.models import attention
from memo.runtime.layer import (
    MIN_CHUNK_WORK,
    MIN_CPU_CHUNK_TOKENS,
    RECOMPUTE_CHUNKS,
    min_chunk_tokens,
    token_chunks,
)
from memo.runtime.tiles import MIN_CPU_CHUNK_WORK, min_tile_tokens
from tests.grads import assert_same_step, random_batch, small_model, train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py




def test_token_chunks_cover_every_token_once() -> None:
    for n in (1, 7, 255, 256, 257, 2048, 2049, 100_000):
        for size in (None, 1, 3, 1000):
            shapes = ((1, 64, "cpu"), (1, 64, "cuda"), (2, 768, "meta"), (4, 8192, "cuda"))
            for batch, hidden, device in shapes:
                chunks = token_chunks(n, size, batch=batch, hidden=hidden, device_type=device)
                assert chunks[0][0] == 0 and chunks[-1][1] == n
                assert all(prev[1] == nxt[0] for prev, nxt in zip(chunks, chunks[1:], strict=False))
                if size is None:
                    assert len(chunks) <= RECOMPUTE_CHUNKS
                    floor = min(n, min_chunk_tokens(batch, hidden, device))
                    assert all(c1 - c0 >= floor for c0, c1 in chunks[:-1])
                else:
                    assert all(c1 - c0 == size for c0, c1 in chunks[:-1])
    assert token_chunks(0, batch=1, hidden=64, device_type="cpu") == []


def test_chunks_carry_enough_work() -> None:
    """NOTE [How small a chunk]: on an accelerator a small layer recomputes in one chunk and a large
    one at a long sequence in RECOMPUTE_CHUNKS chunks, the floor being tokens x batch x hidden^2 of
    MIN_CHUNK_WORK; on the CPU and on meta, a thousandth of that work and at least MIN_CPU_CHUNK_TOKENS,
    which is also the smallest tile a policy may choose there to fit a budget."""
    assert min_chunk_tokens(1, 768, "cuda") == -(-MIN_CHUNK_WORK // 768**2) == 58_255
    assert min_chunk_tokens(2, 768, "cuda") == -(-MIN_CHUNK_WORK // (2 * 768**2))
    assert min_chunk_tokens(2, 768, "meta") == MIN_CPU_CHUNK_TOKENS
    assert min_chunk_tokens(1, 4096, "cuda") == 2048
    assert min_chunk_tokens(1, 4096, "cpu") == MIN_CPU_CHUNK_TOKENS
    assert len(token_chunks(7_000, batch=1, hidden=768, device_type="cuda")) == 1  # gpt-125m, 8K tokens
    assert len(token_chunks(7_000, batch=1, hidden=768, device_type="cpu")) == RECOMPUTE_CHUNKS
    assert len(token_chunks(60_000, batch=1, hidden=768, device_type="cuda")) == 2
    # Where meta is used (a 7B layer at long sequences) it chunks as the GPU does.
    assert token_chunks(30_000, batch=1, hidden=4096, device_type="meta") == \
        token_chunks(30_000, batch=1, hidden=4096, device_type="cuda")
    assert len(token_chunks(1 << 20, batch=1, hidden=4096, device_type="cuda")) == RECOMPUTE_CHUNKS  # 7B, 1M
    assert len(token_chunks(5_000, batch=1, hidden=4096, device_type="cuda")) == 3  # 2,048-token chunks
    assert len(token_chunks(500, batch=1, hidden=512, device_type="cpu")) == 2  # 256-token tiles
    # A hidden-64 layer on the CPU: 2^25 / 64^2 = 8,192 tokens of work floor, one tile at 500 tokens
    # (issue 30: five 256-token tiles of a hidden-128 Llama cost 1.57x its unwrapped step, one 1.24x).
    assert min_chunk_tokens(1, 64, "cpu") == MIN_CPU_CHUNK_WORK // 64**2 == 8192
    assert min_chunk_tokens(1, 128, "meta") == 2048 and min_chunk_tokens(4, 128, "cpu") == 512
    assert len(token_chunks(500, batch=1, hidden=64, device_type="cpu")) == 1
    assert min_tile_tokens(1, 64, "cpu") == MIN_CPU_CHUNK_TOKENS
    assert min_tile_tokens(1, 4096, "cuda") == min_chunk_tokens(1, 4096, "cuda")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_chunk_size_is_refused(bad: object) -> None:
    with pytest.raises(MemoError, match="recompute_chunk_tokens must be a positive number"):
        mr.MemoRuntime(0.5, recompute_chunk_tokens=bad)




@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize(("alpha", "chunk"), [(0.0, 1), (0.0, 5), (0.3, 4), (0.3, 100), (0.75, 2), (1.0, 3)])
def test_chunked_recompute_matches_unwrapped(arch: str, alpha: float, chunk: int) -> None:
    ref = small_model(arch)
    model = mr.wrap(copy.deepcopy(ref), runtime=mr.MemoRuntime(alpha, recompute_chunk_tokens=chunk,
                                                              debug_copy_delay_us=200, policy=["memo"] * 4))
    ids, labels = random_batch(ref, 2, 23, seed=3)
    for _ in range(2):
        assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))


class DropoutLayer(nn.Module):
    """An anatomy layer with dropout in pre and in post (memo's reference layers have none)."""

    def __init__(self, h: int = 8, n: int = 2) -> None:
        super().__init__()
        self.n, self.d = n, h // n
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.fc = nn.Linear(h, h)

    def pre(self, x: torch.Tensor, offset: int = 0):
        s, b, _ = x.shape
        q, k, v = nn.functional.dropout(self.qkv(x), 0.3, self.training).chunk(3, dim=-1)
        return tuple(t.reshape(s, b, self.n, self.d) for t in (q, k, v))

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x + nn.functional.dropout(self.proj(o), 0.5, self.training)
        return y + nn.functional.dropout(torch.tanh(self.fc(y)), 0.5, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(attention(*self.pre(x)).flatten(2), x)


class DropoutModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropoutLayer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (x * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype)).sum()


@pytest.mark.parametrize(("alpha", "chunk"), [(0.0, 2), (0.4, 3), (0.4, 64)])
def test_dropout_masks_are_replayed_per_chunk(alpha: float, chunk: int) -> None:
    register_adapter(DropoutLayer, AnatomyAdapter())
    try:
        torch.manual_seed(0)
        model = DropoutModel().double()
        mr.wrap(model, runtime=mr.MemoRuntime(alpha, recompute_chunk_tokens=chunk, policy=["memo"] * 3))
        x = torch.randn(13, 2, 8, dtype=torch.float64)

        def loss_at(seed: int = 7) -> float:
            # The same masks on every call, so the loss is a function of the weights. A wrapped
            # model runs memo only where autograd records, so every evaluation is a full step.
            model.zero_grad()
            torch.manual_seed(seed)
            loss = model(x)
            loss.backward()
            return loss.item()

        loss_at()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        eps = 1e-6
        for name, p in model.named_parameters():
            direction = torch.randn_like(p)
            with torch.no_grad():
                p += eps * direction
            up = loss_at()
            with torch.no_grad():
                p -= 2 * eps * direction
            down = loss_at()
            with torch.no_grad():
                p += eps * direction
            numeric = (up - down) / (2 * eps)
            analytic = (grads[name] * direction).sum().item()
            assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (name, numeric, analytic)
    finally:
        unregister_adapter(DropoutLayer)


def test_chunks_lower_the_backward_peak() -> None:
    """The same job with one chunk and with eight: the recorded iteration peak drops."""
    from memo.planner import Trace, lower_bound

    from memo.profiler import record

    peaks = {}
    for chunk in (None, 64):
        ref = small_model("gpt", n_layers=3)
        rt = mr.MemoRuntime(0.0, recompute_chunk_tokens=chunk or 512, policy=["memo"] * 3)
        model = mr.wrap(ref, runtime=rt)
        ids = torch.zeros(1, 512, dtype=torch.long)
        peaks[chunk] = lower_bound(Trace.from_dict(record(model, ids, ids).trace))
        mr.unwrap(model)
    assert peaks[64] < peaks[None]
