"""A resumed parallel run's losses are the uninterrupted run's, bit for bit (NOTE [Exact resume] in
memo/train/run_control.py), under FSDP2 with its states offloaded, FSDP2 x Ulysses CP=2, megatron TP=2 (one
step per batch: tensor-parallel slices, rank-named in the checkpoint) and megatron DP=2 over two
micro-batches (megatron's schedule, ZeRO-1's optimizer shards): one launch of two CPU ranks
(tests/dist_harness.py) runs them one after the other in its process group. Each case trains 4 steps
saving every 2, then resumes its step-2 checkpoint to step 4 (memo's strategy: the resumed run replays the
saved plans), with a cosine schedule after one warmup step and clipping that binds, so the scheduler's
state and the clipped gradients must come back too, and an evaluation every 2 steps (equal too, and the
uninterrupted run's evaluation at step 2 must not change the steps after it). The first case's gradient
norm is also checked against one process's (the norm of FSDP2's DTensor shards is the whole gradient's).
Last, SIGTERM sent to one rank stops both at the same step with a checkpoint (no rank left waiting in a
collective), and that checkpoint resumes to the uninterrupted losses; a save that fails on one rank stops
both with one error and commits nothing.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
import torch

from tests import dist_harness
from tests.dist_harness import check

MODULE = "tests.distributed.test_resume"
WORLD = 2
RUN = {"model": "tiny", "seq_len": 64, "micro_batch": 2, "steps": 4, "save_every": 2, "lr_schedule": "cosine",
       "warmup_steps": 1, "min_lr": 1e-4, "clip_grad": 1.0}
MACHINE = {"alpha": 0.5, "layer_ms": 1.0, "bandwidth_gbps": 10.0, "host_mem_gb": 64.0, "time_limit": 0.3}
CASES = {
    "fsdp2-offload": {"engine": "fsdp2", "offload_states": True},
    "fsdp2-cp2": {"engine": "fsdp2", "context_parallel": 2, "cp_comm": "a2a"},
    "megatron-tp2": {"engine": "megatron", "tensor_parallel": 2},
    "megatron-dp2-pipelined": {"engine": "megatron", "data_parallel": 2, "micro_batches": 2},
}


# ----------------------------------------------------------------------------- rank side


def _train(layout: dict[str, Any], folder: str, strategy: str = "memo", **run: Any
           ) -> tuple[list[dict[str, Any]], list[str]]:
    """The run's steps, and what it said about resuming (``strategy``: memo's, or a plain one)."""
    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    config = TrainConfig(**{**RUN, **layout, "save": folder, **run})
    said: list[str] = []
    options = StrategyOptions(**MACHINE) if strategy == "memo" else StrategyOptions(strategy=strategy)
    result = train(config, progress=False, strategy=make_strategy(options),
                   log=lambda line: said.append(line) if line.startswith("memo.train: resum") else None)
    return [{"step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr, "eval": s.eval_loss}
            for s in result.steps], said


def _one_process_norm() -> float:
    """The first step's gradient norm of ``tiny`` in one process, in plain PyTorch (memo train's model and
    first batch)."""
    from memo.adapters.model import model_adapter_for
    from memo.models import DEFAULT_MAX_SEQ_LEN, build_model, get_config
    from memo.train.data import SyntheticTokens

    torch.manual_seed(0)
    config = get_config("tiny")
    model = build_model(config, device="cpu", dtype=torch.float32,
                        max_seq_len=max(RUN["seq_len"], DEFAULT_MAX_SEQ_LEN))
    ids, labels = next(iter(SyntheticTokens(config.vocab_size, RUN["seq_len"], RUN["micro_batch"], 0)))
    model_adapter_for(model, "test").loss(model, ids, labels).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def _case(name: str, root: str, rank: int) -> str:
    folder = os.path.join(root, name)
    run = {"eval_data": os.path.join(root, "eval.txt"), "eval_every": 2, "eval_batches": 2}
    whole, _ = _train(CASES[name], folder, **run)
    resumed, said = _train(CASES[name], folder + "-resumed", resume=os.path.join(folder, "step-00000002"),
                           **run)
    want = [(s["step"], s["loss"], s["lr"], s["eval"]) for s in whole[2:]]
    got = [(s["step"], s["loss"], s["lr"], s["eval"]) for s in resumed]
    assert got == want, f"resumed {got} != uninterrupted {want}"
    # rank 0 speaks (NOTE [Parallel layout])
    assert rank > 0 or any("resuming on the plan saved with step 2" in line for line in said), said
    assert whole[0]["grad_norm"] > RUN["clip_grad"], whole  # the clipping binds
    assert whole[1]["eval"] is not None and whole[0]["eval"] is None, whole  # at steps 2 and 4
    return json.dumps(whole)


def _stop_case(root: str, rank: int) -> str:
    """SIGTERM reaches rank 1 alone, during step 2 of the pipelined case: every rank stops after that step
    (NOTE [Stopping at a step]), its checkpoint saved; resumed, the run repeats the uninterrupted losses."""
    from memo.train import run_control
    from memo.train.stop import StopRequested

    name = "megatron-dp2-pipelined"
    folder = os.path.join(root, "stopped")
    real = run_control.RunControl.end_step

    def end_step(self: Any, step: int, metrics: Any) -> None:
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler sets the flag; the step goes on
        real(self, step, metrics)

    run_control.RunControl.end_step = end_step  # type: ignore[method-assign]
    try:
        _train(CASES[name], folder, save_every=None)
        raise AssertionError("the run did not stop")
    except StopRequested as stop:
        assert stop.exit_status == 143 and "after step 2" in str(stop), str(stop)
    finally:
        run_control.RunControl.end_step = real  # type: ignore[method-assign]
    assert sorted(os.listdir(folder)) == ["latest", "step-00000002"], os.listdir(folder)
    whole = json.loads(_WHOLE[name])
    resumed, _ = _train(CASES[name], folder, resume=folder)
    assert [s["loss"] for s in resumed] == [s["loss"] for s in whole[2:]], (resumed, whole)
    return "stopped together after step 2"


def _failed_save_case(root: str, rank: int) -> str:
    """Rank 1 cannot write its record: both ranks stop with the same MemoError (neither waits in a collective
    for the other), and no checkpoint is committed."""
    from memo.errors import MemoError
    from memo.train import checkpoint

    folder = os.path.join(root, "failed")
    real = checkpoint._write_json

    def failing(path: Any, data: dict[str, Any]) -> None:
        if rank == 1:
            raise OSError("no space left on device")
        real(path, data)

    checkpoint._write_json = failing
    try:
        _train(CASES["megatron-dp2-pipelined"], folder, "none", steps=2)
        raise AssertionError("the save did not fail")
    except MemoError as err:
        assert "checkpoint of step 2 was not written (rank 1: OSError: no space left" in str(err), str(err)
    finally:
        checkpoint._write_json = real
    assert os.listdir(folder) == ["step-00000002.tmp"], os.listdir(folder)
    return "every rank stopped"


#: each case's uninterrupted steps (JSON), for the stop case
_WHOLE: dict[str, str] = {}


def resume_world2(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    for name in CASES:
        check(record, name, lambda name=name: _WHOLE.setdefault(name, _case(name, spec["root"], rank)))
    check(record, "stop", lambda: _stop_case(spec["root"], rank))
    check(record, "failed-save", lambda: _failed_save_case(spec["root"], rank))
    check(record, "one-process-norm", lambda: json.dumps(_one_process_norm()))


# ----------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("resume"))
    with open(os.path.join(root, "eval.txt"), "wb") as f:
        f.write(bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1)).tolist()))
    try:
        return dist_harness.by_name(dist_harness.launch(f"{MODULE}:resume_world2", WORLD, {"root": root},
                                                        timeout_s=300))
    except dist_harness.LaunchError as e:
        out = dist_harness.by_name(e.results)
        out["<launch>"] = [{"name": "<launch>", "ok": False, "detail": str(e)}]
        return out


@pytest.mark.parametrize("name", list(CASES))
def test_a_resumed_parallel_run_repeats_the_uninterrupted_losses(table: dict[str, Any], name: str) -> None:
    dist_harness.assert_passed(table, name, WORLD)


def test_a_signal_to_one_rank_stops_every_rank_at_one_step(table: dict[str, Any]) -> None:
    dist_harness.assert_passed(table, "stop", WORLD)


def test_a_save_that_fails_on_one_rank_stops_every_rank(table: dict[str, Any]) -> None:
    dist_harness.assert_passed(table, "failed-save", WORLD)


def test_the_fsdp2_gradient_norm_is_the_whole_gradients(table: dict[str, Any]) -> None:
    dist_harness.assert_passed(table, "fsdp2-offload", WORLD)
    dist_harness.assert_passed(table, "one-process-norm", WORLD)
    first = json.loads(table["fsdp2-offload"][0]["detail"])[0]
    want = json.loads(table["one-process-norm"][0]["detail"])
    assert abs(first["grad_norm"] - want) <= 1e-5 * want, (first, want)
