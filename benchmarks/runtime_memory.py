"""Device-resident activation memory of memo vs. its baselines, measured on CPU.

Runs one configuration (a GPT from memo.models) under six strategies in one
process and prints a table:

- ``no recompute``: plain autograd, every skeletal tensor stays on the device;
- ``full recompute``: every layer checkpointed (``model.recompute = "full"``);
- ``full offload``: every saved tensor copied to host (``save_on_cpu``-style, alpha=1
  without recompute);
- ``memo a=0``, ``memo a=0.5``, ``memo a=<solved>``: memo.wrap at those alphas; the
  solved alpha comes from ``memo.planner.solve_alpha`` fed with the skeletal sizes
  memo's profiler measures and a host-memory budget, rounded down to a token
  boundary (the runtime offloads floor(alpha * s) tokens).

"planned host" is ``(n - 2) * (S_input + S_attn + alpha * S_others)`` with the
profiler's sizes: the formula solve_alpha and the plan use for ``host_bytes``. The
runtime's host bytes must equal it.

"Device" here is torch's CPU allocator; "host" is memory outside it (memo's host
arena, the full-offload copies). Device bytes are the peak of live storages
allocated during one training iteration (forward + backward), tracked by a
dispatch mode (NOTE [Storage identity and frees] in memo/profiler/recorder.py),
plus, for memo, its two device rounding buffers, which are allocated once before
the measured iteration. Parameters, the batch and gradients of earlier
iterations are not activations and are not counted.

What to expect: memo keeps no layer input on the device, but it keeps the last
two layers' activations (they are not offloaded: their backward follows at once)
and two rounding buffers of one layer's offloaded bytes each. Full recompute
keeps every layer's input. So memo's device bytes fall below full recompute's
once the model is deep enough: n * S_input > 2 * (layer activations) + 2 * (S_input
+ S_attn + alpha * S_others), about n > 36 + 28 * alpha layers at these widths;
the default configuration (64 layers) is past that point for every alpha. memo's
gain over full recompute is mostly time (only the tokens [a:s] of pre/post are
recomputed, never attention), its gain over no recompute is memory.

    python benchmarks/runtime_memory.py [--seq 512] [--layers 64] [--batch 1]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import memo.runtime as mr
from memo.models import build_model, get_config

__all__ = ["LiveBytes", "MemoryRow", "measure", "skeletal_sizes", "main"]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live storages created while active (each storage counted once, freed by weakref)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        # Only fresh outputs allocate: views, in-place and out= returns carry an alias annotation.
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(outs):
            if i < len(returns) and returns[i].alias_info is not None:
                continue
            for leaf in tree_flatten(t)[0]:
                if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                    self._track(leaf.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        ref = self._seen.get(key)
        if ref is not None and ref() is storage:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._seen[key] = weakref.ref(storage, self._freer(key, nbytes))

    def _freer(self, key: int, nbytes: int) -> Callable[[weakref.ref], None]:
        def free(_ref: weakref.ref) -> None:
            self.live -= nbytes
            if self._seen.get(key) is _ref:
                del self._seen[key]
        return free


class _HostOffload:
    """save_on_cpu-style: every saved activation is copied to host memory outside torch's allocator."""

    def __init__(self, params: set[int]) -> None:
        from memo import _C

        self._arena = _C.rounding.host_arena
        self.params = params
        self.host_bytes = 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self.params or t.numel() == 0:
            return ("keep", t)
        nbytes = t.numel() * t.element_size()
        host = self._arena(nbytes).view(t.dtype).view(t.shape)
        host.copy_(t)
        self.host_bytes += nbytes
        return ("host", host)

    def unpack(self, handle: Any) -> torch.Tensor:
        kind, t = handle
        return t if kind == "keep" else t.clone()  # the copy back to the device


@dataclasses.dataclass
class MemoryRow:
    strategy: str
    alpha: float | None
    device_bytes: int
    host_bytes: int
    planned_host_bytes: int | None = None


def _batch(model: nn.Module, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    v = model.config.vocab_size
    return torch.randint(0, v, (b, s), generator=g), torch.randint(0, v, (b, s), generator=g)


def _run(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
         context: Callable[[], Any] | None = None) -> None:
    if context is None:
        model(ids, labels).backward()
    else:
        with context():
            loss = model(ids, labels)
        loss.backward()


def _iteration(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
               context: Callable[[], Any] | None = None) -> int:
    """Peak activation bytes of one iteration, after a warm-up one.

    The warm-up allocates parameter gradients (kept, zeroed in place, so they are not
    counted) and, for memo, the rounding buffers.
    """
    _run(model, ids, labels, context)
    model.zero_grad(set_to_none=False)
    with LiveBytes() as tracker:
        _run(model, ids, labels, context)
    model.zero_grad(set_to_none=True)
    return tracker.peak


def skeletal_sizes(model: nn.Module, b: int, s: int) -> tuple[int, int, int]:
    """(S_input, S_attn, S_others) per layer as memo's profiler measures them (pass 1 of ``memo profile``).

    These are the sizes the alpha LP and a plan's ``host_bytes`` are computed from; the
    runtime's own offloaded bytes must match them (checked in the table's last column).
    """
    from memo.pipeline import profile

    result = profile(model, s, b, device="cpu", solve=False, plan=False, wrap_pass=False,
                     bandwidth_gbps=1.0, layer_ms=1.0, host_mem_gb=1.0)
    layers = result.plain_trace["layers"]
    return int(layers["S_input"]), int(layers["S_attn"]), int(layers["S_others"])


STRATEGIES = ("none", "full", "offload", "memo0", "memo0.5", "solved")


def measure(n_layers: int = 64, s: int = 512, b: int = 1, host_fraction: float = 0.4,
            strategies: tuple[str, ...] = STRATEGIES) -> list[MemoryRow]:
    """The table's rows for a float32 GPT ("tiny" widths, ``n_layers`` layers) at ``s`` tokens, batch ``b``.

    ``host_fraction`` sets the host-memory budget handed to solve_alpha: the bytes
    alpha = host_fraction would need, so the host-memory constraint binds there.
    ``strategies`` picks rows from :data:`STRATEGIES`.
    """
    from memo.planner import solve_alpha

    torch.manual_seed(0)
    cfg = dataclasses.replace(get_config("tiny"), n_layers=n_layers, name=f"tiny-{n_layers}")
    base = build_model(cfg, dtype=torch.float32, max_seq_len=max(s, 16))
    ids, labels = _batch(base, b, s)
    rows = []
    if "none" in strategies:
        rows.append(MemoryRow("no recompute", None, _iteration(base, ids, labels), 0))
    if "full" in strategies:
        full = copy.deepcopy(base)
        full.recompute = "full"
        rows.append(MemoryRow("full recompute", None, _iteration(full, ids, labels), 0))
    if "offload" in strategies:
        params = {p.untyped_storage().data_ptr() for p in base.parameters()}
        off = _HostOffload(params)
        hooks = lambda: torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack)  # noqa: E731
        device = _iteration(base, ids, labels, hooks)
        # off.host_bytes counts both iterations (warm-up and measured): one is half.
        rows.append(MemoryRow("full offload (save_on_cpu)", 1.0, device, off.host_bytes // 2))

    # Per-layer sizes do not depend on depth: measure them on a 3-layer copy.
    probe_cfg = dataclasses.replace(cfg, n_layers=3, name="tiny-3")
    probe = build_model(probe_cfg, dtype=torch.float32, max_seq_len=max(s, 16))
    s_in, s_attn, s_others = skeletal_sizes(probe, b, s)
    kept = n_layers - 2
    host_budget = kept * (s_in + s_attn + host_fraction * s_others)
    solution = solve_alpha(s_in, s_attn, s_others, bandwidth=1e12, layer_time=1.0, n_layers=n_layers,
                           host_memory=host_budget)
    solved = mr.offload_tokens(solution.alpha, s) / s  # a token boundary at or below the LP's alpha
    memo_runs = (("memo0", "memo a=0", 0.0), ("memo0.5", "memo a=0.5", 0.5),
                 ("solved", f"memo a={solved:.3f} (solved)", solved))
    for key, label, alpha in memo_runs:
        if key not in strategies:
            continue
        model = mr.wrap(copy.deepcopy(base), alpha=alpha)
        rt = mr.runtime_of(model)
        peak = _iteration(model, ids, labels)
        device = peak + 2 * rt.layer_bytes
        planned = kept * (s_in + s_attn + round(alpha * s_others))
        rows.append(MemoryRow(label, alpha, device, rt.host_bytes, planned))
    return rows


def format_table(rows: list[MemoryRow]) -> str:
    ref = next(r.device_bytes for r in rows if r.strategy == "no recompute")
    lines = [f"{'strategy':<30} {'device MiB':>11} {'vs none':>8} {'host MiB':>10} {'planned host':>13}"]
    for r in rows:
        planned = "" if r.planned_host_bytes is None else f"{r.planned_host_bytes / 2**20:.3f}"
        lines.append(f"{r.strategy:<30} {r.device_bytes / 2**20:>11.3f} {r.device_bytes / ref:>8.2f} "
                     f"{r.host_bytes / 2**20:>10.3f} {planned:>13}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.layers, args.seq, args.batch)
    print(f"GPT 'tiny' widths (h=64), {args.layers} layers, s={args.seq}, b={args.batch}, float32, CPU")
    print(format_table(rows))


if __name__ == "__main__":
    main()
