"""The CUDA path's arguments and calls, pinned on CPU (issue: the CUDA path on first contact).

Nothing here needs a GPU: each test checks what memo passes to, or calls on, the CUDA-only
pieces (aten's CUDA attention kernels, torch.cuda's memory counters, memo's CUDA allocator
backend) by standing in for them, so a regression shows on every machine.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from memo.planner.job import JobSpec

import memo.allocator as allocator
import memo.allocator._backends as backends
import memo.models.causal_attention as attn
from memo.models import build_model
from memo.pipeline.passes import record_allocator
from memo.train.plan_checks import TrainRun

ATEN = torch.ops.aten


def _qkv(dtype: torch.dtype, s: int = 40, n: int = 4, n_kv: int = 2) -> tuple[torch.Tensor, ...]:
    q = torch.randn(s, 2, n, 16, dtype=dtype)
    k = torch.randn(s, 2, n_kv, 16, dtype=dtype)
    v = torch.randn(s, 2, n_kv, 16, dtype=dtype)
    return q, k, v


def _cpu_backward(g, q, k, v, o, lse, scale):
    return ATEN._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, lse, 0.0, True,
                                                                      scale=scale)


# 1. Attention backward on CUDA passes undefined cumulative sequence lengths --------------------
def test_flash_backward_passes_undefined_cum_seq(monkeypatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_flash_backward(g, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, p, causal, seed, offset, *,
                            scale):
        calls.append((cum_q, cum_k, max_q, max_k, p, causal))
        # The CUDA kernel takes a defined cum_seq as "variable length" and refuses 4-D inputs.
        if cum_q is not None or cum_k is not None:
            raise RuntimeError("cu_seqlens_q must have dtype int32")
        return _cpu_backward(g, q, k, v, o, lse, scale)

    monkeypatch.setattr(ATEN, "_scaled_dot_product_flash_attention_backward", fake_flash_backward)
    q, k, v = _qkv(torch.bfloat16)
    o, lse = attn._forward_kernels("aten_cpu", q, k, v)
    g = torch.randn_like(o)
    got = attn._backward_kernels("aten_cuda", g, q, k, v, o, lse)
    want = attn._backward_kernels("aten_cpu", g, q, k, v, o, lse)
    assert calls == [(None, None, q.shape[0], q.shape[0], 0.0, True)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


# 2. fp32 on CUDA goes to the memory-efficient kernel, fp16/bf16 to flash ------------------------
def test_fp32_on_cuda_uses_the_efficient_kernel(monkeypatch) -> None:
    used: list[str] = []

    def flash_forward(q, k, v, p, causal, debug, *, scale):
        used.append("flash")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        out, lse = ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, p, causal, scale=scale)
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def efficient_forward(q, k, v, bias, compute_lse, p, causal, *, scale):
        used.append("efficient")
        assert bias is None and compute_lse and p == 0.0 and causal
        out, lse = ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, p, causal, scale=scale)
        return out, lse, torch.empty(()), torch.empty(())

    def efficient_backward(g, q, k, v, bias, o, lse, seed, offset, p, mask, causal, *, scale):
        used.append("efficient_backward")
        assert bias is None and mask == [True, True, True, False] and causal
        return (*_cpu_backward(g, q, k, v, o, lse, scale), None)

    monkeypatch.setattr(ATEN, "_scaled_dot_product_flash_attention", flash_forward)
    monkeypatch.setattr(ATEN, "_scaled_dot_product_efficient_attention", efficient_forward)
    monkeypatch.setattr(ATEN, "_scaled_dot_product_efficient_attention_backward", efficient_backward)
    q, k, v = _qkv(torch.float32)
    o, lse = attn._forward_kernels("aten_cuda", q, k, v)
    grads = attn._backward_kernels("aten_cuda", torch.ones_like(o), q, k, v, o, lse)
    assert used == ["efficient", "efficient_backward"]
    want_o, _ = attn._forward_kernels("aten_cpu", q, k, v)
    assert torch.equal(o, want_o) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    used.clear()
    attn._forward_kernels("aten_cuda", *_qkv(torch.bfloat16))
    assert used == ["flash"]


# 3. Peak memory under memo's CUDA allocator comes from memo's counters --------------------------
def _torch_counters_raise(monkeypatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", refuse)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", refuse)


def test_peak_memory_reads_memo_counters_under_memo_allocator(monkeypatch) -> None:
    from memo.train import loop as training

    _torch_counters_raise(monkeypatch)
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(allocator, "cuda_installed", lambda: True)
    monkeypatch.setattr(allocator, "reset_stats", lambda device: calls.append(("reset", device)))
    monkeypatch.setattr(allocator, "stats", lambda device: calls.append(("stats", device)) or
                        {"peak_bytes_in_use": 12345})
    dev = torch.device("cuda", 1)
    training.reset_peak_memory(dev)
    assert training.peak_memory(dev) == (12345, "memo_allocator_peak_in_use")
    assert calls == [("reset", dev), ("stats", dev)]


def test_strategy_peak_on_cuda_counts_parameters_once(monkeypatch) -> None:
    from memo.train import MemoryMeter

    _torch_counters_raise(monkeypatch)
    seen: list[Any] = []
    stats = {"peak_bytes_in_use": 5000, "planned_hits": 3, "fallback_requests": 2, "unplanned_requests": 1,
             "segment_allocs": 4}
    monkeypatch.setattr(allocator, "stats", lambda device: seen.append(device) or stats)
    meter = MemoryMeter()
    meter.device, meter.param_bytes, meter.allocator_on = torch.device("cuda", 1), 777, True
    out = meter.read()
    # memo's CUDA allocator served the parameters as well: its peak already holds them.
    assert out["peak_device_bytes"] == 5000 and out["peak_device_kind"] == "memo_allocator_peak_in_use"
    assert seen == [torch.device("cuda", 1)]
    meter.device = torch.device("cpu")
    assert meter.read()["peak_device_bytes"] == 5000 + 777


# 4. --no-planned-allocator profiles without memo's allocator ----------------------------------
@pytest.mark.parametrize("planned", [True, False])
def test_profile_recorder_follows_the_planned_allocator_flag(monkeypatch, planned: bool) -> None:
    from memo.train import strategies

    captured: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake_profile(model, seq_len, micro_batch, **kwargs):
        captured.update(kwargs)
        raise Stop

    monkeypatch.setattr(strategies.pipeline, "profile", fake_profile)
    model = build_model("tiny", dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 64))
    strategy = strategies.MemoStrategy(strategies.StrategyOptions(planned_allocator=planned, alpha=0.5))
    with pytest.raises(Stop):
        strategy.prepare(model, ids, ids,
                         TrainRun(JobSpec(model="tiny", seq_len=64, micro_batch=1, dtype="float32")))
    # The allocator recorder would install memo's CUDA allocator, too late with the model on the GPU.
    assert captured["recorder"] == ("allocator" if planned else "dispatch")
    assert captured["plan"] is planned
    assert captured["wrap_pass"] is (None if planned else False)


# 5. Pass 1 sizes a given model on a meta copy -------------------------------------------------
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_pass1_of_a_given_model_runs_on_meta(monkeypatch) -> None:
    from memo import pipeline
    from memo.profiler import record

    model = build_model("tiny", dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    devices: list[str] = []
    real_record = pipeline.record_pass

    def spy(net, ids, labels, *args, **kwargs):
        devices.append(next(net.parameters()).device.type)
        return real_record(net, ids, labels, *args, **kwargs)

    monkeypatch.setattr(pipeline, "record_pass", spy)
    result = pipeline.profile(model, 128, 1, device="cpu", bandwidth_gbps=10, layer_ms=1.0, host_mem_gb=8,
                              plan=False, wrap_pass=False)
    assert devices == ["meta"]
    assert result.plain_trace["meta"]["device"] == "meta"
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The same sizes as a real CPU pass: the LP's inputs do not depend on where pass 1 ran.
    cpu_pass = record(model, *(torch.zeros(1, 128, dtype=torch.long),) * 2)
    assert [(s.s_input, s.s_attn, s.s_others) for s in result.layer_stats] == [
        (s.s_input, s.s_attn, s.s_others) for s in cpu_pass.layer_stats]


def test_meta_copy_shares_no_storage() -> None:
    from memo.profiler import meta_copy

    model = build_model("llama-tiny", dtype=torch.float32)
    copy = meta_copy(model)
    pairs = list(zip(model.named_parameters(), copy.named_parameters(), strict=True))
    assert pairs and all(a[0] == b[0] and b[1].is_meta and a[1].shape == b[1].shape for a, b in pairs)
    assert all(isinstance(b[1], torch.nn.Parameter) and b[1].requires_grad for _, b in pairs)
    assert all(not p.is_meta for p in model.parameters())


# 8. The device index reaches the allocator -----------------------------------------------------
def test_strategy_keeps_the_device_index(monkeypatch) -> None:
    from memo.train.strategies import MemoryMeter, Wrapping

    entered: list[Any] = []

    @contextlib.contextmanager
    def fake_planned(table, *, device, **_kw):
        entered.append(device)
        yield

    monkeypatch.setattr(allocator, "cuda_installed", lambda: True)
    monkeypatch.setattr(allocator, "planned", fake_planned)
    meter = MemoryMeter()
    meter.open(build_model("tiny", dtype=torch.float32), Wrapping(), torch.device("cuda", 3), None)
    meter.close()
    assert entered == [torch.device("cuda", 3)]


def test_backend_for_cuda_without_index_is_the_current_device(monkeypatch) -> None:
    # A stand-in for the CUDA library's C API: its device allocators are made without a device anyway.
    library = SimpleNamespace(device_allocator=lambda device_type, index: object())
    monkeypatch.setattr(backends, "_load_cuda_library", lambda: library)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(backends, "_backends", {})
    assert backends.backend_for("cuda").device == torch.device("cuda", 2)
    assert backends.backend_for("cuda:5").device == torch.device("cuda", 5)
    assert backends.backend_for("cuda:2") is backends.backend_for("cuda")


# 9. The allocator trace is logged after one warm-up iteration ---------------------------------
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_allocator_trace_follows_a_warm_up_iteration(monkeypatch) -> None:

    model = build_model("tiny", dtype=torch.float32)
    forwards: list[str] = []
    state = {"logging": False}
    model.register_forward_pre_hook(lambda *_: forwards.append("logged" if state["logging"] else "warm-up"))
    real_logging = allocator.logging

    @contextlib.contextmanager
    def spy_logging(**kwargs):
        state["logging"] = True
        with real_logging(**kwargs) as trace:
            yield trace
        state["logging"] = False

    monkeypatch.setattr(allocator, "logging", spy_logging)
    ids = torch.randint(0, 256, (1, 64))
    trace = record_allocator(model, ids, ids, {"model": "tiny"})
    assert forwards == ["warm-up", "logged"]
    assert all(p.grad is None for p in model.parameters())  # the profile leaves no gradients behind
    mallocs = [e for e in trace["events"] if e["op"] == "malloc" and "phase" in e]
    assert mallocs


def test_device_budget_caps_pytorchs_cuda_allocator_too(monkeypatch) -> None:
    """Baselines on CUDA without memo's allocator: the budget becomes PyTorch's memory fraction."""
    from memo.errors import MemoError
    from memo.train.strategies import MemoryMeter, Wrapping

    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(allocator, "cuda_installed", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((f, i)))
    model, device = build_model("tiny", dtype=torch.float32), torch.device("cuda", 1)
    MemoryMeter(device_budget_bytes=20 * 10**9).open(model, Wrapping(), device, None)
    assert calls == [(0.25, 1)]
    with pytest.raises(MemoError, match="more than the device's 80.0 GB"):
        MemoryMeter(device_budget_bytes=100 * 10**9).open(model, Wrapping(), device, None)
