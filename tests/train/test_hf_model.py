"""``memo train --hf-model DIR`` (issue 43, "Your model"): a tiny Llama saved by ``save_pretrained`` in a
temporary directory is loaded, trained with memo's wrapper and exported with ``--export``; the first
step's loss is Hugging Face's own forward of the checkpoint on the same batch, the export loads back
with ``from_pretrained`` with every tensor the trained one, the rope flags reach the model and the
exported config, and bad checkpoints and flags are one-line errors. The FSDP2 runs (offload, Ulysses CP)
are in tests/distributed/test_hf_model_fsdp2.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from memo.cli.main import main
from memo.errors import MemoError
from tests.hf_checkpoint import make_tiny_llama, make_tokenizer, sharpen_attention

#: The machine given, so that nothing is measured; 4 layers so that memo's wrapper runs on 2 of them
#: (full-offload: every layer but the last two).
MACHINE = {"bandwidth_gbps": 10.0, "layer_ms": 1.0, "host_mem_gb": 8.0, "time_limit": 1.0}
SEQ = 64
LINEAR = {"rope_type": "linear", "factor": 8.0}
#: A rotary base far from the checkpoint's 10000, so that the loss shows which one the model used.
THETA = 100.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sharp_checkpoint(tmp_path_factory.mktemp("ckpt"))


def make_sharp_checkpoint(directory: Path) -> Path:
    """A tokenizer and a 4-layer tiny Llama of its vocabulary, as save_pretrained writes them. Its query
    and key weights are scaled up so that attention is sharp and the loss shows the rotary embedding
    (at the initial 0.02 scale attention is near uniform, whatever the positions)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = make_tokenizer(directory)
    make_tiny_llama(directory, len(AutoTokenizer.from_pretrained(directory)), layers=4)
    model = AutoModelForCausalLM.from_pretrained(directory)
    sharpen_attention(model)
    model.save_pretrained(directory)
    return directory


def hf_loss(directory: Path, ids: torch.Tensor, labels: torch.Tensor, **config: Any) -> float:
    """Hugging Face's own forward of the checkpoint (fp32, its config changed by ``config``): the mean
    cross-entropy of its logits against ``labels`` (already shifted; -100 ignored)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(directory, **config)
    model = AutoModelForCausalLM.from_pretrained(directory, config=cfg, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))


def first_batch(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch ``memo.train.train`` takes for ``config``."""
    from memo.engines import hf_checkpoint_config
    from memo.models import hf_shapes
    from memo.train.config import token_source

    ids, labels = next(iter(token_source(config, hf_shapes(hf_checkpoint_config(config.hf_model)))))
    return ids, labels


def run(config: Any, strategy: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, torch.nn.Module | None]:
    """``memo.train.train(config)`` under ``strategy``; its result and the trained model (caught where the
    export takes it)."""
    from memo.train import export
    from memo.train.loop import train
    from memo.train.strategies import StrategyOptions, make_strategy

    caught: dict[str, torch.nn.Module] = {}
    real = export.export_trained

    def catch(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        caught["model"] = model
        return real(model, *args, **kwargs)

    monkeypatch.setattr(export, "export_trained", catch)
    result = train(config, progress=False, log=lambda _line: None,
                   strategy=make_strategy(StrategyOptions(strategy=strategy, **MACHINE)))
    return result, caught.get("model")


def assert_export_equals(directory: Path, model: torch.nn.Module) -> Any:
    """The export loads with from_pretrained and every tensor equals the trained model's."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(directory)
    want = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    return loaded


def test_hf_model_trains_from_the_checkpoint_and_exports_it(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """memo's wrapper (full-offload) on the loaded checkpoint: HF's loss at step 1, an export equal to the
    trained model, with the checkpoint's tokenizer and generation config."""
    from memo.train.loop import TrainConfig

    config = TrainConfig(hf_model=str(checkpoint), seq_len=SEQ, steps=2, export=str(tmp_path / "out"))
    assert config.dtype == "float32"  # the checkpoint's own
    result, model = run(config, "full-offload", monkeypatch)
    assert result.strategy.offloaded_layers == 2 and model.training  # not from_pretrained's eval mode
    want = hf_loss(checkpoint, *first_batch(config))
    got = result.steps[0].loss
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert result.steps[1].loss != got  # it trained
    out = tmp_path / "out"
    assert_export_equals(out, model)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (out / name).is_file(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial export left


def test_rope_flags_reach_the_model_and_the_exported_config(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """--rope-theta and --rope-scaling: the run's first loss is HF's with those rope parameters (not
    without), and the exported config.json and model hold them."""
    from memo.train.loop import TrainConfig

    config = TrainConfig(hf_model=str(checkpoint), seq_len=SEQ, steps=1, export=str(tmp_path / "out"),
                         rope_theta=THETA, rope_scaling=json.dumps(LINEAR))
    result, _ = run(config, "none", monkeypatch)
    batch = first_batch(config)
    params = {**LINEAR, "rope_theta": THETA}
    want = hf_loss(checkpoint, *batch, rope_parameters=dict(params))
    plain = hf_loss(checkpoint, *batch)
    got = result.steps[0].loss
    # fp32 rounding moves the loss by ~1e-7 of it; these rope parameters by ~1e-3
    assert abs(got - want) <= 1e-5 * abs(want) and abs(got - plain) > 1e-4 * abs(plain), (got, want, plain)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["rope_parameters"] == params, saved
    from transformers import AutoModelForCausalLM

    rotary = AutoModelForCausalLM.from_pretrained(tmp_path / "out").model.rotary_emb
    d = 8  # head_dim of the tiny Llama
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)) / LINEAR["factor"]
    torch.testing.assert_close(rotary.inv_freq, inv_freq)


def test_rope_flags_are_checked_as_transformers_checks_them() -> None:
    """Each rope type's parameters as transformers 5 spells them; what it refuses, or only logs as
    wrong, is one MemoError line."""
    from transformers import LlamaConfig

    from memo.engines import apply_rope

    def made(**kw: Any) -> Any:
        config = LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             max_position_embeddings=4096)
        apply_rope(config, **kw)
        return config.rope_parameters

    yarn = made(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    assert yarn["rope_type"] == "yarn" and yarn["factor"] == 4.0 and yarn["rope_theta"] == 10000.0, yarn
    assert made(rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=1e6) == {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert made(rope_scaling=llama3)["rope_type"] == "llama3"
    config = LlamaConfig(max_position_embeddings=4096)
    apply_rope(config, rope_scaling=llama3)
    assert config.max_position_embeddings == 8 * 8192  # the extended context
    for bad, said in (({"rope_type": "linear", "factor": 0.5}, "must be a float or int >= 1"),
                      ({"rope_type": "linear"}, "Missing required keys"),
                      ({"rope_type": "wobbly", "factor": 2.0}, "rope_type 'wobbly' is not one transformers"),
                      ({"rope_type": "linear", "factor": 2.0, "fator": 3}, "Unrecognized keys")):
        with pytest.raises(MemoError, match=said) as err:
            made(rope_scaling=bad)
        assert "\n" not in str(err.value) and str(err.value).startswith("memo.train: --rope-scaling")


def test_bad_checkpoints_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A missing directory, no config.json, no safetensors weights (a pickle only), a model that is no
    causal LM, a causal LM memo has no adapter for, a checkpoint lacking tensors."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ViTConfig

    def refused(directory: Path | str, said: str) -> None:
        assert main(["train", "--hf-model", str(directory), "--steps", "1", "--seq-len", "32", "--strategy",
                     "none", "--no-progress"]) == 2
        err = capsys.readouterr().err  # transformers' progress bars may come before memo's error
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and said in errors[0], err

    refused(tmp_path / "missing", "is not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, "has no config.json")
    LlamaConfig().save_pretrained(empty)
    (empty / "pytorch_model.bin").write_bytes(b"")
    refused(empty, "its pytorch_model.bin is a pickle")
    vit = tmp_path / "vit"
    ViTConfig().save_pretrained(vit)
    (vit / "model.safetensors").write_bytes(b"")
    refused(vit, "model_type 'vit' (ViTConfig) is not a causal LM")
    gpt2 = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    refused(tmp_path / "gpt2", "no model adapter")
    small = LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                        vocab_size=64)
    LlamaForCausalLM(small).save_pretrained(tmp_path / "lacking")
    small.num_hidden_layers = 2
    small.save_pretrained(tmp_path / "lacking")  # a config of 2 layers over the weights of 1
    refused(tmp_path / "lacking", "its weights lack 9 of the model's tensors")


def test_flags_that_do_not_combine_are_refused(checkpoint: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    from memo.train.loop import TrainConfig

    def refused(args: list[str], said: str) -> None:
        assert main(["train", *args, "--steps", "1", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err

    ck = ["--hf-model", str(checkpoint)]
    refused([*ck, "--model", "tiny"], "--model and --hf-model each name the model to train")
    refused([*ck, "--hf-config", '{"model_type": "llama"}'], "--hf-config and --hf-model each name")
    refused(["--model", "tiny", "--hf-config", '{"model_type": "llama"}'], "--model and --hf-config")
    refused([*ck, "--engine", "megatron", "--micro-batches", "2"], "--pp and --micro-batches > 1 split it")
    refused([*ck, "--export", str(checkpoint)], "is, holds or lies inside the input --hf-model")
    refused([*ck, "--export", str(checkpoint / "out")], "is, holds or lies inside the input --hf-model")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    refused([*ck, "--export", str(tmp_path / "full")], "exists and is not an empty directory")
    refused(["--model", "llama-tiny", "--export", str(tmp_path / "e")], "memo's model 'llama-tiny' has no")
    refused(["--model", "tiny", "--rope-theta", "1e6"], "--rope-theta and --rope-scaling change a Hugging")
    refused([*ck, "--rope-scaling", "yarn"], "--rope-scaling 'yarn' is not JSON")
    refused([*ck, "--rope-scaling", '{"factor": 2}'], "must be a JSON object with a \"rope_type\"")
    with pytest.raises(MemoError, match="--rope-theta must be a positive number"):
        TrainConfig(hf_model=str(checkpoint), rope_theta=float("nan"))
    assert TrainConfig(hf_model=str(checkpoint), dtype="bfloat16").dtype == "bfloat16"  # --dtype wins
    assert TrainConfig().dtype == "float32"


def test_checkpoint_dtype_is_the_default(tmp_path: Path) -> None:
    """A bfloat16 checkpoint trains in bfloat16 unless --dtype says otherwise."""
    from memo.train.loop import TrainConfig

    make_tiny_llama(tmp_path, 64, layers=1, dtype=torch.bfloat16)
    assert TrainConfig(hf_model=str(tmp_path)).dtype == "bfloat16"


def test_an_export_is_whole_or_absent(tmp_path: Path) -> None:
    """NOTE [Exporting the trained model]: a write that fails midway leaves neither the directory nor a
    partial one; a finished export lands in an empty directory given for it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memo.train.export import export_trained

    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                         num_attention_heads=2, vocab_size=64))
    real = model.save_pretrained

    def dies(directory: str, **kwargs: Any) -> None:
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    model.save_pretrained = dies  # type: ignore[method-assign]
    with pytest.raises(OSError, match="disk full"):
        export_trained(model, str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []
    model.save_pretrained = real  # type: ignore[method-assign]
    (tmp_path / "out").mkdir()
    assert export_trained(model, str(tmp_path / "out")) == str(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (tmp_path / "out" / "model.safetensors").is_file()
