"""NOTE [Repeated tiles in a meta estimate]: an estimate that skips repeated tiles reads the numbers
one that runs every tile reads, for every strategy, GPT and Llama, with tensor and context parallelism;
and a loop whose tiles keep something runs them all."""

from __future__ import annotations

import contextlib

import pytest

from memo import repeated_tiles
from memo.estimate import Estimator, Layout, Machine
from memo.models import ModelConfig, register_config

# Small widths and a large vocabulary: 4 loss chunks (256 tokens each at 128K words), four layer
# tiles (256 tokens, the CPU's floor) and s / h tiles of the peer's MLP, in seconds on meta;
# three layers, so that an estimate records the whole depth once (NOTE [Estimate from a meta profile]).
CONFIGS = {
    "gpt": ModelConfig(name="skip-gpt", arch="gpt", n_layers=3, hidden=128, n_heads=4, vocab_size=131072),
    "llama": ModelConfig(name="skip-llama", arch="llama", n_layers=3, hidden=128, n_heads=4, n_kv_heads=2,
                         ffn_hidden=384, vocab_size=131072),
}
for config in CONFIGS.values():
    register_config(config)

NAMES = ("iteration", "activations", "stage_activations", "held", "gradients")


def test_tile_indices_skip_only_tiles_that_repeat_the_state() -> None:
    assert list(repeated_tiles.tile_indices(9)) == list(range(9))  # not asked
    state = [0]
    with repeated_tiles.repeated_tiles_skipped():
        assert list(repeated_tiles.tile_indices(9)) == list(range(9))  # no meta recorder to check
        with repeated_tiles.recording(lambda: (state[0], 0)):
            before = repeated_tiles.skipped
            assert list(repeated_tiles.tile_indices(9)) == [0, 1, 8]
            assert repeated_tiles.skipped == before + 6
            assert list(repeated_tiles.tile_indices(3)) == [0, 1, 2]
            ran = []
            for n in repeated_tiles.tile_indices(6):  # every tile keeps a storage: all run
                ran.append(n)
                state[0] += 1
            assert ran == list(range(6))
    assert not repeated_tiles.skipping()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch,tp,cp,cp_comm", [("gpt", 1, 1, "all_gather"), ("llama", 2, 2, "a2a")])
def test_an_estimate_skipping_repeated_tiles_reads_the_same_numbers(
        arch: str, tp: int, cp: int, cp_comm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seq_len = 1024 * tp * cp  # 1K tokens per rank
    layout = Layout(tp * cp, tp=tp, cp=cp, cp_comm=cp_comm)
    # every strategy at TP 1 (the peer's tiled MLP needs a whole-sequence rank: NOTE [The peer in an
    # estimate]); with TP x CP, memo's tiles around the sequence-parallel gathers and Ulysses' exchange
    if tp == 1:
        cases = [("none", None), ("full-recompute", None), ("memo", 0.0), ("memo", 0.4), ("input-only", None),
                 ("offloaded-checkpoint", None)]
    else:
        cases = [("memo", 0.4), ("input-only", None)]
    machine = Machine(device_mem_gb=80, host_mem_gb=1e4, gpus_per_node=8)
    skipping = Estimator(CONFIGS[arch].name, dtype="float32", machine=machine, device="cpu")
    before = repeated_tiles.skipped
    fast = [skipping.profiler.numbers(s, layout, seq_len, a) for s, a in cases]
    assert repeated_tiles.skipped > before  # the loss's chunks, the layers' tiles, the peer's MLP tiles
    monkeypatch.setattr("memo.estimate.plan_method.repeated_tiles_skipped", contextlib.nullcontext)
    every = Estimator(CONFIGS[arch].name, dtype="float32", machine=machine, device="cpu")
    before = repeated_tiles.skipped
    slow = [every.profiler.numbers(s, layout, seq_len, a) for s, a in cases]
    assert repeated_tiles.skipped == before
    for (strategy, alpha), a, b in zip(cases, fast, slow, strict=True):
        for name in NAMES:
            assert getattr(a, name) == getattr(b, name), (strategy, alpha, name)
