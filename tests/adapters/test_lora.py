"""LoRA-style fine-tuning under memo (NOTE [LoRA linears] in memo/models/lora.py).

A frozen base with small adapters wrapped by memo's runtime (every layer "memo", or every layer
"input-only", or a mix) gives the unwrapped adapted model's loss and adapter gradients (fp32,
relative error < 1e-5); the base gets no gradient; the base's state-dict keys are unchanged; and
``model_states`` counts gradient and optimizer bytes for the adapters alone, also on meta.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import memo.runtime as mr
from memo.errors import MemoError
from memo.models import build_model, get_config
from memo.models.lora import LoRALinear, add_lora, lora_parameters, trainable_parameters
from memo.profiler.device import model_states
from tests.grads import assert_same_step, random_batch, small_model, train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

RANK = 4


def _lora(arch: str, n_layers: int = 4, rank: int = RANK, device: str = "cpu") -> nn.Module:
    name = "tiny" if arch == "gpt" else "llama-tiny"
    cfg = dataclasses.replace(get_config(name), n_layers=n_layers, name=f"{name}-{n_layers}")
    torch.manual_seed(0)
    model = add_lora(build_model(cfg, device=device, dtype=torch.float32), rank=rank)
    if device != "meta":
        with torch.no_grad():  # B starts at zero; nonzero B makes the adapters' A gradients nonzero too
            for p in lora_parameters(model):
                p.normal_(0.0, 0.05)
    return model


def test_adapters_only_train_and_base_keys_stay() -> None:
    plain = small_model("llama")
    model = _lora("llama")
    base_keys = set(plain.state_dict())
    keys = set(model.state_dict())
    assert base_keys <= keys
    assert {k for k in keys - base_keys} == {f"layers.{i}.{m}.lora_{ab}" for i in range(4)
                                             for m in ("qkv", "proj", "gate_up", "down") for ab in "AB"}
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 16
    assert trainable_parameters(model) == lora_parameters(model)
    loss, grads = train_step(model, *random_batch(model.config.vocab_size, 2, 23, seed=5))
    assert torch.isfinite(loss)
    assert grads and all(".lora_" in n for n in grads)
    assert len(grads) == 32


def test_new_adapters_compute_the_base() -> None:
    base = small_model("gpt", 2, seed=0)
    adapted = add_lora(copy.deepcopy(base), rank=RANK)
    ids, labels = random_batch(base, 2, 23, seed=5)
    with torch.no_grad():
        assert torch.equal(adapted(ids, labels), base(ids, labels))  # B = 0


POLICIES = [["memo"] * 4, ["input-only"] * 4, ["input-only", "memo", "recompute", "keep"]]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: "+".join(p))
def test_wrapped_lora_matches_unwrapped(arch: str, policy: list[str]) -> None:
    ref = _lora(arch)
    rt = mr.MemoRuntime(0.3, recompute_chunk_tokens=4, debug_copy_delay_us=200, policy=policy)
    model = mr.wrap(copy.deepcopy(ref), runtime=rt)
    ids, labels = random_batch(ref.config.vocab_size, 2, 23, seed=5)
    for _ in range(2):
        got, want = train_step(model, ids, labels), train_step(ref, ids, labels)
        assert_same_step(got, want)
        assert all(".lora_" in n for n in got[1]) and len(got[1]) == 2 * 4 * 4
    assert rt.stats.bytes_offloaded > 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_model_states_count_no_gradients_or_optimizer_for_the_frozen_base(device: str) -> None:
    cfg = dataclasses.replace(get_config("llama-tiny"), n_layers=4, name="llama-tiny-4")
    base = build_model(cfg, device=device, dtype=torch.bfloat16)
    n_base = sum(p.numel() for p in base.parameters())
    model = add_lora(base, rank=RANK)
    h, ffn, width = cfg.hidden, cfg.ffn_hidden, cfg.hidden // cfg.n_heads
    qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * width
    per_layer = RANK * ((h + qkv_out) + (h + h) + (h + 2 * ffn) + (ffn + h))
    n_lora = cfg.n_layers * per_layer
    assert sum(p.numel() for p in lora_parameters(model)) == n_lora
    states = model_states(model, "same")
    assert states["parameters"]["count"] == n_base + n_lora
    assert states["parameters"]["bytes"] == 2 * (n_base + n_lora)
    assert states["gradients"]["bytes"] == 2 * n_lora  # bf16 gradients of the adapters alone
    assert states["optimizer"]["bytes"] == 4 * n_lora  # AdamW's two bf16 moments, adapters alone
    mixed = model_states(model, "mixed")
    assert mixed["gradients"]["bytes"] == 4 * n_lora and mixed["optimizer"]["bytes"] == 12 * n_lora


def test_llama_8b_on_meta_counts_the_frozen_base_once() -> None:
    """The benchmark's job (benchmarks/one_gpu.py): a bf16 base of ~16 GB, adapters of rank 16."""
    base = build_model(get_config("llama-3.1-8b"), device="meta", dtype=torch.bfloat16)
    n_base = sum(p.numel() for p in base.parameters())
    model = add_lora(base, rank=16)
    n_lora = sum(p.numel() for p in lora_parameters(model))
    assert n_lora == 32 * 16 * ((4096 + 6144) + (4096 + 4096) + (4096 + 2 * 14336) + (14336 + 4096))
    states = model_states(model)
    assert states["parameters"]["bytes"] == 2 * (n_base + n_lora)
    assert 16.0e9 < states["parameters"]["bytes"] < 16.2e9
    assert states["gradients"]["bytes"] == 2 * n_lora and states["optimizer"]["bytes"] == 4 * n_lora


def test_tensor_parallel_rank_model_is_refused() -> None:
    model = build_model(get_config("tiny"), device="meta", tensor_parallel=2)
    with pytest.raises(MemoError, match="tensor-parallel"):
        add_lora(model)
