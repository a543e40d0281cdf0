"""NOTE [Attention in head groups] (memo/models/causal_attention.py): attention run over groups of
whole key/value heads gives the one-call numbers bit for bit, and holds one group's transients."""

from __future__ import annotations

import pytest
import torch

import memo.models.causal_attention as ca
from memo.profiler.recorder import DispatchRecorder
from tests.grads import fused_qkv_views


def _peak(events: list[dict]) -> int:
    live = peak = 0
    sizes = {}
    for e in events:
        if e["op"] == "malloc":
            sizes[e["id"]] = e["size"]
            live += e["size"]
            peak = max(peak, live)
        else:
            live -= sizes.pop(e["id"], 0)
    return peak


def _one_group_per_kv_head(monkeypatch: pytest.MonkeyPatch, q: torch.Tensor, n_kv: int) -> None:
    monkeypatch.setattr(ca, "HEAD_GROUP_BYTES", q.numel() // n_kv * q.element_size())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n,n_kv", [(8, 2), (4, 4), (6, 3)])
def test_groups_give_the_one_call_numbers(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n: int,
                                          n_kv: int) -> None:
    torch.manual_seed(n * n_kv)
    q, k, v, grad_o = fused_qkv_views(48, 2, n, n_kv, 16, dtype)
    o, lse = ca.attention_forward(q, k, v)
    grads = ca.attention_backward(grad_o, q, k, v, o, lse)
    _one_group_per_kv_head(monkeypatch, q, n_kv)
    assert len(ca._head_groups(q, k)) == n_kv
    o_g, lse_g = ca.attention_forward(q, k, v)
    assert torch.equal(o_g, o) and torch.equal(lse_g, lse) and o_g.is_contiguous()
    for got, want in zip(ca.attention_backward(grad_o, q, k, v, o_g, lse_g), grads, strict=True):
        assert torch.equal(got, want) and got.is_contiguous() and got.shape == want.shape


def test_groups_hold_one_groups_transients(monkeypatch: pytest.MonkeyPatch) -> None:
    # On meta (what a profile records): grouped-query backward with 8 query heads on 2 key/value heads.
    s, b, n, n_kv, d = 4096, 1, 8, 2, 64
    q = torch.empty(s, b, n, d, device="meta")
    k, v = (torch.empty(s, b, n_kv, d, device="meta") for _ in range(2))
    o, lse = torch.empty_like(q), torch.empty(b, n, s, device="meta")

    def backward_peak() -> int:
        with DispatchRecorder(lambda: "bwd") as rec:
            ca.attention_backward(q, q, k, v, o, lse)
        return _peak(rec.events)

    whole = backward_peak()
    _one_group_per_kv_head(monkeypatch, q, n_kv)
    grouped = backward_peak()
    q_bytes = q.numel() * 4
    # the outputs dq, dk, dv stay; the expanded k, v and gradients shrink to one group's (a half here)
    assert grouped <= whole - q_bytes, (whole, grouped, q_bytes)
    assert grouped >= q_bytes + 2 * k.numel() * 4  # never less than the outputs themselves
