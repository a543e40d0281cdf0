"""Attention under an arbitrary mask, in blocks of query rows (the kernels of Hugging Face models
that pass a mask memo's causal kernels cannot stand for: NOTE [HF attention masks] in
memo/adapters/hf.py). Exact math in float32, never an ``[s, s]`` score matrix at once; forward
returns the output and its log-sum-exp, backward recomputes the scores block by block."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["MASKED_BLOCK_SCORES", "is_plain_causal", "masked_attention_backward", "masked_attention_forward"]

#: Query rows per block of the masked attention: about this many float32 scores at a time.
MASKED_BLOCK_SCORES = 1 << 22


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The masked kernels compute in float32 on purpose: an ambient autocast would run their matmuls
    in 16 bits and turn a float mask's float32 min into -inf."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _block_rows(s: int, b: int, n: int) -> int:
    return max(1, min(s, MASKED_BLOCK_SCORES // max(1, b * n * s)))


def _stats(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scores(q_blk: torch.Tensor, kb: torch.Tensor, mask: torch.Tensor, i0: int, i1: int, g: int,
            scale: float) -> torch.Tensor:
    """Scaled, masked scores of query rows ``[i0:i1]``: ``[b, n_kv, g * c, s]`` (rows ordered by
    (group member, row))."""
    c = i1 - i0
    sc = torch.matmul(q_blk, kb.transpose(-1, -2)).mul_(scale)  # [b, n_kv, g*c, s]
    m = mask[:, :, i0:i1]  # [B, 1 or n, c, s]
    bsz, heads = m.shape[:2]
    if heads == 1:
        m = m.unsqueeze(2).expand(bsz, 1, g, c, m.shape[-1])
    else:
        m = m.reshape(bsz, heads // g, g, c, m.shape[-1])
    m = m.reshape(bsz, m.shape[1], g * c, m.shape[-1])
    if m.dtype == torch.bool:
        sc.masked_fill_(~m, float("-inf"))
    else:
        sc.add_(m.to(sc.dtype))
    return sc


def _probs(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of whole rows of scores (in place) and their log-sum-exp. Every block holds whole rows,
    so backward recomputes the probabilities the same way instead of from the log-sum-exp: a row
    whose float mask put every key at the dtype's min then gets eager's uniform weights, where
    ``exp(score - lse)`` would not (``lse`` rounds to the min). A row a boolean mask leaves empty gets
    0 (log-sum-exp ``-inf``)."""
    mx = sc.amax(dim=-1, keepdim=True)
    mx.masked_fill_(mx == float("-inf"), 0.0)
    p = sc.sub_(mx).exp_()
    total = p.sum(dim=-1, keepdim=True)
    p.div_(total.masked_fill(total == 0, 1.0))
    return p, mx + total.log()


def _rows_of(t: torch.Tensor, i0: int, i1: int, n_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """``t[i0:i1]: [c, b, n, d]`` -> ``[b, n_kv, g * c, d]`` in ``dtype`` (head j = kv head j // g)."""
    c, b, n, d = t[i0:i1].shape
    g = n // n_kv
    return t[i0:i1].to(dtype).permute(1, 2, 0, 3).reshape(b, n_kv, g * c, d)


def _put_rows(dst: torch.Tensor, i0: int, i1: int, rows: torch.Tensor) -> None:
    """Inverse of :func:`_rows_of`: ``rows [b, n_kv, g * c, d]`` -> ``dst[i0:i1]: [c, b, n, d]``."""
    c = i1 - i0
    b, n_kv, gc, d = rows.shape
    dst[i0:i1] = rows.reshape(b, n_kv * (gc // c), c, d).permute(2, 0, 1, 3)


def masked_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention under an explicit mask, without autograd (NOTE [HF attention masks]).

    Args:
        q: ``[s, b, n, d]``; k, v: ``[s, b, n_kv, d]`` with ``n % n_kv == 0``.
        mask: ``[B, 1 or n, s, s]`` (B = 1 or b); boolean (True = attend) or additive float.
        scale: softmax scale.

    Returns:
        ``o: [s, b, n, d]`` (q's dtype) and ``lse: [b, n, s]`` (float32, float64 for float64 inputs;
        ``-inf`` for a row a boolean mask leaves empty).
    """
    s, b, n, d = q.shape
    n_kv = k.shape[2]
    g = n // n_kv
    f = _stats(q.dtype)
    with torch.no_grad(), _no_autocast(q.device):
        kb = k.to(f).permute(1, 2, 0, 3)  # [b, n_kv, s, d]
        vb = v.to(f).permute(1, 2, 0, 3)
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(b, n, s, dtype=f, device=q.device)
        step = _block_rows(s, b, n)
        for i0 in range(0, s, step):
            i1 = min(s, i0 + step)
            p, m = _probs(_scores(_rows_of(q, i0, i1, n_kv, f), kb, mask, i0, i1, g, scale))
            _put_rows(o, i0, i1, torch.matmul(p, vb).to(q.dtype))
            lse[:, :, i0:i1] = m.view(b, n, i1 - i0)
            del p, m
    return o, lse


def masked_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              o: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`masked_attention_forward`: ``grad_o: [s, b, n, d]`` -> ``dq: [s, b, n, d]``,
    ``dk, dv: [s, b, n_kv, d]`` (grouped heads summed back), in the inputs' dtypes. The
    probabilities are recomputed from whole rows of scores (:func:`_probs`), so ``lse`` is not read;
    it is taken to keep the layer adapter's signature."""
    s, b, n, d = q.shape
    n_kv = k.shape[2]
    g = n // n_kv
    f = _stats(q.dtype)
    with torch.no_grad(), _no_autocast(q.device):
        kb = k.to(f).permute(1, 2, 0, 3)
        vb = v.to(f).permute(1, 2, 0, 3)
        # D_i = sum_j dO_ij O_ij, the softmax backward's row term.
        delta = (grad_o.to(f) * o.to(f)).sum(-1)  # [s, b, n]
        dq = torch.empty(s, b, n, d, dtype=q.dtype, device=q.device)
        dk = torch.zeros(b, n_kv, s, d, dtype=f, device=q.device)
        dv = torch.zeros(b, n_kv, s, d, dtype=f, device=q.device)
        step = _block_rows(s, b, n)
        for i0 in range(0, s, step):
            i1 = min(s, i0 + step)
            c = i1 - i0
            q_blk = _rows_of(q, i0, i1, n_kv, f)
            do_blk = _rows_of(grad_o, i0, i1, n_kv, f)
            p, _ = _probs(_scores(q_blk, kb, mask, i0, i1, g, scale))  # [b, n_kv, g*c, s]
            dv += torch.matmul(p.transpose(-1, -2), do_blk)
            dp = torch.matmul(do_blk, vb.transpose(-1, -2))
            delta_blk = delta[i0:i1].permute(1, 2, 0).reshape(b, n_kv, g * c, 1)
            ds = p.mul_(dp.sub_(delta_blk))  # dS = P * (dP - D), in place of p
            del dp
            _put_rows(dq, i0, i1, torch.matmul(ds, kb).mul_(scale).to(q.dtype))
            dk += torch.matmul(ds.transpose(-1, -2), q_blk).mul_(scale)
            del p, ds, q_blk, do_blk
    dk, dv = (t.permute(2, 0, 1, 3).to(k.dtype).contiguous() for t in (dk, dv))
    return dq, dk, dv


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Where a mask block lets a query see a key: True entries of a boolean mask, 0 of a float one."""
    return mask if mask.dtype == torch.bool else mask == 0


def is_plain_causal(mask: torch.Tensor) -> bool:
    """Whether ``mask [B, H, s, s]`` is exactly causal in every batch row and head: a float mask must
    hold only 0 (allowed) and its dtype's min or -inf (masked), so that memo's causal kernels give
    the same numbers (checked in blocks of rows, never an ``[s, s]`` temporary)."""
    s = mask.shape[-1]
    step = max(1, (1 << 24) // max(1, s * mask.shape[0] * mask.shape[1]))
    cols = torch.arange(s, device=mask.device)
    for i0 in range(0, s, step):
        i1 = min(s, i0 + step)
        blk = mask[:, :, i0:i1]
        causal = cols[None, :] <= torch.arange(i0, i1, device=mask.device)[:, None]
        if not torch.equal(_allowed(blk), causal.expand_as(blk)):
            return False
        if blk.dtype != torch.bool:
            masked = blk[~causal.expand_as(blk)]
            gone = (masked == torch.finfo(blk.dtype).min) | (masked == float("-inf"))
            if not bool(gone.all()):
                return False
    return True
