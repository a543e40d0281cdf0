"""ModelConfig's head_dim and qk_norm: a head size other than hidden / n_heads and Qwen3's per-head
query/key norm, through the layers, the parameter count, memo's wrapper and the fingerprint."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import memo
from memo.errors import MemoError
from memo.models import (
    ModelConfig,
    apply_rotary,
    build_model,
    fingerprint,
    get_config,
    list_configs,
    load_config,
    num_parameters,
    rank_shapes,
)
from tests.grads import assert_same_step, random_batch, train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

#: 4 query heads of 16 (64 channels) from a 48-wide stream, 2 key/value heads, qk_norm.
WIDE_HEADS = ModelConfig(name="wide-heads", arch="llama", n_layers=3, hidden=48, n_heads=4, n_kv_heads=2,
                         head_dim=16, qk_norm=True, ffn_hidden=96, vocab_size=128)

#: fingerprint() of every config registered before head_dim and qk_norm were fields, and of configs
#: built without them: saved plans compare these (NOTE [Fingerprint of later fields]).
FINGERPRINTS = {
    "gpt-125m": "f28836baa873b976",
    "gpt-350m": "2accbcc33789e9dc",
    "gpt-1.3b": "b9c9313fc13a7290",
    "gpt-2.7b": "3496321204fea6ba",
    "gpt-7b": "f5fdfeb6a66a77f3",
    "gpt-13b": "de82300bab14a995",
    "gpt-30b": "421426da2e79233a",
    "gpt-65b": "c0cbeb62ed27c86b",
    "tiny": "bae8ad19940adb95",
    "gpt-mini": "c7246d2357cb2f8a",
    "llama-tiny": "64e70c0d6842facf",
    "llama-3-8b": "953e44144c170a9f",
    "llama-3.1-8b": "953e44144c170a9f",
    "llama-3.1-70b": "e9182f7e429355fb",
    "llama-3.2-1b": "f352e7cef123bd89",
}
UNREGISTERED = [
    (dict(arch="llama", n_layers=3, hidden=96, n_heads=6, n_kv_heads=2), "bb457a4a077264b5"),
    (dict(arch="gpt", n_layers=2, hidden=48, n_heads=3, vocab_size=300), "5849e290ca32ddb6"),
    (dict(arch="llama", n_layers=1, hidden=256, n_heads=8, n_kv_heads=4, ffn_hidden=512), "e0c9e84ea4639421"),
]


def test_a_head_size_of_its_own_builds_and_counts_its_parameters() -> None:
    model = build_model(WIDE_HEADS, dtype=torch.float32)
    layer = model.layers[0]
    assert layer.qkv.weight.shape == ((4 + 2 * 2) * 16, 48)
    assert layer.proj.weight.shape == (48, 4 * 16)
    assert layer.q_norm.weight.shape == layer.k_norm.weight.shape == (16,)
    assert {"q_norm.weight", "k_norm.weight"} <= set(layer.state_dict())
    assert num_parameters(WIDE_HEADS) == sum(p.numel() for p in model.parameters())
    x = torch.randn(7, 2, 48)
    q, k, v = layer.pre(x)
    assert q.shape == (7, 2, 4, 16) and k.shape == v.shape == (7, 2, 2, 16)
    assert layer.core(q, k, v).shape == (7, 2, 64) and layer(x).shape == x.shape


def test_it_trains_a_step() -> None:
    torch.manual_seed(0)
    model = build_model(WIDE_HEADS, dtype=torch.float32)
    ids, labels = random_batch(model, 2, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model(ids, labels)
    before.backward()
    names = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert names == {n for n, _ in model.named_parameters()}  # q_norm and k_norm take part too
    optimizer.step()
    with torch.no_grad():
        assert model(ids, labels) < before


def test_qk_norm_norms_every_head_before_rotary() -> None:
    layer = build_model(WIDE_HEADS, dtype=torch.float64).layers[0]
    with torch.no_grad():
        layer.qkv.weight.mul_(100.0)  # heads far larger than norm_eps
    x = torch.randn(9, 2, 48, dtype=torch.float64)
    q, k, _ = layer.pre(x, offset=3)
    # Unit weights: every head comes out with a root mean square of 1, which rotary keeps.
    for t in (q, k):
        torch.testing.assert_close(t.square().mean(-1), torch.ones(t.shape[:-1], dtype=t.dtype), rtol=1e-5,
                                   atol=0)
    with torch.no_grad():
        layer.q_norm.weight.mul_(2.0)
    q2, k2, _ = layer.pre(x, offset=3)
    torch.testing.assert_close(q2, 2 * q)
    torch.testing.assert_close(k2, k)
    raw = layer.qkv(layer.input_norm(x))[..., :64].reshape(9, 2, 4, 16)
    want = apply_rotary(layer.q_norm(raw), 3, float(WIDE_HEADS.rope_theta))
    torch.testing.assert_close(q2, want, rtol=1e-12, atol=1e-12)


def test_pre_on_a_token_slice_is_the_slice_of_pre() -> None:
    layer = build_model(WIDE_HEADS, dtype=torch.float64).layers[1]
    s, a, b = 31, 11, 23
    x = torch.randn(s, 2, 48, dtype=torch.float64)
    full = layer.pre(x)
    for part, whole in zip(layer.pre(x[a:b], offset=a), full, strict=True):
        torch.testing.assert_close(part, whole[a:b], rtol=1e-12, atol=1e-12)
    o = layer.core(*full)
    torch.testing.assert_close(layer.post(o[a:b], x[a:b]), layer.post(o, x)[a:b], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_memo_gives_the_unwrapped_loss_and_gradients(alpha: float) -> None:
    torch.manual_seed(1)
    ref = build_model(WIDE_HEADS, dtype=torch.float32)
    model = memo.wrap(copy.deepcopy(ref), alpha=alpha, policy=["memo"] * WIDE_HEADS.n_layers)
    for seed in range(2):
        ids, labels = random_batch(ref, 2, 13, seed=seed)  # alpha * 13 is never a whole number
        assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))


def test_full_recompute_gives_the_same_gradients() -> None:
    torch.manual_seed(2)
    ref = build_model(WIDE_HEADS, dtype=torch.float32)
    model = copy.deepcopy(ref)
    model.recompute = "full"
    ids, labels = random_batch(ref, 2, 11)
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))


def test_tensor_parallel_rank_shapes() -> None:
    r = rank_shapes(get_config("qwen3-32b"), 8)
    assert (r.n_heads, r.n_kv_heads, r.head_dim) == (8, 1, 128)
    assert r.qkv_out == (8 + 2) * 128 and r.attn_out == 8 * 128
    model = build_model(WIDE_HEADS, device="meta", tensor_parallel=2)
    assert model.layers[0].qkv.weight.shape == ((2 + 2) * 16, 48)
    assert model.layers[0].proj.weight.shape == (48, 2 * 16)
    assert num_parameters(WIDE_HEADS, tensor_parallel=2) == sum(p.numel() for p in model.parameters())


def test_qwen3_32b_has_its_published_parameter_count() -> None:
    c = get_config("qwen3-32b")
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim) == (64, 5120, 64, 8, 128)
    assert (c.ffn_hidden, c.vocab_size, c.rope_theta, c.norm_eps) == (25600, 151936, 1e6, 1e-6)
    assert c.qk_norm and not c.tied_embeddings
    total = num_parameters(c)
    # Qwen's model card: 32.8B parameters, 31.2B of them outside the embedding and the LM head.
    assert abs(total - 32.8e9) < 0.05e9
    assert abs(total - 2 * c.vocab_size * c.hidden - 31.2e9) < 0.05e9
    assert total == sum(p.numel() for p in build_model(c, device="meta").parameters())
    # 64 query heads of 128 read a 5120-wide stream: the projections are not square.
    layer = build_model(c, device="meta").layers[0]
    assert layer.qkv.weight.shape == (10240, 5120) and layer.proj.weight.shape == (5120, 8192)


def test_earlier_fingerprints_are_unchanged() -> None:
    got = {name: fingerprint(get_config(name)) for name in list_configs() if name in FINGERPRINTS}
    assert got == FINGERPRINTS
    for fields, want in UNREGISTERED:
        config = ModelConfig(name="x", **fields)
        assert fingerprint(config) == want
        # Writing the default head size out changes nothing either.
        assert fingerprint(ModelConfig(name="x", head_dim=config.head_dim, qk_norm=False, **fields)) == want


def test_the_new_fields_change_the_fingerprint_when_set() -> None:
    base = dict(arch="llama", n_layers=1, hidden=256, n_heads=8, n_kv_heads=4, ffn_hidden=512)
    prints = {fingerprint(ModelConfig(name="x", **base)),
              fingerprint(ModelConfig(name="x", head_dim=64, **base)),
              fingerprint(ModelConfig(name="x", qk_norm=True, **base)),
              fingerprint(ModelConfig(name="x", head_dim=64, qk_norm=True, **base))}
    assert len(prints) == 4
    assert fingerprint(get_config("qwen3-32b")) not in FINGERPRINTS.values()


def test_head_dim_defaults_and_errors() -> None:
    assert get_config("llama-3.1-8b").head_dim == 128 and get_config("gpt-7b").head_dim == 128
    assert ModelConfig(name="x", arch="gpt", n_layers=1, hidden=65, n_heads=5, head_dim=16).head_dim == 16
    with pytest.raises(MemoError, match="not divisible by n_heads=4.*unless head_dim is given"):
        ModelConfig(name="x", arch="llama", n_layers=1, hidden=65, n_heads=4)
    for bad in (0, -8, 16.0, True, "16"):
        with pytest.raises(MemoError, match="head_dim must be a positive int"):
            ModelConfig(name="x", arch="llama", n_layers=1, hidden=64, n_heads=4, head_dim=bad)
    with pytest.raises(MemoError, match="rotary needs an even head_dim, got 15"):
        ModelConfig(name="x", arch="llama", n_layers=1, hidden=64, n_heads=4, head_dim=15)
    for bad in (1, "true", None):
        with pytest.raises(MemoError, match="qk_norm must be true or false"):
            ModelConfig(name="x", arch="llama", n_layers=1, hidden=64, n_heads=4, qk_norm=bad)
    with pytest.raises(MemoError, match="qk_norm is a Llama-family option"):
        ModelConfig(name="x", arch="gpt", n_layers=1, hidden=64, n_heads=4, qk_norm=True)


def test_json_configs_take_the_new_fields(tmp_path) -> None:
    path = tmp_path / "qwen-like.json"
    path.write_text(json.dumps({"arch": "llama", "n_layers": 2, "hidden": 48, "n_heads": 4, "n_kv_heads": 2,
                                "head_dim": 16, "qk_norm": True, "ffn_hidden": 96, "vocab_size": 128}))
    config = load_config(path)
    assert config == ModelConfig(**{**WIDE_HEADS.__dict__, "name": "qwen-like", "n_layers": 2})
    assert get_config(str(path)) == config
    for field, value, needle in (("head_dim", 0, "head_dim must be a positive int"),
                                 ("head_dim", "16", "head_dim must be a positive int"),
                                 ("qk_norm", "yes", "qk_norm must be true or false"),
                                 ("qk_norms", True, "unknown field.*qk_norms.*qk_norm")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"arch": "llama", "n_layers": 2, "hidden": 48, "n_heads": 4, field: value}))
        with pytest.raises(MemoError, match=needle):
            load_config(bad)
