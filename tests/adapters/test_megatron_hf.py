"""``memo train --engine megatron --hf-model DIR`` and ``--export`` of a megatron model (issue 43): a tiny
Llama-family checkpoint (vocabulary 200, padded to 256 in megatron's model) converted into memo's
megatron-core GPTModel (NOTE [Hugging Face weights in megatron's layout] in memo/adapters/megatron_hf.py).

One launch of two processes (TP 2, tests/dist_harness.py) trains the checkpoint with memo's strategy,
saves and exports it, resumes it, and is refused a checkpoint whose key/value heads TP 2 cannot split:
the first loss is Hugging Face's own forward on the same batch (fp32, 1e-5), the export re-sharded is
every rank's trained tensors exactly (and transformers loads it), and the resumed step's loss is the
exported model's on that step's batch (the resume restored the trained weights, not the checkpoint's).
In one process: tied embeddings with the rope flags, Qwen3's q/k norms, memo's own llama-arch model
exported, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from memo.errors import MemoError
from tests import dist_harness
from tests.hf_checkpoint import sharpen_attention, train_catching_export
from tests.megatron_state import megatron_state_restored

MODULE = "tests.adapters.test_megatron_hf"
SEQ = 64
VOCAB = 200  # not a multiple of 128: megatron's model pads it, the loss must ignore the padded rows
MACHINE = {"alpha": 0.5, "layer_ms": 1.0, "bandwidth_gbps": 10.0, "host_mem_gb": 16.0, "time_limit": 1.0}


def make_llama(directory: Path, *, model_type: str = "llama", layers: int = 2, **fields: Any) -> Path:
    """A tiny Llama-family checkpoint written by ``save_pretrained``, its query and key weights scaled up
    so that attention is sharp and the loss shows the rotary embedding and the head grouping."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    sharpen_attention(model)
    model.save_pretrained(directory)
    return directory


def batches(config: Any, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n`` global batches ``memo.train.train`` takes for ``config``."""
    from memo.models import get_config
    from memo.train.config import token_source

    source = iter(token_source(config, get_config("llama-tiny") if config.hf_model is None else
                               _shapes(config.hf_model)))
    return [next(source) for _ in range(n)]


def _shapes(path: str) -> Any:
    from memo.adapters.megatron_hf import megatron_shapes
    from memo.engines import hf_checkpoint_config

    return megatron_shapes(hf_checkpoint_config(path), "test")


def hf_loss(directory: Path | str, ids: torch.Tensor, labels: torch.Tensor, **config: Any) -> float:
    """Hugging Face's own forward (fp32): the mean cross-entropy of its logits against ``labels``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(directory, **config)
    model = AutoModelForCausalLM.from_pretrained(directory, config=cfg, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))


def close(got: float, want: float) -> None:
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def train_caught(config: Any, strategy: Any = None) -> tuple[Any, torch.nn.Module | None]:
    """``memo.train.train(config)`` (strategy none unless given); its result and the trained model."""
    from memo.train.strategies import StrategyOptions, make_strategy

    return train_catching_export(config, strategy or make_strategy(StrategyOptions(strategy="none")))


def assert_reshards_to(out: Path, model: Any, rank: int = 0, tp: int = 1) -> int:
    """The export at ``out``, cut into TP rank ``rank``'s shards by the converter, is ``model``'s tensors
    exactly (the padded rows zero, as the trained ones stay); returns how many tensors were compared."""
    from contextlib import ExitStack

    from memo.adapters.megatron_hf import _local_tensors, _Weights

    trained = model.state_dict()
    with ExitStack() as stack:
        weights = _Weights(str(out), stack, "test")
        tied = bool(model.share_embeddings_and_output_weights)
        n = 0
        for name, tensor in _local_tensors(model.memo_config, tied, int(model.vocab_size), weights, rank, tp):
            assert torch.equal(tensor, trained[name]), name
            n += 1
    return n


# ----------------------------------------------------------------------------- two processes, TP 2


def _tp2_runs(spec: dict[str, Any], rank: int, record: Any) -> None:
    from transformers import AutoModelForCausalLM

    from memo.train.loop import TrainConfig
    from memo.train.strategies import StrategyOptions, make_strategy

    checkpoint, out, save = spec["checkpoint"], Path(spec["out"]), spec["save"]
    config = TrainConfig(engine="megatron", hf_model=checkpoint, tensor_parallel=2, seq_len=SEQ, steps=2,
                         save=save, export=str(out))
    result, model = train_caught(config, make_strategy(StrategyOptions(**MACHINE)))
    third = batches(config, 3)

    def loss_equals_hf() -> str:
        close(result.steps[0].loss, hf_loss(checkpoint, *third[0]))
        assert result.steps[1].loss != result.steps[0].loss and result.strategy.offloaded_layers == 1
        return f"first loss {result.steps[0].loss:.6f} is HF's"

    def export_round_trip() -> str:
        n = assert_reshards_to(out, model, rank, 2)
        if rank == 0:
            loaded = AutoModelForCausalLM.from_pretrained(out)
            assert loaded.config.vocab_size == VOCAB and loaded.model.embed_tokens.weight.shape[0] == VOCAB
        return f"{n} trained shards equal the export's"

    dist_harness.check(record, "tp2-loss-equals-hf", loss_equals_hf)
    dist_harness.check(record, "tp2-export-round-trip", export_round_trip)

    def resumes() -> str:
        resumed = TrainConfig(engine="megatron", hf_model=checkpoint, tensor_parallel=2, seq_len=SEQ, steps=3,
                              resume=save)
        again, _ = train_caught(resumed)
        assert [s.step for s in again.steps] == [3]
        close(again.steps[0].loss, hf_loss(out, *third[2]))  # the trained weights, not the checkpoint's
        return f"step 3 loss {again.steps[0].loss:.6f} is the exported model's"

    dist_harness.check(record, "tp2-resume", resumes)

    def refused() -> str:
        config = TrainConfig(engine="megatron", hf_model=spec["one_group"], tensor_parallel=2, seq_len=SEQ,
                             steps=1)
        with pytest.raises(MemoError, match="1 query groups.* which --tp 2 cannot split"):
            train_caught(config)
        return "refused"

    dist_harness.check(record, "tp2-refusal", refused)


def world2(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    _tp2_runs(spec, rank, record)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    checkpoint = make_llama(tmp_path_factory.mktemp("ckpt"), layers=3)
    one_group = tmp_path_factory.mktemp("one_group")  # its config alone is read before the refusal
    fields = json.loads((checkpoint / "config.json").read_text())
    (one_group / "config.json").write_text(json.dumps({**fields, "num_key_value_heads": 1}))
    (one_group / "model.safetensors").write_bytes(b"")
    spec = {"checkpoint": str(checkpoint), "one_group": str(one_group),
            "out": str(tmp_path_factory.mktemp("exports") / "out"),
            "save": str(tmp_path_factory.mktemp("save"))}
    try:
        return dist_harness.by_name(dist_harness.launch(f"{MODULE}:world2", 2, spec, timeout_s=300))
    except dist_harness.LaunchError as e:
        table = dist_harness.by_name(e.results)
        table["<launch>"] = [{"name": "<launch>", "ok": False, "detail": str(e)}]
        return table


@pytest.mark.parametrize("name", ["tp2-loss-equals-hf", "tp2-export-round-trip", "tp2-resume", "tp2-refusal"])
def test_megatron_hf_model_under_tp2(launched, name: str) -> None:
    dist_harness.assert_passed(launched, name, 2)


# ----------------------------------------------------------------------------- one process


@pytest.fixture(scope="module", autouse=True)
def _one_process_state() -> Any:
    """The world of one these tests set up (process group, megatron's parallel state, the CPU shims of
    memo.engines.init_megatron_world) is left behind for no other test."""
    with megatron_state_restored():
        yield


def test_tied_checkpoint_with_rope_flags_trains_and_exports(tmp_path: Path, one_thread: None) -> None:
    """Tied embeddings, --rope-theta and linear --rope-scaling: HF's loss with those rope parameters at
    step 1, an export (the checkpoint's config with the rope flags) whose every tensor is the trained
    model's and whose forward is the trained model's."""
    from transformers import AutoModelForCausalLM

    from memo.train.loop import TrainConfig

    checkpoint = make_llama(tmp_path / "ckpt", tie_word_embeddings=True)
    scaling = {"rope_type": "linear", "factor": 4.0}
    config = TrainConfig(engine="megatron", hf_model=str(checkpoint), seq_len=SEQ, steps=2, rope_theta=100.0,
                         rope_scaling=json.dumps(scaling), export=str(tmp_path / "out"))
    result, model = train_caught(config)
    first, second = batches(config, 2)
    params = {**scaling, "rope_theta": 100.0}
    close(result.steps[0].loss, hf_loss(checkpoint, *first, rope_parameters=dict(params)))
    assert abs(result.steps[0].loss - hf_loss(checkpoint, *first)) > 1e-3  # the flags changed the model
    assert model.share_embeddings_and_output_weights and result.steps[1].loss != result.steps[0].loss
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert exported.config.tie_word_embeddings and exported.config.rope_parameters["rope_theta"] == 100.0
    assert assert_reshards_to(tmp_path / "out", model) == 2 * 6 + 2
    _assert_same_forward(model, tmp_path / "out", second)


def _assert_same_forward(model: torch.nn.Module, exported: Path, batch: tuple[torch.Tensor, ...]) -> None:
    """The exported model's HF loss on ``batch`` is the trained megatron model's (its adapter's loss)."""
    from memo.adapters.model import model_adapter_for

    with torch.no_grad():
        want = float(model_adapter_for(model, "test").loss(model, *batch[:2]))
    close(hf_loss(exported, *batch[:2]), want)


def test_qwen3_qk_norms_convert(tmp_path: Path, one_thread: None) -> None:
    """Qwen3's RMSNorm of every query and key head is megatron's q/k layernorm, from a checkpoint in
    shards (model.safetensors.index.json): the converted model's loss is HF's."""
    from memo.adapters.model import model_adapter_for
    from memo.engines import hf_checkpoint_config, load_megatron_from_hf

    checkpoint = make_llama(tmp_path / "qwen3", model_type="qwen3", head_dim=16)
    with torch.no_grad():  # q/k norm weights away from 1, so that a lost norm shows
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(checkpoint)
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        checkpoint = tmp_path / "sharded"
        hf.save_pretrained(checkpoint, max_shard_size="40KB")
    assert (checkpoint / "model.safetensors.index.json").is_file()
    model, shapes = load_megatron_from_hf(str(checkpoint), hf_checkpoint_config(str(checkpoint)), SEQ, "cpu",
                                          torch.float32)
    assert shapes.qk_norm and shapes.head_dim == 16
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    with torch.no_grad():
        got = float(model_adapter_for(model, "test").loss(model, ids, labels))
    close(got, hf_loss(checkpoint, ids, labels))


def test_memo_llama_megatron_model_exports(tmp_path: Path, one_thread: None) -> None:
    """memo's own llama-arch model under --engine megatron exports to a LlamaConfig model with its
    forward."""
    from memo.train.loop import TrainConfig

    config = TrainConfig(engine="megatron", model="llama-tiny", seq_len=SEQ, steps=1,
                         export=str(tmp_path / "o"))
    _, model = train_caught(config)
    assert assert_reshards_to(tmp_path / "o", model) == 2 * 6 + 3
    _assert_same_forward(model, tmp_path / "o", batches(config, 1)[0])


def test_refusals(tmp_path: Path) -> None:
    """What the converter cannot map, and flags it does not take, are one-line errors naming them."""
    from transformers import AutoConfig

    from memo.adapters.megatron_hf import megatron_shapes
    from memo.engines import hf_checkpoint_config, load_megatron_from_hf
    from memo.train.loop import TrainConfig

    def refused(match: str, hf: Any) -> None:
        with pytest.raises(MemoError, match=match) as err:
            megatron_shapes(hf, "w")
        assert "\n" not in str(err.value)

    small = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1}
    refused("converts llama, mistral, qwen3 checkpoints, not model_type 'qwen2'",
            AutoConfig.for_model("qwen2", **small))
    refused("attention_bias = True", AutoConfig.for_model("llama", attention_bias=True, **small))
    refused("rope_type 'yarn'", AutoConfig.for_model("llama", rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "original_max_position_embeddings": 64},
        **small))
    checkpoint = make_llama(tmp_path / "ckpt", layers=1)
    fields = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**fields, "intermediate_size": 48}))
    with pytest.raises(MemoError, match=r"gate_proj.weight has shape \[64, 32\], its config.json says "
                       r"\[48, 32\]"):
        load_megatron_from_hf(str(checkpoint), hf_checkpoint_config(str(checkpoint)), SEQ, "cpu",
                              torch.float32)
    with pytest.raises(MemoError, match="--pp and --micro-batches > 1 split it"):
        TrainConfig(engine="megatron", hf_model=str(checkpoint), micro_batches=2)
    with pytest.raises(MemoError, match="of the gpt model 'tiny' has no Hugging Face class"):
        TrainConfig(engine="megatron", model="tiny", export=str(tmp_path / "x"))
