"""One layout type (NOTE [One layout type] in memo/distributed/parallel_layout.py): the layout ``memo
estimate`` answers with and the one ``memo train`` launches are the same class, equal for the same job;
one divisibility check (:func:`layout_problems`, NOTE [Valid layouts]) says what both refuse; and the
estimate's files compare the vocabularies (planner/vocab.py) as enum members. All in-process arithmetic.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
from pathlib import Path

import pytest
from memo.planner import vocab
from memo.planner.vocab import CPComm, Sharding

from memo.cli.main import build_parser
from memo.distributed import layout as launcher
from memo.distributed.parallel_layout import ParallelLayout, layout_problems
from memo.errors import MemoError
from memo.estimate import Estimator, Layout, launch_argv
from memo.estimate import layout as estimate_layout
from memo.models import get_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_estimate_and_the_launcher_share_one_layout_class() -> None:
    # The estimate's Layout is a factory of the one class, not a class of its own.
    assert not inspect.isclass(Layout)
    assert launcher.ParallelLayout is ParallelLayout is estimate_layout.ParallelLayout
    made = Layout(8, tp=2, cp=4, cp_comm="a2a")
    assert type(made) is ParallelLayout
    assert made == launcher.resolve_layout(2, 4, None, True, 8, "a2a")  # TP > 1 comes with SP
    assert made == ParallelLayout(2, 4, 1, True, "a2a")  # the launcher's positional order
    assert (made.tp, made.cp, made.dp, made.pp, made.vpp, made.sp, made.gpus, made.world) == (
        2, 4, 1, 1, 1, True, 8, 8)
    assert made.cp_comm is CPComm.A2A and made.sharding is Sharding.OPTIMIZER
    with pytest.raises(AttributeError):
        made.tp = 4  # type: ignore[misc]  # the aliases are read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.tensor_parallel = 4  # type: ignore[misc]
    # What reports and estimates record is unchanged: the same keys, plain strings.
    assert list(made.to_dict()) == ["gpus", "tp", "cp", "pp", "micro_batch", "cp_comm", "sharding",
                                    "head_chunks", "dp"]
    assert list(made.as_dict()) == ["tp", "cp", "sp", "dp", "pp", "vpp", "world", "cp_comm"]
    assert type(made.to_dict()["cp_comm"]) is str and type(made.as_dict()["cp_comm"]) is str
    # One validation, however a layout is made.
    replaced = dataclasses.replace(made, sharding="full")
    assert replaced.sharding is Sharding.FULL and replaced.tensor_parallel == 2
    with pytest.raises(MemoError, match="head chunks are Ulysses'"):
        dataclasses.replace(made, cp_comm="all_gather", head_chunks=2)
    with pytest.raises(MemoError, match="--sharding must be one of optimizer, full, full-offload"):
        ParallelLayout(sharding="zero-2")
    with pytest.raises(MemoError, match="--tp must be a positive integer, got 0"):
        ParallelLayout(0)


@pytest.mark.parametrize("layout", [
    Layout(8, tp=2, pp=2), Layout(32, tp=8, cp=2, pp=2), Layout(12, sharding="full"),
    Layout(8, cp=8, cp_comm="a2a", sharding="full-offload"),
    Layout(4, cp=4, cp_comm="a2a", sharding="full", head_chunks=4)])
def test_the_printed_command_launches_the_estimates_layout(layout: ParallelLayout) -> None:
    # memo train's own parser reads the command an estimate prints, and the launcher resolves the same
    # layout from it (the batch, the sharding and the head chunks are flags of their own there).
    argv = launch_argv(Estimator("llama-3.1-8b", method="formula"), layout, 131072, "none")
    nodes = int(argv[argv.index("--nnodes") + 1]) if "--nnodes" in argv else 1
    world = nodes * int(argv[argv.index("--nproc-per-node") + 1])
    argv[argv.index("--device") + 1] = "cpu"  # the command is for GPUs; its parser checks the device
    args = build_parser("train").parse_args(argv[argv.index("train"):])
    resolved = launcher.resolve_layout(args.tp, args.cp, args.dp, args.sp, world, args.cp_comm, args.pp,
                                       args.vpp)
    assert resolved == dataclasses.replace(layout, micro_batch=1, sharding=Sharding.OPTIMIZER,
                                           head_chunks=None)
    assert args.micro_batch == layout.micro_batch * layout.dp
    assert args.ulysses_head_chunks == layout.head_chunks
    assert args.offload_states == (layout.sharding == Sharding.FULL_OFFLOAD)


def test_one_check_says_what_both_commands_refuse() -> None:
    # Llama-3.1-8B: 32 query heads, 8 key/value heads, 32 layers, MLP 14336.
    config = get_config("llama-3.1-8b")
    shapes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads, "n_layers": config.n_layers,
              "ffn_hidden": config.ffn_hidden}
    layout = Layout(48, tp=16, pp=3)
    problems = layout_problems(layout, seq_len=8190, **shapes)
    assert problems == layout.problems(config, 8190)
    assert [p.split(" (")[0].split(":")[0] for p in problems] == [
        "TP 16 does not divide its 8 key/value heads", "PP 3 does not divide its 32 layers", "--seq-len"]
    assert "the model's 8 query groups, which --tp 16 cannot split evenly" in problems[0]
    assert problems[0].endswith("use a --tp that divides 8")
    assert "32 layers cannot be split evenly over --pp 3 stages; use a --pp that divides 32" in problems[1]
    assert "seq len 8,190 cannot be split over TP 16 x CP 1" in problems[2]
    # memo estimate says them all, after its own prefix ...
    with pytest.raises(MemoError) as estimate_error:
        layout.check(config, 8190)
    assert str(estimate_error.value) == (f"memo estimate: {layout.describe()} does not fit {config.name}: "
                                         + "; ".join(problems))
    # ... memo train the first, after its own, from the same layout made from its flags.
    with pytest.raises(MemoError) as train_error:
        launcher.check_layout(launcher.resolve_layout(16, 1, None, True, 48, pipeline_parallel=3),
                              engine="megatron", n_heads=config.n_heads, n_query_groups=config.n_kv_heads,
                              n_layers=config.n_layers, ffn_hidden=config.ffn_hidden,
                              vocab_size=config.vocab_size, micro_batch=1, seq_len=8190)
    assert str(train_error.value) == f"memo.distributed: {problems[0]}"
    # The MLP and Ulysses' sharing of heads, with the virtual pipeline's chunks of layers.
    mlp = ParallelLayout(4, 4, cp_comm="a2a", pipeline_parallel=2, virtual_pipeline=3)
    got = layout_problems(mlp, n_heads=8, n_kv_heads=4, n_layers=8, ffn_hidden=90, seq_len=None)
    assert got[0].startswith("TP 4 does not divide its 90 MLP size") and got[0].endswith("divides 90")
    assert got[1].startswith("PP 2 x VPP 3 does not divide its 8 layers: the model's 8 layers cannot be "
                             "split evenly over --pp 2 x --vpp 3 = 6 model chunks")
    assert got[2].startswith("Ulysses CP, --cp-comm a2a: the model has 8 attention heads and 4 query groups, "
                             "2 and 1 per --tp 4 rank, and 2 query heads cannot be split over 4")
    assert got[2].endswith("or --cp-comm all_gather")
    assert len(got) == 3
    assert layout_problems(ParallelLayout(2, 2), n_heads=8, n_kv_heads=2, seq_len=256) == []


#: The names that hold a vocabulary of planner/vocab.py where the estimate and the layout compare them.
VOCABULARY_HOLDERS = {"strategy", "method", "cp_comm", "sharding", "policy", "memo_policy", "recorder",
                      "kind", "comm"}
VOCABULARY_VALUES = {m.value for e in vars(vocab).values()
                     if isinstance(e, type) and issubclass(e, enum.Enum) for m in e}


def _raw_vocabulary_comparisons(source: str, name: str) -> list[str]:
    """``name:line: code`` of each comparison of a vocabulary holder with a raw string of a vocabulary."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = {o.attr if isinstance(o, ast.Attribute) else o.id for o in operands
                 if isinstance(o, (ast.Attribute, ast.Name))}
        literals = {e.value for o in operands for e in ([o] if isinstance(o, ast.Constant) else
                                                        getattr(o, "elts", []))
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if names & VOCABULARY_HOLDERS and literals & VOCABULARY_VALUES:
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_estimate_and_the_layout_compare_vocabularies_as_members() -> None:
    memo = ROOT / "memo"
    files = [*sorted((memo / "estimate").glob("*.py")), memo / "cli" / "estimate.py",
             memo / "distributed" / "layout.py", memo / "distributed" / "parallel_layout.py"]
    found = [hit for path in files for hit in _raw_vocabulary_comparisons(path.read_text(),
                                                                          str(path.relative_to(ROOT)))]
    assert not found, "compare with the planner/vocab.py member instead:\n" + "\n".join(found)
    # The check can fail.
    probe = "def f(layout, strategy):\n    return layout.cp_comm == 'a2a' or strategy in ('memo', 'x')\n"
    assert _raw_vocabulary_comparisons(probe, "probe") == [
        "probe:2: layout.cp_comm == 'a2a'", "probe:2: strategy in ('memo', 'x')"]
