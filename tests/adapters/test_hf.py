"""Hugging Face causal LMs under memo (NOTE [HF decoder layer anatomy], NOTE [HF attention masks]).

Tiny random Llama (GQA, RoPE), Qwen2 (attention biases) and Mistral configs, fp32 on CPU: the
wrapped model's HF loss (``model(ids, attention_mask=..., labels=...).loss``) and every gradient
equal the unwrapped model's to 1e-5, with padding on either side, packed sequences, a sliding
window, frozen parameters and the model adapter's chunked loss; what memo cannot honour is refused
with an error that says why.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import memo
from memo.adapters import find_model_adapter, model_adapter_for
from memo.adapters.hf import masked_attention_backward, masked_attention_forward
from memo.adapters.hf_model import CausalLMAdapter
from memo.errors import MemoError
from memo.phases import PhaseTracker
from memo.runtime.wrap import runtime_of
from tests.grads import RTOL, assert_same_step, grads_of, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

V = 128
FAMILIES = ("llama", "qwen2", "mistral")


def _model(family: str, layers: int = 2, impl: str = "sdpa", **overrides: Any) -> nn.Module:
    cfg: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                               attn_implementation=impl, use_cache=False, tie_word_embeddings=False)
    if family == "mistral":
        cfg["sliding_window"] = None
    cfg.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**cfg))
    return model.train()


def _batch(s: int, pad: str | None, seed: int = 1) -> dict[str, torch.Tensor]:
    """Batch 2 of ``s`` tokens; ``pad`` right/left: a 0/1 attention mask with 4 (row 0) and 6 (row 1)
    padded tokens, labels -100 there (HF's convention: the labels are shifted inside the loss)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, s), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if pad is not None:
        mask = torch.ones(2, s, dtype=torch.long)
        for row, n in ((0, 4), (1, 6)):
            if pad == "right":
                mask[row, s - n:] = 0
            else:
                mask[row, :n] = 0
        batch["attention_mask"] = mask
        batch["labels"][mask == 0] = -100
    return batch


def _step(model: nn.Module, batch: dict[str, torch.Tensor], autocast: bool = False) -> tuple[
        torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach().float(), grads_of(model)


def _wrapped(model: nn.Module, alpha: float = 0.5) -> nn.Module:
    n = model.config.num_hidden_layers
    return memo.wrap(copy.deepcopy(model), alpha=alpha, policy=["memo"] * n)


def _compare(model: nn.Module, batch: dict[str, torch.Tensor], alpha: float = 0.5,
             frozen: int = 0) -> nn.Module:
    """``frozen``: bottom layers nothing of which needs a gradient, run as they are (NOTE [Frozen
    layers cost what they cost unwrapped] in memo/runtime/wrap.py)."""
    wrapped = _wrapped(model, alpha)
    assert_same_step(_step(wrapped, batch), _step(model, batch))
    stats = runtime_of(wrapped).stats
    assert stats.layer_forwards == stats.layer_backwards == model.config.num_hidden_layers - frozen
    assert stats.frozen_layers == frozen
    return wrapped


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("pad,s", [(None, 37), ("right", 13), ("left", 37)])
def test_matches_unwrapped(family: str, alpha: float, pad: str | None, s: int) -> None:
    _compare(_model(family), _batch(s, pad), alpha)


@pytest.mark.parametrize("pad", [None, "left"])
def test_eager_attention_matches(pad: str | None) -> None:
    # Eager masks are additive floats; a left-padded row with no key left averages every key, as
    # eager does. The labels are kept at the padding so that those rows reach the loss.
    batch = _batch(37, pad)
    batch["labels"] = batch["input_ids"].clone()
    _compare(_model("llama", impl="eager"), batch)


def test_padded_rows_reach_the_loss_sdpa() -> None:
    batch = _batch(37, "left")
    batch["labels"] = batch["input_ids"].clone()  # a query with no key left gets 0, as sdpa gives it
    _compare(_model("qwen2"), batch, alpha=0.25)


def test_packed_sequences_by_position_ids() -> None:
    batch = _batch(37, None)
    batch["position_ids"] = torch.cat([torch.arange(20), torch.arange(17)])[None].expand(2, 37)
    _compare(_model("llama"), batch)


@pytest.mark.parametrize("pad", [None, "right"])
def test_sliding_window_through_the_mask(pad: str | None) -> None:
    _compare(_model("mistral", sliding_window=8), _batch(37, pad))


def test_softmax_scale_is_hf_s() -> None:
    model = _model("llama")
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.3
    for pad in (None, "left"):
        _compare(model, _batch(13, pad))


def test_frozen_parameters_lora_style() -> None:
    model = _model("llama", layers=3)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("q_proj.weight", "v_proj.weight")) and ".layers.0." not in name)
    batch = _batch(37, "right")
    wrapped = _compare(model, batch, frozen=1)  # layer 0 and the embedding train nothing
    assert all(p.grad is None for p in wrapped.parameters() if not p.requires_grad)


def test_mixed_layer_policies() -> None:
    model = _model("llama", layers=4)
    wrapped = memo.wrap(copy.deepcopy(model), alpha=0.5, policy=["memo", "memo", "recompute", "keep"])
    batch = _batch(37, "left")
    assert_same_step(_step(wrapped, batch), _step(model, batch))
    assert runtime_of(wrapped).stats.recomputed_layers == 1


def test_tied_embeddings() -> None:
    model = _model("qwen2", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _compare(model, _batch(13, "left"))
    adapter = model_adapter_for(model)
    ids, labels = _shifted(_batch(13, None)["input_ids"])
    assert rel_err(adapter.loss(model, ids, labels), _reference_loss(model, ids, labels)) < RTOL


def test_bf16_autocast_as_close_as_hf() -> None:
    # Judged against plain HF at the same precision: memo's error against the fp32 step is at most
    # twice HF's own (flash-attn's rule), for the unmasked and the masked attention.
    model = _model("llama")
    for batch in (_batch(37, None), _batch(37, "left")):
        exact = _step(model, batch)
        hf16 = _step(model, batch, autocast=True)
        memo16 = _step(_wrapped(model), batch, autocast=True)
        worst_hf = max(rel_err(hf16[1][n], g) for n, g in exact[1].items())
        worst_memo = max(rel_err(memo16[1][n], g) for n, g in exact[1].items())
        assert worst_memo < 2 * worst_hf, (worst_memo, worst_hf)
        assert rel_err(memo16[0], hf16[0]) < 1e-3


def test_evaluation_with_cache_runs_hf_s_forward() -> None:
    model = _model("llama")
    wrapped = _wrapped(model)
    ids = _batch(13, None)["input_ids"]
    with torch.no_grad():
        want = model(ids, use_cache=True).logits
        got = wrapped(ids, use_cache=True).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("bool_mask", [True, False])
def test_masked_attention_against_autograd(bool_mask: bool) -> None:
    # float64 reference by autograd, GQA, a row with no key left (boolean: 0 output; float: uniform).
    torch.manual_seed(0)
    s, b, n, n_kv, d = 11, 2, 4, 2, 8
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64) for h in (n, n_kv, n_kv))
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None, None].repeat(b, 1, 1, 1)
    allowed[0, :, :, :3] = False
    low = torch.finfo(torch.float32).min
    mask = allowed if bool_mask else torch.zeros(b, 1, s, s).masked_fill(~allowed, low)
    o, lse = masked_attention_forward(q, k, v, mask, 0.4)
    grad_o = torch.randn_like(o)
    dq, dk, dv = masked_attention_backward(grad_o, q, k, v, o, lse, mask, 0.4)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    kx, vx = (t.repeat_interleave(n // n_kv, dim=2).permute(1, 2, 0, 3) for t in (kr, vr))
    scores = qr.permute(1, 2, 0, 3) @ kx.transpose(-1, -2) * 0.4
    if bool_mask:
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    else:
        p = torch.softmax(scores + mask.double(), -1)
    ref = (p @ vx).permute(2, 0, 1, 3)
    ref.backward(grad_o)
    for got, want in ((o, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert rel_err(got, want) < 1e-12


# The model adapter (NOTE [Model adapters]).


def _shifted(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """memo's labels: labels[:, t] is the target of position t (the next token; -100 at the end)."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def _reference_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids, use_cache=False).logits
    return nn.functional.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_adapter_loss_and_parts(family: str) -> None:
    model = _model(family)
    adapter = model_adapter_for(model)
    assert isinstance(adapter, CausalLMAdapter) and adapter.vocab_size(model) == V
    ids, labels = _shifted(_batch(37, None)["input_ids"])
    labels[1, 5:9] = -100
    got = adapter.loss(model, ids, labels)
    got.backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = _reference_loss(model, ids, labels)
    want.backward()
    assert_same_step((got.detach(), got_grads),
                     (want.detach(), {n: p.grad for n, p in model.named_parameters()}))

    parts = adapter.parts(model)
    assert parts.embedding is model.model.embed_tokens and parts.layers == list(model.model.layers)
    assert parts.head[0] is model.model.norm and parts.head[1] is adapter.loss_head(model)
    assert model.state_dict().keys() == copy.deepcopy(model).state_dict().keys()  # the head is no submodule
    seen: list[str | None] = []
    tracker = PhaseTracker(parts.embedding, parts.layers, parts.head, listeners=[seen.append])
    with tracker.iteration():
        adapter.loss(model, ids, labels).backward()
    tracker.remove()
    opened = [p for p in seen if p is not None]
    # The head's two modules open head.fwd one after the other: one phase.
    phases = [p for i, p in enumerate(opened) if i == 0 or p != opened[i - 1]]
    assert phases == ["embed.fwd", "layer.fwd[0]", "layer.fwd[1]", "head.fwd", "head.bwd", "layer.bwd[1]",
                      "layer.bwd[0]", "embed.bwd"]


def test_model_adapter_refuses_the_meta_device() -> None:
    with torch.device("meta"):
        model = _model("llama")
    ids, labels = _shifted(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    with pytest.raises(MemoError, match="LlamaForCausalLM cannot run on the meta device.*cpu or cuda"):
        model_adapter_for(model).loss(model, ids, labels)


def test_model_adapter_loss_under_memo() -> None:
    model = _model("mistral")
    adapter = find_model_adapter(model)
    ids, labels = _shifted(_batch(37, None)["input_ids"])
    wrapped = _wrapped(model, alpha=0.5)

    def step(m: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = adapter.loss(m, ids, labels)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    assert_same_step(step(wrapped), step(model))


# What memo refuses, and says why.


def _checkpointing(model: nn.Module, on: bool) -> None:
    """HF's activation (gradient) checkpointing on or off, by this transformers version's name."""
    old = "gradient_checkpointing_enable" if on else "gradient_checkpointing_disable"
    (getattr(model, old.replace("gradient", "activation"), None) or getattr(model, old))()


def test_gradient_checkpointing_is_refused() -> None:
    model = _model("llama")
    _checkpointing(model, True)
    # memo.wrap asks the model adapter first: transformers before 4.52 flags only the base model.
    with pytest.raises(MemoError, match="LlamaForCausalLM: HF gradient checkpointing is on.*"
                                        "activation_checkpointing_disable"):
        memo.wrap(model, alpha=0.5)
    with pytest.raises(MemoError, match="LlamaForCausalLM.*gradient checkpointing"):
        model_adapter_for(model)
    _checkpointing(model, False)
    wrapped = memo.wrap(model, alpha=0.5, policy=["memo", "memo"])
    _checkpointing(wrapped, True)  # after wrapping: refused at the next forward (its recompute in 4.5x)
    with pytest.raises(MemoError, match="gradient checkpointing is on"):
        wrapped(**_batch(13, None)).loss.backward()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_stock_training_call_with_use_cache_on_trains(family: str) -> None:
    """HF configs default to use_cache=True: the stock call model(input_ids, attention_mask, labels)
    trains with the cache off and one warning, as HF's gradient checkpointing does (NOTE [The KV
    cache in a training forward] in memo/adapters/hf.py), with the unwrapped model's gradients."""
    model = _model(family, use_cache=True)
    batch = _batch(13, "right")
    wrapped = _wrapped(model)
    with pytest.warns(UserWarning, match="use_cache=True.*KV cache is off in training forwards"):
        got = _step(wrapped, batch)
    assert_same_step(got, _step(model, batch))
    with torch.no_grad():  # eval and generation keep their cache
        out = wrapped(input_ids=batch["input_ids"], use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 13


def test_a_kv_cache_holding_tokens_is_refused_in_training() -> None:
    model = _model("llama")
    ids = _batch(13, None)["input_ids"]
    with torch.no_grad():
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
    wrapped = _wrapped(model)
    with pytest.raises(MemoError, match="LlamaDecoderLayer.*KV cache.*holds tokens already"):
        wrapped(input_ids=ids[:, 5:], past_key_values=cache, use_cache=True)


def test_output_attentions_is_refused() -> None:
    wrapped = _wrapped(_model("qwen2", impl="eager"))
    with pytest.raises(MemoError, match="Qwen2DecoderLayer.*output_attentions"):
        wrapped(**_batch(13, None), output_attentions=True)


@pytest.mark.parametrize("setting,match", [
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"attn_implementation": "flash_attention_2"}, "'flash_attention_2'.*attn_implementation='sdpa'"),
])
def test_unsupported_layer_settings_are_refused(setting: dict[str, Any], match: str) -> None:
    if "attn_implementation" in setting:
        model = _model("mistral")
        model.config._attn_implementation = setting["attn_implementation"]  # no flash-attn on CPU to load
    else:
        model = _model("mistral", **setting)
    # memo.wrap asks the model adapter before the layers' adapters; either names the class.
    with pytest.raises(MemoError, match=f"Mistral(ForCausalLM|DecoderLayer).*{match}"):
        memo.wrap(model, alpha=0.5)


def test_active_sliding_window_without_a_mask_is_refused() -> None:
    model = _wrapped(_model("mistral", sliding_window=8))
    layer = model.model.layers[0]
    hidden = torch.randn(2, 13, 64, requires_grad=True)
    rotary = model.model.rotary_emb(hidden, torch.arange(13)[None])
    with pytest.raises(MemoError, match="sliding_window=8 is shorter than the sequence \\(13 tokens\\)"):
        layer(hidden, attention_mask=None, position_embeddings=rotary)


def test_unsupported_hf_model_names_the_class_and_the_adapter_to_write() -> None:
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=V)
    bert = transformers.BertModel(config)
    with pytest.raises(MemoError, match=r"cannot wrap BertModel.*modeling_bert.BertLayer.*LlamaDecoderLayer.*"
                                        r"register_adapter\(BertLayer, YourAdapter\(\)\)"):
        memo.wrap(bert, alpha=0.5)
    with pytest.raises(MemoError, match=r"no model adapter for transformers.models.bert.modeling_bert."
                                        r"BertModel.*register_model_adapter\(BertModel"):
        model_adapter_for(bert)


@pytest.mark.slow
def test_finetune_example_runs_two_steps_and_against_hf_checkpointing(tmp_path: Path) -> None:
    """The PEFT example trains with memo, then (``--compare``) the same run under HF's gradient
    checkpointing from the same weights: the same losses, both runs' numbers in the JSON."""
    root = Path(__file__).resolve().parents[2]
    # This checkout's memo, whatever is installed; one thread suits the tiny shapes.
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    args = ["--steps", "2", "--seq-len", "257", "--layers", "2", "--hidden", "64", "--vocab", "128", "--bf16",
            "--compare", "--json", str(tmp_path / "compare.json")]
    example = str(root / "examples" / "finetune_hf.py")
    out = subprocess.run([sys.executable, example, *args], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["1", "2", "1", "2"]
    described = json.loads(next(line for line in lines if line.startswith("memo:")).removeprefix("memo:"))
    assert described["policy"] == ["memo", "memo"] and described["stats"]["layer_backwards"] == 4
    runs = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert runs["memo"]["losses"] == pytest.approx(runs["hf-checkpointing"]["losses"], rel=1e-3)
    assert all(len(run["step_seconds"]) == 2 and run["median_step_seconds"] > 0 for run in runs.values())


def test_session_step_takes_hf_labels_and_reports_hfs_loss() -> None:
    """Session.step(ids, labels) with HF's own labels (the model shifts them) trains on the next token
    and reports HF's loss: five optimizer steps against the unwrapped model's own call (NOTE [Labels
    in the model's convention] in memo/session.py)."""
    model = _model("llama")
    reference = copy.deepcopy(model)
    batches = [_batch(13, "right", seed=k) for k in range(5)]
    for b in batches:
        b["labels"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for b in batches:
        ref_opt.zero_grad(set_to_none=True)
        loss = reference(input_ids=b["input_ids"], labels=b["labels"]).loss
        loss.backward()
        ref_opt.step()
        want.append(float(loss))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    with memo.Session(model, alpha=0.5, policy=["memo", "memo"], allocator=False) as s:
        for b in batches:
            opt.zero_grad(set_to_none=True)
            got.append(float(s.step(b["input_ids"], b["labels"])))
            opt.step()
    assert got == pytest.approx(want, rel=1e-5)


class _LoRA(nn.Module):
    """A LoRA-style adapter with dropout on its input, as PEFT's lora.Linear computes it."""

    def __init__(self, base: nn.Linear, r: int = 4, p: float = 0.2) -> None:
        super().__init__()
        self.base, self.drop = base, nn.Dropout(p)
        self.a = nn.Linear(base.in_features, r, bias=False)
        self.b = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(self.drop(x)))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_lora_dropout_masks_are_the_unwrapped_ones_at_batch_two(alpha: float) -> None:
    """HF layers hold [b, s, h]: memo draws their dropout masks in that order (NOTE [Dropout as
    unwrapped]), so with two sequences per batch the masks, loss and gradients are the unwrapped
    model's under the same seed."""
    model = _model("llama")
    for layer in model.model.layers:
        layer.self_attn.q_proj = _LoRA(layer.self_attn.q_proj)
        layer.mlp.down_proj = _LoRA(layer.mlp.down_proj)
    for name, p in model.named_parameters():
        p.requires_grad_(".a." in name or ".b." in name)
    wrapped = memo.wrap(copy.deepcopy(model), alpha=alpha, policy=["memo", "memo"])
    batch = {"input_ids": torch.randint(0, V, (2, 37), generator=torch.Generator().manual_seed(3))}
    batch["labels"] = batch["input_ids"]
    torch.manual_seed(5)
    want = _step(model, batch)
    torch.manual_seed(5)
    assert_same_step(_step(wrapped, batch), want)


def test_a_hook_on_the_mlp_sees_the_models_layout() -> None:
    """The HF submodules run on [b, t, h] (NOTE [HF layout] in memo/adapters/hf.py): a forward hook
    on layer.mlp sees batch-first tensors covering the sequence, and memo says once that it sees
    token ranges."""
    model = _model("llama")
    batch = _batch(37, None)
    wrapped = _wrapped(model, alpha=0.5)
    shapes: list[tuple[int, ...]] = []
    wrapped.model.layers[0].mlp.register_forward_hook(lambda _m, _a, out: shapes.append(tuple(out.shape)))
    with pytest.warns(UserWarning, match=r"forward hooks on mlp see a range of the tokens"):
        wrapped(**batch).loss.backward()
    b, s = batch["input_ids"].shape
    assert shapes and all(len(sh) == 3 and sh[0] == b and sh[2] == 64 for sh in shapes), shapes
    assert sum(sh[1] for sh in shapes) >= s  # every token, in ranges (and again where recomputed)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_peft_lora_with_dropout_at_batch_two_matches_unwrapped(alpha: float) -> None:
    """peft.get_peft_model (LoRA, lora_dropout=0.2) then memo.wrap: loss and LoRA gradients equal
    the unwrapped model's under the same seed, two sequences per batch."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2,
                             target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(_model("llama"), config)
    wrapped = memo.wrap(copy.deepcopy(model), alpha=alpha, policy=["memo", "memo"])
    ids = torch.randint(0, V, (2, 37), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    torch.manual_seed(5)
    want = _step(model, batch)
    torch.manual_seed(5)
    got = _step(wrapped, batch)
    assert got[1] and set(got[1]) == set(want[1])  # the LoRA parameters, and only they, have gradients
    assert all("lora_" in name for name in got[1])
    assert_same_step(got, want)


# ---------------------------------------------------------------------------------------------
# NOTE [memo runs the layer the user wrote, or refuses it] (memo/adapters/exact.py), issue 44


def _wrap_refused(model: nn.Module, match: str) -> None:
    with pytest.raises(MemoError, match=match):
        memo.wrap(model, alpha=0.5, policy=["memo"] * model.config.num_hidden_layers)


def test_a_hook_on_the_attention_module_is_refused_not_skipped() -> None:
    """memo computes self_attn from its projections: a hook on self_attn (head ablation, scaling) would
    never fire (gradients were off by 2.1). Refused at wrap, and at the call when added after it."""
    model = _model("llama")
    handle = model.model.layers[1].self_attn.register_forward_hook(lambda m, a, out: (out[0] * 0.5, *out[1:]))
    _wrap_refused(model, "self_attn has a forward hook, which would never fire")
    handle.remove()
    memo.wrap(model, alpha=0.5, policy=["memo"] * 2)
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: None)
    batch = _batch(16, None)
    with pytest.raises(MemoError, match="self_attn has a forward pre-hook"):
        model(**batch).loss.backward()


def test_a_patched_or_subclassed_attention_is_refused() -> None:
    """A LongLoRA-style patch of LlamaAttention.forward, or an attention of a subclass: memo would run
    its own attention instead of the user's."""
    from transformers.models.llama import modeling_llama

    model = _model("llama")
    original = modeling_llama.LlamaAttention.forward
    try:
        modeling_llama.LlamaAttention.forward = lambda self, *a, **k: original(self, *a, **k)
        _wrap_refused(model, r"LlamaAttention.forward was replaced")
    finally:
        modeling_llama.LlamaAttention.forward = original

    class ShiftedAttention(modeling_llama.LlamaAttention):
        pass

    model.model.layers[0].self_attn.__class__ = ShiftedAttention
    _wrap_refused(model, "its self_attn is a .*ShiftedAttention, not LlamaAttention")


def test_a_decoder_layer_subclass_is_refused() -> None:
    """``class MyLayer(LlamaDecoderLayer)`` overriding forward: memo's adapter, found through the base
    class, would run LlamaDecoderLayer's computation and never MyLayer's."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class MyLayer(LlamaDecoderLayer):
        def forward(self, hidden_states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            return super().forward(hidden_states * 2.0, *args, **kwargs)

    model = _model("llama")
    model.model.layers[1].__class__ = MyLayer
    _wrap_refused(model, "MyLayer is a subclass of LlamaDecoderLayer")
    model.model.layers[1].__class__ = LlamaDecoderLayer
    model.model.layers[1].forward = lambda *a, **k: LlamaDecoderLayer.forward(model.model.layers[1], *a, **k)
    _wrap_refused(model, "its forward was replaced on the instance")


def test_bidirectional_attention_is_refused() -> None:
    """``self_attn.is_causal = False`` (LLM2Vec-style encoders): memo's attention is causal (hidden states
    were off by 0.33)."""
    model = _model("llama")
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    _wrap_refused(model, "is_causal is False")
