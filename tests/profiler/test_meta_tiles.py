"""A profile on meta records and plans the tiles of the device the plan is for (issue 27; NOTE [Tiles of
the device a plan is for] in memo/pipeline/job.py):

* with ``machine.gpu`` set (``--gpu h100``) the plan is for a CUDA device: pass 2 on meta runs the
  tiles a GPU's runtime makes by default (never below NOTE [How small a chunk]'s GPU floor), and the
  plan records that tile, so a runtime replaying the plan runs exactly it, on any device;
* without ``gpu`` meta keeps the CPU's tiles: the meta plan's tiles are the CPU plan's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import memo.runtime as mr
import memo.runtime.layer as runtime_layer
from memo.models import ModelConfig, build_model, get_config
from memo.pipeline import profile
from memo.runtime.tiles import default_tile_tokens, min_chunk_tokens, token_chunks

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

MACHINE = {"bandwidth_gbps": 32.0, "host_mem_gb": 64.0, "layer_ms": 3.0}
#: Every layer of the first two runs tiles (memo, alpha 0.3); the last two are memo's never-offloaded pair.
POLICY = ["memo", "memo", "recompute", "keep"]
ALPHA = 0.3


@pytest.fixture
def tiles_run(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int | None, str]]]:
    """``(tokens, chunk_tokens, device type)`` of every token range a memo layer cut into tiles."""
    calls: list[tuple[int, int | None, str]] = []

    def spy(n: int, chunk_tokens: int | None = None, **kw: Any) -> list[tuple[int, int]]:
        calls.append((n, chunk_tokens, kw["device_type"]))
        return token_chunks(n, chunk_tokens, **kw)

    monkeypatch.setattr(runtime_layer, "token_chunks", spy)
    yield calls


def _wide_llama() -> ModelConfig:
    """Llama-3.1-8B's layer (hidden 4096: a GPU floor of 2,048 tokens), four layers, a small vocabulary."""
    return dataclasses.replace(get_config("llama-3.1-8b"), n_layers=4, vocab_size=512, name="llama-8b-4l")


def _tiny_llama() -> ModelConfig:
    return dataclasses.replace(get_config("llama-tiny"), n_layers=4, name="llama-tiny-4l")


def _profile(config: ModelConfig, seq: int, device: str, **machine: Any) -> Any:
    model = build_model(config, device=device, dtype=torch.float32)
    # The dispatch recorder on meta and cpu alike (on cpu the default is the allocator's, whose requests
    # include kernel scratch a meta run never makes: NOTE [The default recorder]).
    return profile(model, seq, 1, torch.float32, device, machine=None, policy=POLICY, alpha=ALPHA,
                   wrap_pass=True, recorder="dispatch", **MACHINE, **machine)


def test_a_meta_profile_for_a_gpu_records_and_plans_the_gpus_tiles(tiles_run: list[Any]) -> None:
    config, seq = _wide_llama(), 8192
    gpu_floor = min_chunk_tokens(1, config.hidden, "cuda")
    assert gpu_floor == 2048 and min_chunk_tokens(1, config.hidden, "meta") == 256
    r = _profile(config, seq, "meta", gpu="h100")
    # s / 8 = 1,024 tokens: below the GPU's floor, so the floor is the tile; the CPU's would be 1,024.
    assert r.plan.tile_tokens == gpu_floor
    assert r.trace["meta"]["tile_tokens"] == gpu_floor
    assert r.policy.tile_tokens is None  # the policy kept the default: the plan records what it is
    # Every range pass 2's memo layers ran was cut in the GPU's tiles, none in the CPU's.
    assert tiles_run and {chunk for _, chunk, _ in tiles_run} == {gpu_floor}
    # Without the GPU meta keeps the CPU's default (1,024 tokens here; its plans: the tests below).
    cpu_tile = default_tile_tokens(seq, batch=1, hidden=config.hidden, device_type="meta")
    assert cpu_tile == seq // 8 < gpu_floor


def test_where_the_tile_is_larger_than_the_gpu_floor_the_plan_records_the_default() -> None:
    # hidden 64: the GPU floor (2^35 / 64^2 tokens) is past any length, so a layer runs in one tile
    # of s tokens, the default min(s, floor); on the CPU it is 256 tokens.
    config, seq = _tiny_llama(), 1024
    expected = default_tile_tokens(seq, batch=1, hidden=config.hidden, device_type="cuda")
    assert expected == seq
    assert _profile(config, seq, "meta", gpu="h100").plan.tile_tokens == expected


def test_without_a_gpu_the_meta_plan_tiles_as_the_cpu_plan(tiles_run: list[Any]) -> None:
    config, seq = _tiny_llama(), 1024
    meta = _profile(config, seq, "meta")
    on_meta = [(n, chunk) for n, chunk, _ in tiles_run]
    tiles_run.clear()
    cpu = _profile(config, seq, "cpu")
    assert meta.plan.tile_tokens is None and cpu.plan.tile_tokens is None
    assert on_meta == [(n, chunk) for n, chunk, _ in tiles_run]
    assert meta.plan.to_dict()["policy"] == cpu.plan.to_dict()["policy"]


def test_the_runtime_replaying_a_plan_runs_its_recorded_tiles(tiles_run: list[Any]) -> None:
    # A plan made on meta for a GPU, replayed on the CPU: the recorded tile, not the CPU's default.
    config, seq = _tiny_llama(), 1024
    plan = _profile(config, seq, "meta", gpu="h100").plan
    assert plan.tile_tokens == seq
    assert mr.MemoRuntime(plan=plan).recompute_chunk_tokens == plan.tile_tokens
    for tile, expected in ((plan.tile_tokens, {seq}), (None, {None})):
        torch.manual_seed(0)
        model = build_model(config, device="cpu", dtype=torch.float32)
        plan.tile_tokens = tile  # None: a plan made without a GPU, replayed with the CPU's default
        mr.wrap(model, plan=plan)
        tiles_run.clear()
        try:
            ids = torch.randint(0, config.vocab_size, (1, seq))
            _loss(model, ids).backward()
        finally:
            mr.unwrap(model)
        assert tiles_run and {chunk for _, chunk, _ in tiles_run} == expected


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from memo.adapters.model import model_adapter_for

    return model_adapter_for(model, "test").loss(model, ids, ids)


def test_memo_estimate_profiles_with_the_tiles_of_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`memo estimate`'s meta profiles are for the GPU it sizes (its machine.gpu), so their tiles are
    that GPU's; an estimate for the CPU (as the tests compare with memo train there) records CPU tiles.
    memo's recordings wrap the rank model with the tile the runtime runs there: the GPU's tile (memory-
    bounded, for the CUDA device), or the runtime's own default where it records (None) on the CPU."""
    from memo import runtime
    from memo.estimate import Estimator, Layout, Machine

    seen: list[Any] = []
    real = runtime.wrap

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("recompute_chunk_tokens"))
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "wrap", spy)
    for device in ("cuda", "cpu"):
        seen.clear()
        est = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0, gpu="h100"),
                        device=device)
        est.estimate(1024, Layout(1), "memo", 0.5)
        assert seen, device
        if device == "cuda":
            assert all(isinstance(tile, int) and 0 < tile <= 1024 for tile in seen), seen
        else:
            assert set(seen) == {None}, seen
