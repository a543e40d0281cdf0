#!/usr/bin/env python
"""Every activation-memory strategy on one model and one sequence length, side by side.

One invocation trains the same model (same seed, same data) with

- ``none``: plain autograd,
- ``full-recompute``: ``torch.utils.checkpoint`` per layer,
- ``full-offload``: memo's wrapper with alpha = 1,
- ``memo``: memo with the solved alpha ("auto") and the planned allocator,
- ``save-on-cpu``: PyTorch's ``torch.autograd.graph.save_on_cpu(pin_memory=<cuda>)`` around
  forward + backward of the plain model (the baseline a PyTorch user would otherwise pick),

and on CUDA also ``none`` and ``full-recompute`` under PyTorch's own caching allocator, plain and
with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (each in a fresh interpreter, since the
allocator is fixed at CUDA initialisation). It prints one table: alpha, mean step time (steps
after the first), tokens per GPU per second, MFU, device peak, host bytes, planned/fallback
allocations, and ratios to full recompute.

NOTE [Same meter for every row]
The in-process rows all run under one memo.allocator context per row (see NOTE [Measuring
device memory] in memo/strategies.py): the peak is memo's allocator's peak of bytes in use plus
the parameters. ``save-on-cpu`` is a :class:`memo.strategies.Strategy` subclass so that it
gets exactly this meter. On CUDA memo's allocator is installed before the first CUDA tensor
(memo's row needs it), so the in-process baselines are served by memo's fallback caching
allocator; the extra subprocess rows measure PyTorch's allocators with
``torch.cuda.max_memory_allocated``, which counts the same bytes (live tensors, parameters
included).

NOTE [save_on_cpu on the CPU backend]
On a CPU device ``save_on_cpu`` moves nothing: ``tensor.cpu()`` of a CPU tensor is the tensor
itself. memo's CPU backend emulates a device whose memory is what memo's allocator serves and a
host whose memory is outside it (memo's host arena). The CPU row therefore keeps
``save_on_cpu``'s data flow (copy every saved tensor to host when it is saved, copy it back
when backward unpacks it) and puts the host copies in memory that is not the device
allocator's, as memo's own offload does. On CUDA the row is ``torch.autograd.graph.save_on_cpu``
itself, unchanged (its pack hook is only wrapped to count the host bytes it holds).

Usage::

    python benchmarks/strategies.py                       # CPU: gpt-mini, 4K tokens
    python benchmarks/strategies.py --model gpt-1.3b --seq-len 32K --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from memo.cli.args import positive_float, positive_int, seq_len
from memo.errors import MemoError
from memo.strategies import Strategy, StrategyOptions, make_strategy
from memo.units import format_mib

# NOTE [Import pulp before the first model]
# memo's planner imports pulp lazily, inside the first memo step's set-up. pulp's optional solver
# modules (copt_api, cplex_api) keep the exceptions they catch at import time, and those
# tracebacks' frames chain (f_back) up to whoever imported pulp: Strategy.prepare and train(),
# whose locals are that run's model and optimizer. Imported here, before any model exists, the
# chain ends in this module instead, and no measured run keeps an earlier run's memory alive.
try:
    import pulp  # noqa: F401
except ImportError:  # memo's planner reports a missing pulp itself, with what to install
    pass

__all__ = [
    "ROWS",
    "HostBytesMeter",
    "SaveOnCpuStrategy",
    "build_strategy",
    "format_table",
    "main",
    "run_row",
]

#: In-process rows, in table order.
ROWS = ("none", "full-recompute", "full-offload", "memo", "save-on-cpu")
#: Rows that also run under PyTorch's own CUDA allocators (subprocesses, CUDA only).
TORCH_ALLOCATOR_ROWS = ("none", "full-recompute")
TORCH_ALLOCATORS = {"caching": None, "expandable": "expandable_segments:True"}
BENCH_KIND = "memo.benchmark.strategies"
BENCH_VERSION = 1
_ROW_PREFIX = "ROW-JSON "


# ---------------------------------------------------------------- save_on_cpu baseline


class HostBytesMeter:
    """Live and peak bytes of the host copies a saved-tensor hook holds.

    A copy counts from the moment it is packed until autograd drops it (after backward used it,
    or when the graph is freed); ``weakref.finalize`` on the host tensor sees that moment.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, host: torch.Tensor) -> None:
        nbytes = host.numel() * host.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(host, self._drop, nbytes)

    def _drop(self, nbytes: int) -> None:
        self.live -= nbytes


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory that memo's CPU allocator does not serve.

    ``torch.frombuffer`` wraps a Python ``bytearray`` without calling c10's CPU allocator, so the
    copy is "host" memory for the emulated device (NOTE [save_on_cpu on the CPU backend]).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return tensor.detach().clone()
    raw = torch.frombuffer(bytearray(nbytes), dtype=torch.uint8)
    host = raw.view(tensor.dtype).view(tensor.shape)
    host.copy_(tensor)
    return host


class SaveOnCpuStrategy(Strategy):
    """``torch.autograd.graph.save_on_cpu`` around forward + backward of the plain model.

    It is a ``none`` strategy (no recompute, no wrapper) whose steps run under the saved-tensor
    hooks; subclassing :class:`Strategy` gives it the same device-memory meter as every other
    row (NOTE [Same meter for every row]). ``host_pinned_bytes`` is the peak of host copies held.
    """

    def __init__(self) -> None:
        super().__init__(StrategyOptions(strategy="none"))
        self.name = "save-on-cpu"
        self.meter = HostBytesMeter()

    def _hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        if self.device.type == "cuda":
            hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
            pack = hooks.pack_hook

            def counted_pack(tensor: torch.Tensor) -> Any:
                packed = pack(tensor)
                self.meter.add(packed[1])
                return packed

            # saved_tensors_hooks.__enter__ pushes self.pack_hook: wrapping it keeps torch's
            # own pack/unpack and only counts what they hold on the host.
            hooks.pack_hook = counted_pack
            return hooks
        if self.device.type != "cpu":
            raise MemoError(f"benchmarks/strategies: save-on-cpu runs on cpu or cuda, not {self.device.type}")

        def pack_to_host(tensor: torch.Tensor) -> torch.Tensor:
            host = _host_copy(tensor)
            self.meter.add(host)
            return host

        def unpack_to_device(host: torch.Tensor) -> torch.Tensor:
            # Back into device memory (memo's allocator), as save_on_cpu's tensor.to(device) does.
            return host.clone()

        return torch.autograd.graph.saved_tensors_hooks(pack_to_host, unpack_to_device)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._hooks(), super().step():
            yield

    def host_pinned_bytes(self) -> int:
        return self.meter.peak


def build_strategy(name: str, time_limit: float) -> Strategy:
    """The strategy object of one row; ``time_limit``: seconds per MIP solve of memo's planner."""
    if name == "save-on-cpu":
        return SaveOnCpuStrategy()
    options = StrategyOptions(strategy=name, time_limit=time_limit) if name == "memo" else \
        StrategyOptions(strategy=name)
    return make_strategy(options)


# ---------------------------------------------------------------- one row


def run_row(name: str, args: argparse.Namespace, allocator: str = "memo") -> dict[str, Any]:
    """Train one row for ``args.steps`` steps and return its measurements.

    ``allocator``: ``"memo"`` (in-process rows) or the PyTorch CUDA allocator of a subprocess row.
    """
    from memo.utils.training import TrainConfig, summarize, train

    config = TrainConfig(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch,
                         steps=args.steps, device=args.device, dtype=args.dtype, seed=args.seed,
                         peak_tflops=args.peak_tflops)
    strategy = build_strategy(name, args.time_limit)
    lines: list[str] = []
    start = time.perf_counter()
    try:
        result = train(config, progress=False, log=lines.append, strategy=strategy)
    finally:
        # train() closes the strategy only when it finishes; leave no allocator context behind.
        strategy.close()
    wall = time.perf_counter() - start
    summary = summarize(result)
    last = result.steps[-1].extras
    label = name if allocator == "memo" else f"{name} [torch {allocator}]"
    return {
        "row": label,
        "strategy": name,
        "allocator": allocator,
        "alpha": strategy.alpha,
        "alpha_binding": strategy.alpha_binding,
        "first_loss": summary["first_loss"],
        "last_loss": summary["last_loss"],
        "mean_step_time_s": summary["mean_step_time_s"],
        "mean_tgs": summary["mean_tgs"],
        "mean_mfu": summary["mean_mfu"],
        "peak_device_bytes": summary["peak_memory_bytes"],
        "peak_device_kind": result.peak_memory_kind,
        "host_bytes": int(last.get("host_pinned_bytes", 0)),
        "planned": int(last.get("allocator", {}).get("planned", 0)),
        "fallback": int(last.get("allocator", {}).get("fallback", 0)),
        "unplanned": int(last.get("allocator", {}).get("unplanned", 0)),
        "steps": [{"loss": s.loss, "step_time_s": s.step_time_s} for s in result.steps],
        "wall_s": wall,
    }


def _torch_allocator_row(name: str, allocator: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row in a fresh interpreter whose CUDA allocator is PyTorch's (``allocator`` setting)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if TORCH_ALLOCATORS[allocator] is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = TORCH_ALLOCATORS[allocator]
    cmd = [sys.executable, os.path.abspath(__file__), "--child-row", name, "--child-allocator", allocator,
           "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
           "--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype,
           "--seed", str(args.seed), "--time-limit", str(args.time_limit), "--threads", str(args.threads)]
    if args.peak_tflops is not None:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = [line[len(_ROW_PREFIX):] for line in done.stdout.splitlines() if line.startswith(_ROW_PREFIX)]
    if done.returncode != 0 or not rows:
        raise MemoError(
            f"benchmarks/strategies: row {name!r} under PyTorch's {allocator} allocator failed "
            f"(exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(rows[-1])


# ---------------------------------------------------------------- table




def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "n/a"
    return f"{value / base:.2f}x"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table; ratios are row / full-recompute (memo's allocator row)."""
    base = next((r for r in rows if r["row"] == "full-recompute"), None)
    header = ("strategy", "alpha", "step time", "TGS", "MFU", "device peak", "host bytes",
              "planned/fallback", "time/FR", "MFU/FR", "peak/FR")
    table = [header]
    for r in rows:
        table.append((
            r["row"],
            "-" if r["alpha"] is None else f"{r['alpha']:.3f}",
            f"{r['mean_step_time_s'] * 1e3:,.0f} ms",
            f"{r['mean_tgs']:,.0f}",
            "n/a" if r["mean_mfu"] is None else f"{100 * r['mean_mfu']:.1f}%",
            format_mib(r["peak_device_bytes"]),
            format_mib(r["host_bytes"]),
            f"{r['planned']}/{r['fallback']}" if r["allocator"] == "memo" else "-",
            _ratio(r["mean_step_time_s"], base and base["mean_step_time_s"]),
            _ratio(r["mean_mfu"], base and base["mean_mfu"]),
            _ratio(r["peak_device_bytes"], base and base["peak_device_bytes"]),
        ))
    return align(table)


def align(table: list[tuple[str, ...]]) -> str:
    """Rows of cells as text columns: the first left-aligned, the rest right-aligned, and a rule
    under the header row."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                       enumerate(zip(row, widths, strict=True))) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arguments(p)
    p.add_argument("--seq-len", type=seq_len, default=None,
                   help="tokens per sequence: 2048, 32K, 1M (default: 4K on CPU, 32K on CUDA)")
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per step (1)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps per strategy; step 1 is warm-up, not timed (default: 3 on CPU, 6 on CUDA)")
    p.add_argument("--seed", type=int, default=0, help="seed for initialisation and data (0)")
    p.add_argument("--peak-tflops", type=positive_float,
                   help="device peak TFLOPS for MFU (default: known GPUs)")
    p.add_argument("--time-limit", type=positive_float, default=None,
                   help="seconds per MIP solve of memo's planner (default: 5 on CPU, 20 on CUDA)")
    p.add_argument("--only", nargs="+", choices=ROWS, help="run only these rows (default: all)")
    p.add_argument("--no-torch-allocators", action="store_true",
                   help="CUDA: skip the rows under PyTorch's caching/expandable allocators")
    p.add_argument("--json", metavar="OUT.json", help="write every row's measurements as JSON")
    # One row in a fresh interpreter (PyTorch's CUDA allocator rows); not for direct use.
    p.add_argument("--child-row", choices=TORCH_ALLOCATOR_ROWS, help=argparse.SUPPRESS)
    p.add_argument("--child-allocator", choices=sorted(TORCH_ALLOCATORS), help=argparse.SUPPRESS)
    return p


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype and --threads, which :func:`resolve_device` fills in."""
    from memo.models import list_configs
    from memo.utils.training import DTYPES

    p.add_argument("--model", default=None,
                   help=f"model (default: gpt-mini on CPU, gpt-1.3b on CUDA): {', '.join(list_configs())}")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when present)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU: torch intra-op threads (1; 0 keeps torch's default). On a shared machine more "
                   "OpenMP threads than free cores spin at every barrier and steps get many times slower")


def resolve_device(args: argparse.Namespace, prog: str) -> bool:
    """Device, CPU threads, model and dtype defaults the benchmarks share; returns whether on CUDA."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(args.device).type == "cuda"
    if args.threads < 0:
        raise MemoError(f"{prog}: --threads must be >= 0, got {args.threads}")
    if not cuda and args.threads > 0:
        torch.set_num_threads(args.threads)
    if cuda and not torch.cuda.is_available():
        raise MemoError(f"{prog}: --device {args.device} but torch sees no CUDA device")
    if not cuda and args.device != "cpu":
        raise MemoError(f"{prog}: --device must be cpu or cuda[:i], got {args.device!r}")
    args.model = args.model or ("gpt-1.3b" if cuda else "gpt-mini")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    return cuda


def _defaults(args: argparse.Namespace) -> None:
    cuda = resolve_device(args, "benchmarks/strategies")
    args.seq_len = args.seq_len or (32768 if cuda else 4096)
    args.steps = args.steps or (6 if cuda else 3)
    args.time_limit = args.time_limit or (20.0 if cuda else 5.0)
    if args.steps < 2:
        raise MemoError("benchmarks/strategies: --steps must be >= 2 (step 1 is warm-up and is not timed)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _defaults(args)
    cuda = torch.device(args.device).type == "cuda"
    if args.child_row is not None:
        print(_ROW_PREFIX + json.dumps(run_row(args.child_row, args, args.child_allocator)), flush=True)
        return 0
    names = [n for n in ROWS if args.only is None or n in args.only]
    if cuda:
        from memo import allocator

        # memo's row needs memo's CUDA allocator, which must be installed before the first
        # CUDA tensor; every in-process row is then measured by it (NOTE [Same meter for every row]).
        if not allocator.cuda_installed():
            allocator.install_cuda()
    print(f"benchmarks/strategies: {args.model}, seq {args.seq_len:,} x {args.micro_batch}, {args.dtype} on "
          f"{args.device}, {args.steps} steps per strategy (step 1 not timed), torch threads "
          f"{torch.get_num_threads()}", flush=True)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name in names:
        row = run_row(name, args)
        rows.append(row)
        print(f"  {row['row']}: {row['mean_step_time_s'] * 1e3:,.0f} ms/step, "
              f"peak {format_mib(row['peak_device_bytes'])}, loss {row['first_loss']:.4f} -> "
              f"{row['last_loss']:.4f} ({row['wall_s']:.0f} s)", flush=True)
        gc.collect()
        from memo import allocator as memo_allocator

        memo_allocator.empty_cache(torch.device(args.device))
    torch_rows = [n for n in names if n in TORCH_ALLOCATOR_ROWS]
    if not cuda:
        skipped.append("PyTorch caching / expandable_segments allocator rows: CUDA only (no CUDA device in "
                       "this run)")
    elif args.no_torch_allocators:
        skipped.append("PyTorch caching / expandable_segments allocator rows: --no-torch-allocators")
    else:
        for allocator_name in TORCH_ALLOCATORS:
            for name in torch_rows:
                row = _torch_allocator_row(name, allocator_name, args)
                rows.append(row)
                print(f"  {row['row']}: {row['mean_step_time_s'] * 1e3:,.0f} ms/step, "
                      f"peak {format_mib(row['peak_device_bytes'])}", flush=True)
    print(f"\n{args.model}, seq {args.seq_len:,}: mean over steps 2..{args.steps}; ratios to full-recompute "
          "(FR)\n")
    print(format_table(rows))
    kinds = sorted({f"{r['row']}: {r['peak_device_kind']}" for r in rows})
    print("\ndevice peak measured as: " + "; ".join(kinds))
    if not cuda:
        print("host bytes: memo's host arena; for save-on-cpu the peak of host copies held, emulated on CPU "
              "(NOTE [save_on_cpu on the CPU backend]); MFU n/a: no peak FLOPS for a CPU")
    for line in skipped:
        print(f"skipped: {line}")
    if args.json:
        out = {"version": BENCH_VERSION, "kind": BENCH_KIND, "model": args.model, "seq_len": args.seq_len,
               "micro_batch": args.micro_batch, "device": args.device, "dtype": args.dtype,
               "steps": args.steps, "rows": rows, "skipped": skipped}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        print(f"json written to {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MemoError as err:
        sys.exit(f"error: {err}")
