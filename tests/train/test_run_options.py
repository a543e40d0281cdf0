"""What a real run adds around the steps, checked by value: the learning-rate schedule (NOTE
[Learning-rate schedule] in memo/train/lr.py), the gradient norm and clipping (NOTE [Global gradient
norm] in memo/train/grad_norm.py), a run's reported rates and norms, the flags' checks, ``--config`` files
(NOTE [Flags from a config file] in memo/cli/config_file.py) and ``--tensorboard`` without its package.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch

from memo.errors import MemoError
from memo.train.config import TrainConfig
from memo.train.grad_norm import GradNorm
from memo.train.lr import lr_factor, lr_scheduler


def _rates(**flags: object) -> list[float]:
    """The learning rate of each step of a run with ``flags`` (the scheduler stepped after each)."""
    config = TrainConfig(**flags)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = lr_scheduler(optimizer, config)
    rates = []
    for _ in range(config.steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_learning_rate_schedules() -> None:
    assert _rates(steps=4, lr=0.1) == [0.1] * 4  # constant: exactly --lr
    assert _rates(steps=4, lr=0.1, warmup_steps=2) == pytest.approx([0.05, 0.1, 0.1, 0.1], rel=1e-12)
    cosine = _rates(steps=6, lr=0.1, warmup_steps=1, min_lr=0.01, lr_schedule="cosine")
    # after one warmup step: from lr down to min_lr at the last step, (1 + cos(pi p)) / 2 over p in [0, 1]
    want = [0.1] + [0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert cosine == pytest.approx(want, rel=1e-12)
    assert _rates(steps=5, lr=0.1, min_lr=0.02, lr_schedule="linear") == pytest.approx(
        [0.1, 0.08, 0.06, 0.04, 0.02], rel=1e-12)
    assert lr_factor(100, "cosine", 0, 10, 0.1) == pytest.approx(0.1)  # past --steps (a longer resume): min


def test_gradient_norm_and_clipping() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model(torch.randn(4, 8)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    whole = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    assert GradNorm(None)(model.parameters()) == pytest.approx(whole, rel=1e-6)
    # measured only: the gradients unchanged
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    clip = GradNorm(whole / 4)
    assert clip(model.parameters()) == pytest.approx(whole, rel=1e-6)  # the norm before clipping
    after = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert after <= whole / 4 and after == pytest.approx(whole / 4, rel=1e-5)
    for p, g in zip(model.parameters(), grads, strict=True):  # one factor for all
        torch.testing.assert_close(p.grad, g * (after / whole), rtol=1e-5, atol=0)
    assert GradNorm(whole * 2)(model.parameters()) == pytest.approx(after, rel=1e-6)  # below the bound: kept


def test_a_run_reports_its_rate_and_clipped_norm() -> None:
    from memo.train.loop import train
    from memo.train.strategies import NoStrategy

    config = TrainConfig(model="tiny", seq_len=32, steps=3, lr=0.01, warmup_steps=2, clip_grad=0.5)
    steps = train(config, progress=False, strategy=NoStrategy(), log=lambda _line: None).steps
    assert [s.lr for s in steps] == pytest.approx([0.005, 0.01, 0.01], rel=1e-12)
    assert all(s.grad_norm is not None and s.grad_norm > 0.5 for s in steps)  # the bound binds: clipped


def test_a_run_resumed_with_more_steps_follows_its_own_schedule(tmp_path: Path) -> None:
    """NOTE [Learning-rate schedule]: the resumed run's rates are its own curve's from the saved step on."""
    from memo.train.loop import train
    from memo.train.strategies import NoStrategy

    flags = {"model": "tiny", "seq_len": 32, "lr": 0.01, "lr_schedule": "cosine"}
    train(TrainConfig(**flags, steps=2, save=str(tmp_path)), progress=False, strategy=NoStrategy(),
          log=lambda _line: None)
    steps = train(TrainConfig(**flags, steps=4, resume=str(tmp_path)), progress=False, strategy=NoStrategy(),
                  log=lambda _line: None).steps
    assert [s.lr for s in steps] == [0.01 * lr_factor(i, "cosine", 0, 4, 0.0) for i in (2, 3)]


@pytest.mark.parametrize(("flags", "message"), [
    ({"save_every": 2}, "give --save too"),
    ({"eval_every": 2}, "give --eval-data too"),
    ({"lr_schedule": "step"}, "--lr-schedule must be one of"),
    ({"min_lr": 1.0}, "--min-lr must be in"),
    ({"clip_grad": 0.0}, "--clip-grad must be a positive norm"),
    ({"resume": "/nonexistent/ck"}, "is not a folder"),
    ({"eval_data": "/nonexistent/eval.txt"}, "is not a file"),
    ({"tensorboard": "tb"}, "needs the tensorboard package"),
])
def test_bad_run_flags_are_one_line_errors(flags: dict[str, object], message: str) -> None:
    if "tensorboard" in flags and _has_tensorboard():
        pytest.skip("tensorboard is installed here: --tensorboard is accepted")
    with pytest.raises(MemoError, match=message) as err:
        TrainConfig(**flags)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def _parse(argv: list[str]) -> object:
    from memo.cli.main import build_parser

    return build_parser("train").parse_args(["train", *argv])


def test_config_file_flags_and_command_line_precedence(tmp_path: Path) -> None:
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("seq_len: 2K\nlr: 1e-2\nsteps: 7\nlr-schedule: cosine\n--warmup-steps: 3\n"
                         "no_progress: true\ncompare: [a.json, b.json]\n")
    args = _parse(["--config", str(yaml_file), "--lr", "0.5"])
    assert (args.seq_len, args.lr, args.steps, args.lr_schedule, args.warmup_steps, args.no_progress,
            args.compare) == (2048, 0.5, 7, "cosine", 3, True, ["a.json", "b.json"])
    args = _parse(["--steps", "9", "--config", str(yaml_file)])  # the command line wins wherever it stands
    assert (args.steps, args.lr) == (9, 0.01)
    toml_file = tmp_path / "run.toml"
    toml_file.write_text('model = "gpt-mini"\nclip_grad = 1.5\nsave_every = 4\nsave = "ck"\n')
    args = _parse(["--config", str(toml_file)])
    assert (args.model, args.clip_grad, args.save_every, args.save) == ("gpt-mini", 1.5, 4, "ck")
    assert _parse([]).clip_grad is None and _parse([]).lr == 1e-3  # no file: the defaults


@pytest.mark.parametrize(("text", "message"), [
    ("seq_len: 128\nbogus: 1\nalso_bogus: 2\n", "no such flag.*also_bogus, bogus"),
    ("steps: -3\n", "steps: must be a positive integer"),
    ("strategy: magic\n", "strategy must be one of"),
    ("no_progress: 3\n", "no_progress is a switch"),
    ("- a\n- b\n", "must hold one table"),
    ("steps: [1, 2\n", "is not valid YAML"),
])
def test_bad_config_files_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(MemoError, match=message) as err:
        _parse(["--config", str(path)])
    assert "\n" not in str(err.value)


def test_a_stop_signal_sets_a_flag_and_memo_exits_with_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [Stopping at a step] in memo/train/stop.py: while installed, Ctrl-C only sets the flag the
    loop reads after its step; the stop it raises then exits ``memo`` with 128 + the signal."""
    from memo.cli import main as cli
    from memo.cli import train as train_cli
    from memo.train.stop import StopRequested, StopSignals

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in some test workers
    stop = StopSignals()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(distributed=False) == signal.SIGINT
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is before  # given back as it was

    def stopped(_args: object) -> int:
        raise StopRequested(signal.SIGINT, "memo.train: stopped by SIGINT after step 3")

    monkeypatch.setattr(train_cli, "run", stopped)
    assert cli.main(["train"]) == 130
