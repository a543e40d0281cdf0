"""Causal attention for the reference models: one module, three entry points.

Shapes are sequence-first like the rest of memo: ``q: [s, b, n, d]``,
``k, v: [s, b, n_kv, d]`` with ``n % n_kv == 0`` (grouped-query attention when
``n_kv < n``), output ``o: [s, b, n, d]`` and log-sum-exp ``lse: [b, n, s]``
(float32; float64 for float64 inputs on CPU; fp32 inputs on CUDA pad s to a multiple of 32,
NOTE [fp32 attention on CUDA]).

- :func:`attention` is differentiable. It is an ``autograd.Function`` built on
  the two explicit halves below, so what autograd keeps for backward is exactly
  ``q, k, v, o, lse`` (see NOTE [Attention saved tensors]).
- :func:`attention_forward` returns ``(o, lse)`` without recording a graph.
- :func:`attention_backward` turns ``grad_o`` into ``(dq, dk, dv)`` from the
  saved tensors; memo's runtime calls the halves directly.
- :func:`document_attention` (and its halves) is the same attention within each of the documents
  packed into a row, never across them (NOTE [Attention over packed documents]).

Backends, chosen once per device (memo/models/attention_kernels.py, NOTE [Choosing the attention
kernel]):

- CUDA, compute capability 9.0 and above with cuDNN 9: ``aten._scaled_dot_product_cudnn_attention``
  and its ``_backward`` for fp16/bf16 (head dims cuDNN takes; others run torch's flash kernel).
- CUDA with flash-attn >= 2.7 installed: ``flash_attn``'s forward/backward
  kernels (imported lazily; they handle grouped-query attention natively).
- CUDA otherwise: ``aten._scaled_dot_product_flash_attention`` and its ``_backward`` for
  fp16/bf16; the memory-efficient kernel for fp32 on every CUDA backend (NOTE [fp32 attention on CUDA]).
- CPU and meta: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  ``_backward``. Both have meta kernels in torch 2.13, so shapes and dtypes on
  the meta device come from the same ops as on CPU; no meta-only fallback is
  needed.

NOTE [Attention saved tensors]
Memo moves or recomputes every tensor a layer saves for backward except the
attention output, and its memory accounting assumes the attention saves
exactly q, k, v (at their own, un-expanded head count), o and lse. The aten
ops want k and v with as many heads as q, so grouped-query inputs are expanded
inside forward and backward and the expanded copies are freed right away;
they are transient, never saved.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch

from memo.errors import MemoError
from memo.models.attention_kernels import attention_kernel, cudnn_takes
from memo.models.attention_kernels import flash_attn_module as _flash_attn_module

__all__ = ["DocumentOffsets", "attention", "attention_backend", "attention_backward", "attention_forward",
           "gradients_into_inputs",
           "document_attention", "document_attention_backward", "document_attention_forward",
           "longest_document"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise MemoError(
            "memo.models.attention: q, k, v must be [s, b, n, d]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise MemoError(
            "memo.models.attention: k and v must be [s, b, n_kv, d] matching q's s, b and d; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise MemoError(
            f"memo.models.attention: q has {q.shape[2]} heads, k/v have {k.shape[2]}; the query head "
            "count must be a multiple of the key/value head count (grouped-query attention)"
        )
    if 0 in q.shape:
        # The CPU flash kernel divides by the sequence length: an empty tensor kills the process
        # with SIGFPE instead of raising.
        raise MemoError(f"memo.models.attention: q, k, v are empty (shape {tuple(q.shape)}); attention "
                        "needs at least one token, one sequence, one head and one channel")


def attention_backend(device: torch.device | str) -> str:
    """Which kernels serve tensors on ``device``: ``"cudnn"``, ``"flash_attn"``, ``"aten_cuda"`` or
    ``"aten_cpu"``, chosen once per device (NOTE [Choosing the attention kernel] in
    memo/models/attention_kernels.py)."""
    return attention_kernel(device)


def _expand_heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    # Query head j uses key/value head j // group (Megatron and Llama order).
    group = n_heads // t.shape[2]
    return t if group == 1 else t.repeat_interleave(group, dim=2)


# NOTE [Attention in head groups]
# The aten kernels want k and v with as many heads as q, and return dk, dv at that count too, so one
# call over every head holds, beside its inputs, expanded copies of k and v and expanded gradients:
# about five q-sized transients in backward. At long sequences that is the largest thing a layer
# allocates (a Llama-3.1-8B rank at 512K tokens: q is 4 GiB, so ~20 GiB). Heads are independent, so
# the kernels run on groups of whole key/value heads (with their query heads), each group's q at
# most HEAD_GROUP_BYTES, writing into the full-size outputs: the transients shrink to one group's,
# and the numbers are the same (each head's arithmetic is untouched). A q within the bound runs in
# one call; flash-attn takes grouped heads natively and always runs in one call.
HEAD_GROUP_BYTES = 256 << 20


def _head_groups(q: torch.Tensor, k: torch.Tensor, per_kv_head: bool = False) -> list[tuple[slice, slice]]:
    """(query heads, key/value heads) of each group NOTE [Attention in head groups] runs (one per
    key/value head, ``per_kv_head``)."""
    n, n_kv = q.shape[2], k.shape[2]
    per_kv = q.numel() // n_kv * q.element_size()  # q bytes per key/value head
    kv_per_group = 1 if per_kv_head else max(1, min(n_kv, HEAD_GROUP_BYTES // max(per_kv, 1)))
    while n_kv % kv_per_group:
        kv_per_group -= 1
    g = n // n_kv
    return [(slice(j * g, (j + kv_per_group) * g), slice(j, j + kv_per_group))
            for j in range(0, n_kv, kv_per_group)]


# NOTE [Gradients written over q, k, v]
# Attention's backward reads q, k, v and makes dq, dk, dv of the same sizes; a caller that reads q, k, v
# no more (memo's input-only layer, whose recomputed q, k, v are its own) lets it write them over its
# inputs, within :func:`gradients_into_inputs`. The kernels then run on head groups (NOTE [Attention in
# head groups]), at least one group per key/value head: each group's gradients are written over its own
# heads of q, k and v once its kernel has run, and no later group reads those heads, so the backward
# holds its inputs and one group's transients instead of its inputs and its outputs. The numbers are the
# same (each head's arithmetic is untouched). A permission of the calling thread, not an argument: it
# passes through adapters' core_backward, which call attention_backward with positional tensors.
_INTO_INPUTS = threading.local()


@contextlib.contextmanager
def gradients_into_inputs() -> Iterator[None]:
    """Within: :func:`attention_backward` may write dq, dk, dv over the q, k, v it is given (the caller
    reads them no more; NOTE [Gradients written over q, k, v])."""
    before = getattr(_INTO_INPUTS, "on", False)
    _INTO_INPUTS.on = True
    try:
        yield
    finally:
        _INTO_INPUTS.on = before


def _reduce_heads(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    s, b, n, d = grad.shape
    return grad if n == n_kv else grad.view(s, b, n_kv, n // n_kv, d).sum(dim=3)


# NOTE [fp32 attention on CUDA]
# PyTorch's flash kernel takes fp16/bf16 only. fp32 goes to the memory-efficient kernel, which
# also returns the log-sum-exp in fp32 and has an explicit backward. Its lse is padded along the
# sequence to a multiple of 32 ([b, n, ceil(s/32)*32]); memo keeps it as the kernel returns it,
# since its backward reads that layout.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
#: The backends that run torch's own CUDA kernels: cuDNN's for the calls it takes, torch's flash kernel
#: for other fp16/bf16 calls, the memory-efficient kernel for fp32.
_CUDA_ATEN = ("cudnn", "aten_cuda")


def _no_philox(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Stand-in philox seed/offset for kernels run without dropout (they never read it)."""
    return torch.empty(0, dtype=dtype, device=device)


def _bnsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, n, d] -> [b, n, s, d] as a view (the aten kernels take any strides)."""
    return t.permute(1, 2, 0, 3)


def _sbnd(t: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> contiguous [s, b, n, d] (the layout the output projection reads)."""
    return t.permute(2, 0, 1, 3).contiguous()


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention forward without autograd.

    Args:
        q: ``[s, b, n, d]``.
        k, v: ``[s, b, n_kv, d]``, ``n % n_kv == 0``.

    Returns:
        ``o: [s, b, n, d]`` (contiguous, dtype of q) and ``lse: [b, n, s]`` (float32; float64 for
        float64 inputs), the log-sum-exp of each query's scaled scores, which
        :func:`attention_backward` needs.
    """
    _check(q, k, v)
    with torch.no_grad():
        return _forward_kernels(attention_backend(q.device), q, k, v)


def attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of causal attention from the tensors :func:`attention_forward` produced.

    Args:
        grad_o: ``[s, b, n, d]``, gradient of the output.
        q, k, v: the forward inputs (``k, v`` at their own head count ``n_kv``).
        o, lse: the forward outputs.

    Returns:
        ``dq: [s, b, n, d]``, ``dk, dv: [s, b, n_kv, d]`` (grouped heads summed back), contiguous.
    """
    _check(q, k, v)
    with torch.no_grad():
        # The flash kernels need a unit stride in the last dimension; autograd may hand us
        # an expanded or transposed gradient.
        return _backward_kernels(attention_backend(q.device), grad_o.contiguous(), q, k, v, o, lse,
                                 into_inputs=getattr(_INTO_INPUTS, "on", False))


def _forward_kernels(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal=False`` lets every query see every key (``k`` may be longer or shorter than ``q``): the
    off-diagonal blocks of context-parallel attention (memo/models/cp_attention.py). ``scale``: of the
    scores, ``1/sqrt(d)`` when None."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if backend == "flash_attn":
        fa = _flash_attn_module()
        # flash-attn is batch-first [b, s, n, d] and handles n_kv < n itself.
        bq, bk, bv = (t.transpose(0, 1) for t in (q, k, v))
        out, lse, _, _ = fa._flash_attn_forward(  # type: ignore[attr-defined]
            bq, bk, bv, 0.0, scale, causal, -1, -1, 0.0, None, False
        )  # fmt: skip
        return out.transpose(0, 1).contiguous(), lse
    groups = _head_groups(q, k)
    if len(groups) > 1:  # NOTE [Attention in head groups]
        o = q.new_empty(q.shape)
        lse = None
        for qh, kh in groups:
            o_g, lse_g = _aten_forward(backend, q[:, :, qh], k[:, :, kh], v[:, :, kh], causal, scale)
            if lse is None:
                lse = lse_g.new_empty((lse_g.shape[0], q.shape[2], lse_g.shape[2]))
            o[:, :, qh], lse[:, qh] = o_g, lse_g
            del o_g, lse_g
        return o, lse
    return _aten_forward(backend, q, k, v, causal, scale)


def _aten_forward(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = q.shape[2]
    kx, vx = _expand_heads(k, n), _expand_heads(v, n)
    if backend == "cudnn" and cudnn_takes(q):
        # cuDNN's log-sum-exp is [b, n, s, 1]; memo keeps [b, n, s] as the other kernels give it.
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bnsd(q), _bnsd(kx), _bnsd(vx), None, True, 0.0, causal, False, scale=scale
        )[:2]
        lse = lse.squeeze(-1)
    elif backend in _CUDA_ATEN and q.dtype in _FLASH_DTYPES:
        result = torch.ops.aten._scaled_dot_product_flash_attention(
            _bnsd(q), _bnsd(kx), _bnsd(vx), 0.0, causal, False, scale=scale
        )
        out, lse = result[0], result[1]
    elif backend in _CUDA_ATEN:
        # NOTE [fp32 attention on CUDA]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bnsd(q), _bnsd(kx), _bnsd(vx), None, True, 0.0, causal, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bnsd(q), _bnsd(kx), _bnsd(vx), 0.0, causal, scale=scale
        )
    del kx, vx
    return _sbnd(out), lse


def _backward_kernels(backend: str, grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      o: torch.Tensor, lse: torch.Tensor,
                      causal: bool = True, scale: float | None = None, into_inputs: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``into_inputs``: dq, dk, dv written over q, k, v (NOTE [Gradients written over q, k, v]); not
    with flash-attn, whose one call holds them all."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if backend == "flash_attn":
        fa = _flash_attn_module()
        bq, bk, bv, bo, bg = (t.transpose(0, 1).contiguous() for t in (q, k, v, o, grad_o))
        dq, dk, dv = torch.empty_like(bq), torch.empty_like(bk), torch.empty_like(bv)
        fa._flash_attn_backward(  # type: ignore[attr-defined]
            bg, bq, bk, bv, bo, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, False, None
        )  # fmt: skip
        return tuple(t.transpose(0, 1).contiguous() for t in (dq, dk, dv))  # type: ignore[return-value]
    groups = _head_groups(q, k, per_kv_head=into_inputs)
    if len(groups) > 1 or into_inputs:  # NOTE [Attention in head groups]
        if into_inputs:  # NOTE [Gradients written over q, k, v]
            dq, dk, dv = q, k, v
        else:
            dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
        for qh, kh in groups:
            dq[:, :, qh], dk[:, :, kh], dv[:, :, kh] = _aten_backward(
                backend, grad_o[:, :, qh], q[:, :, qh], k[:, :, kh], v[:, :, kh], o[:, :, qh],
                lse[:, qh].contiguous(), causal, scale)
        return dq, dk, dv
    return _aten_backward(backend, grad_o, q, k, v, o, lse, causal, scale)


def _aten_backward(backend: str, grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, n_kv = q.shape[2], k.shape[2]
    kx, vx = _expand_heads(k, n), _expand_heads(v, n)
    if backend == "cudnn" and cudnn_takes(q):
        # Without dropout the kernel never reads the philox seed/offset (NOTE [Attention saved tensors]).
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bnsd(grad_o), _bnsd(q), _bnsd(kx), _bnsd(vx), _bnsd(o), lse.unsqueeze(-1), seed, seed,
            None, None, None, q.shape[0], k.shape[0], 0.0, causal, scale=scale,
        )  # fmt: skip
    elif backend in _CUDA_ATEN and q.dtype in _FLASH_DTYPES:
        # A dense batch has no cumulative sequence lengths: the forward returns undefined tensors
        # for them and so do we (None). A defined tensor, even an empty one, selects the
        # variable-length kernel, which refuses 4-D inputs. Without dropout the kernel never
        # reads the philox seed/offset, so nothing beyond q, k, v, o, lse has to be saved
        # (NOTE [Attention saved tensors]).
        seed = _no_philox(q.device, torch.uint64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bnsd(grad_o), _bnsd(q), _bnsd(kx), _bnsd(vx), _bnsd(o), lse, None, None, q.shape[0], k.shape[0],
            0.0, causal, seed, seed, scale=scale,
        )  # fmt: skip
    elif backend in _CUDA_ATEN:
        seed = _no_philox(q.device, torch.int64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bnsd(grad_o), _bnsd(q), _bnsd(kx), _bnsd(vx), None, _bnsd(o), lse, seed, seed,
            0.0, [True, True, True, False], causal, scale=scale,
        )[:3]  # fmt: skip
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bnsd(grad_o), _bnsd(q), _bnsd(kx), _bnsd(vx), _bnsd(o), lse, 0.0, causal, scale=scale
        )
    del kx, vx
    return _sbnd(dq), _reduce_heads(_sbnd(dk), n_kv), _reduce_heads(_sbnd(dv), n_kv)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        o, lse = attention_forward(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_o: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        return attention_backward(grad_o, q, k, v, o, lse)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Differentiable causal attention. ``q: [s, b, n, d]``, ``k, v: [s, b, n_kv, d]`` -> ``[s, b, n, d]``.

    Saves exactly ``q, k, v, o, lse`` for backward (NOTE [Attention saved tensors]).
    """
    return _Attention.apply(q, k, v)


# NOTE [Attention over packed documents]
# Documents packed into one row attend causally within themselves and never across: the mask is
# block-diagonal, one causal block per document. memo never forms it. A row's documents are given as
# offsets, like flash-attention's cu_seqlens: ``0 = o_0 < o_1 < ... < o_m = s``, document j being
# tokens ``[o_j, o_{j+1})``. Each document runs through the causal kernels above on its own tokens
# (consecutive batch rows with the same offsets together), writing into the full-size outputs: the
# numbers are those of each document's attention run alone, and memory is the kernels' own, linear in
# s (their head groups and GQA handling included), never a score or mask matrix over the row. The
# log-sum-exp is ``[b, n, s]`` on every backend: the fp32 CUDA kernel's padding (NOTE [fp32 attention
# on CUDA]) is cut off per document in forward and put back (+inf, rows it never reads) in backward.

#: Per batch row, the offsets of its documents (NOTE [Attention over packed documents]).
DocumentOffsets = tuple[tuple[int, ...], ...]


def _row_runs(offsets: DocumentOffsets, s: int, b: int) -> list[tuple[slice, tuple[int, ...]]]:
    """Consecutive batch rows with the same offsets, as ``(rows, offsets)``; a MemoError for offsets
    that do not cut ``s`` tokens of ``b`` rows into documents."""
    if len(offsets) != b:
        raise MemoError(f"memo.models.attention: document offsets for {len(offsets)} rows, the batch has {b}")
    for row in offsets:
        if len(row) < 2 or row[0] != 0 or row[-1] != s or any(a >= e for a, e in _pairs(row)):
            raise MemoError(f"memo.models.attention: document offsets {list(row)[:8]} do not cut {s} tokens "
                            "into documents; give 0 = o_0 < o_1 < ... < o_m = s per row (cu_seqlens)")
    runs: list[tuple[slice, tuple[int, ...]]] = []
    for r, row in enumerate(offsets):
        if runs and runs[-1][1] == row:
            runs[-1] = (slice(runs[-1][0].start, r + 1), row)
        else:
            runs.append((slice(r, r + 1), row))
    return runs


def _spans(offsets: DocumentOffsets, s: int, b: int) -> list[tuple[slice, int, int]]:
    """``(rows, start, end)`` of every document the kernels run (NOTE [Attention over packed documents])."""
    return [(rows, a, e) for rows, row in _row_runs(offsets, s, b) for a, e in _pairs(row)]


def _pairs(row: tuple[int, ...]) -> zip[tuple[int, int]]:
    return zip(row, row[1:], strict=False)


def longest_document(offsets: DocumentOffsets) -> int:
    """The most tokens of one document in ``offsets`` (NOTE [Attention over packed documents])."""
    return max(e - a for row in offsets for a, e in _pairs(row))


def document_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: DocumentOffsets,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each packed document, without autograd (NOTE [Attention over packed
    documents]).

    Args:
        q: ``[s, b, n, d]``; k, v: ``[s, b, n_kv, d]``, ``n % n_kv == 0``.
        offsets: per batch row, ``0 = o_0 < ... < o_m = s``: its documents ``[o_j, o_{j+1})``.
        scale: of the scores, ``1/sqrt(d)`` when None.

    Returns:
        ``o: [s, b, n, d]`` (contiguous, dtype of q) and ``lse: [b, n, s]`` as :func:`attention_forward`'s
        (never padded).
    """
    _check(q, k, v)
    s, b, n, _ = q.shape
    backend = attention_backend(q.device)
    with torch.no_grad():
        o = q.new_empty(q.shape)
        lse: torch.Tensor | None = None
        for rows, a, e in _spans(offsets, s, b):
            o_i, lse_i = _forward_kernels(backend, q[a:e, rows], k[a:e, rows], v[a:e, rows], scale=scale)
            if lse is None:
                lse = lse_i.new_empty((b, n, s))
            o[a:e, rows], lse[rows, :, a:e] = o_i, lse_i[..., :e - a]
            del o_i, lse_i
    assert lse is not None
    return o, lse


def document_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                o: torch.Tensor, lse: torch.Tensor, offsets: DocumentOffsets,
                                scale: float | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`document_attention_forward`: ``dq: [s, b, n, d]``, ``dk, dv: [s, b, n_kv, d]``."""
    _check(q, k, v)
    s, b = q.shape[:2]
    backend = attention_backend(q.device)
    padded = backend in _CUDA_ATEN and q.dtype not in _FLASH_DTYPES  # NOTE [fp32 attention on CUDA]
    grad_o = grad_o.contiguous()
    with torch.no_grad():
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
        for rows, a, e in _spans(offsets, s, b):
            lse_i = lse[rows, :, a:e].contiguous()
            if padded:
                lse_i = torch.nn.functional.pad(lse_i, (0, -(e - a) % 32), value=float("inf"))
            dq[a:e, rows], dk[a:e, rows], dv[a:e, rows] = _backward_kernels(
                backend, grad_o[a:e, rows], q[a:e, rows], k[a:e, rows], v[a:e, rows], o[a:e, rows], lse_i,
                scale=scale)
        return dq, dk, dv


class _DocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                offsets: DocumentOffsets, scale: float | None):
        o, lse = document_attention_forward(q, k, v, offsets, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.offsets, ctx.scale = offsets, scale  # type: ignore[attr-defined]
        return o

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_o: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = document_attention_backward(grad_o, q, k, v, o, lse, ctx.offsets,  # type: ignore[attr-defined]
                                                 ctx.scale)  # type: ignore[attr-defined]
        return dq, dk, dv, None, None


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: DocumentOffsets,
                       scale: float | None = None) -> torch.Tensor:
    """Differentiable :func:`document_attention_forward`: ``q: [s, b, n, d]``, ``k, v: [s, b, n_kv, d]``
    -> ``[s, b, n, d]``; saves exactly ``q, k, v, o, lse`` (NOTE [Attention saved tensors])."""
    return _DocumentAttention.apply(q, k, v, offsets, scale)
