"""Causal attention over a context-parallel group: each rank's queries against every rank's keys.

NOTE [Context-parallel attention]
megatron-core's context parallelism over c ranks cuts a sequence of S tokens into 2·c chunks of
m = S/(2c) and gives rank r chunks r and 2c-1-r (its "load-balanced causal layout": every rank
then has the same causal work). A rank's layer sees its 2m tokens in that order; only attention
needs the other ranks' tokens. memo's context-parallel attention all-gathers K and V over the
group (backward: reduce-scatters their gradients), puts the gathered chunks in sequence order,
and runs each of its two query chunks (global chunk j, positions jm .. jm+m-1) as two blocks of
the same kernels as :mod:`memo.models.causal_attention`:

- the diagonal block, chunk j against keys jm .. jm+m-1, causal (a square block);
- the prefix block, chunk j against keys 0 .. jm-1, where every query sees every key.

The two partial outputs are merged by their log-sum-exps (``lse = logaddexp(lse1, lse2)``, each
output weighted by ``exp(lse_i - lse)``), which is exactly softmax attention over the union of
the keys. Backward runs each block's kernel with the *merged* output and log-sum-exp: the
kernels compute ``P = exp(S - lse)`` and ``dS = P (dP - rowsum(dO o))``, both of which are the
full attention's when given the full ``o`` and ``lse``, so the blocks' gradients add up to the
gradient of the whole (the identity ring and all-gather context parallelism rely on).

What a rank holds: K and V of all S tokens during the kernels (transient, as in megatron's
all-gather CP), its own q, o and lse only. Nothing here is saved across the call:
:func:`cp_attention_forward` / :func:`cp_attention_backward` take and return tensors, and
:func:`cp_attention` is the differentiable form (saving q, k, v at the rank's own length, o, lse,
as :func:`memo.models.causal_attention.attention` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from memo.errors import MemoError
from memo.models.causal_attention import _backward_kernels, _check, _forward_kernels, attention_backend

__all__ = ["GroupAttention", "chunk_positions", "cp_attention", "cp_attention_backward",
           "cp_attention_forward", "load_balanced_chunks", "segment_attention_backward",
           "segment_attention_forward"]

#: A query segment: rows ``[row, row + length)`` of the rank's q hold sequence positions
#: ``[pos, pos + length)``; they attend causally to keys ``0 .. pos + length - 1``.
Segment = tuple[int, int, int]


def load_balanced_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2·size) that context-parallel rank ``rank`` holds, in its local order."""
    if not 0 <= rank < size:
        raise MemoError(f"memo.models.cp_attention: rank {rank} is not in a group of {size}")
    return rank, 2 * size - 1 - rank


def chunk_positions(rank: int, size: int, local_len: int) -> list[Segment]:
    """Rank ``rank``'s query segments for a local sequence of ``local_len`` tokens (NOTE
    [Context-parallel attention])."""
    if local_len % 2:
        raise MemoError(
            f"memo.models.cp_attention: a context-parallel rank holds two equal chunks, so its local "
            f"sequence must be even; got {local_len} tokens. Make the sequence a multiple of 2·cp")
    m = local_len // 2
    return [(i * m, m, chunk * m) for i, chunk in enumerate(load_balanced_chunks(rank, size))]


def _lse_rows(lse: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` query rows of a kernel's log-sum-exp (the fp32 CUDA kernel pads them to 32)."""
    return lse[..., :n]


def _lse_for_kernel(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``lse [b, n, s]`` in the layout the backward kernel of ``q``'s dtype and device reads."""
    cuda_aten = attention_backend(q.device) in ("cudnn", "aten_cuda")  # fp32 runs the efficient kernel
    if cuda_aten and q.dtype not in (torch.float16, torch.bfloat16):
        pad = -lse.shape[-1] % 32  # NOTE [fp32 attention on CUDA]
        if pad:
            return torch.nn.functional.pad(lse, (0, pad)).contiguous()
    return lse.contiguous()


def segment_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of query segments at given positions against keys ``k, v: [S, b, n_kv, d]``
    in sequence order -> ``o: [s, b, n, d]``, ``lse: [b, n, s]`` (float32)."""
    backend = attention_backend(q.device)
    s, b, n, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.empty(s, b, n, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, n, s, dtype=acc, device=q.device)
    with torch.no_grad():
        for row, length, pos in segments:
            qs = q[row:row + length]
            o_d, lse_d = _forward_kernels(backend, qs, k[pos:pos + length], v[pos:pos + length], True)
            lse_d = _lse_rows(lse_d, length)
            if pos == 0:
                o[row:row + length], lse[..., row:row + length] = o_d, lse_d
                continue
            o_p, lse_p = _forward_kernels(backend, qs, k[:pos], v[:pos], False)
            lse_p = _lse_rows(lse_p, length)
            lse_d, lse_p = lse_d.to(acc), lse_p.to(acc)
            merged = torch.logaddexp(lse_d, lse_p)
            w_d = torch.exp(lse_d - merged).permute(2, 0, 1).unsqueeze(-1)
            w_p = torch.exp(lse_p - merged).permute(2, 0, 1).unsqueeze(-1)
            o[row:row + length] = (o_d.to(acc) * w_d + o_p.to(acc) * w_p).to(q.dtype)
            lse[..., row:row + length] = merged
    return o, lse


def segment_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               o: torch.Tensor, lse: torch.Tensor, segments: list[Segment]) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`segment_attention_forward` -> ``dq [s, b, n, d]`` (q's dtype), ``dk, dv
    [S, b, n_kv, d]`` in float32 for low-precision inputs: the blocks' shares are summed in float32,
    and a context-parallel caller sums dk, dv over its ranks before rounding them once."""
    backend = attention_backend(q.device)
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    grad_o = grad_o.contiguous()
    with torch.no_grad():
        for row, length, pos in segments:
            rows = slice(row, row + length)
            qs, go, os_ = q[rows], grad_o[rows], o[rows]
            ls = _lse_for_kernel(lse[..., rows], qs)
            dq_s, dk_s, dv_s = _backward_kernels(backend, go, qs, k[pos:pos + length], v[pos:pos + length],
                                                 os_, ls, True)
            dk[pos:pos + length] += dk_s
            dv[pos:pos + length] += dv_s
            if pos:
                dq_p, dk_p, dv_p = _backward_kernels(backend, go, qs, k[:pos], v[:pos], os_, ls, False)
                dq_s = dq_s.to(acc) + dq_p
                dk[:pos] += dk_p
                dv[:pos] += dv_p
            dq[rows] = dq_s
    return dq, dk, dv


def _group_layout(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _sequence_order(size: int, local_len: int, device: torch.device) -> torch.Tensor:
    """Rows of the rank-major all-gather (rank r's two chunks, ranks in order) in sequence order."""
    m = local_len // 2
    index = torch.empty(2 * size, dtype=torch.long)
    for r in range(size):
        for i, chunk in enumerate(load_balanced_chunks(r, size)):
            index[chunk] = 2 * r + i
    return (index[:, None] * m + torch.arange(m)).reshape(-1).to(device)


def _gather_sequence(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All ranks' ``t: [2m, ...]`` -> ``[2m·c, ...]`` in sequence order."""
    rank, size = _group_layout(group)
    t = t.contiguous()
    out = torch.empty((size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t, group=group)
    return out.index_select(0, _sequence_order(size, t.shape[0], t.device))


def _scatter_sequence(grad: torch.Tensor, local_len: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Adjoint of :func:`_gather_sequence`: the sum over ranks of each rank's rows."""
    _, size = _group_layout(group)
    rank_major = torch.empty_like(grad)
    rank_major.index_copy_(0, _sequence_order(size, local_len, grad.device), grad)
    out = torch.empty((local_len, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_tensor(out, rank_major, group=group)
    return out


def _segments(q: torch.Tensor, group: dist.ProcessGroup) -> list[Segment]:
    rank, size = _group_layout(group)
    return chunk_positions(rank, size, q.shape[0])


def cp_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's causal attention over the context-parallel ``group`` (NOTE [Context-parallel
    attention]); ``q: [2m, b, n, d]``, ``k, v: [2m, b, n_kv, d]`` -> ``o``, ``lse`` as
    :func:`memo.models.causal_attention.attention_forward`."""
    _check(q, k, v)
    segments = _segments(q, group)
    return segment_attention_forward(q, _gather_sequence(k, group), _gather_sequence(v, group), segments)


def cp_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          o: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`cp_attention_forward` for this rank's ``q, k, v`` (K/V gathered again;
    their gradients reduce-scattered back to the ranks that hold them)."""
    _check(q, k, v)
    segments = _segments(q, group)
    dq, dk, dv = segment_attention_backward(grad_o, q, _gather_sequence(k, group), _gather_sequence(v, group),
                                            o, lse, segments)
    return (dq, _scatter_sequence(dk, k.shape[0], group).to(k.dtype),
            _scatter_sequence(dv, v.shape[0], group).to(v.dtype))


class GroupAttention(torch.autograd.Function):
    """A context-parallel attention's two halves (``forward(q, k, v, group) -> (o, lse)``,
    ``backward(grad_o, q, k, v, o, lse, group) -> (dq, dk, dv)``) as one differentiable call that
    saves q, k, v at the rank's own length, o and lse: the all-gather form here, the Ulysses form in
    memo/models/ulysses_attention.py."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                halves: tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]],
                              Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
                ) -> torch.Tensor:
        o, lse = halves[0](q, k, v, group)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.backward_half = group, halves[1]
        return o

    @staticmethod
    def backward(ctx: Any, grad_o: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        return (*ctx.backward_half(grad_o, q, k, v, o, lse, ctx.group), None, None)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable :func:`cp_attention_forward`: ``-> o [2m, b, n, d]``."""
    return GroupAttention.apply(q, k, v, group, (cp_attention_forward, cp_attention_backward))
