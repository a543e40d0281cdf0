"""Chunked LM head + cross-entropy that never holds the full ``[s·b, V]`` logits.

With V = 50257 and a 1M-token sequence the full fp32 logits would be 200 GB;
even at 32K tokens they are 6.6 GB plus as much again for their gradient. The
function below walks over token chunks: forward keeps only each token's
log-sum-exp, backward recomputes one chunk's logits at a time and turns them
into that chunk's gradient in place.

NOTE [The final norm in the loss's chunks]
The final norm is token-wise, so it can run chunk by chunk inside the loss too. Applied to the
whole sequence first, it holds its input upcast to float32 and several float32 temporaries of the
whole sequence in backward (five [s, h] float32 tensors for torch's RMSNorm on bf16): at long
sequences the largest allocation of an iteration (a Llama-3.1-8B rank at 512K tokens: 8 GiB each).
Inside the chunks, forward runs the norm without a graph, and backward runs it again on each chunk
with autograd and takes that chunk's gradients for x and the norm's parameters (summed in float32
over chunks, as the head weight's are), so only one chunk's temporaries exist at a time. What is
saved is x before the norm instead of after it: the same size. A sequence-parallel rank keeps the
norm outside (its norm sees the rank's own tokens, before the gather).

NOTE [Chunked loss saved tensors]
Saved for backward: the normed hidden states ``x``, the head weight, the labels
and a float32 log-sum-exp per token (4 bytes per token, negligible next to x;
float64 for float64 inputs).
Peak extra memory in either direction is one chunk of logits (plus, for
16-bit weights, a float32 accumulator for the weight gradient so that
thousands of per-chunk additions do not round away in bf16).

With ``sequence_gather=t > 1`` the function is the LM head of one rank of a
Megatron tensor + sequence parallel group (NOTE [Tensor-parallel rank] in
:mod:`memo.models.parallel`): ``x`` holds the rank's ``n`` local tokens, is
all-gathered to ``n·t`` tokens inside forward and again inside backward (transient,
as megatron-core's column-parallel output layer does), and only the local ``x`` is
saved; ``weight`` is the rank's vocabulary slice, so each chunk's logits are
``[chunk, V/t]``, and the ``[n·t, b, h]`` input gradient is reduce-scattered to
``[n, b, h]``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from memo.errors import MemoError
from memo.models.parallel import all_gather_tokens, reduce_scatter_tokens
from memo.repeated_tiles import run_tiles

__all__ = ["DEFAULT_CHUNK_BYTES", "IGNORE_INDEX", "chunked_lm_loss", "default_chunk_tokens"]

#: Labels equal to this are left out of the loss and its mean (same as ``F.cross_entropy``).
IGNORE_INDEX = -100

#: Target size of one chunk's float32 logits: 128 MiB is 667 tokens at V = 50257. Noise
#: next to the activations of long sequences, yet few enough chunks (~1600 for 1M tokens)
#: that the per-chunk matmuls stay efficient and a meta-device profile of the head at 1M
#: tokens takes seconds (each chunk is a handful of kernel launches).
DEFAULT_CHUNK_BYTES = 128 * 1024 * 1024


def default_chunk_tokens(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits take about ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in float32 for 16-bit inputs, in the input's own dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(x_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the input dtype (tensor cores for bf16); softmax statistics in fp32.
    logits = x_chunk @ weight.t()
    return logits.to(_stats_dtype(logits.dtype))


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
        gather: int,
        norm: torch.nn.Module | None,
        norm_names: tuple[str, ...],
        *norm_params: torch.Tensor,
    ) -> torch.Tensor:
        # gather > 1: one tensor-parallel rank's head; x is local, the logits cover gathered tokens.
        xg = x if gather == 1 else all_gather_tokens(x, gather)
        s, b, h = xg.shape
        n_tokens = s * b
        flat_x = xg.reshape(n_tokens, h)
        # x is [s, b, h] flattened token-major as t = i*b + j, so labels go [b, s] -> [s, b] too.
        flat_labels = labels.t().reshape(n_tokens)
        valid = flat_labels != ignore_index
        safe_labels = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
        stats = _stats_dtype(x.dtype)
        lse = torch.empty(n_tokens, dtype=stats, device=x.device)
        total = torch.zeros((), dtype=stats, device=x.device)
        for start in _chunk_starts(n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            logits = _chunk_logits(_normed(norm, flat_x[start:end]), weight)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, safe_labels[start:end, None]).squeeze(1)
            lse[start:end] = chunk_lse
            total += ((chunk_lse - target) * valid[start:end]).sum()
            del logits
        del flat_x, xg
        n_valid = valid.sum()
        ctx.save_for_backward(x, weight, flat_labels, lse, n_valid, *norm_params)
        ctx.norm, ctx.norm_names = norm, norm_names
        ctx.chunk_tokens = chunk_tokens
        ctx.ignore_index = ignore_index
        ctx.gather = gather
        # Mean over non-ignored tokens; 0/0 = nan when every label is ignored, like F.cross_entropy.
        return (total / n_valid).to(x.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor):
        x, weight, flat_labels, lse, n_valid, *norm_params = ctx.saved_tensors
        xg = x if ctx.gather == 1 else all_gather_tokens(x, ctx.gather)
        s, b, h = xg.shape
        n_tokens = s * b
        flat_x = xg.reshape(n_tokens, h)
        valid = flat_labels != ctx.ignore_index
        safe_labels = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
        scale = grad_loss.to(lse.dtype) / n_valid
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(flat_x) if need_x else None
        acc_dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        norm = ctx.norm
        need_norm = [ctx.needs_input_grad[8 + i] for i in range(len(norm_params))]
        # the norm runs again with the tensors its forward ran with (a functional_call may have
        # substituted them then: NOTE [Recompute with the forward's tensors] in memo/runtime/module_state.py)
        forward_params = dict(zip(ctx.norm_names, norm_params, strict=True))
        grad_norm = [torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)
                     if need else None for p, need in zip(norm_params, need_norm, strict=True)]
        for start in _chunk_starts(n_tokens, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n_tokens)
            x_chunk = flat_x[start:end]
            if norm is not None:  # NOTE [The final norm in the loss's chunks]
                x_in = x_chunk.detach().requires_grad_(need_x)
                with torch.enable_grad():
                    x_chunk = torch.func.functional_call(norm, forward_params, (x_in,))
            # d loss / d logits = (softmax - onehot(target)) * scale, zero for ignored tokens.
            grad_logits = _chunk_logits(x_chunk, weight)
            grad_logits.sub_(lse[start:end, None]).exp_()
            grad_logits.scatter_add_(
                1,
                safe_labels[start:end, None],
                torch.full((end - start, 1), -1.0, dtype=grad_logits.dtype, device=x.device),
            )
            grad_logits.mul_((scale * valid[start:end])[:, None])
            grad_logits = grad_logits.to(x.dtype)
            if grad_w is not None:
                grad_w.addmm_(grad_logits.t().to(acc_dtype), x_chunk.detach().to(acc_dtype))
            if norm is None:
                if grad_x is not None:
                    torch.matmul(grad_logits, weight, out=grad_x[start:end])
            else:
                _norm_backward(x_chunk, x_in, grad_logits @ weight, norm_params, grad_norm,
                               None if grad_x is None else grad_x[start:end])
            del grad_logits
        del flat_x, xg
        if grad_x is not None:
            grad_x = grad_x.view(s, b, h)
            if ctx.gather > 1:
                grad_x = reduce_scatter_tokens(grad_x, ctx.gather)
        return (
            grad_x,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            None,
            None,
            None,
            None,
            None,
            None,
            *(None if g is None else g.to(p.dtype) for g, p in zip(grad_norm, norm_params, strict=True)),
        )


def _chunk_starts(n_tokens: int, chunk_tokens: int) -> Iterator[int]:
    """The first token of each chunk to run (all of them, but for a meta estimate's repeated
    ones: NOTE [Repeated tiles in a meta estimate] in memo/repeated_tiles.py)."""
    return run_tiles(range(0, n_tokens, chunk_tokens))


def _normed(norm: torch.nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def _norm_backward(normed: torch.Tensor, x_in: torch.Tensor, grad_normed: torch.Tensor,
                   params: list[torch.Tensor], grad_params: list[torch.Tensor | None],
                   grad_x: torch.Tensor | None) -> None:
    """One chunk's gradients through the final norm: into ``grad_x`` (the chunk's rows) and added to
    the float32 sums ``grad_params`` (NOTE [The final norm in the loss's chunks])."""
    wanted = [x_in] if grad_x is not None else []
    wanted += [p for p, g in zip(params, grad_params, strict=True) if g is not None]
    if not wanted:
        return
    grads = iter(torch.autograd.grad(normed, wanted, grad_normed))
    if grad_x is not None:
        grad_x.copy_(next(grads))
    for g in grad_params:
        if g is not None:
            g.add_(next(grads))


def chunked_lm_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    sequence_gather: int = 1,
    norm: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``norm(x) @ weight.T`` against ``labels``, computed chunk by chunk.

    Args:
        x: ``[s, b, h]`` hidden states after the final norm, or before it when ``norm`` is given
            (``[s/t, b, h]``, the rank's local tokens, when ``sequence_gather=t``).
        weight: ``[V, h]`` output (LM head) weight.
        labels: ``[b, s]`` target ids (int64) in ``[0, V)``; ``ignore_index`` entries are left out.
        chunk_tokens: tokens per chunk; default :func:`default_chunk_tokens` of V.
        ignore_index: label value excluded from the loss and from the mean's denominator.
        sequence_gather: t > 1 emulates the head of one tensor + sequence parallel rank: x is
            gathered to ``s`` tokens inside (NOTE [Chunked loss saved tensors]).
        norm: a token-wise module (the final norm) applied to each chunk of ``x`` inside, its
            gradients computed chunk by chunk (NOTE [The final norm in the loss's chunks]); with
            ``sequence_gather`` 1 only.

    Returns:
        Scalar loss in x's dtype, equal to ``F.cross_entropy(logits, labels)`` on the full
        logits. Saves only x, weight, labels and a float32 log-sum-exp per token
        (NOTE [Chunked loss saved tensors]).
    """
    if x.dim() != 3 or weight.dim() != 2 or x.shape[2] != weight.shape[1]:
        raise MemoError(
            f"memo.models.loss: expected x [s, b, h] and weight [V, h]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if isinstance(sequence_gather, bool) or not isinstance(sequence_gather, int) or sequence_gather < 1:
        raise MemoError(f"memo.models.loss: sequence_gather must be a positive int, got {sequence_gather!r}")
    s, b, _ = x.shape
    s *= sequence_gather
    if labels.shape != (b, s):
        raise MemoError(
            f"memo.models.loss: labels must be [b, s] = [{b}, {s}] for x of shape {tuple(x.shape)}"
            f"{f' gathered {sequence_gather}x' if sequence_gather > 1 else ''}; got {tuple(labels.shape)}"
        )
    if labels.dtype != torch.long:
        raise MemoError(f"memo.models.loss: labels must be int64 (torch.long), got {labels.dtype}")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0])
    if chunk_tokens < 1:
        raise MemoError(f"memo.models.loss: chunk_tokens must be >= 1, got {chunk_tokens}")
    if norm is not None and sequence_gather > 1:
        raise MemoError("memo.models.loss: a norm inside the loss needs sequence_gather=1 (a "
                        "sequence-parallel rank norms its own tokens before the gather); apply the norm "
                        "to x first")
    named = {} if norm is None else dict(norm.named_parameters())
    return _ChunkedLMLoss.apply(x, weight, labels, int(chunk_tokens), int(ignore_index), sequence_gather,
                                norm, tuple(named), *named.values())
