"""Reference models: layer anatomy, token-wise pre/post, chunked loss, recompute, attention, configs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from memo.errors import MemoError
from memo.models import (
    IGNORE_INDEX,
    ModelConfig,
    attention,
    attention_backward,
    attention_forward,
    build_model,
    chunked_lm_loss,
    fingerprint,
    get_config,
    list_configs,
    num_parameters,
)
from tests.grads import rel_err

ARCHS = ["tiny", "llama-tiny"]


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s, _, n, d = q.shape
    group = n // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("bnst,tbnd->sbnd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_attention_matches_naive_softmax(dtype: torch.dtype, n_kv: int) -> None:
    s, b, n, d = 29, 2, 4, 8
    q = torch.randn(s, b, n, d, dtype=dtype, requires_grad=True)
    k = torch.randn(s, b, n_kv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(s, b, n_kv, d, dtype=dtype, requires_grad=True)
    out = attention(q, k, v)
    ref = _naive_attention(q, k, v)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert out.shape == (s, b, n, d) and out.is_contiguous()
    assert rel_err(out, ref) < tol
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert rel_err(g, w) < tol


@pytest.mark.parametrize("n_kv", [4, 2])
def test_attention_backward_matches_autograd(n_kv: int) -> None:
    q = torch.randn(17, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(17, 3, n_kv, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(17, 3, n_kv, 8, dtype=torch.float64, requires_grad=True)
    o, lse = attention_forward(q, k, v)
    assert lse.shape == (3, 4, 17) and lse.dtype == torch.float64  # float32 for 16/32-bit inputs
    grad_o = torch.randn_like(o)
    manual = attention_backward(grad_o, q, k, v, o, lse)
    auto = torch.autograd.grad(attention(q, k, v), (q, k, v), grad_o)
    for m, a in zip(manual, auto, strict=True):
        torch.testing.assert_close(m, a, rtol=1e-12, atol=1e-12)


def test_attention_saves_exactly_q_k_v_o_lse() -> None:
    q = torch.randn(9, 1, 4, 8, requires_grad=True)
    k = torch.randn(9, 1, 2, 8, requires_grad=True)
    v = torch.randn(9, 1, 2, 8, requires_grad=True)
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        attention(q, k, v)
    assert saved == [q.shape, k.shape, v.shape, q.shape, torch.Size([1, 4, 9])]


@pytest.mark.parametrize("n_kv", [8, 2])
def test_cuda_kernel_calls_have_the_right_arguments_on_meta(n_kv: int) -> None:
    # No GPU here: the aten CUDA flash kernels have meta implementations, so the argument
    # plumbing of the CUDA path (layouts, the backward's extra arguments) is checked on meta.
    from memo.models import causal_attention as attention_module

    q = torch.empty(64, 2, 8, 16, device="meta", dtype=torch.bfloat16)
    k = torch.empty(64, 2, n_kv, 16, device="meta", dtype=torch.bfloat16)
    o, lse = attention_module._forward_kernels("aten_cuda", q, k, k)
    assert o.shape == q.shape and o.is_contiguous() and lse.shape == (2, 8, 64)
    dq, dk, dv = attention_module._backward_kernels("aten_cuda", o, q, k, k, o, lse)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_attention_rejects_bad_head_counts() -> None:
    with pytest.raises(MemoError, match="multiple of the key/value head count"):
        attention(torch.randn(4, 1, 4, 8), torch.randn(4, 1, 3, 8), torch.randn(4, 1, 3, 8))


@pytest.mark.parametrize("name", ARCHS)
def test_layer_forward_is_post_core_pre(name: str) -> None:
    model = build_model(name)
    layer = model.layers[0]
    x = torch.randn(23, 2, model.config.hidden)
    q, k, v = layer.pre(x)
    c = model.config
    assert q.shape == (23, 2, c.n_heads, c.head_dim)
    assert k.shape == v.shape == (23, 2, c.n_kv_heads, c.head_dim)
    o = layer.core(q, k, v)
    assert o.shape == (23, 2, c.n_heads * c.head_dim)
    assert torch.equal(layer(x), layer.post(o, x))
    assert sum(p.numel() for p in layer.core_attention.parameters()) == 0


@pytest.mark.parametrize("name", ARCHS)
def test_pre_and_post_are_token_wise(name: str) -> None:
    model = build_model(name, dtype=torch.float64)
    layer = model.layers[1]
    s, a = 31, 11
    x = torch.randn(s, 2, model.config.hidden, dtype=torch.float64)
    full = layer.pre(x)
    part = layer.pre(x[a:], offset=a)
    for f, p in zip(full, part, strict=True):
        torch.testing.assert_close(p, f[a:], rtol=1e-12, atol=1e-12)
    o = layer.core(*full)
    torch.testing.assert_close(layer.post(o[a:], x[a:]), layer.post(o, x)[a:], rtol=1e-12, atol=1e-12)


def test_rotary_offset_matters_for_llama() -> None:
    layer = build_model("llama-tiny").layers[0]
    x = torch.randn(8, 1, 64)
    q0, _, _ = layer.pre(x)
    q5, _, _ = layer.pre(x, offset=5)
    assert not torch.allclose(q0, q5)


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_loss_matches_cross_entropy(chunk: int) -> None:
    s, b, h, vocab = 37, 3, 16, 101  # s·b = 111: chunks of 7 and 64 do not divide it
    x = torch.randn(s, b, h, requires_grad=True)
    w = torch.randn(vocab, h, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s))
    labels[0, :5] = IGNORE_INDEX
    labels[2, -3:] = IGNORE_INDEX
    loss = chunked_lm_loss(x, w, labels, chunk)
    got = torch.autograd.grad(loss, (x, w))
    logits = (x @ w.t()).transpose(0, 1).reshape(-1, vocab)
    ref = F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX)
    want = torch.autograd.grad(ref, (x, w))
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-5
    for g, r in zip(got, want, strict=True):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("norm_class", [torch.nn.RMSNorm, torch.nn.LayerNorm])
@pytest.mark.parametrize("frozen", [False, True])
def test_the_final_norm_inside_the_loss_chunks(norm_class: type, frozen: bool) -> None:
    # NOTE [The final norm in the loss's chunks]: the same loss and gradients (x, head weight, norm's
    # parameters) as the norm applied to the whole sequence first; a frozen norm gets none.
    torch.manual_seed(3)
    s, b, h, vocab = 37, 3, 16, 101
    norm = norm_class(h)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
        norm.requires_grad_(not frozen)
    x = torch.randn(s, b, h, requires_grad=True)
    w = torch.randn(vocab, h, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s))
    labels[1, :4] = IGNORE_INDEX
    params = [p for p in norm.parameters() if p.requires_grad]
    inside = chunked_lm_loss(x, w, labels, 10, norm=norm)
    got = torch.autograd.grad(inside, (x, w, *params))
    outside = chunked_lm_loss(norm(x), w, labels, 10)
    want = torch.autograd.grad(outside, (x, w, *params))
    assert len(got) == (2 if frozen else 2 + len(list(norm.parameters())))
    assert abs(inside.item() - outside.item()) <= 1e-6 * abs(outside.item())
    for g, r in zip(got, want, strict=True):
        assert rel_err(g, r) < 1e-5
    with pytest.raises(MemoError, match="a norm inside the loss needs sequence_gather=1"):
        chunked_lm_loss(x, w, labels.repeat(1, 2), 10, sequence_gather=2, norm=norm)


def test_chunked_loss_float64_and_bfloat16_precision() -> None:
    s, b, h, vocab = 50, 2, 32, 300
    x64 = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(vocab, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s))

    def full(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy((x @ w.t()).transpose(0, 1).reshape(-1, vocab), labels.reshape(-1))

    ref = full(x64, w64)
    ref_grads = torch.autograd.grad(ref, (x64, w64))
    loss64 = chunked_lm_loss(x64, w64, labels, 33)
    assert abs(loss64.item() - ref.item()) < 1e-12
    for g, r in zip(torch.autograd.grad(loss64, (x64, w64)), ref_grads, strict=True):
        assert rel_err(g, r) < 1e-12
    # bf16: no worse than twice plain PyTorch's bf16 error against the float64 result.
    xb = x64.detach().bfloat16().requires_grad_()
    wb = w64.detach().bfloat16().requires_grad_()
    plain = full(xb, wb)
    plain_grads = torch.autograd.grad(plain, (xb, wb))
    chunked = chunked_lm_loss(xb, wb, labels, 33)
    chunked_grads = torch.autograd.grad(chunked, (xb, wb))
    assert chunked.dtype == torch.bfloat16
    assert abs(chunked.double() - ref).item() <= 2 * abs(plain.double() - ref).item() + 1e-2
    for c, p, r in zip(chunked_grads, plain_grads, ref_grads, strict=True):
        assert rel_err(c.double(), r) <= 2 * rel_err(p.double(), r) + 1e-3


def test_chunked_loss_saves_no_logits() -> None:
    x = torch.randn(64, 2, 16, requires_grad=True)
    w = torch.randn(500, 16, requires_grad=True)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked_lm_loss(x, w, torch.randint(0, 500, (2, 64)), 16)
    assert max(saved) <= w.numel()  # x, weight, labels, per-token lse and a scalar; no [s·b, V]


def test_chunked_loss_input_errors() -> None:
    with pytest.raises(MemoError, match="labels must be"):
        chunked_lm_loss(torch.randn(4, 2, 8), torch.randn(10, 8), torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(MemoError, match="chunk_tokens"):
        chunked_lm_loss(torch.randn(4, 2, 8), torch.randn(10, 8), torch.zeros(2, 4, dtype=torch.long), 0)


@pytest.mark.parametrize("name", ARCHS)
def test_full_recompute_gives_same_grads(name: str) -> None:
    model = build_model(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    labels = torch.roll(ids, -1, dims=1)
    loss = model(ids, labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.recompute = "full"
    loss_r = model(ids, labels)
    grads_r = torch.autograd.grad(loss_r, list(model.parameters()))
    assert abs(loss.item() - loss_r.item()) / loss.item() < 1e-5
    for g, r in zip(grads_r, grads, strict=True):
        assert rel_err(g, r) < 1e-5


def test_model_structure_and_loss() -> None:
    model = build_model("tiny", recompute="full")
    assert model.recompute == "full"
    ids = torch.randint(0, 512, (2, 16))
    x = model.embedding(ids)
    assert x.shape == (16, 2, 64)
    assert len(model.layers) == get_config("tiny").n_layers == 4
    loss = model(ids, torch.randint(0, 512, (2, 16)))
    assert loss.dim() == 0 and abs(loss.item() - math.log(512)) < 0.5  # near-uniform at init
    # GPT ties the LM head to the word embedding; Llama does not.
    assert model.head.weight is model.embedding.word.weight
    llama = build_model("llama-tiny")
    assert llama.head.weight is not llama.embedding.word.weight


@pytest.mark.parametrize("name", list_configs())
def test_num_parameters_matches_built_model(name: str) -> None:
    model = build_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == num_parameters(get_config(name))


def test_num_parameters_known_sizes() -> None:
    assert num_parameters("llama-3-8b") == 8_030_261_248
    assert 6.6e9 < num_parameters("gpt-7b") < 6.8e9
    model = build_model("gpt-125m", device="meta", max_seq_len=2048)
    assert sum(p.numel() for p in model.parameters()) == num_parameters("gpt-125m", max_seq_len=2048)


def test_meta_gpt_7b_forward_backward_long_sequence() -> None:
    s = 131072
    model = build_model("gpt-7b", device="meta", dtype=torch.bfloat16, max_seq_len=s)
    ids = torch.zeros(1, s, dtype=torch.long, device="meta")
    loss = model(ids, ids)
    assert loss.device.type == "meta" and loss.shape == ()
    loss.backward()
    assert model.layers[0].qkv.weight.grad.shape == (3 * 4096, 4096)


def test_meta_llama_3_8b_forward() -> None:
    model = build_model("llama-3-8b", device="meta", dtype=torch.bfloat16)
    ids = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    assert model(ids, ids).device.type == "meta"


def test_gpt_sequence_longer_than_position_table() -> None:
    model = build_model("tiny", max_seq_len=16)
    ids = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(MemoError, match=r"max_seq_len=17"):
        model(ids, ids)


def test_config_errors() -> None:
    with pytest.raises(MemoError, match="valid names: .*gpt-7b"):
        get_config("gpt-8b")
    with pytest.raises(MemoError, match="not divisible by n_heads"):
        ModelConfig(name="x", arch="gpt", n_layers=1, hidden=65, n_heads=4)
    with pytest.raises(MemoError, match="n_kv_heads must equal n_heads"):
        ModelConfig(name="x", arch="gpt", n_layers=1, hidden=64, n_heads=4, n_kv_heads=2)
    with pytest.raises(MemoError, match="multiple of n_kv_heads"):
        ModelConfig(name="x", arch="llama", n_layers=1, hidden=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(MemoError, match="arch must be one of"):
        ModelConfig(name="x", arch="bert", n_layers=1, hidden=64, n_heads=4)
    with pytest.raises(MemoError, match="rope_theta"):
        ModelConfig(name="x", arch="gpt", n_layers=1, hidden=64, n_heads=4, rope_theta=1e4)
    with pytest.raises(MemoError, match="recompute must be one of"):
        build_model("tiny", recompute="selective")
    with pytest.raises(MemoError, match="max_seq_len"):
        build_model("llama-tiny", max_seq_len=128)


def test_config_defaults_and_fingerprint() -> None:
    c = ModelConfig(name="a", arch="llama", n_layers=2, hidden=4096, n_heads=32)
    assert c.n_kv_heads == 32 and c.ffn_hidden == 11008 and c.rope_theta == 10000.0
    assert get_config("gpt-7b").ffn_hidden == 4 * 4096 and get_config("gpt-30b").head_dim == 128
    gpt7 = get_config("gpt-7b")
    assert fingerprint(gpt7) == fingerprint(dataclasses.replace(gpt7, name="renamed"))
    assert fingerprint(gpt7) != fingerprint(get_config("gpt-13b"))
    assert len(fingerprint(c)) == 16
