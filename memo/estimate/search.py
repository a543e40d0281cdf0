"""Layouts ranked, and the longest sequence per strategy (``memo estimate --search / --max-seq``).

NOTE [Layout ranking]
Every valid layout that memo train launches (NOTE [Valid layouts] in memo/distributed/parallel_layout.py,
[Layouts memo train launches])
is estimated and ranked: first those that fit, then by speed, which the estimate does not measure,
so a proxy is used: the fewest communicating ranks t·c·p (the ranks one sequence is spread over
exchange activations every micro-batch; data parallelism talks once per step), then tensor
parallelism kept within a node, then the larger micro-batch, then the smaller total.

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
from the shortest length. memo fits a length when it fits with input-only layers (its least device
need: NOTE [Memo's policy in an estimate]), so the search records two depths per length, not the
alpha corrections; the length found is then estimated once more with the LP's alpha, lowered
until it fits, where memo's own policy fits there. This exact search is the formula method's
(arithmetic costs nothing).

NOTE [Fast longest-sequence search]
The plan method's estimates are meta profiles, a second or so each (a tile that repeats another is
recorded once: NOTE [Repeated tiles in a meta estimate] in memo/repeated_tiles.py), so its search
spends them where they decide the answer:

1. Screen. A meta profile depends on the layout's family (TP, CP and, for CP > 1, its communication:
   Ulysses' exchange is recorded, NOTE [Ulysses in a meta estimate]; PP, micro-batch), not on the
   sharding of the states, which is arithmetic. One full-recompute
   estimate per layout at the first short length (its profiles shared by a family, and reused by
   full recompute's line) gives bytes per token (less the layer inputs full recompute keeps, for
   the strategies that send them to the host); the room its states leave, over that, ranks the
   families (the closed form cannot: it divides every activation by t under sequence parallelism,
   where a rank's profile holds gathered inputs). The SCREENED_FAMILIES best are searched, the
   rest are reported as screened.
2. Predict. At a fixed layout the per-GPU total is nearly affine in the length (activations grow
   linearly under FlashAttention-style attention; states do not grow). Two short lengths give the
   line, and where it meets the strategy's limit is the layout's guess (first_guess).
3. Confirm. Layouts are taken in the order of their guesses. From its guess, each probe is an
   actual estimate at that length (two depths, as any estimate), and the probes close a bracket: the
   longest length found to fit and the shortest found not to, down to the granularity. A probe is
   aimed where the line through the bracket's ends meets the limit (one granularity past the end it
   just moved, so the next probe can close the bracket), and is a bisection after two probes on the
   same side, so a bent line costs a few probes more, never a wrong answer. The first layout's answer
   is its longest length; a later layout is first probed one granularity past the best length
   confirmed so far, and is settled by that probe where it does not fit (it cannot win; its row
   shows a length that fits, marked as no longer than the best). A layout whose line ends
   PRUNE_MARGIN short of a confirmed length is not probed. memo is confirmed at its least device
   need: input-only layers, the host's share of them and the rest recomputed where the host binds
   (NOTE [Memo's policy in an estimate], [Inputs on the device where the host binds]); its LP's alpha
   at the answer would cost profiles at that length and changes nothing about the fit.

Every reported length is one an actual estimate at that length found to fit, and the best layout's is
the longest such within the granularity: one granularity more did not fit (or is past the cap).

NOTE [Host-bound guesses]
The line through two short lengths' device totals knows nothing of the host. memo's least device need
and the offloaded-checkpoint peer send layer inputs there, so where the host binds first the line
guesses far past where either can run, and the probes spend many estimates coming down from it. Their
guess is therefore the shorter of the line's and the longest length whose inputs the host holds (every
layer's for the peer, one per pair of layers for memo: :func:`host_cap`); from there the probes go up
where the length fits (memo keeps inputs on the device past it), so the answer is the same, found with
fewer estimates.

NOTE [Head chunks in the search]
Ulysses over more chunks of heads holds less during attention and sends the key/value heads more
often (NOTE [Ulysses over chunks of heads] in memo/models/ulysses_attention.py). memo's searches by
the plan method therefore try each Ulysses layout of memo train's default chunks also at the finest
count its heads split into (:func:`with_head_chunks`; the two share a family, so one screen). The
default ranks first where both fit (:func:`rank_key`), and the longest-sequence search confirms the
finer count after every default, from one granularity past the best length found: so it answers
only where it goes further, and its command then says ``--ulysses-head-chunks``. The peers run the
default: they are ALST's recipe, which does not chunk heads, and the formula method has no term the
chunks change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memo.errors import MemoError
from memo.estimate.layout import ParallelLayout, valid_layouts
from memo.planner.vocab import CPComm, EstimateMethod, Sharding, StrategyName
from memo.units import GiB

if TYPE_CHECKING:
    from memo.estimate.core import Estimator

__all__ = ["align", "gallop", "longest", "longest_sequences", "rank_key", "search_layouts", "tokens",
           "with_head_chunks"]



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


def host_cap(estimator: Estimator, layout: ParallelLayout, strategy: str, first: int,
             granularity: int) -> int | None:
    """The longest multiple of ``granularity`` whose layer inputs the host holds, for a strategy that sends
    them there: memo's (one per pair of layers: NOTE [Segments where the host binds] in core.py) and the
    offloaded-checkpoint peer's (every layer's), from the layer input at ``first`` tokens (inputs grow
    linearly with the length); None for the others, or where nothing is known (NOTE [Host-bound
    guesses])."""
    if strategy not in (StrategyName.MEMO, StrategyName.OFFLOADED_CHECKPOINT):
        return None
    try:
        host = estimator.machine.host_per_process() // layout.pp - estimator.state_bytes(layout, first)[2]
        s_in = estimator.profiler.input_bytes(layout, first)
    except MemoError:
        return None
    layers = estimator.profiler.offloaded_layers(layout)
    inputs = -(-layers // 2) if strategy == StrategyName.MEMO else layers
    if s_in <= 0 or host <= 0:
        return None
    return max(int(host * first / (inputs * s_in)) // granularity * granularity, granularity)


def gallop(total: Callable[[int], int | None], limit: int, granularity: int, max_seq: int,
           guess: int) -> dict[str, Any]:
    """:func:`longest` from ``guess`` in steps of the granularity (NOTE [Longest sequence search])."""

    def fits(length: int) -> bool:
        t = total(length)
        return t is not None and t <= limit

    return longest(fits, guess, granularity, max_seq, step=granularity)


def rank_key(layout: ParallelLayout, fits: bool, total: int, gpus_per_node: int) -> tuple:
    """NOTE [Layout ranking]: smaller is better; memo train's default chunks of heads before a finer count
    (NOTE [Head chunks in the search])."""
    return (not fits, layout.model_parallel, layout.tp > gpus_per_node, -layout.micro_batch,
            layout.head_chunks is not None, total)


def with_head_chunks(estimator: Estimator, layouts: list[ParallelLayout],
                     strategy: str) -> list[ParallelLayout]:
    """``layouts`` and, for memo by the plan method, each Ulysses layout of the default chunks of heads
    again at the finest count its heads split into, where that is finer and an engine of ``memo train``
    runs it (NOTE [Head chunks in the search])."""
    method = getattr(estimator, "method", EstimateMethod.PLAN)
    if strategy != StrategyName.MEMO or method != EstimateMethod.PLAN:
        return layouts
    import dataclasses

    from memo.models.ulysses_attention import finest_head_chunks, head_chunks, ulysses_heads_problem

    config, out = estimator.config, list(layouts)
    for lay in layouts:
        if not lay.ulysses or lay.head_chunks is not None:
            continue
        n, n_kv = config.n_heads // lay.tp, config.n_kv_heads // lay.tp
        if ulysses_heads_problem(n, n_kv, lay.cp) is not None:
            continue
        finer = dataclasses.replace(lay, head_chunks=finest_head_chunks(n, n_kv, lay.cp))
        if finer.head_chunks > head_chunks(n, n_kv, lay.cp) and finer.engine is not None:
            out.append(finer)  # an engine that runs the count (NOTE [Which engine runs which layout])
    return out


def search_layouts(estimator: Estimator, seq_len: int, gpus: int, strategy: str,
                   micro_batches: tuple[int, ...] = (1,), log: Callable[[str], None] | None = None,
                   shardings: tuple[str, ...] = (Sharding.OPTIMIZER,),
                   cp_comms: tuple[str, ...] = (CPComm.ALL_GATHER,)
                   ) -> list[dict[str, Any]]:
    """Every valid layout of ``gpus`` GPUs estimated and ranked (NOTE [Layout ranking]).

    Returns one row per layout, best first: ``layout``, ``estimate`` (None where it cannot run)
    and ``error``. Raises a MemoError when no layout is valid, or none fits, naming the smallest
    need."""
    say = log or (lambda _line: None)
    config = estimator.config
    layouts = with_head_chunks(estimator, valid_layouts(config, gpus, seq_len, micro_batches,
                                                        shardings=shardings, cp_comms=cp_comms), strategy)
    if not layouts:
        raise MemoError(f"memo estimate: no layout of {gpus} GPUs that memo train launches is valid for "
                        f"{config.name} at seq len {seq_len:,} (TP must divide its {config.n_heads} heads "
                        f"and {config.n_kv_heads} key/value heads, PP its {config.n_layers} layers, and TP x "
                        "CP the sequence; NOTE [Which engine runs which layout] in planner/engines.py says "
                        "which shardings and CP communications each engine runs)")
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
        from memo.estimate.core import limit_words

        best = min(ran, key=lambda r: r["estimate"].total_bytes)
        e = best["estimate"]
        raise MemoError(
            f"memo estimate: no layout of {gpus} GPUs fits {strategy} at seq len {seq_len:,} in "
            f"{limit_words(e.limit_rule, e.fit_fraction, e.device_mem_gb)} ({e.limit_bytes / GiB:,.2f} GiB): "
            f"the smallest need is {e.total_bytes / GiB:,.2f} GiB per GPU ({best['layout'].describe()}); use "
            "more GPUs, more --device-mem-gb or a shorter sequence")
    return rows


#: A layout whose first guess, this much longer, is still shorter than the best length found for
#: its strategy is not searched further (NOTE [Longest sequence search]).
PRUNE_MARGIN = 0.25

#: ParallelLayout families (TP, CP, PP, micro-batch: what a meta profile depends on) the plan method profiles,
#: the best by the closed form's screen (NOTE [Fast longest-sequence search]).
SCREENED_FAMILIES = 3

def strategy_limit(estimator: Estimator, strategy: str) -> int:
    """The bytes one GPU may fill for ``strategy`` (NOTE [Fit limits] in memo/estimate/core.py)."""
    return int(estimator.limit_bytes(strategy))


class _Totals:
    """One layout's estimates by length, for one strategy (a MemoError where it cannot run)."""

    def __init__(self, estimator: Estimator, layout: ParallelLayout, strategy: str) -> None:
        self.estimator, self.layout, self.strategy = estimator, layout, strategy
        self.cache: dict[int, Any] = {}

    def __call__(self, length: int) -> int | None:
        if length not in self.cache:
            try:
                self.cache[length] = self.estimator.estimate(length, self.layout, self.strategy, least=True)
            except MemoError as err:  # memo's host cannot hold even input-only layers, or invalid
                self.cache[length] = err
        got = self.cache[length]
        return None if isinstance(got, MemoError) else got.total_bytes


def longest_sequences(estimator: Estimator, layouts: list[ParallelLayout], strategies: tuple[str, ...],
                      granularity: int, max_seq: int, first: int | None = None,
                      log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """For every strategy, the longest sequence on each layout and the best layout (longest, then
    NOTE [Layout ranking]). Rows: ``strategy``, ``best`` (the winning layout's result, or None where
    no layout fits ``granularity`` tokens) and ``layouts``.

    The formula method searches every layout exactly (NOTE [Longest sequence search]); the plan
    method predicts from lines and confirms (NOTE [Fast longest-sequence search])."""
    if getattr(estimator, "method", EstimateMethod.PLAN) == EstimateMethod.FORMULA:
        return [_exact_search(estimator, layouts, strategy, granularity, max_seq, first, log)
                for strategy in strategies]
    out = []
    for strategy in strategies:
        tried = with_head_chunks(estimator, layouts, strategy)  # NOTE [Head chunks in the search]
        kept = screen_families(estimator, tried, granularity, max_seq, log, first, strategy)
        out.append(_predicted_search(estimator, tried, kept, strategy, granularity, max_seq, first, log))
    return out


def _family(layout: ParallelLayout) -> tuple[int, int, int, int, str]:
    return layout.tp, layout.cp, layout.pp, layout.micro_batch, layout.cp_comm if layout.cp > 1 else ""


def screen_families(estimator: Estimator, layouts: list[ParallelLayout], granularity: int, max_seq: int,
                    log: Callable[[str], None] | None = None, first: int | None = None,
                    strategy: str = StrategyName.FULL_RECOMPUTE) -> set[tuple[int, int, int, int, str]]:
    """NOTE [Fast longest-sequence search]: the SCREENED_FAMILIES families whose best layout goes
    longest for ``strategy`` by one full-recompute estimate at a short length, extended along its
    bytes per token (the states do not grow with the length). For the strategies that send every
    layer's input to the host (memo, offloaded-checkpoint) the inputs full recompute keeps on the
    device are taken out of the bytes per token."""
    from memo.estimate.core import strategy_problem

    layouts = [lay for lay in layouts if strategy_problem(strategy, lay) is None]
    families = {_family(lay) for lay in layouts}
    if len(families) <= SCREENED_FAMILIES:
        return families
    first = first or 4 * granularity
    limit = strategy_limit(estimator, strategy)
    offloads_inputs = strategy in (StrategyName.MEMO, StrategyName.OFFLOADED_CHECKPOINT)
    best: dict[tuple[int, int, int, int, str], int] = {}
    for lay in layouts:
        try:
            (states, short), (_, long) = (estimator.screen_bytes(n, lay) for n in (first, 2 * first))
        except MemoError:
            continue
        # the line through two lengths: what does not grow with the length (the embedding's and the
        # head's gradients, one layer's weights) is not charged per token
        per_token = (long - short) / first
        fixed = short - per_token * first
        if offloads_inputs:  # every layer's input [s/(t·c), b, h] (NOTE [Tensor-parallel rank])
            depth = estimator.config.n_layers // lay.pp
            inputs = depth * lay.micro_batch * estimator.config.hidden * estimator.dtype.itemsize
            per_token = max(per_token - inputs / (lay.tp * lay.cp), per_token / 8)
        room = limit - states - fixed
        n = int(room / per_token) if per_token > 0 and room > 0 else 0
        best[_family(lay)] = max(best.get(_family(lay), 0), min(n, max_seq))
    # Ties (to the granularity) go to the smaller TP: a tensor + sequence parallel rank gathers each
    # layer's input whole, which a context-parallel rank never holds.
    kept = sorted(best, key=lambda f: (-(best[f] // granularity), f[0], f[2]))[:SCREENED_FAMILIES]
    if log:
        log(f"  {strategy}: screened by full recompute at " + tokens(first) + ": "
            + ", ".join(f"t{f[0]} c{f[1]}{' ' + f[4] if f[4] else ''} p{f[2]} "
                        f"~{tokens(best[f] // granularity * granularity)}" for f in kept))
    return set(kept)


def _exact_search(estimator: Estimator, layouts: list[ParallelLayout], strategy: str, granularity: int,
                  max_seq: int, first: int | None, log: Callable[[str], None] | None) -> dict[str, Any]:
    """NOTE [Longest sequence search]: every layout galloped from its line's guess, bisected to the
    granularity (layouts whose guess is PRUNE_MARGIN short of the best found are left out)."""
    say = log or (lambda _line: None)
    limit = strategy_limit(estimator, strategy)
    first = first or 4 * granularity
    items = []
    for layout in layouts:
        total = _Totals(estimator, layout, strategy)
        items.append({"layout": layout, "guess": first_guess(total, limit, granularity, max_seq, first),
                      "total": total})
    items.sort(key=lambda x: -x["guess"])
    results: list[dict[str, Any]] = []
    best_len = 0
    for item in items:
        layout, cache = item["layout"], item["total"].cache
        if best_len and item["guess"] * (1 + PRUNE_MARGIN) < best_len:
            results.append(_pruned(layout, item["guess"]))
            say(f"  {strategy:<14} {layout.short()}: ~{tokens(item['guess'])} by the line, not searched")
            continue
        found = gallop(item["total"], limit, granularity, max_seq, item["guess"])
        best_len = max(best_len, found["longest"])
        results.append(_result(estimator, layout, strategy, found, item["guess"], cache))
        got = tokens(found["longest"]) if found["longest"] else "-"
        say(f"  {strategy:<14} {layout.short()}: longest {got} ({len(cache)} estimates)")
    return _ranked(estimator, strategy, results)


def _pruned(layout: ParallelLayout, guess: int | None) -> dict[str, Any]:
    """A layout left out: by its line (``guess``), or by the screen (``guess`` None)."""
    return {"layout": layout, "longest": 0, "first_failure": None, "capped_by_max_seq": False, "tries": [],
            "estimate": None, "guess": guess, "pruned": True}


def _result(estimator: Estimator, layout: ParallelLayout, strategy: str, found: dict[str, Any], guess: int,
            cache: dict[int, Any], solve_alpha: bool = True) -> dict[str, Any]:
    best = cache.get(found["longest"])
    if solve_alpha and strategy == StrategyName.MEMO and found["longest"] and not isinstance(best, MemoError):
        best = estimator.estimate(found["longest"], layout, strategy)  # the LP's alpha, lowered
    return {"layout": layout, **found, "guess": guess, "pruned": False,
            "estimate": best if not isinstance(best, MemoError) else None}


def _ranked(estimator: Estimator, strategy: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    per_node = estimator.machine.gpus_per_node
    ranked = sorted(results, key=lambda r: (-r["longest"],) + rank_key(
        r["layout"], True, r["estimate"].total_bytes if r["estimate"] else 0, per_node))
    return {"strategy": strategy, "best": ranked[0] if ranked and ranked[0]["longest"] else None,
            "layouts": ranked}


def confirm(total: Callable[[int], int | None], limit: int, granularity: int, max_seq: int,
            known: list[int], guess: int, beat: int = 0) -> dict[str, Any]:
    """NOTE [Fast longest-sequence search]: from the line's ``guess``, the longest multiple of the
    granularity an actual estimate confirms, bracketed by a length that does not fit one granularity
    above it (or by ``max_seq``). Each probe is aimed where the line through the bracket's ends meets
    the limit, one granularity past the end it just moved so that the next probe can close the bracket,
    and is a plain bisection after two probes on the same side.

    ``beat``: the longest length already confirmed on another layout; a layout that does not fit one
    granularity above it is settled there (``"settled"``: its ``longest`` is then a length that fits,
    not its longest)."""
    g = granularity
    top = max_seq // g * g

    def fits(length: int) -> bool:
        t = total(length)
        return t is not None and t <= limit

    lo = max((n for n in known if n % g == 0 and fits(n)), default=0)
    hi: int | None = min((n for n in known if n % g == 0 and not fits(n)), default=None)
    tried: list[int] = []
    same_side, last_fit = 0, None
    settled = False
    while (hi is None and lo < top) or (hi is not None and hi - lo > g):
        ceiling = top if hi is None else hi - g
        if beat and lo <= beat < ceiling and (hi is None or hi > beat + g) and not tried:
            guess = beat + g  # first show whether this layout can go past the best one at all
        if same_side >= 2 and hi is not None:
            guess = (lo + hi) // 2
        guess = min(max(guess // g * g, lo + g), ceiling)
        tried.append(guess)
        ok = fits(guess)
        if ok:
            lo = guess
        else:
            hi = guess
        same_side = same_side + 1 if ok == last_fit else 1
        last_fit = ok
        if not ok and beat and guess <= beat + g:
            settled = True  # it cannot go past the best layout: where it stops does not matter
            break
        line = _secant(total, limit, lo, hi, g)
        guess = line + g if ok else line  # past the end just moved, so the next probe can close it
    return {"longest": lo, "first_failure": hi, "capped_by_max_seq": hi is None and lo >= top, "tries": tried,
            "settled": settled}


def _secant(total: Callable[[int], int | None], limit: int, lo: int, hi: int | None, g: int) -> int:
    """Where the line through the totals at ``lo`` and ``hi`` meets ``limit`` (midway where one of
    them cannot run); with nothing failed yet, along the line through ``lo`` and half of it, at most
    doubling."""
    t_lo = total(lo) if lo else None
    if hi is None:
        half = lo // 2 // g * g
        t_half = total(half) if half else None
        if t_lo is None or t_half is None or t_lo <= t_half:
            return 2 * lo
        return min(2 * lo, int(lo + (limit - t_lo) * (lo - half) / (t_lo - t_half)))
    t_hi = total(hi)
    if t_lo is None or t_hi is None or t_hi <= t_lo:
        return (lo + hi) // 2
    return int(lo + (limit - t_lo) * (hi - lo) / (t_hi - t_lo))


def _predicted_search(estimator: Estimator, layouts: list[ParallelLayout],
                      kept: set[tuple[int, int, int, int, str]], strategy: str, granularity: int,
                      max_seq: int, first: int | None,
                      log: Callable[[str], None] | None) -> dict[str, Any]:
    """NOTE [Fast longest-sequence search] for one strategy."""
    say = log or (lambda _line: None)
    limit = strategy_limit(estimator, strategy)
    first = first or 4 * granularity
    items: list[dict[str, Any]] = []
    for layout in layouts:
        if _family(layout) not in kept:
            continue
        total = _Totals(estimator, layout, strategy)
        guess = first_guess(total, limit, granularity, max_seq, first)
        cap = host_cap(estimator, layout, strategy, first, granularity)
        items.append({"layout": layout, "total": total, "guess": guess if cap is None else min(guess, cap)})
    # equal guesses (both at the cap) go to the layout whose states leave the device more room; finer
    # head chunks after every default, so that each is probed past the best the default reached and
    # answers only where it goes further (NOTE [Head chunks in the search])
    items.sort(key=lambda x: (x["layout"].head_chunks is not None, -int(x["guess"]),
                              estimator.states(x["layout"], first)[1]))
    results: list[dict[str, Any]] = []
    best_len = 0
    for item in items:
        layout, total = item["layout"], item["total"]
        if item["guess"] * (1 + PRUNE_MARGIN) < best_len:  # its line ends well short of a confirmed length
            results.append(_pruned(layout, item["guess"]))
            continue
        found = confirm(total, limit, granularity, max_seq, [first, 2 * first], item["guess"], best_len)
        best_len = max(best_len, found["longest"])
        # memo at its least device need, as confirmed (solving alpha there costs profiles at that length)
        results.append(_result(estimator, layout, strategy, found, item["guess"], total.cache, False))
        say(f"  {strategy:<14} {layout.short()}: line ~{tokens(item['guess'])}, "
            + ("no longer than the best, " if found["settled"] else "longest ")
            + f"{tokens(found['longest']) if found['longest'] else '-'} ({len(found['tries'])} probes)")
    for layout in layouts:
        if _family(layout) not in kept:
            results.append(_pruned(layout, None))
    return _ranked(estimator, strategy, results)
