"""Reliability, round four (issue 44): the profile, the command line's files and ``memo show``.

Each test reproduces one defect at its cause: the profile's gradients (1), the default recorder of a
plan made from Python, ``--hf-config`` files and values (8, 9), ``--save-plan`` patterns (10), outputs
that are inputs (11) and ``memo show`` of a plan without its summary fields (round three).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch

import memo
from memo.cli.main import main
from memo.errors import MemoError
from memo.models import build_model

_MACHINE = ["--bandwidth-gbps", "10", "--layer-ms", "1", "--host-mem-gb", "8", "--no-progress"]


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a MemoError leaves on stderr (NOTE in memo/cli/main.py), without its prefix."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0].removeprefix("error: ")


# ------------------------------------------------------------------ 1. profile keeps the gradients
#: The model, its batch, its gradients before the profile and their values, and the profile's result.
Profiled = tuple[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor | None], dict[str, torch.Tensor],
                 Any]


@pytest.fixture(scope="module")
def profiled() -> Profiled:
    """llama-tiny (the issue's ~1,150 fallback requests a step) profiled from Python as the README does,
    half of its parameters holding accumulated gradients and half none."""
    from memo.pipeline import profile

    torch.manual_seed(0)
    model = build_model("llama-tiny")
    ids = torch.randint(0, model.config.vocab_size, (1, 256))
    model(ids, ids).backward()
    model(ids, ids).backward()  # accumulated: two micro-batches
    for i, p in enumerate(model.parameters()):
        if i % 2:
            p.grad = None
    given = {n: p.grad for n, p in model.named_parameters()}
    values = {n: g.clone() for n, g in given.items() if g is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = profile(model, batch=(ids, ids), bandwidth_gbps=10, layer_ms=5, host_mem_gb=8, time_limit=2,
                         alpha=0.25, policy=["memo"] * len(model.layers))
    return model, ids, given, values, result


def test_profile_leaves_the_gradients_as_it_found_them(profiled: Profiled) -> None:
    """NOTE [The profile keeps the user's gradients]: the very tensors, their values, and None where
    there were none (a profile left its own gradients there, which the next step added to)."""
    model, _ids, given, values, _result = profiled
    for name, p in model.named_parameters():
        if given[name] is None:
            assert p.grad is None, name
        else:
            assert p.grad is given[name], name
            assert torch.equal(p.grad, values[name]), name


def test_a_plan_made_from_python_is_replayed_on_cpu(profiled: Profiled) -> None:
    """NOTE [The default recorder]: profile(model, batch) on CPU plans from the allocator's requests,
    so a Session serves every request of a step's phases from the plan (from the dispatch recorder's
    plan, llama-tiny at 512 tokens: 38 of 1,163; here 279 of 691)."""
    from memo import allocator

    model, ids, _given, _values, result = profiled
    assert result.trace["meta"]["recorder"] == "allocator"
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memo.Session(model, result.plan, example=(ids, ids)) as session:
            session.step(ids, ids)  # the warm-up a recorded plan had
            for p in model.parameters():  # zero_grad(set_to_none=True): the plan's gradients are new
                p.grad = None
            before = dict(allocator.stats(cpu))
            session.step(ids, ids)
            after = allocator.stats(cpu)
    step = {k: after[k] - before[k] for k in ("requests", "planned_hits", "deviations", "unplanned_requests")}
    assert step["deviations"] == 0, step
    assert step["planned_hits"] == step["requests"] - step["unplanned_requests"] > 600, step


# ------------------------------------------------------------------ 8, 9. --hf-config
_LLAMA = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}


def _hf_train(config: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["train", "--hf-config", config, "--seq-len", "64", "--steps", "1", *_MACHINE]) == 2
    return _one_error_line(capsys)


def test_an_unreadable_hf_config_file_is_one_line(tmp_path, capsys) -> None:
    truncated = tmp_path / "truncated.json"
    truncated.write_text(json.dumps(_LLAMA)[:40])
    assert "is not valid JSON" in _hf_train(str(truncated), capsys)
    latin = tmp_path / "latin1.json"
    latin.write_bytes(json.dumps({**_LLAMA, "name": "Ü"}, ensure_ascii=False).encode("latin-1"))
    assert "is not UTF-8 text" in _hf_train(str(latin), capsys)
    folder = tmp_path / "folder"
    folder.mkdir()
    assert "without a config.json" in _hf_train(str(folder), capsys)


@pytest.mark.parametrize(("change", "said"), [
    ({"num_attention_heads": 5}, "hidden size (64) is not a multiple of the number of attention heads (5)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads (3) must divide num_attention_heads (4)"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer, got 0"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    ({"head_dim": "16"}, "head_dim must be a positive integer, got '16'"),
    ({"rope_scaling": {"rope_type": "bogus", "factor": 2.0}}, "rope_type 'bogus' is not one transformers"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}},
     "factor field must be a float or int >= 1, got 0.5"),
    ({"hidden_act": "swishy"}, "cannot build a llama model from this config (KeyError: 'swishy'): "
                               "hidden_act = 'swishy'"),
])
def test_hf_config_values_transformers_refuses_are_named(change: dict, said: str, capsys) -> None:
    """NOTE [An HF config memo can run]: each was a traceback (or, for the key/value heads, the MLP and
    the vocabulary, a failure at the first forward or a model of zero width); the last fails in the
    model's constructor, after the config was made."""
    message = _hf_train(json.dumps({**_LLAMA, **change}), capsys)
    assert message.startswith("memo.train: --hf-config: ") and said in message, message


# ------------------------------------------------------------------ 10. --save-plan patterns
@pytest.mark.parametrize("pattern", ["x/{stage.__class__}", "x/{stage[0]}", "x/{0}", "x/{}", "x/{name}",
                                     "x/{stage!r}", "x/{stage:>999999999}", "x/{stage"])
def test_a_stage_plan_pattern_fills_stage_and_rank_only(pattern: str, tmp_path, capsys, monkeypatch) -> None:
    """NOTE [Stage-plan patterns]: refused before anything runs, by the command and where the stages'
    plans are written from Python."""
    from memo.pipeline.stage_plan import _fill
    from memo.train import loop

    os.chdir(tmp_path)
    monkeypatch.setattr(loop, "train", lambda *_a, **_k: pytest.fail("memo train ran before refusing"))
    assert main(["train", "--save-plan", pattern, "--engine", "megatron", "--micro-batches", "2", "--steps",
                 "1", *_MACHINE]) == 2
    message = _one_error_line(capsys)
    assert "only {stage} and {rank} are filled in" in message and repr(pattern) in message, message
    assert os.listdir(tmp_path) == []
    with pytest.raises(MemoError, match="only {stage} and {rank} are filled in"):
        _fill(pattern, 1, 0)
    assert _fill("plans/stage{stage}-rank{rank:02d}.json", 1, 3) == "plans/stage1-rank03.json"


def test_stages_cannot_share_a_plan_file(capsys) -> None:
    assert main(["train", "--save-plan", "plan.json", "--engine", "megatron", "--pp", "2", *_MACHINE]) == 2
    assert "has no {stage}: the 2 pipeline stages would share one file" in _one_error_line(capsys)


# ------------------------------------------------------------------ 11. outputs are not inputs
@pytest.mark.parametrize(("argv", "flags"), [
    (["plan", "t.json", "-o", "t.json"], ("-o 't.json'", "TRACE 't.json'")),
    (["plan", "t.json", "-o", "sub/../t.json"], ("-o 'sub/../t.json'", "TRACE 't.json'")),
    (["plan", "link.json", "-o", "t.json"], ("-o 't.json'", "TRACE 'link.json'")),
    (["plan", "t.json", "-o", "hard.json"], ("-o 'hard.json'", "TRACE 't.json'")),
    (["plot", "t.json", "-o", "t.json.png"], None),
    (["train", "--plan", "t.json", "--report", "t.json", "--steps", "1", *_MACHINE],
     ("--report 't.json'", "--plan 't.json'")),
    (["train", "--plan", "s{stage}.json", "--save-plan", "s{stage}.json", "--engine", "megatron", "--pp", "2",
      *_MACHINE], ("--save-plan 's0.json'", "--plan 's0.json'")),
    (["train", "--hf-config", "t.json", "--report", "t.json", *_MACHINE], ("--report 't.json'",
                                                                           "--hf-config 't.json'")),
    (["train", "--report", "r.png", "--plot", "r.png", *_MACHINE], ("--report 'r.png'", "--plot 'r.png'")),
    (["profile", "--model", "tiny", "--seq-len", "64", "--device", "meta", "--trace-out", "X", "-o", "X"],
     ("-o 'X'", "--trace-out 'X'")),
    (["profile", "--model", "t.json", "--seq-len", "64", "--device", "meta", "-o", "t.json"],
     ("-o 't.json'", "--model 't.json'")),
])
def test_an_output_that_is_an_input_is_refused_before_anything_is_written(argv: list[str], flags, tmp_path,
                                                                          capsys) -> None:
    """NOTE [Outputs are not inputs]: the same path, a path through another folder, a symbolic link and
    a hard link; every file is as it was, and no other was made."""
    os.chdir(tmp_path)
    (tmp_path / "t.json").write_bytes(b'{"the input": "unchanged"}\n')
    (tmp_path / "sub").mkdir()
    os.symlink("t.json", tmp_path / "link.json")
    os.link(tmp_path / "t.json", tmp_path / "hard.json")
    before = sorted(os.listdir(tmp_path))
    code = main(argv)
    if flags is None:  # a figure path is never a plan path: the plan's own error, nothing written
        assert code == 2 and "memo.plan:" in _one_error_line(capsys)
    else:
        assert code == 2
        message = _one_error_line(capsys)
        assert all(flag in message for flag in flags) and "(nothing was run)" in message, message
    assert sorted(os.listdir(tmp_path)) == before
    assert (tmp_path / "t.json").read_bytes() == b'{"the input": "unchanged"}\n'


# ------------------------------------------------------------------ round three: memo show, no summary
def _without_summary(src: str, dst: str, one_line: bool = False) -> None:
    text = open(src).read()
    at = text.index('\n "allocations": [\n')
    head = json.loads(text[:at].rstrip(",") + "}")
    del head["allocation_count"], head["phase_peaks"]
    if one_line:
        rows = json.loads(text[at + len('\n "allocations": '):text.rindex("\n}")])
        text = json.dumps({**head, "allocations": rows})
    else:
        text = json.dumps(head, indent=1)[:-2] + "," + text[at:]
    with open(dst, "w") as f:
        f.write(text)


def test_show_summarises_a_plan_without_its_summary_from_its_rows(tmp_path, monkeypatch) -> None:
    """NOTE [A plan without its summary]: a plan an older memo wrote is summarised from its rows, as
    numbers (no Plan, no object per row), to what the whole plan gives; rows that are not six integers
    a line are not guessed at; another layout is refused once its size is seen."""
    from memo.planner import Plan, load_plan, make_plan, read_plan_summary, save_plan
    from memo.planner import summary as summary_module
    from memo.planner.summary import PlanSummary
    from memo.planner.synthetic import layered_trace, write_layered_plan

    from memo.cli.show import format_plan

    layered = str(tmp_path / "layered.json")
    write_layered_plan(layered, layers=40, requests=50)
    items = str(tmp_path / "items.json")  # placed one by one in items, unphased ones among them
    save_plan(make_plan(layered_trace(3), use_mip=False, method="flat"), items)
    wholes = {path: format_plan(load_plan(path)) for path in (layered, items)}
    for path in (layered, items):
        _without_summary(path, path + ".old")
    monkeypatch.setattr(Plan, "from_dict", lambda *_a, **_k: pytest.fail("memo show loaded every row"))
    monkeypatch.setattr(summary_module, "_BLOCK_BYTES", 4096)  # many blocks of rows
    for path, whole in wholes.items():
        summary = read_plan_summary(path + ".old")
        assert isinstance(summary, PlanSummary) and format_plan(summary) == whole
    assert read_plan_summary(layered + ".old").allocation_count == 4000
    monkeypatch.setattr(summary_module, "MAX_WHOLE_BYTES", 0)  # what a large file meets
    text = open(layered + ".old").read()
    shifted = text.replace("[0, 0, 512, 0, 50, 0],\n[0, 1, 512, 1, 51, 1]",
                           "[0, 0, 512, 0, 50, 0, 0],\n[1, 512, 1, 51, 1]")
    assert shifted != text
    (tmp_path / "shifted.json").write_text(shifted)
    _without_summary(layered, str(tmp_path / "line.json"), one_line=True)
    for name in ("shifted.json", "line.json"):
        with pytest.raises(MemoError, match=r"memo show: .* has no summary .* Write it again with this memo"):
            read_plan_summary(tmp_path / name)
