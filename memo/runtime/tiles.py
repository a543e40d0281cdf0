"""Token tiles: how many tokens each piece of a memo layer's token-wise work runs over.

A memo layer runs ``pre`` and ``post`` over token tiles (NOTE [Tiles bounded by memory]) and
recomputes ``[a:s]`` in chunks of the same size (NOTE [Chunked recompute] in
memo/runtime/layer.py); :func:`token_chunks` cuts them.

NOTE [How small a chunk]
Every chunk costs the same Python and kernel launches whatever its size: on a GPU a chunk of
``pre`` + ``post`` is some hundred small kernels and three ``autograd.grad`` calls, about 1 ms
of host time. gpt-125m at 8K tokens in eight chunks of ~900 tokens ran at 3.5x full
recompute's step time on an H100, the GPU idle behind the host; in one chunk, at full
recompute's (benchmarks/RESULTS.md, "Third make gpu-check"). So on an accelerator a chunk
must carry enough work to hide that cost: tokens x batch x hidden^2 multiply-adds of at least
MIN_CHUNK_WORK (2^35, ~2 ms of ``pre`` + ``post`` at the H100's dense bf16 rate). Small
models then recompute in one chunk (a hidden size of 768 chunks only past ~58K tokens, 4096
past ~2K), where their activations are small anyway; the memory saving of chunks matters for
large layers at long sequences, where the floor is far below ``s / RECOMPUTE_CHUNKS``. On the
CPU a chunk's host cost is a few ms too (Python, some hundred small ops, a weight gradient written
per chunk), and its kernels are about a thousand times slower, so the floor there is a thousandth
of the work, MIN_CPU_CHUNK_WORK (2^25), and never under MIN_CPU_CHUNK_TOKENS: a hidden-128 Llama
at 1,280 tokens in five 256-token tiles ran 1.57x its unwrapped step, in one tile 1.24x
(benchmarks/varlen.py); its floor is 2,048 tokens, from hidden 362 up it is 256. That floor is
for speed; where a budget binds, the policy may still choose tiles down to MIN_CPU_CHUNK_TOKENS on
the CPU (:func:`min_tile_tokens`), trading host time for memory. Meta follows the CPU, so that a
plan made on meta is the plan made on the CPU (tests/runtime/test_plan_truth.py). A profile on meta for a
GPU (``--gpu``) records and plans the GPU's tiles instead: it gives the runtime on meta the tile
the GPU's default makes (:func:`default_tile_tokens` with ``"cuda"``) and the plan records it, so
the GPU replays exactly those tiles (NOTE [Tiles of the device a plan is for] in
memo/pipeline/job.py). The policy's cost model counts the chunks of the device the plan is for
(``layer_costs`` in memo/pipeline/policy.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "MIN_CHUNK_WORK", "MIN_CPU_CHUNK_TOKENS", "MIN_CPU_CHUNK_WORK", "RECOMPUTE_CHUNKS", "TILE_BYTES",
    "default_tile_tokens", "layer_token_bytes", "min_chunk_tokens", "min_tile_tokens", "params_token_bytes",
    "tile_bound_tokens", "token_chunks",
]


#: Token tiles are ``s / RECOMPUTE_CHUNKS`` tokens while that is small (NOTE [Tiles bounded by memory]) ...
RECOMPUTE_CHUNKS = 8
#: ... and no larger than holds TILE_BYTES of a tile's transient tensors; the number of tiles then
#: grows with s ...
TILE_BYTES = 256 << 20
#: ... but none has less work than this on an accelerator: tokens x batch x hidden^2 multiply-adds,
#: about 2 ms of ``pre`` + ``post`` on an H100 ...
MIN_CHUNK_WORK = 1 << 35
#: ... and on the CPU and on meta, where kernels are about a thousand times slower, a thousandth of it ...
MIN_CPU_CHUNK_WORK = MIN_CHUNK_WORK >> 10
#: ... and none shorter than this many tokens (NOTE [How small a chunk]).
MIN_CPU_CHUNK_TOKENS = 256


# NOTE [Tiles bounded by memory]
# Every token-wise part of a memo layer runs over token tiles: the offloaded range [0:a] in forward
# (each tile's saved tensors are packed into the rounding buffer as the tile runs, and its graph is
# kept only as the GradientEdges of its outputs), the recomputed range [a:s] in forward (no grad)
# and backward (recompute, then back-propagate, one tile at a time), and the [0:a] tiles' backward.
# A tile's transient tensors (the MLP's intermediates above all: ffn_hidden x batch elements per
# token, several times the layer's width) thus exist for one tile at a time, and a layer's
# transient peak is one tile's, not a share of s tokens'. What still spans the sequence is what
# must: the layer's input and output, q, k, v, the attention output and its log-sum-exp, their
# gradients, and the rounding buffer (tests/runtime/test_tiles.py measures it).
# How many tokens a tile holds: ``s / RECOMPUTE_CHUNKS`` at short lengths (few tiles, few kernel
# launches), capped so that a tile's transient stays within TILE_BYTES, estimated from the layer's
# width per token (its parameters / hidden: 4h + 3 ffn for a SwiGLU layer, the elements its matmuls
# produce per token), and never below the work floor of NOTE [How small a chunk]: ALST's tiled
# MLP makes ceil(s / hidden) tiles, which at hidden 4096 is the same 4096-token tile. The policy may
# choose a smaller bound to fit a device budget (planner/policy.py, ``tile_tokens``); a plan records
# it and the runtime runs it (``MemoRuntime(recompute_chunk_tokens=...)``).


def min_chunk_tokens(batch: int, hidden: int, device_type: str) -> int:
    """The fewest tokens a recompute chunk of a layer with input ``[s, batch, hidden]`` holds on
    a device of ``device_type`` (NOTE [How small a chunk])."""
    if device_type in ("cpu", "meta"):
        return max(MIN_CPU_CHUNK_TOKENS, _work_tokens(MIN_CPU_CHUNK_WORK, batch, hidden))
    return min_tile_tokens(batch, hidden, device_type)


def min_tile_tokens(batch: int, hidden: int, device_type: str) -> int:
    """The fewest tokens a tile the policy chooses to fit a device budget holds (NOTE [How small a
    chunk]): the work floor on an accelerator, MIN_CPU_CHUNK_TOKENS on the CPU and on meta."""
    if device_type in ("cpu", "meta"):
        return MIN_CPU_CHUNK_TOKENS
    return max(1, _work_tokens(MIN_CHUNK_WORK, batch, hidden))


def _work_tokens(work: int, batch: int, hidden: int) -> int:
    """The fewest tokens of a ``[s, batch, hidden]`` layer input with ``work`` tokens x batch x
    hidden^2 multiply-adds."""
    return -(-work // max(1, batch * hidden * hidden))


def tile_bound_tokens(batch: int, token_bytes: int) -> int | None:
    """The most tokens whose transient tensors (``token_bytes`` per token and batch row) fit in
    TILE_BYTES (NOTE [Tiles bounded by memory]); None when the width is unknown."""
    if token_bytes <= 0:
        return None
    return max(1, TILE_BYTES // max(1, batch * token_bytes))


def token_chunks(n: int, chunk_tokens: int | None = None, *, batch: int, hidden: int,
                 device_type: str, token_bytes: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` ranges that split ``n`` tokens into tiles of ``chunk_tokens`` (None: the
    default of NOTE [Tiles bounded by memory]: ``n / RECOMPUTE_CHUNKS`` tokens, at most what keeps a
    tile's transient of ``token_bytes`` per token within TILE_BYTES, at least
    :func:`min_chunk_tokens`)."""
    if n <= 0:
        return []
    size = chunk_tokens or default_tile_tokens(n, batch=batch, hidden=hidden, device_type=device_type,
                                               token_bytes=token_bytes)
    return [(i, min(n, i + size)) for i in range(0, n, size)]


def default_tile_tokens(n: int, *, batch: int, hidden: int, device_type: str, token_bytes: int = 0) -> int:
    """Tokens per tile of ``n`` (> 0) tokens by default on a device of ``device_type`` (NOTE [Tiles
    bounded by memory]): ``n / RECOMPUTE_CHUNKS``, at most what keeps a tile's transient of
    ``token_bytes`` per token within TILE_BYTES, at least :func:`min_chunk_tokens` (or ``n``)."""
    size = -(-n // RECOMPUTE_CHUNKS)
    bound = tile_bound_tokens(batch, token_bytes)
    if bound is not None:
        size = min(size, bound)
    return max(min(n, min_chunk_tokens(batch, hidden, device_type)), size)


def layer_token_bytes(layer: nn.Module, hidden: int, elem_size: int) -> int:
    """A layer's transient bytes per token and batch row, estimated from its width: its parameters'
    elements per hidden unit (NOTE [Tiles bounded by memory])."""
    return params_token_bytes(sum(p.numel() for p in layer.parameters()), hidden, elem_size)


def params_token_bytes(layer_params: int, hidden: int, elem_size: int) -> int:
    """:func:`layer_token_bytes` of a layer known by its parameter count (a profile's, an estimate's)."""
    return (layer_params // max(1, hidden)) * elem_size
