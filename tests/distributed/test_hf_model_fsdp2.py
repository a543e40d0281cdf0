"""``memo train --engine fsdp2 --hf-model DIR --export OUT`` on two processes (issue 43, "Your model"): one
launch (tests/dist_harness.py) runs memo's strategy on the loaded checkpoint under FSDP2 with
``--offload-states --dp 2``, and under FSDP2 x Ulysses ``--cp 2 --cp-comm a2a``. Each first-step loss is
Hugging Face's own forward of the checkpoint on the same global batch (fp32, 1e-5), and each export,
written by rank 0 from the gathered full state dict, loads with ``from_pretrained`` (sdpa attention, not
memo's Ulysses name) with every tensor equal to the trained shards gathered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests import dist_harness
from tests.hf_checkpoint import train_catching_export

MODULE = "tests.distributed.test_hf_model_fsdp2"
MACHINE = {"alpha": 0.5, "layer_ms": 1.0, "bandwidth_gbps": 10.0, "host_mem_gb": 16.0, "time_limit": 1.0}
SEQ = 64
#: (name, TrainConfig fields) of the runs; each exports (the Ulysses run's model runs memo's attention
#: name, which its exported config must not carry).
RUNS = [("offload-dp2", {"offload_states": True, "data_parallel": 2, "micro_batch": 2}),
        ("ulysses-cp2", {"context_parallel": 2, "cp_comm": "a2a", "micro_batch": 1})]


# ----------------------------------------------------------------------------- rank side


def _run(name: str, fields: dict[str, Any], spec: dict[str, Any], rank: int) -> str:
    from memo.train.loop import TrainConfig
    from memo.train.strategies import StrategyOptions, make_strategy
    from tests.train.test_hf_model import first_batch, hf_loss

    checkpoint = Path(spec["checkpoint"])
    out = Path(spec["out"]) / name
    config = TrainConfig(engine="fsdp2", hf_model=str(checkpoint), seq_len=SEQ, steps=2, export=str(out),
                         **fields)
    result, model = train_catching_export(config, make_strategy(StrategyOptions(**MACHINE)))
    want = hf_loss(checkpoint, *first_batch(config))
    got = result.steps[0].loss
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert result.steps[1].loss != got
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out) if rank == 0 else None
    assert exported is None or exported.config._attn_implementation == "sdpa"
    loaded = {} if exported is None else exported.state_dict()
    names = [n for n, _ in model.state_dict().items()]
    assert rank != 0 or sorted(loaded) == sorted(names), sorted(set(loaded) ^ set(names))
    for n, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a collective
        if rank == 0:
            assert torch.equal(loaded[n], full.cpu()), n
    return f"first loss {got:.6f} (HF {want:.6f}); export equals the {len(names)} gathered tensors"


def world2(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    for name, fields in RUNS:
        dist_harness.check(record, name, lambda n=name, f=fields: _run(n, f, spec, rank))


# ----------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    from tests.train.test_hf_model import make_sharp_checkpoint

    directory = make_sharp_checkpoint(tmp_path_factory.mktemp("ckpt"))
    out = tmp_path_factory.mktemp("exports")
    try:
        return dist_harness.by_name(dist_harness.launch(
            f"{MODULE}:world2", 2, {"checkpoint": str(directory), "out": str(out)}, timeout_s=300))
    except dist_harness.LaunchError as e:
        table = dist_harness.by_name(e.results)
        table["<launch>"] = [{"name": "<launch>", "ok": False, "detail": str(e)}]
        return table


@pytest.mark.parametrize("name", [name for name, _ in RUNS])
def test_fsdp2_hf_model_matches_hf_and_exports(launched, name: str) -> None:
    dist_harness.assert_passed(launched, name, 2)
