"""Checkpoints of a training run, written with ``torch.distributed.checkpoint`` (DCP), and the resume
that continues one exactly (``memo train --save DIR --save-every N``, ``--resume DIR``).

NOTE [Checkpoints]
A checkpoint is a folder ``DIR/step-00000012`` holding:

- DCP's files: every tensor of the model's and the optimizer's state dicts, as
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives them. An FSDP2 state is a DTensor,
  which DCP saves once, by shards, under its name. Every other tensor (one process's, megatron's
  tensor-parallel slices, the optimizer shards of ZeRO-1, FSDP2's step counters) is this rank's own, and
  is saved under a name of its own (``rank3/model/...``): DCP takes plain tensors of one name on several
  ranks for copies and would keep one rank's only.
- ``rank-00003.json`` per rank: the state dicts around those tensors (the optimizer's hyper-parameters,
  the tensors' names), the learning-rate scheduler, the token source's position (NOTE [A token source's
  position] in memo/train/data.py) and the random generators (torch's CPU and CUDA ones, Python's,
  megatron's tracker); ``plan-rank3.json``, memo's plan of that rank, when its strategy made one.
- ``manifest.json``: versioned, what run wrote it (the step; model and its fingerprint, engine, world size
  and layout, sequence length, dtype, batch and micro-batches, checked on resume; the strategy, recorded),
  so that a checkpoint of another model, world size or layout is refused with everything that differs
  (every tensor that is not an FSDP2 shard is a rank's own, so a checkpoint is read by the layout that
  wrote it).

Atomic: the ranks write into ``step-00000012.tmp``; rank 0 writes the manifest last, renames the folder
(the commit) and then replaces ``DIR/latest`` (atomically, NOTE [Atomic writes] in memo/jsonio.py). A run
that dies while saving leaves a ``.tmp`` folder, never read, and the checkpoint before it whole; the next
save removes the leftover. ``--resume DIR`` takes the folder ``latest`` names (or, without it, the newest
whole one), or a step folder given itself. The newest ``keep`` checkpoints are kept. The ranks need one
file system (a node's disk for one node; a shared one across nodes).

What a resumed run restores is everything its steps read (NOTE [Exact resume] in memo/train/run_control.py):
weights, optimizer states, scheduler, data position, generators, and memo's plan.
"""

from __future__ import annotations

import base64
import os
import random
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memo.errors import MemoError, internal_assert
from memo.jsonio import atomic_write, read_json

__all__ = ["CHECKPOINT_VERSION", "Resume", "TrainState", "find_checkpoint", "load_json_state",
           "read_model_state", "save_checkpoint", "step_dir_name"]

CHECKPOINT_VERSION = 1
_KIND = "memo.checkpoint"
_RANK_KIND = "memo.checkpoint.rank"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
#: Fields of the manifest a resumed run must match (NOTE [Checkpoints]), with how the error names them.
IDENTITY = {"model": "model", "model_fingerprint": "model fingerprint", "engine": "engine",
            "world": "world size", "layout": "layout", "seq_len": "seq len", "dtype": "dtype",
            "micro_batch": "micro batch", "micro_batches": "micro-batches"}


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class TrainState:
    """The live objects a checkpoint holds (NOTE [Checkpoints])."""

    module: nn.Module
    """What the state dict is taken of: the model, FSDP2's root, or the stage's chunks in a ModuleList."""
    optimizer: torch.optim.Optimizer
    """The optimizer whose states are this rank's (ZeRO-1: its local optimizer)."""
    scheduler: Any
    """The learning-rate scheduler (memo/train/lr.py)."""
    source: Any
    """The token source (``state_dict()`` / ``load_state_dict()``)."""
    plan: Any = None
    """memo's plan of this rank (memo.planner.Plan), or None."""


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _dcp(call: Any, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """DCP's save or load of ``tensors`` in ``folder``: collective over the default group, or one
    process's without one (DCP warns each time that it assumes so; here that is the intent)."""
    alone = not torch.distributed.is_initialized()
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        call(tensors, checkpoint_id=folder, no_dist=alone)


# ----------------------------------------------------------------------------------- JSON with tensors


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _encode(obj: Any, tensors: dict[str, torch.Tensor] | None, path: str, rank: int) -> Any:
    """``obj`` as JSON: a tensor goes to ``tensors`` (for DCP, under a rank's own name unless it is a
    DTensor) and leaves its name, or with ``tensors`` None is written inline; tuples are kept."""
    if isinstance(obj, torch.Tensor):
        if tensors is None:
            data = obj.detach().cpu().contiguous()
            raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
            return {"__tensor__": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                    "data": base64.b64encode(raw).decode()}
        key = path if _is_dtensor(obj) else f"rank{rank}/{path}"
        tensors[key] = obj
        return {"__dcp__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, tensors, _join(path, k), rank) for k, v in obj.items()}
        return {"__items__": [[_encode(k, None, path, rank), _encode(v, tensors, _join(path, k), rank)]
                              for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, _join(path, i), rank) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, _join(path, i), rank) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise MemoError(f"memo.train: a checkpoint cannot hold {type(obj).__name__} (at {path!r}); a state dict "
                    "holds tensors and plain values")


def _join(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


def _decode(obj: Any, tensors: dict[str, torch.Tensor] | None) -> Any:
    """The inverse of :func:`_encode` (``tensors``: DCP's, loaded)."""
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__dcp__" in obj:
        internal_assert(tensors is not None and obj["__dcp__"] in tensors,
                        "memo.train: a DCP tensor is missing")
        return tensors[obj["__dcp__"]]  # type: ignore[index]
    if "__tensor__" in obj:
        dtype = getattr(torch, str(obj["__tensor__"]), None)
        if not isinstance(dtype, torch.dtype):
            raise MemoError(f"memo.train: a checkpoint names an unknown dtype {obj['__tensor__']!r}")
        raw = bytearray(base64.b64decode(obj["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(obj["shape"]).clone()
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def load_json_state(obj: Any) -> Any:
    """A value :func:`_encode` wrote inline (no DCP tensors)."""
    return _decode(obj, None)


# ----------------------------------------------------------------------------------- the states


def _rng_state() -> dict[str, Any]:
    """Every generator a step may read (NOTE [Exact resume] in memo/train/run_control.py)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_tracker()
    if tracker is not None:
        state["megatron"] = tracker.get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _megatron_tracker()
    if tracker is not None and state.get("megatron") is not None:
        tracker.set_states(state["megatron"])


def _megatron_tracker() -> Any:
    """megatron's RNG tracker when its parallel state is set up (its engine), else None."""
    if "megatron.core" not in sys.modules:
        return None
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker() if parallel_state.model_parallel_is_initialized() else None


def _state_dicts(state: TrainState) -> dict[str, Any]:
    """The model's and the optimizer's state dicts as DCP's state-dict API gives them (FSDP2: sharded)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(state.module, state.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


# ----------------------------------------------------------------------------------- save


def save_checkpoint(root: str | os.PathLike[str], step: int, state: TrainState, manifest: dict[str, Any],
                    keep: int) -> Path:
    """Write the checkpoint of ``step`` under ``root`` (NOTE [Checkpoints]); every rank calls it. Returns
    the step's folder. A rank that cannot write its part stops every rank with a MemoError (one left in a
    collective would wait for it); the previous checkpoint stays whole."""
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    final = Path(root) / step_dir_name(step)
    tmp = final.with_name(final.name + ".tmp")

    def start() -> None:
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # a save that died before
            tmp.mkdir(parents=True)

    def write_rank() -> None:
        plan = None
        if state.plan is not None:
            from memo.planner import save_plan

            plan = f"plan-rank{rank}.json"
            save_plan(state.plan, tmp / plan)
        record = {"version": CHECKPOINT_VERSION, "kind": _RANK_KIND, "rank": rank, "states": states,
                  "scheduler": _encode(state.scheduler.state_dict(), None, "scheduler", rank),
                  "data": _encode(state.source.state_dict(), None, "data", rank),
                  "rng": _encode(_rng_state(), None, "rng", rank), "plan": plan}
        _write_json(tmp / f"rank-{rank:05d}.json", record)

    def commit() -> None:
        if rank != 0:
            return
        _write_json(tmp / "manifest.json", {"version": CHECKPOINT_VERSION, "kind": _KIND, "step": step,
                                            **manifest})
        if final.exists():  # this step saved before (a stop right after a periodic save): replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        with atomic_write(Path(root) / "latest", "memo.train --save") as f:
            f.write(final.name + "\n")
        _prune(Path(root), keep)

    _together(start, step)
    tensors: dict[str, torch.Tensor] = {}
    states = _encode(_state_dicts(state), tensors, "", rank)
    _dcp(dcp.save, tensors, tmp)  # collective: DCP raises on every rank when one fails
    _together(write_rank, step)
    _together(commit, step)
    return final


def _together(part: Any, step: int) -> None:
    """Run ``part`` of a save on this rank; when it fails on any rank, fail on every rank (NOTE
    [Checkpoints]). One process: its own error, as it is."""
    alone = not torch.distributed.is_initialized()
    problem = None
    try:
        part()
    except Exception as err:
        if alone:
            raise
        problem = f"{type(err).__name__}: {err}"
    if alone:
        return
    problems: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(problems, problem)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        r, p = failed[0]
        raise MemoError(f"memo.train: the checkpoint of step {step} was not written (rank {r}: "
                        f"{str(p).splitlines()[0]}); the previous one stays whole")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    import json

    with atomic_write(path, "memo.train --save") as f:
        json.dump(data, f)


def _whole_steps(root: Path) -> list[tuple[int, Path]]:
    """The whole checkpoints under ``root`` (a manifest in a step folder), oldest first."""
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(child.name)
        if match and (child / "manifest.json").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; remove older ones and leftovers of saves that died."""
    for _, path in _whole_steps(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for child in root.iterdir():
        if child.name.endswith(".tmp") and _STEP_DIR.match(child.name[:-4]) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


# ----------------------------------------------------------------------------------- resume


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The step folder ``--resume PATH`` means (NOTE [Checkpoints])."""
    root = Path(path)
    if (root / "manifest.json").is_file():
        return root
    latest = root / "latest"
    if latest.is_file():
        named = root / latest.read_text().strip()
        if _STEP_DIR.match(named.name) and (named / "manifest.json").is_file():
            return named
    steps = _whole_steps(root)
    if not steps:
        raise MemoError(f"memo.train: --resume {os.fspath(path)!r} holds no whole checkpoint (a step-N "
                        "folder with a manifest.json); give the --save DIR of a run that saved one")
    return steps[-1][1]


class Resume:
    """A checkpoint being resumed by this rank: its manifest and this rank's record (NOTE [Checkpoints])."""

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        self.dir = find_checkpoint(path)
        self.manifest = read_json(self.dir / "manifest.json", "memo.train", "resume from a whole checkpoint")
        m = self.manifest
        if (not isinstance(m, dict) or m.get("kind") != _KIND or m.get("version") != CHECKPOINT_VERSION
                or not isinstance(m.get("step"), int)):
            raise MemoError(f"memo.train: {os.fspath(self.dir / 'manifest.json')!r} is not a memo checkpoint "
                            f"manifest of version {CHECKPOINT_VERSION}")
        self.step: int = self.manifest["step"]
        self.rank = rank
        self._record: dict[str, Any] | None = None

    def check(self, identity: dict[str, Any]) -> None:
        """Refuse a checkpoint written by another run, naming every field that differs."""
        differ = [f"{IDENTITY[k]} {self.manifest.get(k)!r} (checkpoint) vs {identity[k]!r} (this run)"
                  for k in IDENTITY if self.manifest.get(k) != identity[k]]
        if differ:
            raise MemoError(f"memo.train: --resume {os.fspath(self.dir)!r} was written by another run: "
                            + ", ".join(differ) + "; resume with that run's model and layout, or drop "
                            "--resume")

    @property
    def record(self) -> dict[str, Any]:
        """This rank's record (read once)."""
        if self._record is None:
            path = self.dir / f"rank-{self.rank:05d}.json"
            record = read_json(path, "memo.train", "the checkpoint lacks this rank's file: was it written by "
                                                   "as many ranks?")
            if (not isinstance(record, dict) or record.get("kind") != _RANK_KIND
                    or record.get("rank") != self.rank):
                raise MemoError(f"memo.train: {os.fspath(path)!r} is not rank {self.rank}'s checkpoint "
                                "record")
            self._record = record
        return self._record

    def restore_data(self, source: Any) -> None:
        """Put ``source`` where the saved run's was (before its first batch is read)."""
        source.load_state_dict(load_json_state(self.record["data"]))

    def plan_path(self) -> Path | None:
        """This rank's saved plan, or None."""
        name = self.record.get("plan")
        return None if name is None else self.dir / str(name)

    def load(self, state: TrainState) -> None:
        """Load the model's and optimizer's states, the scheduler and the generators into ``state``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        targets: dict[str, torch.Tensor] = {}
        _encode(_state_dicts(state), targets, "", self.rank)
        saved = self.record["states"]
        wanted: dict[str, torch.Tensor] = {}
        _collect_keys(saved, wanted)
        missing = sorted(set(wanted) - set(targets))[:3] + sorted(set(targets) - set(wanted))[:3]
        if missing:
            raise MemoError("memo.train: the checkpoint's states do not match this run's model and "
                            f"optimizer (e.g. {', '.join(missing)}); resume with the model it was written "
                            "for")
        _dcp(dcp.load, targets, self.dir)
        restored = _decode(saved, targets)
        set_state_dict(state.module, state.optimizer, model_state_dict=restored["model"],
                       optim_state_dict=restored["optimizer"])
        state.scheduler.load_state_dict(load_json_state(self.record["scheduler"]))
        _set_rng_state(load_json_state(self.record["rng"]))


def _collect_keys(obj: Any, out: dict[str, Any]) -> None:
    if isinstance(obj, list):
        for v in obj:
            _collect_keys(v, out)
    elif isinstance(obj, dict):
        if "__dcp__" in obj:
            out[obj["__dcp__"]] = None
            return
        for v in obj.values():
            _collect_keys(v, out)


def read_model_state(path: str | os.PathLike[str], module: nn.Module) -> None:
    """Load the model weights of a one-process checkpoint (``--resume``'s PATH) into ``module`` (the same
    model, unwrapped): for a look at what a run trained, outside a run."""
    import torch.distributed.checkpoint as dcp

    resume = Resume(path, 0)
    targets: dict[str, torch.Tensor] = {}
    model = _encode(module.state_dict(), targets, "model", 0)
    _dcp(dcp.load, targets, resume.dir)
    module.load_state_dict(_decode(model, targets))
