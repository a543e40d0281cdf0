"""Token tiles that repeat one another, skipped in a meta estimate.

Torch-free and light, like memo/token_split.py: the loops that run over token tiles live in the
models (the loss's chunks, attention's head groups), the runtime (a memo layer's recompute chunks)
and the peers (the tiled MLP), and each asks :func:`tile_indices` which tiles to run.

NOTE [Repeated tiles in a meta estimate]
An estimate records one iteration of a rank on the meta device (NOTE [Estimate from a meta profile]
in memo/estimate/plan_method.py), and its cost is the number of ops it records. Memory-bounded loops
make that number grow with the length: at 600K tokens a rank of Llama-3.1-8B runs ~2,300 loss chunks
and ~150 tiles per layer, minutes of recording, where the answer (the peak, the bytes held) is set by
one tile: tiles of the same size run the same ops on the same shapes.

So under :func:`repeated_tiles_skipped` (entered by the estimator, never by a run that allocates) a
loop of n > 3 tiles runs tile 0, tile 1 and the last, and skips tiles 2..n-2 when they cannot change
the answer. Tile 0 may differ from the rest (it creates what later tiles accumulate into: a
parameter's gradient, a buffer); tile 1 is then the steady state. The check is the recorder's own:
if the bytes and the number of storages live after tile 1 equal those before it, tile 1 left the
state it found, so tiles 2..n-2 would each start from that state, run the same ops on the same shapes
and reach the same peak as tile 1; skipping them changes no peak and no byte held after the loop. If
the state moved (a tile keeps something, as the offloaded range's tiles keep their graphs), every
tile runs. Only a recorder on the meta device offers the check (:func:`recording`), so a run with real
tensors always runs every tile, and so does a meta run outside an estimate.

What this gives up: the trace of a skipped estimate is not the iteration's event by event (a plan made
from it would not match a run), so it is used for estimates only; the tests compare every number an
estimate reads with and without skipping (tests/profiler/test_repeated_tiles.py).

NOTE [Replicated tiles in a meta recording]
A plan needs every event (each allocation gets its own address, and the runtime looks each request
up by its place in its phase), so a meta recording for a plan cannot skip tiles; but it need not run
them either. Outside an estimate, a loop of n > 4 tiles under a meta recorder runs tiles 0, 1 and 2,
and the recorder compares tile 2 with tile 1 (:meth:`DispatchRecorder.replicate`): the same mallocs in
the same order (size, phase, op, tags), frees at the same places of the tile's own storages, and, of
older storages, tile 2 frees exactly those tile 1 left alive. Then tile 2 took the live state from
X + S1 (what tile 1 left) to X + S2, S2 made as S1 was: tile 3 starts from the state tile 2 started
from, up to which storage is which, runs the same ops on the same shapes (tiles 1..n-2 have one size)
and records tile 2's events with its own ids, and so on to tile n-2. So the recorder appends n-4 copies
of tile 2's events with the ids a full recording gives (record ids count mallocs), each copy freeing
the previous one's survivors, moves tile 2's survivors to the last copy's ids, and the loop runs the
last tile. The trace is the full recording's event for event and id for id
(tests/profiler/test_replicated_tiles.py). If the tiles differ, nothing is copied and every tile
runs. Only the meta recorder replicates: it records no data, and what a skipped tile would have
computed (values in its rows) is never read on meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

__all__ = ["Replicator", "recording", "repeated_tiles_skipped", "replicated", "run_tiles", "skipped",
           "skipping", "tile_indices"]

T = TypeVar("T")

#: Whether an estimate asked for repeated tiles to be skipped (module-level, not a ContextVar:
#: autograd may run a backward on another thread).
_asked = False
#: The live-state probe of the meta recorder running now: () -> (storages live, bytes live).
_probe: Callable[[], tuple[int, int]] | None = None
#: The meta recorder running now, which can replicate a steady tile (NOTE [Replicated tiles in a
#: meta recording]).
_replicator: Replicator | None = None
#: Tiles skipped so far in this process (what an estimate's log and the tests read).
skipped = 0
#: Tiles recorded as copies so far in this process.
replicated = 0


class Replicator(Protocol):
    """What a meta recorder offers a tile loop: where it stands, and copies of a steady tile."""

    def mark(self) -> Any: ...

    def replicate(self, first: Any, second: Any, copies: int) -> bool: ...


@contextlib.contextmanager
def repeated_tiles_skipped() -> Iterator[None]:
    """Within it, meta recordings skip repeated tiles (NOTE [Repeated tiles in a meta estimate])."""
    global _asked
    before, _asked = _asked, True
    try:
        yield
    finally:
        _asked = before


@contextlib.contextmanager
def recording(probe: Callable[[], tuple[int, int]], replicator: Replicator | None = None) -> Iterator[None]:
    """A meta recorder's span: ``probe`` tells the storages and bytes live at any moment;
    ``replicator`` copies steady tiles (NOTE [Replicated tiles in a meta recording])."""
    global _probe, _replicator
    before, _probe = _probe, probe
    before_rep, _replicator = _replicator, replicator
    try:
        yield
    finally:
        _probe, _replicator = before, before_rep


def skipping() -> bool:
    """Whether loops may skip repeated tiles now (asked, and a meta recorder can check them)."""
    return _asked and _probe is not None


def tile_indices(count: int) -> Iterator[int]:
    """The indices of a loop's ``count`` tiles to run, in order: every one, or under a skipping meta
    recording, 0, 1 and ``count - 1`` when tile 1 left the live state it found (NOTE [Repeated tiles
    in a meta estimate]). Tiles 1..count-2 must have one size; the last may be shorter."""
    probe = _probe if _asked else None
    if probe is None:
        yield from _replicated(count, _replicator)
        return
    if count <= 3:
        yield from range(count)
        return
    yield 0
    before = probe()
    yield 1
    if probe() != before:
        yield from range(2, count)
        return
    global skipped
    skipped += count - 3
    yield count - 1


def _replicated(count: int, rep: Replicator | None) -> Iterator[int]:
    """Every index, but under a meta recorder that replicated tile 2 (NOTE [Replicated tiles in a meta
    recording]) 0, 1, 2 and ``count - 1``."""
    if rep is None or count <= 4:
        yield from range(count)
        return
    yield 0
    first = rep.mark()
    yield 1
    second = rep.mark()
    yield 2
    if rep.replicate(first, second, count - 4):
        global replicated
        replicated += count - 4
        yield count - 1
    else:
        yield from range(3, count)


def run_tiles(tiles: Sequence[T]) -> Iterator[T]:
    """The items of ``tiles`` that :func:`tile_indices` runs."""
    for n in tile_indices(len(tiles)):
        yield tiles[n]
