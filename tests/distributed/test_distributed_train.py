"""``memo train`` over several processes (issue 14): the layout's checks, the data split, the start-up
agreement, and a torchrun launch whose losses equal the single-process run's.

The checks read only the arguments (NOTE [Checks before any process group] in
memo/distributed/layout.py), so they are tested without launching anything. One world-size-2
launch (20-30 s here, mostly importing megatron-core) checks TP=2 + SP with memo's strategy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memo.distributed.layout import (
    LaunchEnv,
    ParallelLayout,
    ParallelRun,
    check_layout,
    free_port,
    padded_vocab_size,
    resolve_layout,
)
from memo.errors import MemoError, PlanMismatchError

ROOT = Path(__file__).resolve().parents[2]
TINY = {"n_heads": 4, "n_query_groups": 4, "vocab_size": 512}


def _check(layout: ParallelLayout, engine: str = "megatron", seq_len: int = 256, micro_batch: int = 2,
           **shapes: int) -> None:
    check_layout(layout, engine=engine, seq_len=seq_len, micro_batch=micro_batch, **{**TINY, **shapes})


def test_layout_must_make_up_the_world() -> None:
    assert resolve_layout(2, 1, None, True, 4) == ParallelLayout(2, 1, 2, True)
    with pytest.raises(MemoError, match=r"--tp 2 x --cp 1 x --dp 2 = 4 ranks, but 2 process\(es\)"):
        resolve_layout(2, 1, 2, False, 2)
    with pytest.raises(MemoError, match="does not divide the world of 3"):
        resolve_layout(2, 1, None, False, 3)


def test_layout_checks_name_what_to_change() -> None:
    _check(ParallelLayout(2, 1, 1, True))  # the shipped example's layout is fine
    with pytest.raises(MemoError, match="4 attention heads, which --tp 3"):
        _check(ParallelLayout(3, 1, 1), seq_len=258, vocab_size=384)
    with pytest.raises(MemoError, match="2 query groups.*--tp 4"):
        _check(ParallelLayout(4, 1, 1), n_query_groups=2)
    with pytest.raises(MemoError, match=r"--seq-len: seq len 257 cannot be split over TP 2.*use 256 or 258"):
        _check(ParallelLayout(2, 1, 1, True), seq_len=257)
    with pytest.raises(MemoError, match=r"2·c = 4 load-balanced chunks.*multiple of 4"):
        _check(ParallelLayout(1, 2, 1), seq_len=250)
    with pytest.raises(MemoError, match=r"chunks and each of the c·t = 8 ranks.*of 8; use 256 or 264"):
        _check(ParallelLayout(4, 2, 1, True), seq_len=260)  # CP chunks and SP shares combined
    # Ulysses (NOTE [Ulysses context parallelism]): the CP ranks share the heads of a TP rank
    _check(ParallelLayout(1, 2, 1, cp_comm="a2a"))
    _check(ParallelLayout(1, 4, 1, cp_comm="a2a"), n_query_groups=2)  # each key/value head sent twice
    with pytest.raises(MemoError, match=r"--cp-comm a2a: .*4 attention heads and 4 query groups, 2 and 2 per "
                                        r"--tp 2 rank, and 2 query heads cannot be split over 4 "
                                        r".*all_gather"):
        _check(ParallelLayout(2, 4, 1, cp_comm="a2a"))
    _check(ParallelLayout(2, 4, 1))  # the all-gather form has no such limit
    with pytest.raises(MemoError, match="--cp-comm must be one of all_gather, a2a .* got 'p2p'"):
        resolve_layout(1, 2, None, False, 2, "p2p")
    with pytest.raises(MemoError, match=r"--micro-batch 3 \(the global batch\) cannot be split over --dp 2"):
        _check(ParallelLayout(1, 1, 2), micro_batch=3)
    with pytest.raises(MemoError, match="refuses it without one; give --tp 2"):
        _check(ParallelLayout(1, 1, 1, True))
    with pytest.raises(MemoError, match="--engine memo builds one process's model"):
        _check(ParallelLayout(1, 1, 2), engine="memo")
    with pytest.raises(MemoError, match="cannot be split over --tp 3"):
        padded_vocab_size(512, 3)
    assert padded_vocab_size(500, 2) == padded_vocab_size(500, 1) == 512


def test_train_config_refuses_parallel_flags_without_megatron() -> None:
    from memo.train.loop import TrainConfig

    with pytest.raises(MemoError, match="--engine memo builds a single-process model"):
        TrainConfig(tensor_parallel=2)
    with pytest.raises(MemoError, match="--engine memo builds a single-process model"):
        TrainConfig(sequence_parallel=True)
    TrainConfig(engine="megatron", tensor_parallel=2, sequence_parallel=True)


def test_launch_environment() -> None:
    assert LaunchEnv.from_environ({}) == LaunchEnv()
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
           "MASTER_PORT": "1"}
    assert LaunchEnv.from_environ(env) == LaunchEnv(1, 2, 1, 2, launched=True)
    # torchrun with one process: a distributed run of one (NCCL on a GPU), not the single-process path
    assert LaunchEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1"}).launched
    assert not LaunchEnv.from_environ({}).launched
    with pytest.raises(MemoError, match="RANK='x'"):
        LaunchEnv.from_environ({**env, "RANK": "x"})
    with pytest.raises(MemoError, match="MASTER_ADDR or MASTER_PORT is not set"):
        LaunchEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2"})


def test_plan_for_another_layout_is_refused() -> None:
    from memo.planner.job import JobSpec

    from memo.train.strategies import TrainRun, _check_plan

    class Plan:
        meta = {"model": "tiny", "seq_len": 256, "tensor_parallel": 1, "context_parallel": 1}

    def run(**layout) -> TrainRun:
        return TrainRun(JobSpec(model="tiny", seq_len=256, **layout))

    _check_plan(Plan(), run())
    with pytest.raises(PlanMismatchError, match="tensor_parallel=1, this run has tensor_parallel=2"):
        _check_plan(Plan(), run(tensor_parallel=2, context_parallel=1))
    with pytest.raises(PlanMismatchError, match="context_parallel=1, this run has context_parallel=2"):
        _check_plan(Plan(), run(tensor_parallel=1, context_parallel=2))

    class SequenceParallelPlan:  # `memo profile --tensor-parallel 2` plans a rank of TP + SP
        meta = {**Plan.meta, "tensor_parallel": 2, "sequence_parallel": True}

    _check_plan(SequenceParallelPlan(), run(tensor_parallel=2, sequence_parallel=True))
    with pytest.raises(PlanMismatchError, match="made for a rank with sequence parallelism.*without it"):
        _check_plan(SequenceParallelPlan(), run(tensor_parallel=2, sequence_parallel=False))


def _rank(layout: ParallelLayout, tp: int = 0, cp: int = 0, dp: int = 0) -> ParallelRun:
    run = ParallelRun(layout, LaunchEnv(), torch.device("cpu"))
    run.tp_rank, run.cp_rank, run.dp_rank = tp, cp, dp
    return run


def test_shard_is_megatrons_load_balanced_layout() -> None:
    ids = torch.arange(2 * 16).view(2, 16)
    labels = ids + 100
    for r, chunks in ((0, (0, 3)), (1, (1, 2))):
        got_ids, got_labels, positions = _rank(ParallelLayout(1, 2, 2), cp=r, dp=1).shard(ids, labels)
        want = torch.cat([torch.arange(c * 4, c * 4 + 4) for c in chunks])
        assert torch.equal(positions, want.unsqueeze(0))
        assert torch.equal(got_ids, ids[1:2, want]) and torch.equal(got_labels, labels[1:2, want])
    # TP ranks keep every token
    assert torch.equal(_rank(ParallelLayout(2, 1, 1), tp=1).shard(ids, labels)[0], ids)


class _Gathered(ParallelRun):
    """A rank whose all_gather_object answers the given records (no process group)."""

    def __init__(self, records: list) -> None:
        super().__init__(ParallelLayout(2, 1, 1), LaunchEnv(0, 2, 0, 2), torch.device("cpu"))
        self.records = records

    def gather(self, obj):
        return self.records


def test_ranks_that_disagree_all_raise_the_same_error() -> None:
    base = {"layout": {"tp": 2}, "strategy": "memo", "alpha": 0.5, "plan": "aa", "plan_made_from": "x"}
    _Gathered([base, dict(base)]).agree(base)
    with pytest.raises(MemoError, match=r"disagree on alpha \(rank 0: 0.5, rank 1: 0.25\)"):
        _Gathered([base, {**base, "alpha": 0.25}]).agree(base)
    # same recorded iteration, different plans: refused; different iterations: each its own plan
    with pytest.raises(MemoError, match="disagree on plan"):
        _Gathered([base, {**base, "plan": "bb"}]).agree(base)
    _Gathered([base, {**base, "plan": "bb", "plan_made_from": "y"}]).agree(base)
    shared = {k: v for k, v in base.items() if k != "plan_made_from"}  # one --plan file for all
    with pytest.raises(MemoError, match="same --plan file"):
        _Gathered([shared, {**shared, "plan": "bb"}]).agree(shared)


def _losses(path: Path) -> list[float]:
    return [s["loss"] for s in json.loads(path.read_text())["steps"]]


@pytest.mark.slow
@pytest.mark.megatron
def test_tp2_sequence_parallel_matches_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``torchrun --nproc-per-node 2 -m memo train --engine megatron --tp 2 --sp`` (memo's strategy,
    a fixed alpha so that layers offload) gives the single-process losses to 1e-5."""
    from memo.cli.main import main
    from tests.megatron_state import megatron_state_restored

    common = ["--engine", "megatron", "--model", "tiny", "--seq-len", "256", "--steps", "3", "--alpha", "0.5",
              "--layer-ms", "1", "--bandwidth-gbps", "10", "--no-progress"]
    launched = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launched}
    for name in launched:
        monkeypatch.delenv(name, raising=False)
    one, two = tmp_path / "one.json", tmp_path / "tp2.json"
    # the single process in this one (no interpreter to start), torchrun's two ranks in their own
    with megatron_state_restored():
        assert main(["train", *common, "--report", str(one)]) == 0, capsys.readouterr().err[-3000:]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "memo",
                           "train", *common, "--tp", "2", "--sp", "--report", str(two)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "agree on strategy memo, alpha 0.5000" in done.stdout, done.stdout
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5)
    report = json.loads(two.read_text())
    par = report["parallel"]
    assert {k: par[k] for k in ("tp", "cp", "sp", "dp", "world")} == {"tp": 2, "cp": 1, "sp": True, "dp": 1,
                                                                       "world": 2}
    assert [r["rank"] for r in par["ranks"]] == [0, 1]
    assert all(r["peak_device_bytes"] > 0 and r["host_pinned_bytes"] > 0 for r in par["ranks"]), par


class _FakePlan:
    """What _shared_plan reads of a plan: its JSON (requests and the addresses found for them)."""

    def __init__(self, requests: str, addresses: str) -> None:
        self.data = {"allocations": requests, "phases": [], "policy": ["memo"], "alpha": 0.5,
                     "offsets": addresses}

    def to_dict(self) -> dict:
        return dict(self.data)

    @classmethod
    def from_dict(cls, data: dict) -> _FakePlan:
        return cls(data["allocations"], data["offsets"])


class _Ranks(_Gathered):
    """Rank ``rank`` of four whose gathers answer what each of the four ranks gives (in turn)."""

    def __init__(self, rank: int, answers: list[list]) -> None:
        super().__init__([])
        self.launch = LaunchEnv(rank, 4, rank, 4)
        self.answers = iter(answers)

    @property
    def rank(self) -> int:
        return self.launch.rank

    def gather(self, obj):
        return next(self.answers)


def test_each_rank_runs_the_plan_of_the_first_rank_that_recorded_its_iteration() -> None:
    """Ranks 0, 1 recorded iteration A, ranks 2, 3 iteration B; the time-limited search found other
    addresses on each rank: ranks 1 and 3 adopt the plans of ranks 0 and 2 (ParallelRun.agree then
    finds equal plans among ranks that recorded the same iteration)."""
    from memo.distributed.layout import requests_fingerprint
    from memo.train.strategies import _shared_plan

    own = [_FakePlan("A", "a0"), _FakePlan("A", "a1"), _FakePlan("B", "b2"), _FakePlan("B", "b3")]
    made_from = [requests_fingerprint(p) for p in own]
    leaders = [own[0].to_dict(), None, own[2].to_dict(), None]
    said: list[str] = []
    adopted = [_shared_plan(_Ranks(r, [made_from, leaders]), own[r], said.append) for r in range(4)]
    assert [p.data["offsets"] for p in adopted] == ["a0", "a0", "b2", "b2"]
    assert "2 different iterations" in said[0]


def test_memo_and_hf_models_run_as_one_process_under_torchrun_of_one(monkeypatch) -> None:
    """Their models have no parallel layers: torchrun --nproc-per-node 1 runs them on the single-process
    path (megatron's DDP cannot wrap them), not as a distributed run of one."""
    from memo.train.loop import TrainConfig, _start_parallel

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    assert _start_parallel(TrainConfig(engine="memo", model="tiny")) is None
    hf = TrainConfig(engine="memo", model="tiny", hf_config='{"model_type": "llama"}')
    assert _start_parallel(hf) is None
