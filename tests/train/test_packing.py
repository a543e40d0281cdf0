"""Packed documents through the model (issue 43, "your data"): ``memo train --hf-config ... --tokenizer DIR
--data corpus.jsonl`` trains and its first step's loss is Hugging Face's own on the same packed batch;
a packed batch's loss and every gradient equal its documents' run one by one (no token attends across a
boundary), for the plain HF model and under memo's wrapper; under FSDP2 (DP 2) and FSDP2 x Ulysses (CP
2) the packed step is one process's, and memo's wrapper under Ulysses refuses packed documents on every
rank alike (one launch of two ranks, tests/dist_harness.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from memo.errors import MemoError
from tests import dist_harness
from tests.grads import RTOL, rel_err
from tests.hf_checkpoint import SENTENCES, make_tokenizer, write_jsonl

MODULE = "tests.train.test_packing"
#: A tiny Hugging Face Llama (4 query, 2 key/value heads: two Ulysses ranks can share them) of the
#: test tokenizer's 260 tokens.
HF_LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 260, "use_cache": False,
            "tie_word_embeddings": False, "attn_implementation": "sdpa"}
SEQ = 48


def _hf_model(seed: int = 0) -> torch.nn.Module:
    from memo.engines import build_hf_causal_lm, hf_config

    torch.manual_seed(seed)
    return build_hf_causal_lm(hf_config(json.dumps(HF_LLAMA)), "cpu", torch.float32).train()


class _Docs:
    """Documents of given lengths, random tokens (the last one EOS = 2), every target learned."""

    def __init__(self, lengths: list[int], seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.name = "test documents"
        self.ids = [torch.cat([torch.randint(4, 256, (n - 1,), generator=generator), torch.tensor([2])])
                    for n in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.ids[index]
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        return ids, labels


def _step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
          positions: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from memo.adapters.model import adapter_loss, model_adapter_for

    model.zero_grad(set_to_none=True)
    loss = adapter_loss(model_adapter_for(model, "test"), model, ids, labels, positions)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _one_by_one(model: torch.nn.Module, docs: _Docs, order: list[int]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each document alone (its own sequence, HF's default positions), the losses weighted by their
    counted tokens: the mean over every counted token of the batch."""
    from memo.adapters.model import model_adapter_for

    adapter = model_adapter_for(model, "test")
    model.zero_grad(set_to_none=True)
    total = sum(int((docs.document(i)[1] != -100).sum()) for i in order)
    loss = torch.zeros(())
    for i in order:
        ids, labels = docs.document(i)
        part = adapter.loss(model, ids[None], labels[None]) * int((labels != -100).sum()) / total
        part.backward()
        loss = loss + part.detach()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got: tuple[torch.Tensor, dict[str, torch.Tensor]],
                 want: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    assert rel_err(got[0], want[0]) < RTOL, (float(got[0]), float(want[0]))
    worst = max((rel_err(got[1][n], g), n) for n, g in want[1].items())
    assert worst[0] < RTOL, f"gradient of {worst[1]} differs: relative error {worst[0]:.3g}"


def test_packed_documents_do_not_attend_across_boundaries() -> None:
    """Three documents packed into one row of 48 (with positions restarting) give the loss and every
    gradient of the three run one by one, for HF's model and under memo's wrapper (masked attention)."""
    import memo
    from memo.train.corpus import PackedDocuments

    docs = _Docs([17, 20, 11])  # 48 tokens: one row holds them whole
    source = PackedDocuments(docs, SEQ, 1, seed=3)
    order = [int(i) for i in torch.randperm(3, generator=torch.Generator().manual_seed(3 * 1_000_003))]
    ids, labels, positions = next(source)
    assert (positions == 0).sum() == 3 and labels[0, -1] == -100
    model = _hf_model()
    want = _one_by_one(model, docs, order)
    _assert_same(_step(model, ids, labels, positions), want)
    # without the positions the documents would see each other: the check can fail
    assert rel_err(_step(model, ids, labels, None)[0], want[0]) > 1e-4
    wrapped = memo.wrap(copy.deepcopy(model), alpha=0.5, policy=["memo"] * HF_LLAMA["num_hidden_layers"])
    _assert_same(_step(wrapped, ids, labels, positions), want)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("packing")
    tokenizer = make_tokenizer(root / "tokenizer")
    records = [{"text": s} for s in SENTENCES] + [{"prompt": "question: " + s, "completion": " answer"}
                                                  for s in SENTENCES[:2]]
    data = write_jsonl(root / "corpus.jsonl", records)
    (root / "llama.json").write_text(json.dumps(HF_LLAMA))
    return {"tokenizer": str(tokenizer), "data": str(data), "hf_config": str(root / "llama.json")}


@pytest.mark.parametrize("strategy", ["none", "memo"])
def test_memo_train_first_step_is_hf_s_own_loss(corpus: dict[str, str], strategy: str) -> None:
    """``memo train --hf-config C --tokenizer DIR --data corpus.jsonl`` (the Python API, the same config):
    its first step's loss is what HF's own forward (``position_ids`` and ``-100`` labels, its own
    causal-LM loss) gives on the same packed batch, with the same initial weights; memo's strategy
    (profile, plan, wrapped layers) too."""
    from memo.engines import hf_config
    from memo.models import hf_shapes
    from memo.train.config import TrainConfig, token_source
    from memo.train.loop import train
    from memo.train.strategies import StrategyOptions, make_strategy

    config = TrainConfig(hf_config=corpus["hf_config"], tokenizer=corpus["tokenizer"], data=corpus["data"],
                         seq_len=64, micro_batch=2, steps=2)
    machine = {"alpha": 0.5, "layer_ms": 1.0, "bandwidth_gbps": 10.0, "host_mem_gb": 64.0, "time_limit": 1.0}
    options = StrategyOptions(strategy=strategy, **(machine if strategy == "memo" else {}))
    result = train(config, progress=False, log=lambda _line: None, strategy=make_strategy(options))
    ids, labels, positions = next(iter(token_source(config, hf_shapes(hf_config(corpus["hf_config"])))))
    assert int((positions[:, 1:] == 0).sum()) >= 2, positions  # documents start inside the rows
    hf = _hf_model(config.seed)
    with torch.no_grad():
        # HF shifts its labels itself: shift_labels are the targets already shifted, as memo's are (a
        # row's last target is the next row's first token when a document continues there)
        want = hf(input_ids=ids, position_ids=positions, labels=labels, shift_labels=labels).loss
        # and the plain call, labels=ids-shaped HF labels, where a row's last token has no target
        hf_labels = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)
        plain = hf(input_ids=ids, position_ids=positions, labels=hf_labels).loss
        from memo.adapters.model import model_adapter_for

        ends = labels.clone()
        ends[:, -1] = -100
        mine = model_adapter_for(hf, "test").loss(hf, ids, ends, positions)
    assert abs(result.steps[0].loss - float(want)) <= RTOL * float(want), (result.steps[0].loss, float(want))
    assert rel_err(mine, plain) < RTOL, (float(mine), float(plain))
    assert result.steps[1].loss < result.steps[0].loss


# ----------------------------------------------------------------------------- FSDP2 (rank side)


def _fsdp2_case(rank: int, world: int, cp: int, wrapped: bool) -> str:
    """One packed step under FSDP2 (``cp`` 1: DP over both ranks; 2: Ulysses) against one process's."""
    import memo
    from memo.distributed.fsdp2 import FSDP2Run
    from memo.distributed.layout import LaunchEnv, ParallelLayout
    from memo.train.corpus import PackedDocuments
    from memo.train.parallel import ParallelLoss, Sharded

    ref = _hf_model()
    model = copy.deepcopy(ref)
    # two rows of 64: documents start inside both, one continues from the first row into the second
    packed = PackedDocuments(_Docs([30, 41, 9, 24, 30]), 64, 2, seed=1)
    ids, labels, positions = next(PackedDocuments(_Docs([30, 41, 9, 24, 30]), 64, 2, seed=1))
    want = _step(ref, ids, labels, positions)
    layout = ParallelLayout(context_parallel=cp, data_parallel=world // cp, cp_comm="a2a")
    launch = LaunchEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, launched=True)
    run = FSDP2Run.start(layout, launch, "cpu", seed=0)
    run.wrap(model)
    if wrapped:
        memo.wrap(model, alpha=0.5, policy=["memo"] * HF_LLAMA["num_hidden_layers"])
    sharded = Sharded(packed, run)
    mine = next(sharded)
    assert len(mine) == 4
    try:
        to_backward, loss = ParallelLoss(run, mine[2], sharded.count, mine[3]).loss(model, mine[0], mine[1])
    except MemoError as err:
        run.root.reset_iter_state()
        run.root = None
        return f"refused: {err}"
    to_backward.backward()
    assert rel_err(loss, want[0]) <= RTOL, (float(loss), float(want[0]))
    worst = max((rel_err(p.grad.full_tensor(), want[1][n]), n) for n, p in model.named_parameters())
    assert worst[0] <= RTOL, f"gradient of {worst[1]} differs: relative error {worst[0]:.3g}"
    run.root = None
    return f"loss {float(loss):.6f}, worst gradient error {worst[0]:.2g} ({worst[1]})"


CASES = [(1, False), (1, True), (2, False), (2, True)]


def fsdp2_worker(rank: int, world: int, spec: dict[str, Any], record: dist_harness.Record) -> None:
    import time

    torch.set_num_threads(1)
    for cp, wrapped in CASES:
        name = f"cp{cp}-{'memo' if wrapped else 'plain'}"
        start = time.perf_counter()
        try:
            detail = _fsdp2_case(rank, world, cp, wrapped)
            record(name, True, f"{detail} ({time.perf_counter() - start:.1f} s)")
        except AssertionError as err:
            record(name, False, str(err))


def test_packed_documents_under_fsdp2_and_ulysses() -> None:
    """FSDP2 over two data-parallel ranks (plain and memo-wrapped) and FSDP2 x Ulysses CP 2 (plain) give
    one process's packed loss and gradients; memo's wrapper under Ulysses refuses packed documents with
    one line on both ranks (NOTE [Packed documents under Ulysses] in memo/adapters/hf_ulysses.py)."""
    results = dist_harness.launch(f"{MODULE}:fsdp2_worker", 2, {}, timeout_s=240)
    for rank, records in enumerate(results):
        got = {r["name"]: r for r in records}
        assert len(got) == len(CASES), records
        for name, r in got.items():
            assert r["ok"], f"rank {rank} {name}: {r['detail']}"
            refused = r["detail"].startswith("refused")
            assert refused == (name == "cp2-memo"), f"rank {rank} {name}: {r['detail']}"
        assert "packed documents under Ulysses" in got["cp2-memo"]["detail"], got["cp2-memo"]
        assert "\n" not in got["cp2-memo"]["detail"]


def test_packed_data_is_refused_where_documents_would_mix(corpus: dict[str, str]) -> None:
    """memo's reference models, megatron and the pipelined loop get no packed data; memo's model adapter
    refuses positions."""
    from memo.adapters.model import adapter_loss, model_adapter_for
    from memo.models import build_model
    from memo.train.config import TrainConfig

    data = {"tokenizer": corpus["tokenizer"], "data": corpus["data"]}
    hf = {"hf_config": corpus["hf_config"]}
    for kwargs, match in [({}, "no document masking"), ({**hf, "micro_batches": 2}, "pipelined loop"),
                          ({"engine": "megatron"}, "--engine megatron")]:
        with pytest.raises(MemoError, match=match) as err:
            TrainConfig(**data, **kwargs)
        assert "\n" not in str(err.value)
    tiny = build_model("tiny", device="meta")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(MemoError, match="does not mask attention at document boundaries"):
        adapter_loss(model_adapter_for(tiny, "test"), tiny, ids, ids, ids)


def test_data_help_names_the_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    from memo.cli.main import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--tokenizer DIR" in text and "--text-field NAME" in text and "PREFIX.bin" in text
