#!/usr/bin/env python
"""Every GPU check of memo in one go (``make gpu-check``): tests, training smoke runs, the
allocator's steady state, the GPU benchmark rows and compute-sanitizer; one dated results file
and a summary table.

Run ``--preflight`` first (the Makefile does): it needs only torch and fails within seconds,
with a clear message, where no CUDA device is present. Each check runs in its own interpreter
with a time limit, so one failure or hang does not hide the others; the exit status is non-zero
when any check failed.

Usage::

    make gpu-check WHEELS=/path/to/wheels          # installs, builds with MEMO_BUILD_CUDA=1, runs this
    python benchmarks/gpu_check.py --quick         # fewer and shorter runs
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_KIND = "memo.gpu_check"
RESULTS_VERSION = 1


def preflight(command: str = "make gpu-check",
              hint: str = "Run it on a machine with an NVIDIA GPU and a CUDA build of torch.") -> int:
    """Exit status 0 when torch sees a CUDA device; otherwise say why (as ``command``, then ``hint``),
    fast, without importing memo."""
    try:
        import torch
    except ImportError:
        print(f"{command}: torch is not installed; install a CUDA build of torch first", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        cuda = torch.version.cuda or "none (a CPU-only build)"
        print(f"{command}: no CUDA device is present (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA {cuda}). {hint}", file=sys.stderr)
        return 2
    return 0


class Check:
    """One named check: a command, its time limit, its outcome and the numbers it produced."""

    def __init__(self, name: str, cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.timeout, self.env = name, cmd, timeout, env
        self.status = "not run"
        self.seconds = 0.0
        self.detail = ""
        self.numbers: dict[str, Any] = {}
        self.output = ""

    def run(self, log_dir: Path) -> Check:
        print(f"== {self.name}: {' '.join(self.cmd)}", flush=True)
        start = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        try:
            proc = subprocess.run(self.cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=self.timeout)
            self.output = proc.stdout + proc.stderr
            self.status = "pass" if proc.returncode == 0 else f"fail (exit {proc.returncode})"
        except subprocess.TimeoutExpired as exc:
            self.output = _text(exc.stdout) + _text(exc.stderr)
            self.status = f"timeout ({self.timeout:.0f} s)"
        self.seconds = time.perf_counter() - start
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)
        (log_dir / f"{slug}.log").write_text(self.output)
        tail = "\n".join(self.output.strip().splitlines()[-15:])
        print(f"-- {self.name}: {self.status} in {self.seconds:.0f} s\n{tail}\n", flush=True)
        return self

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "command": self.cmd, "status": self.status,
                "seconds": round(self.seconds, 1), "detail": self.detail, "numbers": self.numbers}


class _SavingList(list):
    """The checks done so far; every append writes the results file."""

    def __init__(self, save: Any) -> None:
        super().__init__()
        self._save = save

    def append(self, check: Check) -> None:
        super().append(check)
        self._save(self)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def _hardware() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    info = {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    return info


def _train_cmd(strategy: str, model: str | None, seq: str, steps: int, report: Path,
               *extra: str) -> list[str]:
    """``memo train`` of ``model`` (None: ``extra`` names the model, e.g. ``--hf-config``)."""
    return [sys.executable, "-m", "memo", "train", *(("--model", model) if model else ()), "--seq-len", seq,
            "--steps", str(steps),
            "--device", "cuda", "--dtype", "bfloat16", "--strategy", strategy, "--no-progress",
            "--report", str(report), *extra]


def _train_numbers(check: Check, report: Path) -> None:
    if not report.exists():
        return
    rep = json.loads(report.read_text())
    steps = rep["steps"]
    times = [s["step_time_s"] for s in steps[1:]] or [s["step_time_s"] for s in steps]
    check.numbers = {
        "alpha": rep.get("alpha"),
        "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
        "median_step_s": round(statistics.median(times), 4),
        "peak_device_mib": None if rep["peak_device_bytes"] is None
        else round(rep["peak_device_bytes"] / 2**20, 1),
        "host_pinned_mib": round(rep["host_pinned_bytes"] / 2**20, 1),
        "allocator": rep["allocator"],
        "segment_allocs_per_step": [s.get("segment_allocs") for s in steps],
    }


def _steady_state(train_check: Check) -> Check:
    """No backend segment allocations (cudaMalloc) once training is in its steady state.

    NOTE [Steady state starts at step 3]: step 1 allocates everything the first time, and AdamW
    creates its state at the end of it; step 2 is the first whose backward runs with gradients
    and optimizer state alive together, so the fallback may still grow there (one segment on an
    H100 with gpt-125m). From step 3 on every step must be served from memory already held.
    """
    check = Check("allocator steady state (memo run)", [], 0)
    per_step = train_check.numbers.get("segment_allocs_per_step") or []
    if not train_check.ok or len(per_step) < 3 or per_step[0] is None:
        check.status, check.detail = "fail", f"no per-step segment counts from '{train_check.name}'"
        return check
    after = per_step[-1] - per_step[1]
    check.numbers = {"segment_allocs_step1": per_step[0], "segment_allocs_step2": per_step[1] - per_step[0],
                     "segment_allocs_after_step2": after}
    check.status = "pass" if after == 0 else "fail"
    check.detail = (f"{after} segment allocations after step 2, {per_step[1] - per_step[0]} in step 2 "
                    f"(cumulative per step: {per_step})")
    return check


def _megatron_hf_check(work: Path, logs: Path, seq: str, steps: int) -> Check:
    """Issue 43: ``--engine megatron --hf-model`` (memo's converter, NOTE [Hugging Face weights in
    megatron's layout] in memo/adapters/megatron_hf.py) on the GPU under NCCL at world 1, exported back
    with ``--export`` (the gather and the inverse conversion of device tensors): a 4-layer Llama saved by
    ``save_pretrained`` here, its export loaded by transformers."""
    ckpt, out, report = work / "hf-llama-ckpt", work / "hf-llama-export", work / "train-megatron-hf.json"
    make = ("import sys, transformers as t; c = t.LlamaConfig(num_hidden_layers=4, hidden_size=1024, "
            "intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, "
            "max_position_embeddings=131072); t.LlamaForCausalLM(c).save_pretrained(sys.argv[1])")
    load = ("import sys, transformers as t; m = t.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
            "print('export loads:', sum(p.numel() for p in m.parameters()), 'parameters')")
    shutil.rmtree(out, ignore_errors=True)
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
             *_train_cmd("memo", None, seq, steps, report, "--engine", "megatron", "--hf-model", str(ckpt),
                         "--export", str(out))[1:]]
    script = " && ".join(shlex.join(cmd) for cmd in ([sys.executable, "-c", make, str(ckpt)], train,
                                                      [sys.executable, "-c", load, str(out)]))
    c = Check(f"torchrun memo train --engine megatron --hf-model (4-layer Llama) {seq} bf16 --export (NCCL, "
              "world 1)", ["bash", "-c", script], 600)
    _train_numbers(c.run(logs), report)
    return c


def _resume_checks(work: Path, logs: Path, seq: str) -> list[Check]:
    """Issue 43: a bf16 run under NCCL at world 1 (FSDP2), stopped after 2 of 4 steps with a checkpoint and
    resumed, against the 4 uninterrupted steps: the losses of steps 3 and 4 must be equal."""
    py, steps = sys.executable, 4
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    # a constant learning rate: a run of 2 --steps and one of 4 then follow the same schedule
    engine = ("--engine", "fsdp2", "--clip-grad", "1.0")
    whole, first, rest = (work / f"resume-{n}.json" for n in ("whole", "first", "rest"))
    ckpt = work / "resume-ckpt"
    runs = [Check(f"torchrun memo train fsdp2 gpt-125m {seq} bf16, {steps} steps (NCCL, world 1)",
                  [*torchrun, *_train_cmd("memo", "gpt-125m", seq, steps, whole, *engine)[1:]], 600),
            Check(f"... the first 2 steps, --save {ckpt.name}",
                  [*torchrun, *_train_cmd("memo", "gpt-125m", seq, 2, first, *engine, "--save",
                                          str(ckpt))[1:]], 600),
            Check(f"... --resume {ckpt.name} to step {steps}",
                  [*torchrun, *_train_cmd("memo", "gpt-125m", seq, steps, rest, *engine,
                                          "--resume", str(ckpt))[1:]], 600)]
    for run, report in zip(runs, (whole, first, rest), strict=True):
        _train_numbers(run.run(logs), report)
    check = Check("resumed bf16 losses equal the uninterrupted run's (NCCL, world 1)", [], 0)
    if not all(r.ok for r in runs):
        check.status, check.detail = "fail", "a run failed: see the checks above"
        return [*runs, check]

    def losses(report: Path) -> dict[int, float]:
        return {s["step"]: s["loss"] for s in json.loads(report.read_text())["steps"]}

    want, got = losses(whole), losses(rest)
    compared = {step: (want[step], got.get(step)) for step in range(3, steps + 1)}
    check.numbers = {"losses (uninterrupted, resumed)": compared}
    check.status = "pass" if all(a == b for a, b in compared.values()) else "fail"
    check.detail = ", ".join(f"step {k}: {a!r} vs {b!r}" for k, (a, b) in compared.items())
    return [*runs, check]


def _pytest_numbers(check: Check) -> None:
    found = re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", check.output)
    check.numbers = {kind: int(n) for n, kind in found}
    check.detail = ", ".join(f"{n} {k}" for k, n in check.numbers.items())


def _sanitizer_numbers(check: Check) -> None:
    summaries = ((r"ERROR SUMMARY: (\d+) error", "errors"), (r"RACECHECK SUMMARY: (\d+) hazard", "hazards"))
    for pattern, key in summaries:
        match = re.search(pattern, check.output)
        if match:
            found = int(match.group(1))
            check.numbers[key], check.detail = found, f"{found} {key}"
            if found and check.ok:
                check.status = f"fail ({key})"


def _table(checks: list[Check]) -> str:
    rows = [("check", "status", "seconds", "numbers")]
    for c in checks:
        nums = c.detail or ", ".join(f"{k} {v}" for k, v in c.numbers.items()
                                     if k not in ("allocator", "segment_allocs_per_step"))
        rows.append((c.name, c.status, f"{c.seconds:.0f}", nums[:110]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _save(out: Path, date: str, hw: dict[str, Any], quick: bool, checks: list[Check]) -> dict[str, Any]:
    """Write the results so far (after every check: a run cut short keeps what it measured)."""
    results = {"version": RESULTS_VERSION, "kind": RESULTS_KIND, "date": date, "hardware": hw,
               "quick": quick, "checks": [c.as_dict() for c in checks],
               "passed": sum(c.ok for c in checks), "failed": sum(not c.ok for c in checks)}
    out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preflight", action="store_true", help="only check that a CUDA device is present")
    p.add_argument("--quick", action="store_true", help="shorter runs (smoke only; fewer steps and lengths)")
    p.add_argument("--out", default=None,
                   help="results file (default: benchmarks/results/gpu-check-<date>.json)")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=("pytest", "train", "megatron", "resume", "benchmarks", "sanitizer", "hf"),
                   help="check groups to leave out")
    args = p.parse_args(argv)
    status = preflight()
    if status or args.preflight:
        return status

    date = dt.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"gpu-check-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="memo-gpu-check-"))
    logs = out.parent / f"gpu-check-{date}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    hw = _hardware()
    print(f"memo gpu-check {date}: {hw}", flush=True)
    steps, seq = (3, "4K") if args.quick else (6, "8K")
    py = sys.executable
    checks = _SavingList(lambda done: _save(out, date, hw, args.quick, done))

    if "pytest" not in args.skip:
        c = Check("pytest -m gpu", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"], 600)
        _pytest_numbers(c.run(logs))
        checks.append(c)

    if "train" not in args.skip:
        memo_run = None
        from memo.train import STRATEGIES  # `memo train`'s own list (imports no torch)

        for strategy in STRATEGIES:
            report = work / f"train-{strategy}.json"
            c = Check(f"memo train {strategy} gpt-125m {seq} bf16",
                      _train_cmd(strategy, "gpt-125m", seq, steps, report), 300)
            _train_numbers(c.run(logs), report)
            checks.append(c)
            if strategy == "memo":
                memo_run = c
        if memo_run is not None:
            checks.append(_steady_state(memo_run))

    if "megatron" not in args.skip:
        # Issue 14: the megatron-core path launched by torchrun, world size 1 on the GPU (NCCL).
        report = work / "train-megatron-torchrun.json"
        c = Check(f"torchrun memo train --engine megatron gpt-125m {seq} bf16 (NCCL, world 1)",
                  [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   *_train_cmd("memo", "gpt-125m", seq, steps, report, "--engine", "megatron")[1:]], 600)
        _train_numbers(c.run(logs), report)
        checks.append(c)
        # Issue 28: FSDP2's sharded states, on the device and in host memory (CPUOffloadPolicy), and
        # issue 29: megatron's schedule over micro-batches (no pipelining at world 1), all under NCCL.
        # Issue 41: FSDP2 with a Hugging Face Llama (its attention under memo), CP 1, world 1 under NCCL.
        hf_llama = json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 2048,
                               "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 8,
                               "vocab_size": 32000, "max_position_embeddings": 131072, "use_cache": False,
                               "attn_implementation": "sdpa"})
        for name, extra in (("fsdp2", ("--engine", "fsdp2")),
                            ("fsdp2-offload", ("--engine", "fsdp2", "--offload-states")),
                            ("fsdp2-hf-llama", ("--engine", "fsdp2", "--hf-config", hf_llama)),
                            ("megatron-microbatches", ("--engine", "megatron", "--micro-batches", "4"))):
            report = work / f"train-{name}-torchrun.json"
            what = "--engine fsdp2 --hf-config (an 8-layer 1B-wide Llama)" if "--hf-config" in extra else \
                f"{' '.join(extra)} gpt-125m"
            c = Check(f"torchrun memo train {what} {seq} bf16 (NCCL, world 1)",
                      [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                       *_train_cmd("memo", None if "--hf-config" in extra else "gpt-125m", seq, steps, report,
                                   *extra)[1:]], 600)
            _train_numbers(c.run(logs), report)
            checks.append(c)

        checks.append(_megatron_hf_check(work, logs, seq, steps))

    if "resume" not in args.skip:
        for check in _resume_checks(work, logs, seq):
            checks.append(check)

    if "sanitizer" not in args.skip:
        sanitizer = shutil.which("compute-sanitizer")
        for tool in ("memcheck", "racecheck"):
            report = work / f"sanitizer-{tool}.json"
            cmd = _train_cmd("memo", "tiny", "512", 2, report, "--alpha", "0.5")
            if sanitizer is None:
                c = Check(f"compute-sanitizer {tool}", cmd, 0)
                c.status, c.detail = "fail", "compute-sanitizer is not on PATH"
            else:
                extra = ["--leak-check", "no"] if tool == "memcheck" else []
                c = Check(f"compute-sanitizer {tool}", [sanitizer, "--tool", tool, *extra, *cmd], 900)
                _sanitizer_numbers(c.run(logs))
            checks.append(c)

    if "benchmarks" not in args.skip:
        bench_json = work / "strategies.json"
        c = Check(f"benchmarks/strategies.py gpt-125m {seq}",
                  [py, "benchmarks/strategies.py", "--device", "cuda", "--model", "gpt-125m",
                   "--seq-len", seq, "--steps", str(min(steps, 4)), "--json", str(bench_json)], 900)
        c.run(logs)
        if bench_json.exists():
            c.numbers = {"rows": json.loads(bench_json.read_text()).get("rows")}
        checks.append(c)
        max_json = work / "max_seq_len.json"
        c = Check("benchmarks/max_seq_len.py gpt-125m 8 GiB",
                  [py, "benchmarks/max_seq_len.py", "--device", "cuda", "--model", "gpt-125m",
                   "--device-mem-mb", "8192", "--granularity", "8K",
                   "--max-seq", "32K" if args.quick else "64K", "--json", str(max_json)], 900)
        c.run(logs)
        if max_json.exists():
            res = json.loads(max_json.read_text())["results"]
            c.numbers = {r["strategy"]: r["longest"] for r in res}
        checks.append(c)

    if "hf" not in args.skip:
        # Issue 13: a Hugging Face Llama fine-tuned with memo in bf16 on the GPU (LoRA-style, 20 steps).
        c = Check("examples/finetune_hf.py bf16 20 steps",
                  [py, "examples/finetune_hf.py", "--device", "cuda", "--bf16", "--steps", "20",
                   "--seq-len", "8K" if args.quick else "16K", "--hidden", "512", "--layers", "8",
                   "--heads", "8"], 900)
        c.run(logs)
        checks.append(c)
        # Issue 30: the PEFT example in bf16 at 32K tokens, memo against HF's own gradient
        # checkpointing (use_reentrant=False), one process: step time and peak device memory.
        compare_json = work / "finetune_compare.json"
        c = Check("examples/finetune_hf.py --compare bf16 32K",
                  [py, "examples/finetune_hf.py", "--device", "cuda", "--bf16", "--steps", "4",
                   "--seq-len", "16K" if args.quick else "32K", "--hidden", "2048", "--layers", "16",
                   "--heads", "16", "--compare", "--json", str(compare_json)], 900)
        c.run(logs)
        if compare_json.exists():
            runs = json.loads(compare_json.read_text())["runs"]
            c.numbers = {name: {"median_step_s": run["median_step_seconds"],
                                "peak_gib": (run["peak_device_bytes"] or 0) / 2**30}
                         for name, run in runs.items()}
        checks.append(c)

    results = _save(out, date, hw, args.quick, checks)
    print(f"\nmemo gpu-check {date} on {hw['gpu']} (torch {hw['torch']}, CUDA {hw['cuda']})\n")
    print(_table(checks))
    print(f"\n{results['passed']} passed, {results['failed']} failed")
    print(f"results written to {out} (logs in {logs})")
    return 0 if results["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
