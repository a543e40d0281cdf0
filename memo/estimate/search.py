"""Layouts ranked, and the longest sequence per strategy (``memo estimate --search / --max-seq``).

NOTE [Layout ranking]
Every valid layout (NOTE [Valid layouts]) is estimated and ranked: first those that fit, then
by speed, which the estimate does not measure, so a proxy is used: the fewest communicating
ranks t·c·p (the ranks one sequence is spread over exchange activations every micro-batch; data
parallelism talks once per step), then tensor parallelism kept within a node, then the larger
micro-batch, then the smaller total.

NOTE [Longest sequence layouts]
The longest-sequence search only looks at layouts with d = 1. Turning data parallelism into
context parallelism (d -> d/2, c -> 2c) keeps the ZeRO split over d·c, keeps the weights (CP does
not shard them) and halves every activation of a rank, so a layout with d > 1 never trains a
longer sequence than one without.

NOTE [Longest sequence search]
Per layout and strategy, the total is estimated at two lengths and the straight line through
them gives a first guess of the longest length that fits (activations grow linearly with the
length under FlashAttention; memo's alpha makes its line bend, which the next step absorbs).
From the guess, steps of the granularity, doubling, go up while the length fits (down while it
does not), then bisection down to the granularity: a handful of estimates instead of a doubling
from the shortest length. memo fits a length when it fits at alpha = 0 (its least device need:
NOTE [Memo's alpha in an estimate]), so the search records two depths per length, not the
alpha corrections; the length found is then estimated once more with the LP's alpha, lowered
until it fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memo.errors import MemoError
from memo.estimate.layout import Layout, valid_layouts
from memo.units import GiB

__all__ = ["align", "gallop", "longest", "longest_sequences", "rank_key", "search_layouts", "tokens"]



def tokens(n: int) -> str:
    """``tokens(1 << 20) -> "1M"``, ``tokens(98304) -> "96K"``, otherwise the count with commas."""
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if n >= scale and n % (scale // 4) == 0:
            return f"{n / scale:g}{unit}"
    return f"{n:,}"


def align(table: list[tuple[str, ...]]) -> str:
    """The first column left-aligned, the rest right-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def longest(fits: Callable[[int], bool], start: int, granularity: int, max_seq: int,
            step: int | None = None) -> dict[str, Any]:
    """The longest multiple of ``granularity`` tokens (up to ``max_seq``) for which ``fits`` holds.

    From ``start``: while it fits, the length doubles (``step`` None) or grows by ``step``,
    ``2·step``, ... (NOTE [Longest sequence search]); while it does not, the length halves (or
    shrinks likewise); then bisection. ``fits`` must be monotone (true up to some length).
    Returns ``longest`` (0: not even ``granularity``), ``first_failure`` (None: capped by
    ``max_seq``), ``capped_by_max_seq`` and the lengths tried.
    """
    g = granularity
    tried: list[int] = []

    def ok(length: int) -> bool:
        tried.append(length)
        return bool(fits(length))

    lo, hi = 0, None  # lo: the longest that fit; hi: the shortest that did not
    grow = step
    if ok(start):
        lo = start
        while lo < max_seq:
            length = min(lo * 2 if grow is None else lo + grow, max_seq)
            if not ok(length):
                hi = length
                break
            lo = length
            grow = None if grow is None else grow * 2
    else:
        hi = start
        while True:
            if grow is None:
                length = hi // 2
                if length < g or length % g:
                    break
            else:
                length = max(hi - grow, g)
                if length >= hi:
                    break
                grow *= 2
            if ok(length):
                lo = length
                break
            hi = length
    while hi is not None and hi - lo > g:
        mid = (lo + hi) // 2 // g * g
        if mid <= lo:
            break
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"longest": lo, "first_failure": hi, "capped_by_max_seq": hi is None, "tries": tried}


def first_guess(total: Callable[[int], int | None], limit: int, granularity: int, max_seq: int,
                first: int) -> int:
    """NOTE [Longest sequence search]: where the line through the totals at ``first`` and ``2·first``
    reaches ``limit``, as a multiple of ``granularity`` in [granularity, max_seq]. ``total(length)``
    is the estimated bytes (None: the length cannot run)."""
    g = granularity
    t1, t2 = total(first), total(2 * first)
    guess = first
    if t1 is not None and t2 is not None and t2 > t1:
        guess = int(first + (limit - t1) * first / (t2 - t1))
    return min(max(guess // g * g, g), max_seq // g * g)


def gallop(total: Callable[[int], int | None], limit: int, granularity: int, max_seq: int,
           guess: int) -> dict[str, Any]:
    """:func:`longest` from ``guess`` in steps of the granularity (NOTE [Longest sequence search])."""

    def fits(length: int) -> bool:
        t = total(length)
        return t is not None and t <= limit

    return longest(fits, guess, granularity, max_seq, step=granularity)


def rank_key(layout: Layout, fits: bool, total: int, gpus_per_node: int) -> tuple:
    """NOTE [Layout ranking]: smaller is better."""
    return (not fits, layout.model_parallel, layout.tp > gpus_per_node, -layout.micro_batch, total)


def search_layouts(estimator: Any, seq_len: int, gpus: int, strategy: str,
                   micro_batches: tuple[int, ...] = (1,), log: Callable[[str], None] | None = None,
                   shardings: tuple[str, ...] = ("optimizer",)) -> list[dict[str, Any]]:
    """Every valid layout of ``gpus`` GPUs estimated and ranked (NOTE [Layout ranking]).

    Returns one row per layout, best first: ``layout``, ``estimate`` (None where it cannot run)
    and ``error``. Raises a MemoError when no layout is valid, or none fits, naming the smallest
    need."""
    say = log or (lambda _line: None)
    config = estimator.config
    layouts = valid_layouts(config, gpus, seq_len, micro_batches, shardings=shardings)
    if not layouts:
        raise MemoError(f"memo estimate: no layout of {gpus} GPUs is valid for {config.name} at seq len "
                        f"{seq_len:,} (TP must divide its {config.n_heads} heads and {config.n_kv_heads} "
                        f"key/value heads, PP its {config.n_layers} layers, and TP x CP the sequence)")
    rows = []
    for layout in layouts:
        try:
            est = estimator.estimate(seq_len, layout, strategy)
        except MemoError as err:
            rows.append({"layout": layout, "estimate": None, "error": str(err)})
            say(f"  {layout.short()}: {err}")
            continue
        rows.append({"layout": layout, "estimate": est, "error": None})
        say(f"  {layout.short()}: {est.total_bytes / GiB:,.2f} GiB "
            f"({'fits' if est.fits else 'does not fit'})")
    per_node = estimator.machine.gpus_per_node
    rows.sort(key=lambda r: (r["estimate"] is None,) + (
        rank_key(r["layout"], r["estimate"].fits, r["estimate"].total_bytes, per_node)
        if r["estimate"] is not None else ()))
    if not any(r["estimate"] is not None and r["estimate"].fits for r in rows):
        ran = [r for r in rows if r["estimate"] is not None]
        if not ran:
            raise MemoError(f"memo estimate: no layout of {gpus} GPUs can run {strategy} at seq len "
                            f"{seq_len:,}: {rows[0]['error']}")
        best = min(ran, key=lambda r: r["estimate"].total_bytes)
        e = best["estimate"]
        raise MemoError(
            f"memo estimate: no layout of {gpus} GPUs fits {strategy} at seq len {seq_len:,} in "
            f"{e.fit_fraction:.0%} of {e.device_mem_gb:g} GB ({e.limit_bytes / GiB:,.2f} GiB): the smallest "
            f"need is {e.total_bytes / GiB:,.2f} GiB per GPU ({best['layout'].describe()}); use more GPUs, "
            "more --device-mem-gb or a shorter sequence")
    return rows


#: A layout whose first guess, this much longer, is still shorter than the best length found for
#: its strategy is not searched further (NOTE [Longest sequence search]).
PRUNE_MARGIN = 0.25


def longest_sequences(estimator: Any, layouts: list[Layout], strategies: tuple[str, ...], granularity: int,
                      max_seq: int, first: int | None = None, log: Callable[[str], None] | None = None
                      ) -> list[dict[str, Any]]:
    """For every strategy, the longest sequence on each layout (NOTE [Longest sequence search]) and
    the best layout (longest, then NOTE [Layout ranking]). Rows: ``strategy``, ``best`` (the
    winning layout's result, or None where no layout fits ``granularity`` tokens) and ``layouts``.

    Layouts are searched in the order of their first guesses; one whose guess, PRUNE_MARGIN
    longer, is still shorter than the best found is left at its guess (``pruned``)."""
    say = log or (lambda _line: None)
    limit = estimator.machine.limit_bytes
    first = first or 4 * granularity
    per_node = estimator.machine.gpus_per_node
    out = []
    for strategy in strategies:
        items = []
        for layout in layouts:
            cache: dict[int, Any] = {}

            def total(length: int, layout: Layout = layout, strategy: str = strategy,
                      cache: dict[int, Any] = cache) -> int | None:
                if length not in cache:
                    try:
                        cache[length] = estimator.estimate(length, layout, strategy,
                                                           0.0 if strategy == "memo" else None)
                    except MemoError as err:  # memo's host memory cannot hold alpha = 0, or invalid
                        cache[length] = err
                got = cache[length]
                return None if isinstance(got, MemoError) else got.total_bytes

            guess = first_guess(total, limit, granularity, max_seq, first)
            items.append({"layout": layout, "guess": guess, "total": total, "cache": cache})
        items.sort(key=lambda x: -x["guess"])
        results = []
        best_len = 0
        for item in items:
            layout, cache = item["layout"], item["cache"]
            if best_len and item["guess"] * (1 + PRUNE_MARGIN) < best_len:
                results.append({"layout": layout, "longest": 0, "first_failure": None,
                                "capped_by_max_seq": False, "tries": [], "estimate": None,
                                "guess": item["guess"], "pruned": True})
                say(f"  {strategy:<14} {layout.short()}: ~{tokens(item['guess'])} by the line, "
                    "not searched")
                continue
            found = gallop(item["total"], limit, granularity, max_seq, item["guess"])
            best = cache.get(found["longest"])
            if strategy == "memo" and found["longest"]:
                best = estimator.estimate(found["longest"], layout, strategy)  # the LP's alpha, lowered
            best_len = max(best_len, found["longest"])
            results.append({"layout": layout, **found, "guess": item["guess"], "pruned": False,
                            "estimate": best if not isinstance(best, MemoError) else None})
            got = tokens(found["longest"]) if found["longest"] else "-"
            say(f"  {strategy:<14} {layout.short()}: longest {got} ({len(cache)} estimates)")
        ranked = sorted(results, key=lambda r: (-r["longest"],) + rank_key(
            r["layout"], True, r["estimate"].total_bytes if r["estimate"] else 0, per_node))
        out.append({"strategy": strategy, "best": ranked[0] if ranked and ranked[0]["longest"] else None,
                    "layouts": ranked})
    return out
