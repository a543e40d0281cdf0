"""Fine-tuning your own model on your own data (issue 43), end to end through ``memo train``: a Llama
checkpoint saved by ``save_pretrained`` with its tokenizer in the same directory (as users have it), a
JSONL corpus, and the command a user types. The pieces are tested on their own in test_corpus.py,
test_packing.py, test_hf_model.py and test_checkpoint.py; here they meet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memo.cli.main import main
from tests.grads import RTOL
from tests.hf_checkpoint import SENTENCES, make_checkpoint, write_jsonl


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune")
    records = [{"text": s} for s in SENTENCES]
    records += [{"prompt": "q: " + s, "completion": " a"} for s in SENTENCES[:3]]
    return {"checkpoint": make_checkpoint(root / "checkpoint"),
            "data": write_jsonl(root / "corpus.jsonl", records), "root": root}


def test_the_checkpoint_trains_on_the_corpus_from_hf_s_own_loss(files: dict[str, Path],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``memo train --hf-model DIR --data corpus.jsonl`` (the tokenizer is the checkpoint's): the first
    step's loss is what the checkpoint, loaded by transformers, gives on the same packed batch."""
    from transformers import AutoModelForCausalLM

    from memo.models import hf_shapes
    from memo.train.config import TrainConfig, token_source

    report = files["root"] / "report.json"
    args = ["train", "--hf-model", str(files["checkpoint"]), "--data", str(files["data"]), "--seq-len", "64",
            "--micro-batch", "2", "--steps", "2", "--no-progress", "--report", str(report),
            "--alpha", "0.5", "--layer-ms", "1", "--bandwidth-gbps", "10", "--host-mem-gb", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"from {files['checkpoint']}" in out, out
    losses = [s["loss"] for s in json.loads(report.read_text())["steps"]]
    hf = AutoModelForCausalLM.from_pretrained(files["checkpoint"], local_files_only=True)
    config = TrainConfig(hf_model=str(files["checkpoint"]), data=str(files["data"]), seq_len=64,
                         micro_batch=2)
    ids, labels, positions = next(iter(token_source(config, hf_shapes(hf.config))))
    assert int((positions[:, 1:] == 0).sum()) >= 2, positions  # several documents in a row
    with torch.no_grad():
        # use_cache=False: with a cache transformers does not look for packed documents in position_ids
        want = float(hf(input_ids=ids, position_ids=positions, labels=labels, shift_labels=labels,
                        use_cache=False).loss)
        crossing = float(hf(input_ids=ids, labels=labels, shift_labels=labels, use_cache=False).loss)
    assert abs(losses[0] - want) <= RTOL * want, (losses[0], want)
    assert abs(crossing - want) > 10 * RTOL * want  # attending across documents would show
    assert losses[1] < losses[0]


def test_a_resumed_fine_tune_on_packed_documents_is_the_uninterrupted_one(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The corpus's position (epoch, document, token) is in the checkpoint with the rest: 2 steps saved and
    resumed to 4 give the losses, evaluation losses and exported weights of 4 steps run at once."""
    from safetensors.torch import load_file

    root = files["root"] / "resume"
    root.mkdir()
    common = ["train", "--hf-model", str(files["checkpoint"]), "--data", str(files["data"]),
              "--seq-len", "48", "--micro-batch", "2", "--no-progress", "--strategy", "none", "--lr", "3e-3",
              "--lr-schedule", "constant", "--clip-grad", "0.5", "--eval-data", str(files["data"]),
              "--eval-every", "2", "--eval-batches", "2"]

    def run(name: str, *extra: str) -> list[tuple[float, float | None]]:
        metrics = root / f"{name}.jsonl"
        assert main([*common, "--metrics", str(metrics), "--export", str(root / name), *extra]) == 0
        capsys.readouterr()
        return [(r["loss"], r.get("eval_loss")) for r in map(json.loads, metrics.read_text().splitlines())]

    whole = run("whole", "--steps", "4")
    run("first", "--steps", "2", "--save", str(root / "ckpt"))
    resumed = run("resumed", "--steps", "4", "--save", str(root / "ckpt"), "--resume", str(root / "ckpt"))
    assert resumed == whole[2:], (resumed, whole)  # steps 3 and 4, and the evaluation after step 4
    want = load_file(root / "whole" / "model.safetensors")
    got = load_file(root / "resumed" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
