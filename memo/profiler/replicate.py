"""Replicated tiles in a meta recording: a steady tile's events copied, as the tiles it stands for
would have recorded them (NOTE [Replicated tiles in a meta recording] in memo/repeated_tiles.py).

Torch-free: the recorder hands its event list and allocation records, and takes back the events and
records of the copies and the ids its live storages move to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Mark", "TileTemplate", "steady_template"]


@dataclass(frozen=True)
class Mark:
    """Where a recording stood between two tiles: events so far, the next record id, the phase
    span (NOTE [Storage identity and frees] in memo/profiler/recorder.py) and ops so far."""

    events: int
    next_id: int
    span: int
    ops: int


#: One event of a tile's template: ("m", malloc position, the event without its id), ("f", malloc
#: position in this tile, {}) or ("p", malloc position in the tile before, {}).
_Step = tuple[str, int, dict[str, Any]]


@dataclass(frozen=True)
class TileTemplate:
    """A steady tile's events with ids relative to its first malloc (``mallocs`` of them)."""

    steps: list[_Step]
    mallocs: int
    ops: int

    def events(self, base: int) -> list[dict[str, Any]]:
        """The events of the copy whose first malloc gets record id ``base``."""
        out: list[dict[str, Any]] = []
        prev = base - self.mallocs
        for kind, q, event in self.steps:
            if kind == "m":
                out.append({**event, "id": base + q})
            else:
                out.append({"op": "free", "id": (base if kind == "f" else prev) + q})
        return out


def steady_template(events: list[dict[str, Any]], tags: dict[int, Any], first: Mark, second: Mark,
                    now: Mark) -> TileTemplate | None:
    """The template of the tile recorded between ``second`` and ``now`` when it is steady: the tile
    between ``first`` and ``second`` made the same mallocs in the same order (sizes, phases, what
    the recorder noted of each: ``tags[id]``) and freed at the same places, and the later tile frees,
    besides its own storages, exactly the ones the earlier tile left alive, no other. Else None.

    ``tags``: record id -> what must agree between the two tiles' allocations besides the event
    (the recorder's op name and tags)."""
    if not (first.span == second.span == now.span):
        return None  # a phase changed inside the tiles: spans and phases would differ per copy
    n = second.events - first.events
    m = second.next_id - first.next_id
    if n <= 0 or now.events - second.events != n or now.next_id - second.next_id != m:
        return None
    lo1, lo2, hi2 = first.next_id, second.next_id, now.next_id
    steps: list[_Step] = []
    freed_before: set[int] = set()
    for a, b in zip(events[first.events:second.events], events[second.events:now.events], strict=True):
        op = b["op"]
        if a["op"] != op or a.keys() != b.keys():
            return None
        if op == "malloc":
            q = b["id"] - lo2
            if a["id"] - lo1 != q or a["size"] != b["size"] or a.get("phase") != b.get("phase") \
                    or tags.get(a["id"]) != tags.get(b["id"]):
                return None
            steps.append(("m", q, {k: v for k, v in b.items() if k != "id"}))
        elif op == "free":
            x, y = b["id"], a["id"]
            if lo2 <= x < hi2:  # its own storage: the earlier tile freed its own at this place
                if y - lo1 != x - lo2:
                    return None
                steps.append(("f", x - lo2, {}))
            elif lo1 <= x < lo2:  # left alive by the tile before; the earlier tile freed an older one
                if y >= lo1:
                    return None
                freed_before.add(x)
                steps.append(("p", x - lo1, {}))
            else:
                return None  # older than the tile before: a later copy would have nothing to free
        else:
            return None
    own_freed = {s[1] for s in steps if s[0] == "f"}
    left = {lo1 + q for q in range(m) if q not in own_freed}
    if freed_before != left:
        return None  # the state moves from tile to tile (something is kept): every tile must run
    return TileTemplate(steps, m, now.ops - second.ops)
