"""Machine numbers of the alpha LP: FLOP estimate, layer timing, bandwidth, and where each came from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memo.errors import MemoError
from memo.profiler import (
    estimate_layer_ms,
    gpu_names,
    gpu_peak_flops,
    layer_forward_flops,
    measure_bandwidth,
    time_layer_forward,
)


def test_layer_flops_are_the_papers_per_layer_share() -> None:
    from memo.models import get_config, num_parameters

    c = get_config("gpt-7b")
    s, b = 1 << 20, 2
    params = num_parameters(c, max_seq_len=0)  # the position table does no matmul work
    paper = 6 * s * params + 6 * c.n_layers * c.hidden * s**2
    assert layer_forward_flops(c, s, b) == pytest.approx(paper * b / c.n_layers / 3)


def test_estimate_layer_ms_gpt7b_1m_h100() -> None:
    from memo.models import get_config

    c = get_config("gpt-7b")
    q = estimate_layer_ms(c, 1 << 20, 1, "h100", torch.bfloat16, 0.5)
    assert q.source == "estimated" and "h100" in q.how
    expected = layer_forward_flops(c, 1 << 20, 1) / (989e12 * 0.5) * 1e3
    assert q.value == pytest.approx(expected)
    assert 15_000 < q.value < 25_000  # about 19 s per layer forward at a million tokens


def test_gpu_names_and_errors() -> None:
    assert {"h100", "a100", "h200"} <= set(gpu_names())
    assert gpu_peak_flops("H100", torch.bfloat16) == 989e12
    with pytest.raises(MemoError, match="known GPUs"):
        gpu_peak_flops("tpu-v9", torch.bfloat16)
    from memo.models import get_config

    with pytest.raises(MemoError, match="efficiency"):
        estimate_layer_ms(get_config("tiny"), 1024, 1, "h100", torch.bfloat16, 1.5)


def test_time_layer_forward_is_the_median_of_the_timed_forwards(monkeypatch) -> None:
    """On a scripted clock: warm-up runs are not counted, the value is the median of the rest in ms,
    and every run gets the layer's arguments, without autograd."""
    from types import SimpleNamespace

    import memo.profiler.measure as measure

    now = [0.0]
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    durations = iter([0.5, 0.005, 0.009, 0.007])  # seconds: one warm-up, three timed forwards
    calls = []

    class Scripted(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor, *, scale: float) -> torch.Tensor:
            calls.append((x.shape, mask.shape, scale, torch.is_grad_enabled()))
            now[0] += next(durations)
            return x * scale

    x = torch.randn(16, 2, 32, requires_grad=True)
    q = time_layer_forward(Scripted(), x, torch.ones(16), repeats=3, warmup=1, layer_kwargs={"scale": 2.0})
    assert q.source == "measured" and "median of 3" in q.how
    assert q.value == pytest.approx(7.0)  # median of 5, 9 and 7 ms; the 500 ms warm-up is left out
    assert calls == [(x.shape, torch.Size([16]), 2.0, False)] * 4


def test_a_layer_given_its_hidden_states_by_keyword_is_timed() -> None:
    """megatron-core passes ``hidden_states=`` by keyword (memo train --engine megatron without
    --layer-ms timed nothing and raised a TypeError)."""
    seen = []

    class KeywordOnly(nn.Module):
        def forward(self, *, hidden_states: torch.Tensor, attention_mask: None = None) -> torch.Tensor:
            seen.append(hidden_states.shape)
            return hidden_states * 2

    x = torch.randn(8, 1, 4)
    q = time_layer_forward(KeywordOnly(), layer_kwargs={"hidden_states": x, "attention_mask": None})
    assert q.source == "measured" and q.value >= 0 and seen == [x.shape] * 4
    with pytest.raises(MemoError, match="no tensor was given"):
        time_layer_forward(KeywordOnly(), layer_kwargs={"attention_mask": None})


def test_meta_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(MemoError, match="meta"):
        time_layer_forward(nn.Linear(4, 4, device="meta"), torch.empty(2, 4, device="meta"))
    with pytest.raises(MemoError, match="meta"):
        measure_bandwidth(torch.device("meta"))


def test_cpu_backend_measures_memcpy_bandwidth_and_layer_time() -> None:
    # memo's CPU backend copies with memcpy on its worker thread: that rate is its B.
    bandwidth = measure_bandwidth(torch.device("cpu"), nbytes=8 << 20)
    assert bandwidth.source == "measured" and "memcpy" in bandwidth.how
    assert 0.05 < bandwidth.value < 1000  # GB/s: any real machine, never a default constant
    layer_ms = time_layer_forward(nn.Linear(256, 256), torch.randn(512, 256))
    assert layer_ms.source == "measured" and layer_ms.value > 0


@pytest.mark.slow
def test_profile_on_cpu_measures_missing_numbers() -> None:
    from memo.machine import GB
    from memo.pipeline import profile

    result = profile("tiny", 64, 1, "float32", "cpu", host_mem_gb=1, plan=False, recorder="dispatch")
    bandwidth, layer_ms = result.quantities["bandwidth_gbps"], result.quantities["layer_ms"]
    assert bandwidth.source == "measured" and layer_ms.source == "measured"
    # The measured numbers are the ones the alpha LP was solved with.
    sizes = result.plain_trace["layers"]
    per_layer = sizes["S_input"] + sizes["S_attn"] + result.alpha.alpha * sizes["S_others"]
    assert result.alpha.layer_time == pytest.approx(layer_ms.value / 1e3, rel=1e-12)
    assert result.alpha.copy_seconds == pytest.approx(per_layer / (bandwidth.value * GB), rel=1e-12)


def test_profile_refuses_missing_numbers_before_recording() -> None:
    from memo.pipeline import profile

    with pytest.raises(MemoError, match="--layer-ms"):
        profile("gpt-7b", 1 << 20, device="meta", bandwidth_gbps=32)
    with pytest.raises(MemoError, match="--bandwidth-gbps"):
        profile("gpt-7b", 1 << 20, device="meta", layer_ms=100)


@pytest.mark.gpu
def test_cuda_measures_bandwidth_and_layer_time() -> None:
    from memo.pipeline import profile

    result = profile("tiny", 4096, 1, "bfloat16", "cuda", host_mem_gb=64, plan=False, recorder="dispatch")
    assert result.quantities["bandwidth_gbps"].source == "measured"
    assert result.quantities["layer_ms"].source == "measured"
    assert result.layer_stats[0].forward_ms == result.quantities["layer_ms"].value
    assert result.layer_stats[0].s_input == 4096 * 64 * 2
