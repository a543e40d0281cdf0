"""memo on real megatron-core layers (CPU, gloo, world size 1), against the unwrapped layers.

megatron-core is a test dependency (``make test`` installs megatron-core==0.16.1): a broken import
fails here, it is not skipped.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

import memo.runtime as mr
from memo.distributed.layout import free_port
from memo.errors import MemoError

pytestmark = pytest.mark.megatron

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron warns on import that TransformerEngine and Apex are absent
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

from memo.adapters.megatron import get_memo_gpt_layer_local_spec  # noqa: E402
from tests.grads import RTOL, grads_of, rel_err  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _megatron_world():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    created = not torch.distributed.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        torch.distributed.destroy_process_group()
    torch.set_num_threads(threads)


def _config(n_layers: int = 5, groups: int = 2) -> TransformerConfig:
    return TransformerConfig(
        num_layers=n_layers, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
        ffn_hidden_size=64, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, params_dtype=torch.float32,
    )


def _twin(build, like: torch.nn.Module | None = None) -> torch.nn.Module:
    """Megatron modules hold process groups and cannot be deep-copied: build again, load the weights."""
    torch.manual_seed(0)
    model = build()
    if like is not None:
        model.load_state_dict(like.state_dict())
    return model


def _rope(s: int, head_dim: int) -> torch.Tensor:
    """Megatron's rotary table ``[s, 1, 1, head_dim]`` (its RotaryEmbedding module moves itself to CUDA)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def _compare(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert grads.keys() == ref.keys() and ref
    worst = max((rel_err(grads[n], ref[n]), n) for n in ref)
    assert worst[0] < RTOL, f"gradient of {worst[1]} differs: relative error {worst[0]:.3g}"


@pytest.mark.parametrize("alpha", [0.0, 0.125, 0.25, 0.5, 1.0])
def test_transformer_block_with_rope_and_gqa_matches_unwrapped(alpha: float) -> None:
    ref = _twin(lambda: TransformerBlock(_config(), spec=get_memo_gpt_layer_local_spec()))
    model = _twin(lambda: TransformerBlock(_config(), spec=get_memo_gpt_layer_local_spec()), ref)
    mr.wrap(model, alpha=alpha, debug_copy_delay_us=300)
    assert mr.runtime_of(model).n_layers == 5
    s, b = 13, 2
    for it in range(2):
        g = torch.Generator().manual_seed(it)
        x, w = torch.randn(s, b, 32, generator=g), torch.randn(s, b, 32, generator=g)
        outs, grads = [], []
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            inp = x.clone().requires_grad_()
            y = m(hidden_states=inp, attention_mask=None, rotary_pos_emb=_rope(s, 8))
            (y * w).sum().backward()  # O(1) gradients everywhere
            outs.append((y.detach(), inp.grad))
            grads.append(grads_of(m))
        assert rel_err(outs[0][0], outs[1][0]) < RTOL
        assert rel_err(outs[0][1], outs[1][1]) < RTOL
        _compare(*grads)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7])
def test_hidden_dropout_draws_the_unwrapped_masks(alpha: float) -> None:
    """megatron-core's bias-dropout-add under memo draws the unwrapped layer's masks (NOTE [Dropout
    as unwrapped]): with the same seed, a step with memo equals the step without it."""
    import dataclasses

    config = dataclasses.replace(_config(n_layers=3), hidden_dropout=0.2)
    ref = _twin(lambda: TransformerBlock(config, spec=get_memo_gpt_layer_local_spec()))
    model = _twin(lambda: TransformerBlock(config, spec=get_memo_gpt_layer_local_spec()), ref)
    mr.wrap(model, runtime=mr.MemoRuntime(alpha, recompute_chunk_tokens=3, policy=["memo"] * 3))
    s, b = 13, 2
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(s, b, 32, generator=g), torch.randn(s, b, 32, generator=g)
    losses, grads = [], []
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        loss = (m(hidden_states=x, attention_mask=None, rotary_pos_emb=_rope(s, 8)) * w).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append(grads_of(m))
    assert rel_err(losses[0], losses[1]) < RTOL
    _compare(*grads)


def test_gpt_model_matches_unwrapped_and_keeps_state_dict() -> None:
    def build() -> GPTModel:
        return GPTModel(config=_config(), transformer_layer_spec=get_memo_gpt_layer_local_spec(),
                        vocab_size=64, max_sequence_length=32, position_embedding_type="learned_absolute")

    ref = _twin(build)
    model = _twin(build, ref)
    before = model.state_dict()
    mr.wrap(model, alpha=0.3, debug_copy_delay_us=300)
    after = model.state_dict()
    assert list(before) == list(after) and all(torch.equal(before[k], after[k]) for k in before
                                               if isinstance(before[k], torch.Tensor))
    s, b = 11, 2
    ids = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    losses, grads = [], []
    for m in (model, ref):
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            loss = m(ids, pos, None, labels=ids).float().mean()
            loss.backward()
        losses.append(loss.detach())
        grads.append(grads_of(m))
    assert rel_err(losses[0], losses[1]) < RTOL
    _compare(*grads)
    mr.unwrap(model)


def test_unsupported_megatron_arguments_are_refused() -> None:
    block = TransformerBlock(_config(n_layers=4), spec=get_memo_gpt_layer_local_spec())
    mr.wrap(block, alpha=0.5)
    layer = block.layers[0]
    x = torch.randn(5, 1, 32, requires_grad=True)
    with pytest.raises(MemoError, match="context"):
        layer(x, attention_mask=None, context=torch.zeros(1))


def test_core_attention_accepts_the_defaults_and_refuses_what_it_cannot_do() -> None:
    """MemoCoreAttention takes DotProductAttention's arguments: their defaults (and megatron's own
    pg_collection, whose cp group has one rank) build it; a context-parallel size that is not its
    group's, and arguments DotProductAttention does not take, are refused, not ignored."""
    from types import SimpleNamespace

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from memo.adapters.megatron import MemoCoreAttention

    cfg = _config()
    causal = AttnMaskType.causal
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    for kwargs in ({}, {"cp_comm_type": None, "pg_collection": None}, {"pg_collection": pgs}):
        core = MemoCoreAttention(cfg, 1, causal, "self", **kwargs)
        q = torch.randn(3, 1, 4, 8)
        assert core(q, q, q, None).shape == (3, 1, 32)  # built and runs

    # cp_comm_type matters only with a context-parallel group (memo's attention all-gathers K/V)
    assert MemoCoreAttention(cfg, 1, causal, "self", cp_comm_type="p2p").cp_group is None
    two_ranks = SimpleNamespace(cp=SimpleNamespace(size=lambda: 2), tp=None)
    with pytest.raises(MemoError, match=r"context_parallel_size=1 but the context-parallel group has 2 rank"):
        MemoCoreAttention(cfg, 1, causal, "self", pg_collection=two_ranks)
    with pytest.raises(MemoError, match=r"context_parallel_size=2 but the context-parallel group has 1 rank"):
        MemoCoreAttention(SimpleNamespace(**{**vars(cfg), "context_parallel_size": 2}), 1, causal, "self")
    # with a group of two: all-gather (the default) or Ulysses all-to-all; ring attention is refused
    cp2 = SimpleNamespace(**{**vars(cfg), "context_parallel_size": 2})
    for comm, built in ((None, "all_gather"), ("all_gather", "all_gather"), ("a2a", "a2a")):
        core = MemoCoreAttention(cp2, 1, causal, "self", cp_comm_type=comm, pg_collection=two_ranks)
        assert core.cp_comm_type == built
    for comm in ("p2p", "a2a+p2p"):
        supported = rf"cp_comm_type='{re.escape(comm)}'.*\"all_gather\".*and \"a2a\".*not ring"
        with pytest.raises(MemoError, match=supported):
            MemoCoreAttention(cp2, 1, causal, "self", cp_comm_type=comm, pg_collection=two_ranks)
    # Ulysses gives each of the c ranks n/c heads: 4 heads and 2 query groups do not split over 3 ranks
    three_ranks = SimpleNamespace(cp=SimpleNamespace(size=lambda: 3), tp=None)
    with pytest.raises(MemoError, match=r"\"a2a\" with 4 attention heads.*4 query heads cannot be split "
                                        r"over 3"):
        MemoCoreAttention(SimpleNamespace(**{**vars(cfg), "context_parallel_size": 3}), 1, causal, "self",
                          cp_comm_type="a2a", pg_collection=three_ranks)
    with pytest.raises(MemoError, match=r"got argument\(s\) window_size, which .*DotProductAttention"):
        MemoCoreAttention(cfg, 1, causal, "self", window_size=(8, 0))
    core = MemoCoreAttention(cfg, 1, causal, "self")
    with pytest.raises(MemoError, match=r"forward got argument\(s\) inference_context"):
        core(q, q, q, None, inference_context=object())


class SlidingWindowAttention(torch.nn.Module):
    """A core attention memo does not know: causal within a window of WINDOW keys, plain torch ops
    (it saves its scores, probabilities and expanded heads), DotProductAttention's signature."""

    WINDOW = 4

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        self.calls += 1
        s, b, n, d = query.shape
        group = n // key.shape[2]
        k, v = (t.repeat_interleave(group, dim=2) for t in (key, value))
        scores = torch.einsum("ibnd,jbnd->bnij", query, k) / d ** 0.5
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        scores = scores.masked_fill((j > i) | (i - j >= self.WINDOW), float("-inf"))
        return torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v).reshape(s, b, n * d)


def _sliding_window_spec():
    spec = get_memo_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SlidingWindowAttention
    return spec


@pytest.mark.parametrize("alpha,chunk", [(0.0, 3), (0.5, 2), (1.0, None)])
def test_a_black_box_core_attention_is_followed_exactly(alpha: float, chunk: int | None) -> None:
    """NOTE [Black-box core attention]: a core attention that is not memo's (a sliding window, whose
    result differs from causal attention) runs as the layer's own, once per forward, with its own
    backward: loss, input and parameter gradients equal the unwrapped block's, recomputed chunks or
    not, and differ from what causal attention would give."""
    cfg = lambda: _config(n_layers=2)  # noqa: E731
    ref = _twin(lambda: TransformerBlock(cfg(), spec=_sliding_window_spec()))
    model = _twin(lambda: TransformerBlock(cfg(), spec=_sliding_window_spec()), ref)
    causal = _twin(lambda: TransformerBlock(cfg(), spec=get_memo_gpt_layer_local_spec()), ref)
    mr.wrap(model, runtime=mr.MemoRuntime(alpha, policy=["memo"] * 2, recompute_chunk_tokens=chunk))
    s, b = 11, 2
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(s, b, 32, generator=g), torch.randn(s, b, 32, generator=g)
    cores = [layer.self_attention.core_attention for layer in model.layers]
    outs, grads, calls = [], [], []
    for m in (model, ref, causal):
        inp = x.clone().requires_grad_()
        y = m(hidden_states=inp, attention_mask=None, rotary_pos_emb=_rope(s, 8))
        calls.append([c.calls for c in cores])
        (y * w).sum().backward()
        outs.append((y.detach(), inp.grad))
        grads.append(grads_of(m))
    assert rel_err(outs[0][0], outs[1][0]) < RTOL and rel_err(outs[0][1], outs[1][1]) < RTOL
    _compare(grads[0], grads[1])
    assert rel_err(outs[2][0], outs[1][0]) > 100 * RTOL  # the window matters: this is not causal attention
    # backward runs the black box's own graph: no call of it (the first forward's extra call of the
    # first layer is the runtime's dry run that sizes the host arena, NOTE [Sizing the host arena])
    assert calls[1] == [c.calls for c in cores] and calls[0][1] == 1
    assert mr.runtime_of(model).layer_bytes > 0  # through memo's token-wise path, not kept whole


def test_layer_offload_bytes_are_linear_in_offloaded_tokens() -> None:
    """alpha = 0 moves the input, the attention output and its log-sum-exp; more alpha moves
    proportionally more; alpha = 1 moves at most what autograd keeps
    (tests/profiler/test_offload_bytes.py)."""
    from tests.profiler.test_offload_bytes import ALPHAS, autograd_saved_bytes

    s, b, h, heads = 256, 1, 32, 4
    torch.manual_seed(0)
    block = TransformerBlock(_config(n_layers=4), spec=get_memo_gpt_layer_local_spec())
    rope = _rope(s, h // heads)
    x = torch.randn(s, b, h, requires_grad=True)
    truth = autograd_saved_bytes(block.layers[0], x, attention_mask=None, rotary_pos_emb=rope)
    got = {}
    for alpha in ALPHAS:
        mr.wrap(block, alpha=alpha)
        try:
            block(hidden_states=x, attention_mask=None, rotary_pos_emb=rope).sum().backward()
            got[alpha] = mr.runtime_of(block).layer_bytes
        finally:
            mr.unwrap(block)
    assert got[0.0] == 4 * (s * b * h + s * b * h + b * heads * s)  # fp32 x, o and lse
    assert got[1.0] <= truth, (got, truth)
    for alpha in ALPHAS:
        linear = got[0.0] + mr.offload_tokens(alpha, s) / s * (got[1.0] - got[0.0])
        assert abs(got[alpha] - linear) <= 0.01 * got[alpha], (alpha, got)


def test_the_profile_counts_megatron_attention_as_s_attn() -> None:
    """The layer adapter names megatron's core attention (``self_attention.core_attention``), so the
    profile counts what is made inside it, the attention output and its log-sum-exp, as S_attn
    (which memo offloads whole), not as S_others (offloaded by token share): the plan's offload
    bytes are then the runtime's."""
    from memo.pipeline import profile

    torch.manual_seed(0)
    model = GPTModel(config=_config(n_layers=2), transformer_layer_spec=get_memo_gpt_layer_local_spec(),
                     vocab_size=128, max_sequence_length=64, position_embedding_type="learned_absolute")
    s, b, h, heads = 64, 1, 32, 4
    stats = profile(model, s, b, device="cpu", solve=False).layer_stats
    o, lse = s * b * h * 4, b * heads * s * 4
    assert [st.s_attn for st in stats] == [o + lse] * 2


@pytest.mark.parametrize("chunk", [3, None])
def test_a_black_box_core_attention_under_input_only_is_recomputed_exactly(chunk: int | None) -> None:
    """NOTE [Input-only layers]: an input-only layer runs a black-box core attention once more in
    backward (with autograd, from the forward's RNG and autocast state): loss and every gradient equal
    the unwrapped block's, and its host region holds the layer input alone."""
    cfg = lambda: _config(n_layers=2)  # noqa: E731
    ref = _twin(lambda: TransformerBlock(cfg(), spec=_sliding_window_spec()))
    model = _twin(lambda: TransformerBlock(cfg(), spec=_sliding_window_spec()), ref)
    mr.wrap(model, runtime=mr.MemoRuntime(0.5, policy=["input-only", "memo"], recompute_chunk_tokens=chunk))
    s, b = 11, 2
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(s, b, 32, generator=g), torch.randn(s, b, 32, generator=g)
    cores = [layer.self_attention.core_attention for layer in model.layers]
    outs, grads = [], []
    for m in (model, ref):
        inp = x.clone().requires_grad_()
        y = m(hidden_states=inp, attention_mask=None, rotary_pos_emb=_rope(s, 8))
        before = [c.calls for c in cores]
        (y * w).sum().backward()
        outs.append((y.detach(), inp.grad))
        grads.append(grads_of(m))
        if m is model:  # backward called layer 0's core again, layer 1's (memo) not
            assert [c.calls for c in cores] == [before[0] + 1, before[1]]
    assert rel_err(outs[0][0], outs[1][0]) < RTOL and rel_err(outs[0][1], outs[1][1]) < RTOL
    _compare(grads[0], grads[1])
    assert mr.runtime_of(model).buffers.region_bytes[0] == s * b * 32 * 4


# ---------------------------------------------------------------------------------------------
# NOTE [memo runs the layer the user wrote, or refuses it] (memo/adapters/exact.py), issue 44


def test_every_transformer_config_field_is_run_or_refused() -> None:
    """NOTE [megatron-core's config fields under memo]: each field of megatron-core's TransformerConfig is
    in exactly one of memo's sets; a field memo does not know (a new megatron-core) fails here."""
    import dataclasses

    from memo.adapters.megatron_config import CORE_DEFAULT, LAYER_DEFAULT, NOT_ATTENTION, RUN

    sets = {"RUN": RUN, "CORE_DEFAULT": CORE_DEFAULT, "LAYER_DEFAULT": LAYER_DEFAULT,
            "NOT_ATTENTION": NOT_ATTENTION}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(name for name in fields if not any(name in s for s in sets.values()))
    assert not unknown, f"TransformerConfig fields memo has not classified: {unknown}"
    twice = sorted(n for n in fields if sum(n in s for s in sets.values()) > 1)
    assert not twice, twice
    stale = (RUN | CORE_DEFAULT | LAYER_DEFAULT | NOT_ATTENTION) - fields
    assert not stale, f"names megatron-core does not have: {sorted(stale)}"


REFUSED_CORE = [("softmax_type", "off-by-one", "softmax_type='off-by-one'"),
                ("softmax_type", "learnable", "softmax_type='learnable'"),
                ("window_size", (8, 0), "window_size=(8, 0)")]


@pytest.mark.parametrize(("field", "value", "named"), REFUSED_CORE)
def test_memo_core_attention_refuses_attention_it_does_not_compute(field: str, value: object,
                                                                  named: str) -> None:
    """Attention sinks and a sliding window change megatron's softmax; memo's spec used to run plain
    causal softmax for them (gradients off by ~0.4; the window ignored). Now refused by name."""
    import dataclasses

    config = dataclasses.replace(_config(n_layers=1), **{field: value})
    with pytest.raises(MemoError, match=re.escape(named)):
        TransformerBlock(config, spec=get_memo_gpt_layer_local_spec())


def test_a_layer_memo_would_not_run_as_written_is_refused() -> None:
    """A TransformerLayer subclass, a patched SelfAttention.forward, a hook on self_attention, and a
    config option of the layer's glue (apply_residual_connection_post_layernorm): each refused."""
    import dataclasses

    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    block = TransformerBlock(_config(n_layers=2), spec=get_memo_gpt_layer_local_spec())
    handle = block.layers[1].self_attention.register_forward_hook(lambda *_: None)
    with pytest.raises(MemoError, match="self_attention has a forward hook, which would never fire"):
        mr.wrap(block, alpha=0.5, policy=["memo"] * 2)
    handle.remove()

    class MyLayer(TransformerLayer):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return super().forward(*args, **kwargs)

    block.layers[0].__class__ = MyLayer
    with pytest.raises(MemoError, match="MyLayer is a subclass of TransformerLayer"):
        mr.wrap(block, alpha=0.5, policy=["memo"] * 2)
    block.layers[0].__class__ = TransformerLayer
    original = SelfAttention.forward
    try:
        SelfAttention.forward = lambda self, *a, **k: original(self, *a, **k)
        with pytest.raises(MemoError, match=r"SelfAttention.forward was replaced"):
            mr.wrap(block, alpha=0.5, policy=["memo"] * 2)
    finally:
        SelfAttention.forward = original
    glue = dataclasses.replace(_config(n_layers=1), apply_residual_connection_post_layernorm=True)
    with pytest.raises(MemoError, match="apply_residual_connection_post_layernorm=True"):
        mr.wrap(TransformerBlock(glue, spec=get_memo_gpt_layer_local_spec()), alpha=0.5)
    runtime = mr.wrap(block, alpha=0.5)  # the same layers, as megatron wrote them: accepted
    assert runtime is not None
    mr.unwrap(block)
