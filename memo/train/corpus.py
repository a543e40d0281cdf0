"""Your data for ``memo train``: a JSONL corpus through a local Hugging Face tokenizer, or a pre-tokenized
megatron indexed dataset, its documents packed into rows of ``--seq-len`` tokens with their boundaries kept.

The readers are the ecosystem's: transformers' ``AutoTokenizer`` (``local_files_only``) and megatron-core's
``IndexedDataset``; memo only lays their documents out in rows (NOTE [Packed documents]).

NOTE [Packed documents]
A document is a token sequence and, for each token, the token it should predict (its label): the next
token of the same document, -100 where the data says not to learn (the prompt of a prompt/completion
record) and -100 for the document's last token, whose next token would be another document's first. The
documents of an epoch, in an order drawn from ``--seed`` and the epoch, are laid end to end and cut into
rows of ``seq_len`` tokens; ``micro_batch`` rows make a batch ``(ids, labels, position_ids)``, each
``[micro_batch, seq_len]`` int64, labels in memo's convention (already shifted: ``labels[:, t]`` is what
``ids[:, t]`` predicts). ``position_ids`` give each token its position in its own document, so a
document's first token has position 0 and a reset of the positions marks a boundary. The model attends
within the spans those resets mark, document by document with no s x s mask (NOTE [Packed attention in HF
models] in memo/adapters/hf_packed.py), so no token attends across documents. A document longer than what
is left of a row continues at the start of the next row with its positions continuing (k, k+1, ...): its
tokens keep their true positions, and the continuation attends only to its own row (rows are independent
sequences), like the first rows of a sliding window. Rotary models see only relative positions within a
row, so a continuation computes what a document starting there would, except that a position-dependent
scaling (dynamic NTK, long-rope) sees the true position. The last label of such a row is the
continuation's first token, so no target is lost between rows. A batch with no target at all (long
prompts) is skipped, as its mean loss would be 0/0; every corpus holds a target. Epochs follow each other
without end; the source's :meth:`PackedDocuments.state_dict` is its exact position (epoch, document,
token), so a restored source yields the batches the uninterrupted one would.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from memo.errors import MemoError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IndexedDocuments", "JsonlDocuments", "PackedDocuments", "data_kind", "indexed_prefix",
           "load_tokenizer"]

IGNORE = -100
_WHERE = "memo.train"


def indexed_prefix(path: str) -> str | None:
    """The megatron indexed-dataset prefix ``path`` names (``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx``,
    with both files present), else None."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    return prefix if Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file() else None


def data_kind(path: str) -> str:
    """What ``--data path`` is: ``"jsonl"`` (a ``.jsonl`` file), ``"indexed"`` (megatron's ``.bin`` +
    ``.idx``) or ``"bytes"`` (any other file: its bytes are the tokens)."""
    if path.endswith(".jsonl"):
        return "jsonl"
    if indexed_prefix(path) is not None:
        return "indexed"
    if path.endswith((".bin", ".idx")):
        raise MemoError(f"{_WHERE}: --data {path} names a megatron indexed dataset, but "
                        f"{path[:-4]}.bin and {path[:-4]}.idx are not both there; give the prefix of an "
                        "existing pair (megatron's tools/preprocess_data.py writes them)")
    return "bytes"


def load_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(directory, local_files_only=True)``, as a one-line MemoError when it
    cannot be loaded."""
    if not Path(directory).is_dir():
        raise MemoError(f"{_WHERE}: --tokenizer {directory} is not a directory; give the directory a "
                        "tokenizer was saved to (tokenizer.save_pretrained(DIR), or a model checkpoint's)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, ... with many lines
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MemoError(f"{_WHERE}: --tokenizer {directory}: transformers cannot load a tokenizer from it "
                        f"({first}); save one there with tokenizer.save_pretrained") from None


class Documents(Protocol):
    """A corpus of documents (NOTE [Packed documents])."""

    name: str

    def __len__(self) -> int: ...

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, labels)`` of document ``index``: ``[n]`` int64 each (NOTE [Packed documents])."""
        ...


def _labels(ids: torch.Tensor, counted_from: int) -> torch.Tensor:
    """The labels of a document: the next token, -100 for targets before ``counted_from`` and for the
    last token (NOTE [Packed documents])."""
    labels = torch.full_like(ids, IGNORE)
    labels[:-1] = ids[1:]
    labels[:max(counted_from - 1, 0)] = IGNORE
    return labels


class JsonlDocuments:
    """A JSONL corpus (one JSON object per line), tokenized once on load.

    A record is ``{text_field: "..."}`` (loss on every token), or ``{"prompt": "...", "completion":
    "..."}`` (loss on the completion only). Each document is the tokenizer's BOS when the tokenizer adds
    one, the tokens, and the tokenizer's EOS. Blank lines are skipped; anything else that is not such a
    record is a one-line MemoError with its line number.
    """

    def __init__(self, path: str, tokenizer_dir: str, text_field: str, vocab_size: int) -> None:
        self.name = path
        tokenizer = load_tokenizer(tokenizer_dir)
        if len(tokenizer) > vocab_size:
            raise MemoError(f"{_WHERE}: --tokenizer {tokenizer_dir} has {len(tokenizer)} tokens, more than "
                            f"the model's vocabulary of {vocab_size}; use the model's own tokenizer (or "
                            "resize the model's embeddings to it)")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise MemoError(f"{_WHERE}: --tokenizer {tokenizer_dir} has no EOS token, which ends every "
                            "document; set tokenizer.eos_token and save it again")
        bos = tokenizer.bos_token_id
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        head = [bos] if bos is not None and probe[:1] == [bos] else []
        texts, prompts = self._read(Path(path), text_field)

        def encode(strings: list[str]) -> list[list[int]]:
            return tokenizer(strings, add_special_tokens=False)["input_ids"] if strings else []

        encoded_prompts = encode([p for p in prompts if p is not None])
        encoded = encode(texts)
        pieces, starts, lengths = [], [], []
        prompt_iter = iter(encoded_prompts)
        for tokens, prompt in zip(encoded, prompts, strict=True):
            first = head + (next(prompt_iter) if prompt is not None else [])
            ids = first + tokens + [eos]
            pieces.append(torch.tensor(ids, dtype=torch.long))
            starts.append(len(first) if prompt is not None else 0)
            lengths.append(len(ids))
        if sum(n - max(start, 1) for n, start in zip(lengths, starts, strict=True)) == 0:
            raise MemoError(f"{_WHERE}: --data {path}: no record has a token to learn (every text is empty); "
                            "write records with text")
        self._tokens = torch.cat(pieces)
        self._offsets = [0]
        for n in lengths:
            self._offsets.append(self._offsets[-1] + n)
        self._counted_from = starts

    @staticmethod
    def _read(path: Path, text_field: str) -> tuple[list[str], list[str | None]]:
        """The text (or completion) of every record, and its prompt (None for a text record)."""
        if not path.is_file():
            raise MemoError(f"{_WHERE}: --data {path} does not exist or is not a file")
        texts: list[str] = []
        prompts: list[str | None] = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{_WHERE}: {path} line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise MemoError(f"{where} is not valid JSON ({err.msg}, column {err.colno}); each line "
                                    "must be one JSON object") from None
                if not isinstance(record, dict):
                    raise MemoError(f"{where} is a JSON {type(record).__name__}, not an object; each line "
                                    f"must be {{\"{text_field}\": ...}} or {{\"prompt\": ..., "
                                    "\"completion\": ...}")
                if "prompt" in record or "completion" in record:
                    fields = ("prompt", "completion")
                else:
                    fields = (text_field,)
                for name in fields:
                    if name not in record:
                        raise MemoError(f"{where} has no {name!r} field (it has {sorted(record)}); each "
                                        f"line must be {{\"{text_field}\": ...}} or {{\"prompt\": ..., "
                                        "\"completion\": ...} (--text-field names the text field)")
                    if not isinstance(record[name], str):
                        raise MemoError(f"{where}: field {name!r} is a {type(record[name]).__name__}, not a "
                                        "string")
                texts.append(record[fields[-1]])
                prompts.append(record["prompt"] if len(fields) == 2 else None)
        if not texts:
            raise MemoError(f"{_WHERE}: --data {path} holds no records; write one JSON object per line, "
                            f"{{\"{text_field}\": ...}} or {{\"prompt\": ..., \"completion\": ...}}")
        return texts, prompts

    def __len__(self) -> int:
        return len(self._counted_from)

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._tokens[self._offsets[index]:self._offsets[index + 1]]
        return ids, _labels(ids, self._counted_from[index])


class IndexedDocuments:
    """A megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) read with megatron-core's own
    ``IndexedDataset`` (memory-mapped): each of its sequences is a document, every token of it
    learned (end each one with the EOS token, as megatron's ``preprocess_data.py --append-eod`` does)."""

    def __init__(self, path: str, vocab_size: int) -> None:
        prefix = indexed_prefix(path)
        if prefix is None:
            raise MemoError(f"{_WHERE}: --data {path}: no megatron indexed dataset there (PREFIX.bin and "
                            "PREFIX.idx); give its prefix")
        with warnings.catch_warnings():  # megatron-core's import warns of optional GPU libraries
            warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
            from megatron.core.datasets.indexed_dataset import IndexedDataset

        try:
            self._data = IndexedDataset(prefix, multimodal=False, mmap=True)
        except Exception as err:  # a truncated or foreign file: numpy/struct/assertion errors
            raise MemoError(f"{_WHERE}: --data {path}: megatron-core cannot read it as an indexed dataset "
                            f"({type(err).__name__}: {str(err).strip()[:200]}); rewrite it with megatron's "
                            "tools/preprocess_data.py") from None
        self.name, self.vocab_size = prefix, vocab_size
        lengths = self._data.sequence_lengths.tolist()
        self._kept = [i for i, n in enumerate(lengths) if n > 0]
        if max(lengths, default=0) < 2:
            raise MemoError(f"{_WHERE}: --data {path} holds no token to learn: its {len(lengths)} sequences "
                            "have fewer than 2 tokens each")

    def __len__(self) -> int:
        return len(self._kept)

    def document(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sequence = self._kept[index]
        ids = torch.from_numpy(self._data[sequence].astype("int64", copy=True))
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise MemoError(f"{_WHERE}: {self.name} sequence {sequence} holds token id {bad}, outside the "
                            f"model's vocabulary [0, {self.vocab_size}); tokenize it with the model's "
                            "tokenizer")
        return ids, _labels(ids, 0)


class PackedDocuments:
    """Endless batches ``(ids, labels, position_ids)`` of ``documents`` packed into rows (NOTE [Packed
    documents]): each ``[micro_batch, seq_len]`` int64. The order of an epoch's documents is drawn from
    ``seed`` and the epoch number; :meth:`state_dict` / :meth:`load_state_dict` save and restore the
    exact position."""

    def __init__(self, documents: Documents, seq_len: int, micro_batch: int, seed: int) -> None:
        self.documents, self.seq_len, self.micro_batch, self.seed = documents, seq_len, micro_batch, seed
        self.epoch, self.cursor, self.offset = 0, 0, 0
        self._order: tuple[int, torch.Tensor] | None = None
        self._current: tuple[int, int, torch.Tensor, torch.Tensor] | None = None

    def _document(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids and labels of the document at the cursor (the last one read is kept)."""
        if self._order is None or self._order[0] != self.epoch:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**63)
            self._order = (self.epoch, torch.randperm(len(self.documents), generator=generator))
        if self._current is None or self._current[:2] != (self.epoch, self.cursor):
            ids, labels = self.documents.document(int(self._order[1][self.cursor]))
            self._current = (self.epoch, self.cursor, ids, labels)
        return self._current[2], self._current[3]

    def _row(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, labels, positions = [], [], []
        need = self.seq_len
        while need:
            doc_ids, doc_labels = self._document()
            take = min(need, doc_ids.numel() - self.offset)
            ids.append(doc_ids[self.offset:self.offset + take])
            labels.append(doc_labels[self.offset:self.offset + take])
            positions.append(torch.arange(self.offset, self.offset + take))
            self.offset += take
            need -= take
            if self.offset == doc_ids.numel():
                self.offset, self.cursor = 0, self.cursor + 1
                if self.cursor == len(self.documents):
                    self.epoch, self.cursor = self.epoch + 1, 0
        if self.offset > 0:  # the row's last token predicts the continuation's first (NOTE [Packed
            # documents])
            labels[-1] = labels[-1].clone()
            labels[-1][-1] = self._document()[0][self.offset]
        return torch.cat(ids), torch.cat(labels), torch.cat(positions)

    def __iter__(self) -> PackedDocuments:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        while True:  # a batch with no target (all prompt) is skipped: its mean loss would be 0/0
            rows = [self._row() for _ in range(self.micro_batch)]
            if any(bool((row[1] != IGNORE).any()) for row in rows):
                return tuple(torch.stack(column) for column in zip(*rows, strict=True))  # type: ignore[return-value]

    def _identity(self) -> dict[str, int | str]:
        return {"kind": "packed", "documents": len(self.documents), "seq_len": self.seq_len,
                "micro_batch": self.micro_batch, "seed": self.seed}

    def state_dict(self) -> dict[str, int | str]:
        """The position of the next batch (plain ints), with what it is a position in."""
        return {**self._identity(), "epoch": self.epoch, "cursor": self.cursor, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Continue from ``state`` (:meth:`state_dict` of a source over the same documents, row shape and
        seed; a MemoError naming what differs otherwise)."""
        mine = self._identity()
        differ = [f"{k} {state.get(k)!r} (this run: {v!r})" for k, v in mine.items() if state.get(k) != v]
        if differ:
            raise MemoError(f"{_WHERE}: the saved data position is for other data: " + ", ".join(differ)
                            + "; resume with the data, --seq-len, --micro-batch and --seed it was saved with")
        epoch, cursor, offset = (int(state[k]) for k in ("epoch", "cursor", "offset"))
        if not 0 <= cursor < len(self.documents) or epoch < 0 or offset < 0:
            raise MemoError(f"{_WHERE}: the saved data position (epoch {epoch}, document {cursor}, token "
                            f"{offset}) is outside {self.documents.name}")
        self.epoch, self.cursor, self.offset = epoch, cursor, offset
        if offset >= self._document()[0].numel():
            raise MemoError(f"{_WHERE}: the saved data position (token {offset} of document {cursor}) is "
                            f"past that document's end in {self.documents.name}; the data has changed since")
