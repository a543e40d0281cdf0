"""``memo show plan.json``: a readable summary of a plan.

Alpha and its binding constraint, peak, lower bound and their ratio, per-phase
peaks, host bytes, and how the solver did.
"""

from __future__ import annotations

import argparse

from memo.planner import Plan, PlanSummary, offload_difference, read_plan_summary
from memo.planner.vocab import LayerPolicy
from memo.units import format_bytes

__all__ = ["add_parser", "format_plan", "parallel_line", "run", "safe_text", "warning_lines"]


def safe_text(value: object) -> str:
    """``value`` as text fit for a terminal: characters that are not printable (escape sequences,
    newlines, carriage returns) are written as Python escapes, so a string read from a file can
    neither drive the terminal nor print a line of its own (a crafted "peak" line)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("show", help="summarise a plan file", description=__doc__)
    parser.add_argument("plan", help="plan JSON written by `memo plan` or `memo profile`")
    parser.set_defaults(func=run)
    return parser


def _mib(n: int | None) -> str:
    # One human unit per quantity; the exact bytes are in the plan file.
    return "unknown" if n is None else format_bytes(n)


#: The plan meta keys of the "model" line.
MODEL_KEYS = ("model", "seq_len", "micro_batch", "dtype", "n_layers", "fingerprint")


#: Phases listed one by one up to this many; past it, the highest ones and a count (a plan of 10^7
#: allocations has 10^5 phase instances: NOTE [A plan's summary] in planner/summary.py).
MAX_PHASE_LINES = 64


def format_plan(plan: Plan | PlanSummary) -> str:
    """The summary of a :class:`memo.planner.Plan` or :class:`memo.planner.PlanSummary`."""
    meta = plan.meta
    out = [
        "model         " + " ".join(f"{k}={safe_text(meta[k])}" for k in MODEL_KEYS if k in meta),
        parallel_line(meta),
        "alpha         " + ("not solved" if plan.alpha is None else f"{plan.alpha:.4f}"
                            + f" (binding: {safe_text(plan.alpha_binding)})"),
        f"peak          {_mib(plan.peak)}",
        f"lower bound   {_mib(plan.lower_bound)}",
        f"ratio         {plan.ratio:.4f}",
        f"no reuse      {_mib(plan.no_reuse_bytes)}",
        f"host bytes    {_mib(plan.host_bytes)}",
        f"allocations   {_allocations(plan):,}",
    ]
    if plan.policy:  # NOTE [Layer policy] in memo/runtime/runtime.py
        from memo.planner import describe_policy

        out.append(f"policy        {describe_policy(plan.policy)} (per layer: "
                   f"{' '.join(p[0] for p in plan.policy)}; m = memo, i = input-only, r = full recompute, "
                   "k = keep)")
        # NOTE [Tiles bounded by memory] in memo/runtime/tiles.py
        if any(p in (LayerPolicy.MEMO, LayerPolicy.INPUT_ONLY) for p in plan.policy):
            tiles = ("the runtime's default (s/8 tokens, at most 256 MiB of a tile's transients)"
                     if plan.tile_tokens is None else
                     f"{plan.tile_tokens:,} tokens, as recorded (the default of the device the plan is for, "
                     "or a smaller tile chosen to fit the device budget)")
            out.append("tiles         " + tiles)
    out += device_lines(plan.device)
    if plan.offload:  # NOTE [Planned and actual offload] in planner/plan.py
        o = plan.offload
        out.append(f"offload       {o['offloaded_layers']} layers; per layer planned "
                   f"{_mib(o['planned_bytes_per_layer'])}, actual {_mib(o['actual_bytes_per_layer'])}")
        warning = offload_difference(o)
        if warning is not None:
            out.append(f"warning       {safe_text(warning)}")
    s = plan.solver
    out.append(f"solver        {safe_text(s.get('kind'))} {safe_text(s.get('solver') or 'heuristic only')}, "
               f"{s.get('seconds', 0):.2f} s, heuristic fallback: {bool(s.get('heuristic_fallback'))}")
    stages = s.get("stages") or ({"total": s["total"]} if "total" in s else {})
    for name, st in stages.items():
        out.append(f"  {safe_text(name):<20} {safe_text(st.get('method'))}: {safe_text(st.get('status'))}, "
                   f"{safe_text(st.get('seconds'))} s, "
                   f"gap to lower bound {100 * st.get('gap_to_lower_bound', 0):.2f}%, "
                   f"items {safe_text(st.get('items'))}")
    for kind, height in plan.level1_peak.items():
        out.append(f"level 1       {safe_text(kind)}: block {_mib(height)}")
    peaks = plan.phase_peaks()
    shown = list(peaks.items())
    if len(shown) > MAX_PHASE_LINES:
        shown = sorted(shown, key=lambda kv: -kv[1])[:MAX_PHASE_LINES // 2]
        out.append(f"phase peaks (highest arena byte each phase's allocations reach; the {len(shown)} "
                   f"highest of {len(peaks):,} phases):")
    else:
        out.append("phase peaks (highest arena byte each phase's allocations reach):")
    for phase, top in shown:
        out.append(f"  {safe_text(phase):<20} {_mib(top)}")
    out += warning_lines(plan.warnings)
    return "\n".join(out)


def parallel_line(meta: dict) -> str:
    """Which rank the plan is for: tensor and context parallel sizes and the tokens the rank runs
    (NOTE [Tensor-parallel rank], NOTE [Context-parallel profile]); 1 where the plan records none."""
    tp, cp = int(meta.get("tensor_parallel", 1)), int(meta.get("context_parallel", 1))
    line = f"parallel      TP {tp} x CP {cp}"
    if tp * cp == 1:
        return line + " (one unsharded process)"
    seq = meta.get("seq_len")
    line += f": one rank of {tp * cp} GPUs"
    if isinstance(seq, int):
        line += f"; it runs {seq // cp:,} of the {seq:,} tokens, its layer input holds {seq // (cp * tp):,}"
    return line


BINDING_WORDS = {"bandwidth": "bandwidth (the link cannot move more under one layer's compute)",
                 "host_memory": "host memory (the pinned arena is full: a larger alpha, or a memo layer in "
                                "place of an input-only one, would not fit)",
                 "device_memory": "device memory (a faster layer policy or larger alpha would not fit)",
                 "alpha<=1": "none (everything is offloaded, nothing recomputed)",
                 "none": "none (every layer keeps its activations)",
                 "given": "none (alpha or the policy was given)"}


def device_lines(device: dict | None) -> list[str]:
    """One rank's device memory (NOTE [Model states]): total, parts, budget, binding constraint."""
    if not device:
        return []
    st = device.get("model_states")
    if st is None:  # `memo plan` of a trace that records no model states
        states = "not recorded in the trace: the total is the iteration's alone"
    else:
        states = ", ".join(f"{part} {_mib(st[part]['bytes'])} {safe_text(st[part].get('dtype', ''))}".rstrip()
                           for part in ("parameters", "gradients", "optimizer"))
    budget = device.get("budget_bytes")
    total = device["total_bytes"]
    fits = "" if budget is None else (" (fits)" if total <= budget else " (OVER the budget)")
    out = [
        f"device/rank   {_mib(total)} of "
        + ("no budget given" if budget is None else f"{_mib(budget)} GPU memory{fits}"),
        f"  iteration   {_mib(device.get('iteration_peak_bytes'))} at the peak (activations, rounding "
        "buffers, "
        "gradients as they appear)",
        f"  states      {states}",
    ]
    est = device.get("estimate") or {}
    if "full_recompute_bytes" in est:
        out.append(f"  full recompute would need {_mib(est['full_recompute_bytes'])} per rank")
    binding = device.get("binding")
    if binding:
        out.append(f"binding       {safe_text(BINDING_WORDS.get(binding, binding))}")
    return out


def warning_lines(warnings: list[str]) -> list[str]:
    """The planner's warnings for people: one line per kind, information marked as a note.

    A layer pass that differs from the others by design (memo keeps the last two layers'
    activations on the device), or one that other phases interrupt, is information, not
    something to act on; the same message for twelve phases is one line naming them.
    """
    kinds = (("differs from the other", "differ from the other layer passes and are planned on their own: "
              "their layer policy differs from the others' (NOTE [Layer policy]; nothing to do)"),
             ("is interrupted by other phases", "are interrupted by other phases, so their allocations are "
              "planned one by one instead of as one layer block (nothing to do)"))
    out, rest = [], [safe_text(w) for w in warnings]
    for needle, text in kinds:
        hits = [w for w in rest if needle in w and "phase " in w]  # the planner's form: "phase P ..."
        if hits:
            phases = ", ".join(w.split("phase ", 1)[1].split(" ", 1)[0] for w in hits)
            out.append(f"note          {phases} {text}")
            rest = [w for w in rest if w not in hits]
    return [f"warning       {w}" for w in rest] + out


def _allocations(plan: Plan | PlanSummary) -> int:
    count = getattr(plan, "allocation_count", None)
    return int(count) if count is not None else len(plan.allocations)


def run(args: argparse.Namespace) -> int:
    # NOTE [A plan's summary]: the printed fields only, where the file has them; else the whole plan
    print(format_plan(read_plan_summary(args.plan)))
    return 0
