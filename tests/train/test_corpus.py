"""Your data for ``memo train`` (issue 43): a JSONL corpus through a local tokenizer (text records and
prompt/completion pairs), megatron's indexed dataset through megatron-core's own reader, packing into
rows with the document boundaries kept (NOTE [Packed documents] in memo/train/corpus.py), the exact
position as a state dict, and a one-line MemoError for every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memo.errors import MemoError
from memo.models import ModelConfig
from memo.train.config import TrainConfig, token_source
from memo.train.corpus import IndexedDocuments, JsonlDocuments, PackedDocuments
from tests.hf_checkpoint import SENTENCES, make_tokenizer, write_jsonl

VOCAB = 260  # the test tokenizer's 256 byte-level tokens and 4 special ones
EOS = 2


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: str):  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def _shapes(vocab: int = VOCAB) -> ModelConfig:
    return ModelConfig(name="t", arch="llama", n_layers=1, hidden=8, n_heads=1, vocab_size=vocab)


def test_jsonl_text_and_prompt_completion(tmp_path: Path, tokenizer_dir: str, tokenizer) -> None:  # noqa: ANN001
    """A text record is its tokens and EOS, every target learned; a prompt/completion pair learns the
    completion and EOS only (the prompt's targets are -100); the last token of each has label -100."""
    records = [{"text": SENTENCES[0]}, {"prompt": "question: " + SENTENCES[1], "completion": " yes"},
               {"body": SENTENCES[2]}]
    path = write_jsonl(tmp_path / "c.jsonl", records[:2])
    docs = JsonlDocuments(str(path), tokenizer_dir, "text", VOCAB)
    assert len(docs) == 2
    text = tokenizer(SENTENCES[0], add_special_tokens=False)["input_ids"]
    ids, labels = docs.document(0)
    assert ids.tolist() == text + [EOS]
    assert labels.tolist() == text[1:] + [EOS, -100]
    prompt = tokenizer("question: " + SENTENCES[1], add_special_tokens=False)["input_ids"]
    completion = tokenizer(" yes", add_special_tokens=False)["input_ids"]
    ids, labels = docs.document(1)
    assert ids.tolist() == prompt + completion + [EOS]
    want = [-100] * (len(prompt) - 1) + completion + [EOS, -100]
    assert labels.tolist() == want
    # --text-field names the text field
    other = write_jsonl(tmp_path / "b.jsonl", records[2:])
    assert JsonlDocuments(str(other), tokenizer_dir, "body", VOCAB).document(0)[0].tolist() == \
        tokenizer(SENTENCES[2], add_special_tokens=False)["input_ids"] + [EOS]


class _Docs:
    def __init__(self, lengths: list[int]) -> None:
        self.name = "docs"
        start = 10
        self.ids = []
        for n in lengths:  # distinct tokens, so the layout can be read back
            self.ids.append(torch.arange(start, start + n))
            start += n

    def __len__(self) -> int:
        return len(self.ids)

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.ids[index]
        return ids, torch.cat([ids[1:], torch.tensor([-100])])


def test_packing_keeps_document_boundaries() -> None:
    """Rows hold the documents end to end in the epoch's order: positions restart at each document, a
    document's last token has label -100, a document cut by a row continues in the next with its positions
    continuing and the row's last label its next token; epochs follow each other in new orders."""
    docs = _Docs([5, 9, 3, 12, 7])  # 36 tokens
    source = PackedDocuments(docs, seq_len=8, micro_batch=2, seed=0)
    rows = [next(source) for _ in range(9)]  # 144 tokens: four epochs
    ids, labels, positions = (torch.cat([r[k] for r in rows]).reshape(-1) for k in range(3))
    for epoch in range(4):
        got = ids[36 * epoch:36 * (epoch + 1)]
        order = sorted(range(5), key=lambda i: int((got == docs.ids[i][0]).nonzero()[0]))
        assert torch.equal(got, torch.cat([docs.ids[i] for i in order]))
        want_positions = torch.cat([torch.arange(docs.ids[i].numel()) for i in order])
        assert torch.equal(positions[36 * epoch:36 * (epoch + 1)], want_positions)
        if epoch == 0:
            first_order = order
        elif epoch == 1:
            assert order != first_order  # a new order each epoch (seed 0 draws one)
    ends = torch.cat([positions[1:] == 0, torch.tensor([positions[0] == 0])])  # token before a start
    assert (labels[ends] == -100).all()
    inside = ~ends
    assert torch.equal(labels[inside], ids.roll(-1)[inside])  # every other label is the next token
    assert (positions.reshape(-1, 8)[:, 0] != 0).any()  # some row starts inside a document


def test_a_batch_without_targets_is_skipped() -> None:
    """A batch whose labels are all -100 (a long prompt) would have the mean loss 0/0: it is skipped."""
    class Prompts(_Docs):
        def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            ids, labels = super().document(index)
            return ids, (torch.full_like(ids, -100) if index == 0 else labels)

    source = PackedDocuments(Prompts([12, 3]), seq_len=4, micro_batch=1, seed=0)
    batches = [next(source) for _ in range(6)]
    assert all((labels != -100).any() for _, labels, _ in batches)
    plain = PackedDocuments(_Docs([12, 3]), seq_len=4, micro_batch=1, seed=0)
    for _ in range(6):
        next(plain)
    assert source.state_dict() != plain.state_dict()  # rows of the prompt alone were left out


def test_state_dict_restores_the_exact_position() -> None:
    """A source restored from another's state dict (JSON round trip) yields the batches the first one
    goes on to yield, across epoch boundaries; the same seed gives the same batches, another another."""
    docs = _Docs([5, 9, 3, 12, 7, 1, 20])
    source = PackedDocuments(docs, seq_len=6, micro_batch=3, seed=7)
    for _ in range(4):
        next(source)
    state = json.loads(json.dumps(source.state_dict()))
    assert all(isinstance(v, (int, str)) for v in state.values())
    want = [next(source) for _ in range(6)]
    resumed = PackedDocuments(docs, seq_len=6, micro_batch=3, seed=7)
    resumed.load_state_dict(state)
    for w, g in zip(want, (next(resumed) for _ in range(6)), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))
    fresh, again = PackedDocuments(docs, 6, 3, seed=7), PackedDocuments(docs, 6, 3, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(next(fresh), next(again), strict=True))
    other = PackedDocuments(docs, 6, 3, seed=8)
    assert not torch.equal(next(other)[0], next(PackedDocuments(docs, 6, 3, seed=7))[0])
    with pytest.raises(MemoError, match="seq_len 6 .this run: 5."):
        PackedDocuments(docs, 5, 3, seed=7).load_state_dict(state)


def test_indexed_dataset_through_megatron_s_reader(tmp_path: Path) -> None:
    """``--data PREFIX`` (or PREFIX.bin / PREFIX.idx) of a dataset megatron-core's IndexedDatasetBuilder
    wrote: each sequence is a document, every target learned; a token outside the vocabulary is refused."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    sequences = [torch.tensor([5, 6, 7, EOS]), torch.tensor([8, 9, EOS]), torch.tensor([11, 12, 13, 14, EOS])]
    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for seq in sequences:
        builder.add_item(seq)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    for given in (prefix, prefix + ".bin", prefix + ".idx"):
        config = TrainConfig(hf_config='{"model_type": "llama"}', data=given, seq_len=4, micro_batch=3)
        source = token_source(config, _shapes())
        assert isinstance(source, PackedDocuments)
        ids, labels, positions = next(source)
        assert ids.shape == labels.shape == positions.shape == (3, 4)
    docs = IndexedDocuments(prefix, VOCAB)
    assert [docs.document(i)[0].tolist() for i in range(3)] == [s.tolist() for s in sequences]
    assert docs.document(1)[1].tolist() == [9, EOS, -100]
    with pytest.raises(MemoError, match="token id 14, outside the model's vocabulary") as err:
        IndexedDocuments(prefix, 14).document(2)
    assert "\n" not in str(err.value)
    builder = IndexedDatasetBuilder(prefix + "1.bin", dtype=numpy.int32)
    builder.add_item(torch.tensor([EOS]))
    builder.end_document()
    builder.finalize(prefix + "1.idx")
    with pytest.raises(MemoError, match="holds no token to learn"):
        IndexedDocuments(prefix + "1", VOCAB)


BAD_LINES = [
    ('{"text": "a"}\n{"text": oops}\n', "line 2 is not valid JSON"),
    ('["a list"]\n', "line 1 is a JSON list, not an object"),
    ('{"text": "a"}\n\n{"title": "b"}\n', "line 3 has no 'text' field"),
    ('{"prompt": "a"}\n', "line 1 has no 'completion' field"),
    ('{"text": 3}\n', "line 1: field 'text' is a int, not a string"),
    ("\n\n", "holds no records"),
    ('{"text": ""}\n', "no record has a token to learn"),
]


@pytest.mark.parametrize("content,match", BAD_LINES)
def test_a_bad_corpus_is_one_line_with_its_line_number(tmp_path: Path, tokenizer_dir: str, content: str,
                                                       match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(MemoError, match=match) as err:
        JsonlDocuments(str(path), tokenizer_dir, "text", VOCAB)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_bad_flags_are_one_line(tmp_path: Path, tokenizer_dir: str) -> None:
    """A tokenizer larger than the model's vocabulary, no tokenizer for a JSONL corpus, a tokenizer for
    other data, a missing tokenizer directory, half an indexed dataset."""
    corpus = str(write_jsonl(tmp_path / "c.jsonl"))
    hf = '{"model_type": "llama"}'
    cases = [
        (lambda: JsonlDocuments(corpus, tokenizer_dir, "text", 100), "has 260 tokens, more than the model's"),
        (lambda: TrainConfig(hf_config=hf, data=corpus), "add --tokenizer DIR"),
        (lambda: TrainConfig(hf_config=hf, tokenizer=tokenizer_dir), "no --data is given"),
        (lambda: JsonlDocuments(corpus, str(tmp_path / "none"), "text", VOCAB), "is not a directory"),
        (lambda: JsonlDocuments(corpus, str(tmp_path), "text", VOCAB), "cannot load a tokenizer"),
    ]
    (tmp_path / "half.bin").write_bytes(b"")
    cases.append((lambda: TrainConfig(hf_config=hf, data=str(tmp_path / "half.bin")), "are not both there"))
    for make, match in cases:
        with pytest.raises(MemoError, match=match) as err:
            make()
        assert "\n" not in str(err.value), str(err.value)
