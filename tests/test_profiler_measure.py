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


def test_time_layer_forward_on_cpu() -> None:
    layer = nn.Sequential(nn.Linear(32, 32), nn.GELU())
    q = time_layer_forward(layer, torch.randn(16, 2, 32))
    assert q.source == "measured" and q.value > 0


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


def test_profile_on_cpu_measures_missing_numbers() -> None:
    from memo.pipeline import profile

    result = profile("tiny", 64, 1, "float32", "cpu", host_mem_gb=1, plan=False, recorder="dispatch")
    assert result.quantities["bandwidth_gbps"].source == "measured"
    assert result.quantities["layer_ms"].source == "measured"
    assert 0.0 <= result.alpha.alpha <= 1.0


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
