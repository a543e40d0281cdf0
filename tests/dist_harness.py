"""Multi-process launches for the distributed tests: N CPU processes over gloo, results as JSON.

Not a test module (no ``test_`` prefix): tests/distributed/test_distributed.py uses it. :func:`launch` starts
``world_size`` processes with ``torch.multiprocessing`` (spawn), each of which sets one intra-op
thread, joins a gloo process group on 127.0.0.1 at a free port and calls the worker
``"module:function"`` as ``worker(rank, world_size, spec, record)``. The worker reports each
check with ``record(name, ok, detail)``; every call rewrites the rank's JSON file at once, so a
launch that times out still returns what was recorded before. Nothing is pickled to files: the
worker's ``spec`` is plain JSON-able data and the results come back as JSON.

Every launch has a deadline. A rank that raises ends the launch at once (torch terminates the
others) and a launch past its deadline is terminated: both raise :class:`LaunchError` with the
ranks' tracebacks and whatever they recorded, so CI never hangs on a collective that waits for
a dead rank.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from memo.distributed.layout import free_port

#: How long one collective may wait for the other ranks before gloo raises (seconds).
COLLECTIVE_TIMEOUT_S = 60.0

Record = Callable[[str, bool, str], None]


# NOTE [Ranks forked from a server]
# Each rank is a fresh process, as under torchrun, but not a fresh interpreter: a spawned rank imported
# torch, memo and megatron-core again (seconds of CPU per rank, a quarter of the distributed tests' time on
# two cores). Ranks are forked from multiprocessing's fork server instead, one per pytest worker, which
# imported those modules once and started no threads (forking a process with threads, e.g. pytest's after a
# test ran torch ops, is not safe; the server never runs any). MEMO_TEST_START_METHOD=spawn goes back.
START_METHOD = os.environ.get("MEMO_TEST_START_METHOD", "forkserver")
if START_METHOD == "forkserver":
    # torch._dynamo too: the first meta op with a Python decomposition imports it (3-5 s of CPU per rank)
    mp.set_forkserver_preload(["torch", "torch.distributed", "memo", "memo.train.loop",
                               "megatron.core"])


class LaunchError(RuntimeError):
    """A launch that failed (a rank raised) or ran past its deadline, with what was recorded."""

    def __init__(self, message: str, results: list[list[dict[str, Any]]]) -> None:
        super().__init__(message)
        self.results = results


def launch(worker: str, world_size: int, spec: dict[str, Any],
           timeout_s: float) -> list[list[dict[str, Any]]]:
    """Run ``worker`` ("package.module:function") on ``world_size`` ranks; per rank, its records in order.

    Raises :class:`LaunchError` if a rank raised or exited with an error, or when ``timeout_s``
    passed (the processes are then terminated).
    """
    json.dumps(spec)  # plain data only
    with tempfile.TemporaryDirectory(prefix="memo-dist-") as out:
        port = free_port()
        ctx = mp.start_processes(_entry, args=(worker, world_size, port, out, spec), nprocs=world_size,
                                 join=False, start_method=START_METHOD)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    _terminate(ctx)
                    results = _read(out, world_size)
                    raise LaunchError(
                        f"dist_harness: {worker} on {world_size} ranks ran past its {timeout_s:.0f} s "
                        f"deadline and was terminated; recorded so far: {_summary(results)}", results)
        except ProcessException as e:  # a rank raised or exited with an error
            _terminate(ctx)
            results = _read(out, world_size)
            raise LaunchError(f"dist_harness: {worker} on {world_size} ranks failed: {e}; recorded so far: "
                              f"{_summary(results)}", results) from None
        return _read(out, world_size)


def _terminate(ctx: Any) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(timeout=10)


def _read(out: str, world_size: int) -> list[list[dict[str, Any]]]:
    results = []
    for rank in range(world_size):
        path = Path(out, f"rank{rank}.json")
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            results.append([])
    return results


def _summary(results: list[list[dict[str, Any]]]) -> str:
    parts = []
    for rank, recs in enumerate(results):
        bad = [f"{r['name']}: {r['detail'][-500:]}" for r in recs if not r["ok"]]
        parts.append(f"rank {rank}: {len(recs)} record(s), failing {bad}")
    return "; ".join(parts)


def _entry(rank: int, worker: str, world_size: int, port: int, out: str, spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    records: list[dict[str, Any]] = []
    path = Path(out, f"rank{rank}.json")
    started = time.monotonic()

    def record(name: str, ok: bool, detail: str = "") -> None:
        # "s" and "cpu": seconds (wall, CPU) since the rank started, to see where a slow launch goes
        records.append({"name": name, "ok": bool(ok), "detail": detail,
                        "s": round(time.monotonic() - started, 2), "cpu": round(time.process_time(), 2)})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        tmp.replace(path)

    module, _, function = worker.partition(":")
    fn = getattr(importlib.import_module(module), function)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        fn(rank, world_size, spec, record)
    except BaseException:  # recorded first: torch reports whichever rank it notices first
        record("<raised>", False, traceback.format_exc()[-2000:])
        raise
    finally:
        torch.distributed.destroy_process_group()


def check(record: Record, name: str, fn: Callable[[], str | None]) -> None:
    """Run one check: ``fn`` returns a detail string (or None) on success or raises; recorded either way."""
    try:
        detail = fn()
    except Exception as e:  # noqa: BLE001 - every failure of a check is its result
        lines = traceback.format_exception_only(type(e), e)
        record(name, False, "".join(lines).strip()[:2000])
    else:
        record(name, True, detail or "")


def by_name(results: list[list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """``{check name: [rank 0's record, rank 1's, ...]}`` (a rank that did not record it is missing)."""
    table: dict[str, list[dict[str, Any]]] = {}
    for recs in results:
        for r in recs:
            table.setdefault(r["name"], []).append(r)
    return table


def launch_table(worker: str, world_size: int, timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    """:func:`launch` as :func:`by_name`'s table; a failed launch keeps what was recorded before it and
    adds its error under ``"<launch>"`` (each test then says which of its checks did not run)."""
    try:
        return by_name(launch(worker, world_size, {}, timeout_s))
    except LaunchError as e:
        table = by_name(e.results)
        table["<launch>"] = [{"name": "<launch>", "ok": False, "detail": str(e)}]
        return table


def assert_passed(table: dict[str, list[dict[str, Any]]], name: str, world_size: int) -> None:
    """Check ``name`` was recorded by every rank, and passed on each."""
    recs = table.get(name, [])
    launched = table.get("<launch>", [{}])[0].get("detail", "")
    assert len(recs) == world_size, f"{name}: recorded by {len(recs)} of {world_size} ranks. {launched}"
    failed = [f"rank {i}: {r['detail']}" for i, r in enumerate(recs) if not r["ok"]]
    assert not failed, f"{name}: " + " | ".join(failed)
