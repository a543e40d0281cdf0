"""Context parallelism in a profile: the tokens one rank runs, and what such a profile leaves out.

NOTE [Context-parallel profile]
megatron-core's context parallelism over c ranks cuts every sequence into 2·c chunks and gives
rank r chunks r and 2c-1-r (which balances causal attention), so every activation of a rank, in
every layer, holds s/c tokens (NOTE [Tensor-parallel rank], last paragraph, in
memo/models/parallel.py). The profile of one context-parallel rank is therefore the profile of the
rank model (tensor-parallel too when t > 1) fed s/c tokens: S_input, S_attn, S_others, the alpha
LP, the layer policy and the address plan are all that rank's, and with tensor + sequence
parallelism its layer input is ``[s/(c·t), b, h]``. Context parallelism does not shard weights: a
rank's parameters, gradients and optimizer states are those of its tensor-parallel shard, and
GPT's learned position table still covers all s positions, so the rank model is built for the
job's whole sequence and only fed s/c tokens of it.

Host memory and the link. Every GPU runs one process whatever its place in the TP x CP grid, so a
process may pin the node's host memory x host_safety / gpus_per_node, as without context
parallelism (a group of c·t ranks spans c·t / gpus_per_node nodes); the link is per GPU.

What is not counted: ring attention's buffers. memo's reference attention runs on the rank's own
s/c tokens. A real context-parallel rank (TransformerEngine's attention with P2P K/V exchange)
also holds the key/value chunks in flight from its neighbours, in backward their gradients, and
the per-step partial outputs and softmax statistics it combines. Their sizes follow
TransformerEngine's implementation, which memo does not emulate, so they are in neither the trace
nor the plan nor the device total; the profile says so in a note (:func:`context_parallel_note`)
rather than guess. Attention *time* is the s/c model's too: a rank does about s²/(2c) causal
attention work, the s/c-token profile (s/c)²/2, c times less, so a measured or FLOP-estimated
T_layer is short; give ``--layer-ms`` with one rank's real forward time.

The plan's meta records ``context_parallel`` (beside ``tensor_parallel``); its ``seq_len`` is the
job's whole sequence. ``memo train`` runs one unsharded process, so it refuses a plan made for
c > 1 (or t > 1): ``check_plan`` in memo/train/plan_checks.py; ``memo.planner.load_plan`` matches both
when asked.
"""

from __future__ import annotations

from memo.errors import MemoError
from memo.models.parallel import context_parallel_seq_len
from memo.token_split import check_seq_len, token_multiple

__all__ = ["check_context_parallel", "context_parallel_note", "rank_tokens", "token_multiple"]


def check_context_parallel(context_parallel: object) -> int:
    """``context_parallel`` as an int >= 1, or a MemoError."""
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1:
        raise MemoError(
            f"memo.profiler: context_parallel must be a positive integer (ranks the sequence is split "
            f"over; 1 for none), got {context_parallel!r}"
        )
    return context_parallel


def rank_tokens(seq_len: int, tensor_parallel: int = 1, context_parallel: int = 1) -> int:
    """Tokens the rank model is fed for a job of ``seq_len`` tokens: ``seq_len / c``
    (NOTE [Context-parallel profile]); its layer input then holds ``seq_len / (c·t)`` of them.

    A ``seq_len`` that the ranks cannot share evenly is refused with the nearest valid lengths.
    """
    c = check_context_parallel(context_parallel)
    t = tensor_parallel
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise MemoError(f"memo.profiler: tensor_parallel must be a positive integer, got {t!r}")
    check_seq_len(seq_len, t, c, "memo.profiler")  # NOTE [Tokens per rank] in memo/token_split.py
    return context_parallel_seq_len(seq_len, c)


def context_parallel_note(context_parallel: int, layer_time_from_profile: bool,
                          runs_collectives: bool = False) -> str:
    """What a context-parallel profile does not count, for ``ProfileResult.notes``.
    ``runs_collectives``: the profile ran the rank's own model in its group (``memo train``), so its
    attention's exchanges (all-gather or all-to-all) were recorded as they ran."""
    if runs_collectives:
        note = (f"context parallel {context_parallel}-way: the profile recorded this rank's own iteration, "
                "its attention's exchanges in the trace as they ran")
    else:
        note = (f"context parallel {context_parallel}-way: the profile is one rank's, fed seq_len/"
                f"{context_parallel} tokens; ring attention's communication buffers (key/value chunks in "
                "flight, their gradients, per-step partial outputs) are not counted in the plan or the "
                "device total (NOTE [Context-parallel profile])")
    if layer_time_from_profile:
        note += (f"; T_layer was not given: measured or estimated on seq_len/{context_parallel} tokens, "
                 f"it misses ~{context_parallel}x of a rank's attention time (pass --layer-ms)")
    return note
