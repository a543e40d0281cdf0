"""NOTE [Meta kernels by their inputs' shapes]: an estimate that reuses meta kernels' outputs reads the
numbers one that runs every kernel reads (every strategy a longest-sequence search records, memo's
mixed policies, Ulysses over chunks of heads), a recording's trace is the same event by event, and an
op whose output is an input's storage always runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memo.estimate import Estimator, Layout, Machine
from memo.models import ModelConfig, register_config
from memo.profiler.meta_cache import MetaKernelCache, _empty, _Meta

# Eight layers (more than the recorded depths, so two depths are recorded and extended), Qwen3's
# QK-norm and grouped key/value heads, a vocabulary of a few loss chunks: seconds on meta.
CONFIG = register_config(ModelConfig(name="kernel-cache-llama", arch="llama", n_layers=8, hidden=128,
                                     n_heads=16, n_kv_heads=4, ffn_hidden=384, vocab_size=32768,
                                     qk_norm=True))
NAMES = ("iteration", "activations", "stage_activations", "held", "gradients", "by_kind")


def _numbers(reuse: bool) -> tuple[list, MetaKernelCache | None]:
    machine = Machine(device_mem_gb=80, host_mem_gb=1e4, gpus_per_node=8)
    est = Estimator(CONFIG.name, dtype="float32", machine=machine, device="cpu")
    if not reuse:
        est.profiler.kernels = None
    p = est.profiler
    ulysses = Layout(4, cp=4, cp_comm="a2a")
    chunked = Layout(4, cp=4, cp_comm="a2a", head_chunks=4)
    out = [p.numbers("full-recompute", ulysses, 2048), p.numbers("memo", ulysses, 2048, 0.4),
           p.numbers("offloaded-checkpoint", ulysses, 2048),
           p.numbers("input-only", chunked, 2048, pairs=1, recomputed=1)]
    return out, p.kernels


@pytest.mark.usefixtures("one_thread")
def test_an_estimate_reusing_meta_kernels_reads_the_same_numbers() -> None:
    fast, cache = _numbers(reuse=True)
    slow, _ = _numbers(reuse=False)
    for i, (a, b) in enumerate(zip(fast, slow, strict=True)):
        for name in NAMES:
            assert getattr(a, name) == getattr(b, name), (i, name)
    # the layers repeat one another's ops: most kernels are answered from the cache
    assert cache is not None and cache.hits > 3 * cache.misses, (cache.hits, cache.misses)


@pytest.mark.usefixtures("one_thread")
def test_a_recording_reusing_meta_kernels_is_the_same_trace() -> None:
    from memo.models import build_model
    from memo.profiler.record import record

    def events(cache: MetaKernelCache | None) -> list[dict]:
        model = build_model(dataclasses.replace(CONFIG, n_layers=3), device="meta", dtype=torch.float32)
        ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
        if cache is None:
            return record(model, ids, ids).trace["events"]
        with cache:
            return record(model, ids, ids).trace["events"]

    cache = MetaKernelCache()
    assert events(cache) == events(None)
    assert cache.hits > 0


def test_an_output_on_an_inputs_storage_is_never_reused() -> None:
    cache = MetaKernelCache()
    with cache:
        for _ in range(2):
            x = torch.empty(4, 6, device="meta")
            y = torch.ops.aten._unsafe_view(x, [24])  # its schema says fresh; its storage is x's
            assert y.untyped_storage() is x.untyped_storage()
            z = x * 2  # fresh, and reused the second time
            assert z.shape == (4, 6) and z.untyped_storage() is not x.untyped_storage()
    assert cache.hits >= 2  # the second empty and the second multiplication
    # an output whose storage is larger than its view, at an offset, comes back the same
    made = _empty(_Meta((torch.float16, (2, 3), (1, 2), 4, 64)))
    assert (made.shape, made.stride(), made.storage_offset(), made.untyped_storage().nbytes()) == (
        (2, 3), (1, 2), 4, 64)
