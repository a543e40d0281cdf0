"""memo.train's strategies: one class per name, the loop closes them when a step fails, and a
strategy's measurements come from the meter it was given."""

from __future__ import annotations

import pytest
import torch

from memo import runtime
from memo.errors import MemoError
from memo.train import (
    STRATEGIES,
    MemoryMeter,
    SaveOnCpu,
    Strategy,
    StrategyOptions,
    TrainConfig,
    loop,
    make_strategy,
    train,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_strategy_name_has_its_class() -> None:
    built = [make_strategy(StrategyOptions(strategy=name)) for name in STRATEGIES]
    assert [s.name for s in built] == list(STRATEGIES)
    assert len({type(s) for s in built}) == len(STRATEGIES)
    assert all(isinstance(s, Strategy) for s in [*built, SaveOnCpu()])


def test_alpha_is_checked_once_with_the_runtimes_rule() -> None:
    assert StrategyOptions(alpha="0.25").alpha == 0.25
    with pytest.raises(MemoError, match=r"memo.train: --alpha 1.5: memo.runtime: alpha must be in \[0, 1\]"):
        StrategyOptions(alpha=1.5)
    with pytest.raises(MemoError, match="'auto' or a number"):
        StrategyOptions(alpha="lots")


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("name", ["full-offload", "none"])
def test_a_failed_step_closes_the_strategy(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    def failing_step(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise Boom("step failed")

    monkeypatch.setattr(loop, "train_step", failing_step)
    strategy = make_strategy(StrategyOptions(strategy=name))
    with pytest.raises(Boom):
        train(TrainConfig(model="tiny", seq_len=64, steps=1), log=lambda _line: None, progress=False,
              strategy=strategy)
    session = strategy.meter.session
    assert session is not None and not session.allocator_on and not strategy.meter.allocator_on
    assert not runtime.is_wrapped(strategy.model)


class CountingMeter(MemoryMeter):
    """A meter that records what it was asked to do."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def open(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        self.calls.append("open")
        return super().open(*args, **kwargs)

    def read(self) -> dict:
        self.calls.append("read")
        return super().read()

    def close(self) -> None:
        self.calls.append("close")
        super().close()


def test_the_meter_given_is_the_one_that_measures() -> None:
    meter = CountingMeter()
    strategy = SaveOnCpu(meter)
    result = train(TrainConfig(model="tiny", seq_len=64, steps=2), log=lambda _line: None, progress=False,
                   strategy=strategy)
    assert meter.calls == ["open", "read", "read", "close"]
    assert result.peak_memory_kind == "memo_allocator_peak_in_use+params"
    assert all(s.peak_memory_bytes and s.peak_memory_bytes > meter.param_bytes for s in result.steps)
    assert strategy.host_pinned_bytes() > 0  # save_on_cpu's host copies were counted
