"""One rank of Megatron tensor + sequence parallelism (NOTE [Tensor-parallel rank]): shapes, saved
bytes against Korthikanti et al. 2022, the token-wise contract under the gather, and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memo.errors import MemoError
from memo.models import (
    IGNORE_INDEX,
    ModelConfig,
    build_model,
    chunked_lm_loss,
    context_parallel_seq_len,
    get_config,
    num_parameters,
    per_rank_seq_len,
    rank_shapes,
)
from memo.models.layers import GPTLayer, LlamaLayer
from memo.models.parallel import (
    all_gather_tokens,
    column_parallel_linear,
    reduce_scatter_tokens,
    scatter_to_sequence_parallel,
)
from memo.profiler.record import record

ARCHS = ["tiny", "llama-tiny"]
#: llama-tiny has two key/value heads, so t = 4 needs one with four.
LLAMA_KV4 = ModelConfig(name="llama-kv4", arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=4,
                        ffn_hidden=176, vocab_size=512)
RANK_MODELS = ["tiny", pytest.param(LLAMA_KV4, id="llama-kv4")]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _saved_storage_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages one forward of ``layer`` saves for backward."""
    params = {_storage(p) for p in layer.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _storage(t) not in params:
            storages[_storage(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(storages.values())


# --- per-rank shapes -------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4, 8])
def test_gpt_7b_rank_parameter_shapes(t: int) -> None:
    model = build_model("gpt-7b", device="meta", tensor_parallel=t)
    h, ffn, vocab = 4096, 4 * 4096, 50257
    layer = model.layers[0]
    assert model.tensor_parallel == t and layer.sequence_gather == t
    assert layer.qkv.weight.shape == (3 * h // t, h) and layer.qkv.bias.shape == (3 * h // t,)
    assert layer.proj.weight.shape == (h, h // t) and layer.proj.bias.shape == (h,)
    assert layer.fc1.weight.shape == (ffn // t, h) and layer.fc1.bias.shape == (ffn // t,)
    assert layer.fc2.weight.shape == (h, ffn // t) and layer.fc2.bias.shape == (h,)
    assert layer.input_norm.weight.shape == (h,) and layer.post_norm.weight.shape == (h,)
    # 50257 is odd: the vocabulary is padded to a multiple of t, ceil(V/t) rows per rank.
    rows = -(-vocab // t)
    assert model.embedding.word.weight.shape == (rows, h)
    assert model.head.weight is model.embedding.word.weight  # still tied
    assert model.embedding.position.weight.shape == (4096, h)  # replicated, not sharded
    shapes = rank_shapes(get_config("gpt-7b"), t)
    assert (shapes.n_heads, shapes.n_kv_heads, shapes.head_dim) == (32 // t, 32 // t, 128)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_llama_3_8b_rank_parameter_shapes(t: int) -> None:
    model = build_model("llama-3-8b", device="meta", tensor_parallel=t)
    h, d, ffn, vocab = 4096, 128, 14336, 128256
    layer = model.layers[0]
    assert layer.qkv.weight.shape == ((32 + 2 * 8) // t * d, h)
    assert layer.proj.weight.shape == (h, 32 // t * d)
    assert layer.gate_up.weight.shape == (2 * ffn // t, h)
    assert layer.down.weight.shape == (h, ffn // t)
    assert model.embedding.word.weight.shape == (vocab // t, h)
    assert model.head.weight.shape == (vocab // t, h)
    assert model.head.norm.weight.shape == (h,)


@pytest.mark.parametrize("name", ARCHS)
def test_tensor_parallel_one_is_the_plain_model(name: str) -> None:
    torch.manual_seed(0)
    plain = build_model(name)
    torch.manual_seed(0)
    same = build_model(name, tensor_parallel=1)
    assert [(k, v.shape) for k, v in plain.state_dict().items()] == [
        (k, v.shape) for k, v in same.state_dict().items()
    ]
    assert [type(m) for m in plain.modules()] == [type(m) for m in same.modules()]
    assert all(layer.sequence_gather == 1 for layer in same.layers)
    ids = torch.randint(0, 512, (2, 24))
    labels = torch.randint(0, 512, (2, 24))
    loss_a, loss_b = plain(ids, labels), same(ids, labels)
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    for (_, p), (_, q) in zip(plain.named_parameters(), same.named_parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("name", RANK_MODELS)
@pytest.mark.parametrize("t", [1, 2, 4])
def test_num_parameters_per_rank(name: str | ModelConfig, t: int) -> None:
    model = build_model(name, device="meta", tensor_parallel=t)
    assert num_parameters(name, tensor_parallel=t) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", RANK_MODELS)
@pytest.mark.parametrize("t", [2, 4])
def test_rank_activation_shapes(name: str | ModelConfig, t: int) -> None:
    config = get_config(name) if isinstance(name, str) else name
    model = build_model(config, device="meta", tensor_parallel=t)
    s, b, h = 64, 3, config.hidden
    n, n_kv, d = config.n_heads // t, config.n_kv_heads // t, config.head_dim
    seen: dict[str, tuple[int, ...]] = {}

    def note(*names: str):  # a forward (pre-)hook noting the shapes of its inputs or its output
        def hook(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object = None) -> None:
            tensors = args if out is None else (out,)
            seen.update({name: tuple(t.shape) for name, t in zip(names, tensors, strict=False)})
        return hook

    layer = model.layers[0]
    layer.register_forward_pre_hook(note("x"))
    layer.register_forward_hook(note("y"))
    layer.core_attention.register_forward_pre_hook(note("q", "k"))
    layer.core_attention.register_forward_hook(note("o"))
    model.head.register_forward_pre_hook(note("head"))
    ids = torch.zeros(b, s, dtype=torch.long, device="meta")
    model(ids, ids).backward()
    assert seen == {"x": (s // t, b, h), "y": (s // t, b, h), "q": (s, b, n, d), "k": (s, b, n_kv, d),
                    "o": (s, b, n * d), "head": (s // t, b, h)}


# --- saved bytes: Korthikanti et al. 2022 divided by t ----------------------------------------


def _korthikanti_sp_bytes(s: int, b: int, h: int, a: int, t: int) -> int:
    """Activation bytes per layer with tensor + sequence parallelism and no recompute, 16-bit
    (Korthikanti et al. 2022, Table 2): ``sbh·(34/t + 5as/(ht))``."""
    return (34 * s * b * h + 5 * a * s * s * b) // t


def _gpt_layer_bytes(s: int, b: int, h: int, a: int, t: int) -> int:
    """What memo's GPT layer saves per rank, in bf16, from Korthikanti's count.

    memo's layer has no dropout (drop the two sbh/t of dropout masks: attention's and the
    MLP's) and flash-style attention (drop the 5as²b/t of scores, softmax and its dropout);
    what is left is 32·sbh/t bytes, the paper's 16·sbh elements per layer divided by t. Korthikanti
    neglects the fp32 statistics, which are exact here and shard the same way: two LayerNorms'
    mean and rstd (4 x 4 bytes per local token) and attention's log-sum-exp (4 bytes per token
    and head, a/t heads over all s tokens).
    """
    activations = _korthikanti_sp_bytes(s, b, h, a, t) - (2 * s * b * h + 5 * a * s * s * b) // t
    stats = 2 * 2 * (s // t) * b * 4 + b * (a // t) * s * 4
    return activations + stats


@pytest.mark.parametrize(("s", "b", "h", "a", "t"), [
    (64, 2, 256, 8, 1),
    (64, 2, 256, 8, 2),
    (128, 1, 512, 8, 4),
    (256, 2, 256, 16, 8),
    (96, 3, 192, 6, 3),
])
def test_gpt_layer_saved_bytes_match_korthikanti_over_t(s: int, b: int, h: int, a: int, t: int) -> None:
    config = ModelConfig(name="k", arch="gpt", n_layers=1, hidden=h, n_heads=a)
    layer = GPTLayer(config, device="meta", dtype=torch.bfloat16, tensor_parallel=t)
    x = torch.empty(s // t, b, h, device="meta", dtype=torch.bfloat16, requires_grad=True)
    # Equality also says that no gathered [s, b, h] input is kept: it would add s·b·h·2 bytes.
    assert _saved_storage_bytes(layer, x) == _gpt_layer_bytes(s, b, h, a, t)


def _llama_layer_bytes(s: int, b: int, h: int, a: int, kv: int, ffn: int, t: int, e: int) -> int:
    """What memo's Llama layer saves per rank (dtype of ``e`` bytes).

    Every term but one shards by t. Each RMSNorm (memo's, NOTE [Lean RMSNorm] in
    memo/models/norms.py) saves its input and a float32 rstd, and the linear after it saves
    its output, per local token; attention keeps the rotated q and k, the fused QKV output (v
    is a view of it), o and the fp32 log-sum-exp on the rank's heads over all s tokens; the
    SwiGLU MLP keeps the gate+up output, silu(gate) and silu(gate)·up. The exception: each
    call of the rotary embedding builds cos and sin ``[s, 1, 1, d]`` for q and for k, for the
    positions of all s gathered tokens, whatever t.
    """
    m, d = s // t, h // a
    n, g, f = a // t, kv // t, ffn // t
    norms = 2 * m * b * (h * (e + e) + 4)
    attention = s * b * d * e * ((n + g) + (n + 2 * g) + n) + 4 * b * n * s
    rotary = 4 * s * d * e
    mlp = s * b * e * (2 * f + f + f)
    return norms + attention + rotary + mlp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("s", "b", "h", "a", "kv", "ffn", "t"), [
    (64, 2, 256, 8, 4, 512, 1),
    (64, 2, 256, 8, 4, 512, 2),
    (128, 1, 512, 16, 4, 1024, 4),
])
def test_llama_layer_saved_bytes_per_rank(s: int, b: int, h: int, a: int, kv: int, ffn: int, t: int,
                                          dtype: torch.dtype) -> None:
    config = ModelConfig(name="k", arch="llama", n_layers=1, hidden=h, n_heads=a, n_kv_heads=kv,
                         ffn_hidden=ffn)
    layer = LlamaLayer(config, device="meta", dtype=dtype, tensor_parallel=t)
    x = torch.empty(s // t, b, h, device="meta", dtype=dtype, requires_grad=True)
    e = torch.empty((), dtype=dtype).element_size()
    assert _saved_storage_bytes(layer, x) == _llama_layer_bytes(s, b, h, a, kv, ffn, t, e)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_profiler_records_per_rank_layer_sizes(t: int) -> None:
    """memo's dispatch recorder, on the rank model as built: S_input, S_attn and the layer total
    are the whole model's divided by t (GPT, bf16, meta)."""
    config = ModelConfig(name="k", arch="gpt", n_layers=2, hidden=256, n_heads=8, vocab_size=1024)
    s, b, h, a = 256, 2, 256, 8
    model = build_model(config, device="meta", dtype=torch.bfloat16, tensor_parallel=t)
    ids = torch.zeros(b, s, dtype=torch.long, device="meta")
    stats = record(model, ids, ids).layer_stats[0]
    assert stats.s_input == s * b * h * 2 // t
    assert stats.s_attn == (s * b * h * 2 + b * a * s * 4) // t  # o and its log-sum-exp
    assert stats.total == _gpt_layer_bytes(s, b, h, a, t)


# --- the emulated collectives ----------------------------------------------------------------


def test_gather_and_reduce_scatter_are_adjoint() -> None:
    x = torch.arange(6.0).view(3, 2)
    g = all_gather_tokens(x, 2)
    assert torch.equal(g, torch.stack([x[0], x[0], x[1], x[1], x[2], x[2]]))  # token-major replicas
    assert torch.equal(reduce_scatter_tokens(g, 2), 2 * x)
    y = torch.randn(8, 2, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda y: scatter_to_sequence_parallel(y, 4), (y,))
    assert scatter_to_sequence_parallel(y, 1) is y


def test_column_parallel_linear_saves_the_local_input_only() -> None:
    linear = torch.nn.Linear(4, 6, dtype=torch.float64)
    x = torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = column_parallel_linear(x, linear, 3)
    assert out.shape == (15, 2, 6)
    assert sorted(_storage(t) for t in saved) == sorted([_storage(x), _storage(linear.weight)])
    torch.testing.assert_close(out, F.linear(all_gather_tokens(x, 3), linear.weight, linear.bias))
    torch.autograd.gradcheck(lambda x, w, b: column_parallel_linear(x, _Lin(w, b), 3),
                             (x, linear.weight, linear.bias))


class _Lin(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias


@pytest.mark.parametrize("t", [2, 3])
def test_chunked_loss_with_gather_matches_the_gathered_input(t: int) -> None:
    n, b, h, vocab = 5, 2, 8, 11
    x = torch.randn(n, b, h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (b, n * t))
    labels[0, 3] = IGNORE_INDEX
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t_: saved.append(t_) or t_, lambda t_: t_):
        loss = chunked_lm_loss(x, w, labels, 4, sequence_gather=t)
    assert all(s.dim() != 3 or s.shape[0] == n for s in saved)  # x is kept local, never gathered
    gx, gw = torch.autograd.grad(loss, (x, w))
    ref = chunked_lm_loss(all_gather_tokens(x, t), w, labels, 4)
    rx, rw = torch.autograd.grad(ref, (x, w))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    with pytest.raises(MemoError, match=r"labels must be \[b, s\].*gathered"):
        chunked_lm_loss(x, w, labels[:, :n], 4, sequence_gather=t)


# --- the layer contract with memo's runtime --------------------------------------------------


@pytest.mark.parametrize("name", RANK_MODELS)
@pytest.mark.parametrize("t", [2, 4])
def test_rank_layer_is_token_wise_over_local_ranges(name: str | ModelConfig, t: int) -> None:
    """The runtime's split: pre on x[0:a] and x[a:n] (offset a), q/k/v joined, attention once,
    post on o[0:a·t] / o[a·t:] with x[0:a] / x[a:]: the same as the whole layer."""
    layer = build_model(name, dtype=torch.float64, tensor_parallel=t).layers[0]
    n, b = 6, 2
    x = torch.randn(n, b, layer.config.hidden, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = layer.pre(x)
        assert q.shape[0] == n * t
        o = layer.core(q, k, v)
        y = layer.post(o, x)
        assert y.shape == x.shape
        for a in (1, 3, 5):
            parts = [layer.pre(x[:a], offset=0), layer.pre(x[a:], offset=a)]
            for whole, first, rest in zip((q, k, v), *parts, strict=True):
                torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=1e-12, atol=1e-12)
            g = a * layer.sequence_gather
            y_split = torch.cat([layer.post(o[:g], x[:a]), layer.post(o[g:], x[a:])])
            torch.testing.assert_close(y_split, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ARCHS)
def test_rank_model_forward_backward_on_cpu(name: str) -> None:
    t, s = 2, 32
    model = build_model(name, tensor_parallel=t)
    ids = torch.randint(0, 512, (2, s))
    labels = torch.randint(0, 512, (2, s))
    labels[1, :4] = IGNORE_INDEX
    loss = model(ids, labels)
    assert torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, pname
        assert torch.isfinite(p.grad).all(), pname
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model.recompute = "full"
    loss_full = model(ids, labels)
    loss_full.backward()
    torch.testing.assert_close(loss_full, loss)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k])


# --- errors and helpers ----------------------------------------------------------------------


def test_indivisible_sizes_are_refused() -> None:
    with pytest.raises(MemoError, match="n_heads=12 is not divisible by 8"):
        build_model(ModelConfig(name="x", arch="gpt", n_layers=1, hidden=96, n_heads=12), device="meta",
                    tensor_parallel=8)
    with pytest.raises(MemoError, match="n_kv_heads=2 is not divisible by 4"):
        build_model("llama-tiny", device="meta", tensor_parallel=4)
    with pytest.raises(MemoError, match="ffn_hidden=100 is not divisible by 8"):
        build_model(ModelConfig(name="x", arch="gpt", n_layers=1, hidden=64, n_heads=8, ffn_hidden=100),
                    device="meta", tensor_parallel=8)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(MemoError, match="tensor_parallel must be a positive int"):
            build_model("tiny", device="meta", tensor_parallel=bad)
    model = build_model("tiny", device="meta", tensor_parallel=4)
    ids = torch.zeros(1, 30, dtype=torch.long, device="meta")
    with pytest.raises(MemoError, match="seq len 30 cannot be split over TP 4 x CP 1.*use 28 or 32"):
        model(ids, ids)


def test_vocabulary_is_padded_to_a_multiple_of_t() -> None:
    config = ModelConfig(name="v", arch="llama", n_layers=1, hidden=64, n_heads=4, vocab_size=1001)
    assert rank_shapes(config, 1).vocab_rows == 1001
    assert rank_shapes(config, 4).vocab_rows == 251  # 1004 / 4
    model = build_model(config, tensor_parallel=4)
    assert model.embedding.word.weight.shape == (251, 64) and model.head.weight.shape == (251, 64)
    ids = torch.full((1, 8), 1000)  # the last id: beyond rank 0's slice
    assert torch.isfinite(model(ids, ids))


def test_per_rank_seq_len() -> None:
    assert per_rank_seq_len(131072) == 131072
    assert per_rank_seq_len(131072, tp=8) == 16384
    assert per_rank_seq_len(131072, tp=4, cp=2) == 16384
    assert context_parallel_seq_len(131072, 4) == 32768
    with pytest.raises(MemoError, match="2·c = 8 load-balanced chunks.*multiple of 8; use 1,000 or 1,008"):
        context_parallel_seq_len(1004, 4)
    with pytest.raises(MemoError, match="seq len 1,002 cannot be split over TP 4 x CP 1"):
        per_rank_seq_len(2004, tp=4, cp=2)
    with pytest.raises(MemoError, match="cp must be a positive int"):
        per_rank_seq_len(1024, cp=0)
