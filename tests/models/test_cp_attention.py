"""Context-parallel attention's arithmetic in one process (NOTE [Context-parallel attention]).

The collectives are tested in several processes (tests/distributed/test_distributed.py); here every rank's
query segments, attended against the whole sequence's keys, must give causal attention's output,
log-sum-exp and gradients, the keys' gradients summed over ranks.
"""

from __future__ import annotations

import pytest
import torch

from memo.errors import MemoError
from memo.models.causal_attention import attention_backward, attention_forward
from memo.models.cp_attention import (
    _sequence_order,
    chunk_positions,
    load_balanced_chunks,
    segment_attention_backward,
    segment_attention_forward,
)


def test_load_balanced_layout() -> None:
    assert [load_balanced_chunks(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert chunk_positions(1, 2, 6) == [(0, 3, 3), (3, 3, 6)]  # rows 0-2 hold positions 3-5, rows 3-5 6-8
    # rank-major all-gather of 2 ranks x 2 chunks of 2 rows, in sequence order
    assert _sequence_order(2, 4, torch.device("cpu")).tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    with pytest.raises(MemoError, match="multiple of 2·cp"):
        chunk_positions(0, 2, 5)
    with pytest.raises(MemoError, match="rank 2 is not in a group of 2"):
        load_balanced_chunks(2, 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_every_rank_segments_give_causal_attention(cp: int, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(cp)
    s, b, n, n_kv, d = 12 * cp, 2, 4, 2, 8
    q = torch.randn(s, b, n, d, dtype=dtype)
    k, v = (torch.randn(s, b, n_kv, d, dtype=dtype) for _ in range(2))
    o_ref, lse_ref = attention_forward(q, k, v)
    grad_o = torch.randn_like(o_ref)
    dq_ref, dk_ref, dv_ref = attention_backward(grad_o, q, k, v, o_ref, lse_ref)
    dk_sum, dv_sum = torch.zeros_like(k), torch.zeros_like(v)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    for r in range(cp):
        segments = chunk_positions(r, cp, s // cp)
        rows = torch.cat([torch.arange(pos, pos + length) for _, length, pos in segments])
        o, lse = segment_attention_forward(q[rows], k, v, segments)
        assert err(o, o_ref[rows]) < tol and err(lse, lse_ref[..., rows]) < tol
        dq, dk, dv = segment_attention_backward(grad_o[rows], q[rows], k, v, o, lse, segments)
        assert err(dq, dq_ref[rows]) < tol
        dk_sum += dk
        dv_sum += dv
    assert err(dk_sum, dk_ref) < tol and err(dv_sum, dv_ref) < tol
