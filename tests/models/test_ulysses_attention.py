"""Ulysses context-parallel attention's arithmetic in one process (NOTE [Ulysses context parallelism]).

The c ranks run as c threads whose all-to-all is an exchange of tensors in memory (part j of rank
i's tensor becomes part i of rank j's), so the reshuffles, the load-balanced layout and the
grouped-query handling are tested without a process group; the collective itself runs in several
processes in tests/distributed/test_distributed.py. Every rank's output, log-sum-exp and gradients must be its
rows of causal attention over the whole sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from memo.errors import MemoError
from memo.models.causal_attention import attention_backward, attention_forward
from memo.models.cp_attention import load_balanced_chunks
from memo.models.ulysses_attention import (
    finest_head_chunks,
    head_chunk_slices,
    head_chunks,
    kv_replicas,
    legal_head_chunks,
    ulysses_backward,
    ulysses_chunked_backward,
    ulysses_chunked_forward,
    ulysses_forward,
)


class _Exchange:
    """``all_to_all_single`` among ``size`` threads: rank i's part j becomes rank j's part i."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sent: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def of(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def exchange(t: torch.Tensor) -> torch.Tensor:
            assert t.shape[0] == self.size
            self.sent[rank] = t.clone()
            self.barrier.wait()
            out = torch.stack([self.sent[i][rank] for i in range(self.size)])
            self.barrier.wait()  # nobody overwrites its part before every rank has read it
            return out

        return exchange


def _on_ranks(size: int, fn: Callable[[int, Callable], Any]) -> list[Any]:
    exchange = _Exchange(size)

    def run(r: int) -> Any:
        try:
            return fn(r, exchange.of(r))
        except BaseException:
            exchange.barrier.abort()  # the other ranks stop waiting for this one
            raise

    with ThreadPoolExecutor(size) as pool:
        return [f.result() for f in [pool.submit(run, r) for r in range(size)]]


def _rows(s: int, size: int, rank: int) -> torch.Tensor:
    m = s // (2 * size)
    return torch.cat([torch.arange(c * m, (c + 1) * m) for c in load_balanced_chunks(rank, size)])


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("size,n,n_kv", [
    (2, 4, 2),  # key/value heads split like the query heads
    (3, 6, 3),  # an odd group
    (4, 4, 2),  # more ranks than key/value heads: each replicated twice
    (4, 8, 1),  # multi-query: the one key/value head replicated 4 times
])
def test_every_rank_gets_its_rows_of_causal_attention(size: int, n: int, n_kv: int, dtype: torch.dtype,
                                                       tol: float) -> None:
    torch.manual_seed(size * 10 + n_kv)
    s, b, d = 2 * size * 3, 2, 8  # chunks of 3: odd chunk length, local length 6
    q = torch.randn(s, b, n, d, dtype=dtype)
    k, v = (torch.randn(s, b, n_kv, d, dtype=dtype) for _ in range(2))
    o_ref, lse_ref = attention_forward(q, k, v)
    grad_o = torch.randn_like(o_ref)
    dq_ref, dk_ref, dv_ref = attention_backward(grad_o, q, k, v, o_ref, lse_ref)

    def rank(r: int, exchange: Callable) -> None:
        rows = _rows(s, size, r)
        o, lse = ulysses_forward(q[rows], k[rows], v[rows], size, exchange)
        assert o.shape == (2 * 3, b, n, d) and lse.shape == (b, n, 2 * 3) and lse.dtype == lse_ref.dtype
        assert o.is_contiguous() and lse.is_contiguous()  # as causal attention's: megatron views o
        assert _err(o, o_ref[rows]) < tol and _err(lse, lse_ref[..., rows]) < tol
        dq, dk, dv = ulysses_backward(grad_o[rows], q[rows], k[rows], v[rows], o, lse, size, exchange)
        assert dk.shape == (2 * 3, b, n_kv, d) and dk.dtype == dtype
        assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
        # every token's key/value gradient comes back whole to the rank that holds the token
        for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
            assert _err(got, want[rows]) < tol

    _on_ranks(size, rank)


def _bfloat16_case(s: int, b: int, n: int, n_kv: int, d: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """bfloat16 q, k, v and the float32 reference: o, lse and (grad_o = 1) dq, dk, dv."""
    q = torch.randn(s, b, n, d, dtype=torch.bfloat16)
    k, v = (torch.randn(s, b, n_kv, d, dtype=torch.bfloat16) for _ in range(2))
    ref = [t.float() for t in (q, k, v)]
    o_ref, lse_ref = attention_forward(*ref)
    return q, k, v, (o_ref, lse_ref, *attention_backward(torch.ones_like(o_ref), *ref, o_ref, lse_ref))


def test_bfloat16_keeps_the_dtypes_and_sums_replicas_in_float32() -> None:
    torch.manual_seed(0)
    size, s, b, n, n_kv, d = 4, 16, 1, 4, 1, 8
    q, k, v, (o_ref, lse_ref, dq_ref, dk_ref, dv_ref) = _bfloat16_case(s, b, n, n_kv, d)

    def rank(r: int, exchange: Callable) -> None:
        rows = _rows(s, size, r)
        o, lse = ulysses_forward(q[rows], k[rows], v[rows], size, exchange)
        assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
        dq, dk, dv = ulysses_backward(torch.ones_like(o), q[rows], k[rows], v[rows], o, lse, size, exchange)
        assert dk.dtype == dv.dtype == torch.bfloat16
        assert _err(o, o_ref[rows]) < 1e-2 and _err(dk, dk_ref[rows]) < 3e-2 and _err(dv, dv_ref[rows]) < 3e-2

    _on_ranks(size, rank)


def test_heads_the_ranks_cannot_share_and_odd_local_lengths_are_refused() -> None:
    assert [kv_replicas(8, 4, 2), kv_replicas(8, 2, 4), kv_replicas(8, 1, 8), kv_replicas(4, 4, 4)] == [
        1, 2, 8, 1]
    with pytest.raises(MemoError, match=r"4 query heads cannot be split over 3 context-parallel ranks.*"
                                        r"cp_comm_type \"all_gather\""):
        kv_replicas(4, 2, 3)
    with pytest.raises(MemoError, match="6 key/value heads cannot be shared by 4 context-parallel ranks"):
        kv_replicas(8, 6, 4)
    with pytest.raises(MemoError, match="2 key/value heads cannot be shared by 3"):
        kv_replicas(6, 2, 3)  # 3 ranks, neither a divisor nor a multiple of 2
    q = torch.randn(5, 1, 4, 8)
    with pytest.raises(MemoError, match="local sequence must be even; got 5 tokens.*multiple of 2·cp"):
        ulysses_forward(q, q, q, 2, lambda t: t)


def _chunked_matches_whole(size: int, n: int, n_kv: int, contiguous: bool, chunks: int | None,
                           dtype: torch.dtype, tol: float) -> None:
    """Each rank's chunked Ulysses forward and backward (``chunks`` None: the default count) equal its
    rows of causal attention over the whole sequence, within ``tol``."""
    s, b, d = 2 * size * 3, 2, 8
    q = torch.randn(s, b, n, d, dtype=dtype)
    k, v = (torch.randn(s, b, n_kv, d, dtype=dtype) for _ in range(2))
    o_ref, lse_ref = attention_forward(q, k, v)
    grad_o = torch.randn_like(o_ref)
    refs = attention_backward(grad_o, q, k, v, o_ref, lse_ref)

    def rank(r: int, exchange: Callable) -> None:
        local = s // size
        rows = torch.arange(r * local, (r + 1) * local) if contiguous else _rows(s, size, r)
        o, lse = ulysses_chunked_forward(q[rows], k[rows], v[rows], size, exchange, contiguous, chunks)
        assert _err(o, o_ref[rows]) < tol and _err(lse, lse_ref[..., rows]) < tol
        grads = ulysses_chunked_backward(grad_o[rows], q[rows], k[rows], v[rows], o, lse, size, exchange,
                                         contiguous, chunks)
        for got, want in zip(grads, refs, strict=True):
            assert got.shape == want[rows].shape and got.dtype == want.dtype and _err(got, want[rows]) < tol

    _on_ranks(size, rank)


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("size,n,n_kv,chunks", [
    (2, 8, 4, 2),  # each rank receives 2 key/value heads: 2 chunks of 4 query heads
    (2, 4, 4, 2),  # multi-head attention
    (2, 8, 8, 4),
    (4, 8, 2, 1),  # replicated key/value heads: each rank receives one, one chunk
])
def test_chunks_of_heads_give_the_same_attention(contiguous: bool, size: int, n: int, n_kv: int,
                                                 chunks: int) -> None:
    """NOTE [Ulysses over chunks of heads]: the exchange over chunks of heads, in either layout (NOTE
    [Contiguous Ulysses]), is causal attention over the whole sequence, every rank its rows."""
    assert head_chunks(n, n_kv, size) == chunks
    torch.manual_seed(chunks * 10 + n)
    _chunked_matches_whole(size, n, n_kv, contiguous, None, torch.float64, 1e-12)


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("size,n,n_kv,chunks", [
    (2, 8, 2, 2),  # GQA, default 1 chunk: each chunk one key/value head, its 4 query heads
    (2, 8, 2, 4),  # GQA, chunks inside a key/value group: every key/value head sent by two chunks
    (4, 8, 2, 2),  # fewer key/value heads than ranks: replicated within each chunk
    (2, 8, 8, 2),  # MHA, coarser than the default 4 (its finest: one query head per rank per chunk)
    (2, 8, 8, 1),  # MHA, all heads at once
    (2, 4, 1, 2),  # multi-query: the one key/value head sent by every chunk
])
def test_any_legal_count_of_chunks_gives_the_same_attention(
        contiguous: bool, size: int, n: int, n_kv: int, chunks: int) -> None:
    """NOTE [Ulysses over chunks of heads]: counts other than the default, finer ones splitting the query
    heads below one key/value head per rank, fp32."""
    assert chunks != head_chunks(n, n_kv, size) and chunks in legal_head_chunks(n, n_kv, size)
    torch.manual_seed(chunks * 10 + n + n_kv)
    _chunked_matches_whole(size, n, n_kv, contiguous, chunks, torch.float32, 1e-5)


def test_shared_key_value_gradients_sum_in_float32_for_bfloat16() -> None:
    torch.manual_seed(1)
    size, s, b, n, n_kv, d, chunks = 2, 16, 1, 8, 2, 8, 4  # every key/value head sent by 2 chunks
    q, k, v, (o_ref, lse_ref, dq_ref, dk_ref, dv_ref) = _bfloat16_case(s, b, n, n_kv, d)

    def rank(r: int, exchange: Callable) -> None:
        rows = _rows(s, size, r)
        o, lse = ulysses_chunked_forward(q[rows], k[rows], v[rows], size, exchange, False, chunks)
        dq, dk, dv = ulysses_chunked_backward(torch.ones_like(o), q[rows], k[rows], v[rows], o, lse, size,
                                              exchange, False, chunks)
        assert o.dtype == dk.dtype == dv.dtype == torch.bfloat16
        assert _err(o, o_ref[rows]) < 1e-2 and _err(dk, dk_ref[rows]) < 3e-2 and _err(dv, dv_ref[rows]) < 3e-2

    _on_ranks(size, rank)


def test_chunk_counts_the_heads_cannot_split_into_are_refused() -> None:
    # Llama-3.1-8B's heads at CP 8: 1, 2 or 4 chunks (4: one query head per rank, 2 key/value heads each)
    assert legal_head_chunks(32, 8, 8) == [1, 2, 4] and finest_head_chunks(32, 8, 8) == 4
    assert head_chunk_slices(32, 8, 8, 4)[1] == (slice(8, 16), slice(2, 4))
    assert finest_head_chunks(32, 8, 2) == 16 and finest_head_chunks(4, 4, 2) == 2
    with pytest.raises(MemoError, match="8 chunks of heads: a chunk of 4 query heads: 4 query heads "
                                        "cannot be split over 8.*legal counts: 1, 2, 4"):
        head_chunk_slices(32, 8, 8, 8)
    with pytest.raises(MemoError, match="8 query heads do not split into 3 chunks.*legal counts: 1, 2, 4"):
        head_chunk_slices(8, 2, 2, 3)
    with pytest.raises(MemoError, match="positive integer, got 0"):
        head_chunk_slices(8, 2, 2, 0)
    q, kv = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 2, 8)
    with pytest.raises(MemoError, match="do not split into 3 chunks"):
        ulysses_chunked_forward(q, kv, kv, 2, lambda t: t, True, 3)
