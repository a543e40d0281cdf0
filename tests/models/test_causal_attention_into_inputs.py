"""NOTE [Gradients written over q, k, v] (memo/models/causal_attention.py): within gradients_into_inputs,
attention's backward gives the usual numbers, written over q, k, v, and allocates no outputs of its own."""

from __future__ import annotations

import pytest
import torch

import memo.models.causal_attention as ca
from memo.profiler.recorder import DispatchRecorder
from tests.grads import fused_qkv_views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,n_kv", [(8, 2), (4, 4), (6, 1)])
def test_gradients_over_inputs_are_the_usual_ones(dtype: torch.dtype, n: int, n_kv: int) -> None:
    torch.manual_seed(n * n_kv)
    q, k, v, grad_o = fused_qkv_views(40, 2, n, n_kv, 16, dtype)
    o, lse = ca.attention_forward(q, k, v)
    want = ca.attention_backward(grad_o, q, k, v, o, lse)
    with ca.gradients_into_inputs():
        got = ca.attention_backward(grad_o, q, k, v, o, lse)
    for g, w, inp in zip(got, want, (q, k, v), strict=True):
        assert g.data_ptr() == inp.data_ptr() and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6) if dtype == torch.float32 else \
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert not getattr(ca._INTO_INPUTS, "on", False)  # the permission ends with the block


def test_gradients_over_inputs_allocate_no_outputs() -> None:
    # On meta (what a profile records): 8 query heads on 2 key/value heads; dq, dk, dv are not allocated.
    s, b, n, n_kv, d = 4096, 1, 8, 2, 64
    q = torch.empty(s, b, n, d, device="meta")
    k, v = (torch.empty(s, b, n_kv, d, device="meta") for _ in range(2))
    o, lse = torch.empty_like(q), torch.empty(b, n, s, device="meta")

    def backward_peak(into: bool) -> int:
        with DispatchRecorder(lambda: "bwd") as rec:
            if into:
                with ca.gradients_into_inputs():
                    ca.attention_backward(q, q.clone(), k.clone(), v.clone(), o, lse)
            else:
                ca.attention_backward(q, q.clone(), k.clone(), v.clone(), o, lse)
        live = peak = 0
        sizes: dict[int, int] = {}
        for e in rec.events:
            if e["op"] == "malloc":
                sizes[e["id"]] = e["size"]
                live += e["size"]
                peak = max(peak, live)
            else:
                live -= sizes.pop(e["id"], 0)
        return peak

    q_bytes, kv_bytes = q.numel() * 4, k.numel() * 4
    # one call (q is under HEAD_GROUP_BYTES): its dq, expanded k, v and their gradients, five q's
    assert backward_peak(False) == q_bytes + 2 * kv_bytes + 5 * q_bytes
    # a group per key/value head, its gradients written over the inputs: one group's five
    assert backward_peak(True) == q_bytes + 2 * kv_bytes + 5 * q_bytes // n_kv
