"""Packed documents without an ``[s, s]`` mask (NOTE [Packed attention in HF models] in
memo/adapters/hf_packed.py, NOTE [Attention over packed documents] in memo/models/causal_attention.py):
memo's document attention equals attention under the block-causal mask; a tiny HF Llama switched to
``memo_packed`` gives HF's own masked sdpa and eager loss and every gradient, and the documents' run
one by one, plain and under memo's wrapper; at 16K packed tokens nothing of s x s bytes is allocated."""

from __future__ import annotations

import copy

import pytest
import torch

import memo
from memo.adapters.hf_packed import PACKED_ATTENTION, document_offsets, use_packed_attention
from memo.errors import MemoError
from memo.models.causal_attention import document_attention
from tests.grads import assert_same_step, rel_err

#: One row of 4 documents: one of a single token, one crossing the wrapper's 64-token tile boundary.
LENGTHS = [1, 50, 60, 17]
TILE = 64


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _block_causal(offsets: tuple[tuple[int, ...], ...], s: int) -> torch.Tensor:
    """``[b, 1, s, s]`` boolean, True = attend: the mask transformers builds from packed positions."""
    doc = torch.zeros(len(offsets), s, dtype=torch.long)
    for r, row in enumerate(offsets):
        for j, (a, e) in enumerate(zip(row, row[1:], strict=False)):
            doc[r, a:e] = j
    return ((doc[:, :, None] == doc[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()).unsqueeze(1)


def test_document_offsets_follow_transformers_rule() -> None:
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.tensor([[5, 6, 0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_offsets(positions, 2) == ((0, 2, 5, 6, 8), (0, 8))
    assert document_offsets(positions[:1], 3) == ((0, 2, 5, 6, 8),) * 3
    assert document_offsets(torch.arange(8)[None] + 3, 2) is None
    ids = find_packed_sequence_indices(positions)  # the same documents as transformers sees them
    for r, row in enumerate(document_offsets(positions, 2)):
        assert all(len(set(ids[r, a:e].tolist())) == 1 for a, e in zip(row, row[1:], strict=False))
    with pytest.raises(MemoError, match="position_ids must be"):
        document_offsets(positions, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_document_attention_is_block_causal_attention(dtype: torch.dtype) -> None:
    """Rows with different documents, GQA (4 query heads on 2), a 1-token document: output and
    gradients equal sdpa under the block-causal mask."""
    torch.manual_seed(0)
    s, b, n, n_kv, d = 40, 2, 4, 2, 8
    offsets = ((0, 1, 17, 33, 40), (0, 20, 40))
    q = torch.randn(s, b, n, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(s, b, n_kv, d, dtype=dtype, requires_grad=True) for _ in range(2))
    o = document_attention(q, k, v, offsets, scale=0.3)

    def bnsd(t: torch.Tensor) -> torch.Tensor:
        return t.permute(1, 2, 0, 3).repeat_interleave(n // t.shape[2], dim=1)

    want = torch.nn.functional.scaled_dot_product_attention(
        bnsd(q), bnsd(k), bnsd(v), attn_mask=_block_causal(offsets, s), scale=0.3).permute(2, 0, 1, 3)
    g = torch.randn_like(o)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert rel_err(o, want) < tol
    for got, ref in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g),
                        strict=True):
        assert rel_err(got, ref) < tol
    with pytest.raises(MemoError, match="do not cut 40 tokens"):
        document_attention(q, k, v, ((0, 20, 40), (0, 41)))


# --------------------------------------------------------------------------- a tiny HF Llama


def _llama(impl: str = "sdpa", layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64, use_cache=False,
                         attn_implementation=impl)
    return LlamaForCausalLM(config).train()


def _step(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor | None,
          targets: torch.Tensor, mask: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed next-token loss over ``targets`` (-100: none) and every gradient."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask,
                   **({} if positions is None else {"position_ids": positions})).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _targets(ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each token's next token within its document, -100 at a document's end."""
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    ends = torch.tensor(lengths).cumsum(0) - 1
    targets[:, ends] = -100
    return targets


_FIXTURE = ("ids", "positions", "targets", "model", "want")


@pytest.fixture(scope="module")
def packed() -> dict[str, object]:
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (1, sum(LENGTHS)))
    positions, targets = _positions(LENGTHS), _targets(ids, LENGTHS)
    model = _llama()
    want = _step(model, ids, positions, targets)  # HF's own: sdpa under its [1, 1, s, s] mask
    return {"ids": ids, "positions": positions, "targets": targets, "model": model, "want": want}


def test_packed_llama_equals_hf_masked_sdpa_eager_and_documents_one_by_one(
        packed: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import memo.adapters.hf_packed as hf_packed

    ids, positions, targets, model, want = (packed[k] for k in _FIXTURE)
    read = []
    monkeypatch.setattr(hf_packed, "document_offsets",
                        lambda *a, _fn=hf_packed.document_offsets: read.append(1) or _fn(*a))
    mine = copy.deepcopy(model)
    use_packed_attention(mine)
    assert mine.config._attn_implementation == PACKED_ATTENTION
    masks: list[object] = []
    mine.model.layers[0].register_forward_pre_hook(
        lambda _m, _a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    assert_same_step(_step(mine, ids, positions, targets), want)
    assert masks == [None]  # transformers built no mask: the layers got the documents instead
    assert len(read) == 1  # the offsets are read once for the forward, not per layer
    # a 2-D padding mask: transformers ignores position resets then, and so does memo
    ones = torch.ones_like(ids)
    assert_same_step(_step(mine, ids, positions, targets, ones), _step(model, ids, positions, targets, ones))

    eager = _llama("eager")
    assert_same_step(_step(eager, ids, positions, targets), want)

    # the documents one by one, each its own sequence with HF's default positions
    loss, grads, start = torch.zeros(()), {n: torch.zeros_like(p) for n, p in model.named_parameters()}, 0
    for n in LENGTHS:
        part, part_grads = _step(model, ids[:, start:start + n], None, targets[:, start:start + n])
        loss, start = loss + part, start + n
        for name, g in part_grads.items():
            grads[name] += g
    assert_same_step((loss, grads), want)
    # without positions the documents see each other: the comparison can fail
    assert rel_err(_step(mine, ids, None, targets)[0], want[0]) > 1e-4


def test_packed_llama_under_memos_wrapper(packed: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """memo's wrapper runs the document attention itself (memo/adapters/hf.py) on the offsets the base
    model's hook computed once, over 64-token tiles that a document crosses, with alpha 0.5 (offload
    and recompute)."""
    import memo.adapters.hf as hf
    import memo.adapters.hf_packed as hf_packed

    ids, positions, targets, model, want = (packed[k] for k in _FIXTURE)
    calls: list[str] = []
    for module, name in ((hf, "document_attention_forward"), (hf, "document_attention_backward"),
                         (hf_packed, "document_offsets")):
        def spy(*args: object, _fn: object = getattr(module, name), _name: str = name) -> object:
            calls.append(_name)
            return _fn(*args)  # type: ignore[operator]

        monkeypatch.setattr(module, name, spy)
    mine = copy.deepcopy(model)
    use_packed_attention(mine)
    wrapped = memo.wrap(mine, alpha=0.5, policy=["memo", "recompute"], recompute_chunk_tokens=TILE)
    assert_same_step(_step(wrapped, ids, positions, targets), want)
    # one offsets reading per forward; the memo layer's attention over the documents, both ways
    assert calls.count("document_offsets") == 1, calls
    assert {"document_attention_forward", "document_attention_backward"} <= set(calls), calls


def test_packed_attention_refuses_what_it_cannot_compute() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, use_cache=False, sliding_window=8,
                           attn_implementation="sdpa")
    model = MistralForCausalLM(config)
    use_packed_attention(model)
    ids = torch.randint(0, 64, (1, 24))
    model(input_ids=ids, position_ids=_positions([8, 8, 8]))  # documents within the window
    with pytest.raises(MemoError, match="sliding_window=8 is shorter than a document"):
        model(input_ids=ids, position_ids=_positions([4, 12, 8]))
    other = _llama()
    other.config._attn_implementation = "flex_attention"
    with pytest.raises(MemoError, match="uses attention 'flex_attention'"):
        use_packed_attention(other)


# --------------------------------------------------------------------------- memory


def _allocations(fn: object) -> tuple[int, int]:
    """``(largest single allocation, peak live bytes)`` of memo's CPU allocator during ``fn()``: every
    allocation, kernels' own buffers included."""
    from memo import allocator

    with allocator.logging(device="cpu") as trace:
        fn()  # type: ignore[operator]
    live, peak, largest, sizes = 0, 0, 0, {}
    for event in trace["events"]:
        if event["op"] == "malloc":
            sizes[event["id"]] = event["size"]
            live += event["size"]
            peak, largest = max(peak, live), max(largest, event["size"])
        elif event["op"] == "free":
            live -= sizes.pop(event["id"], 0)
    return largest, peak


def test_16k_packed_tokens_allocate_linear_memory() -> None:
    """A packed step of 16,384 tokens (documents of 1 to 2,000 tokens) through memo's packed attention
    allocates nothing larger than its ``[s, vocab]`` logits (an s x s mask would be 268 MB) and at most
    about twice the peak of 8,192 tokens of the same documents: memory linear in s. HF's own path at
    2,048 tokens already allocates s x s (the check can fail)."""
    model = _llama(layers=1)
    use_packed_attention(model)
    ids = torch.randint(0, 64, (1, 16384))
    peaks = []
    for lengths in ([1] + [2000] * 4 + [191], [1] + [2000] * 8 + [383]):
        s = sum(lengths)
        row = ids[:, :s]
        largest, peak = _allocations(lambda r=row, n=lengths: _step(model, r, _positions(n), _targets(r, n)))
        assert largest <= s * 64 * 4, (s, largest)  # the float32 logits [s, 64]
        peaks.append(peak)
    assert peaks[1] < 2.1 * peaks[0], peaks

    short = [1, 1000, 1047]  # 2,048 tokens under HF's sdpa: its [1, 1, s, s] mask and scores
    row = ids[:, :sum(short)]
    largest, _ = _allocations(lambda: _step(_llama(layers=1), row, _positions(short), _targets(row, short)))
    assert largest >= sum(short) ** 2, largest
