"""The attention kernel of a device (memo/models/attention_kernels.py, NOTE [Choosing the attention kernel]).

On the CPU: the rule with the availability mocked, the choice made once per device, the cuDNN path's
shapes through causal_attention on the meta device (whose kernels exist for cuDNN's ops), and the
training report's record. On a GPU (``-m gpu``): every available kernel's output, log-sum-exp and
gradients against the fp32 reference, within what torch's own flash kernel achieves.
"""

from __future__ import annotations

import pytest
import torch

from memo.errors import MemoError
from memo.models import attention_kernels as ak
from memo.models import causal_attention as ca


@pytest.mark.parametrize(("capability", "cudnn", "flash", "kernel"), [
    ((9, 0), True, True, "cudnn"),          # Hopper: cuDNN first
    ((10, 0), True, False, "cudnn"),        # Blackwell too
    ((9, 0), False, True, "flash_attn"),    # no cuDNN 9 attention: flash-attn
    ((9, 0), False, False, "aten_cuda"),
    ((8, 0), True, True, "flash_attn"),     # Ampere: flash-attn, cuDNN only available
    ((8, 0), True, False, "aten_cuda"),
])
def test_the_rule(capability, cudnn, flash, kernel) -> None:
    choice = ak.choose_kernel(capability, cudnn, flash)
    assert choice.kernel == kernel, choice
    assert choice.kernel in choice.available and choice.available[-1] == "aten_cuda"
    assert list(choice.available) == [k for k in ak.KERNELS if k in choice.available]
    assert ("cudnn" in choice.available) == cudnn and ("flash_attn" in choice.available) == flash
    assert f"{capability[0]}.{capability[1]}" in choice.reason


def test_cudnn_needs_ampere() -> None:
    assert ak.kernels_available((7, 5), cudnn=True, flash_attn=False) == ("aten_cuda",)


def test_chosen_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[int] = []

    def capability(index: int) -> tuple[int, int]:
        probes.append(index)
        return (9, 0) if index == 0 else (8, 6)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(ak, "_cudnn_attention_present", lambda: True)
    monkeypatch.setattr(ak, "flash_attn_module", lambda: None)
    ak._cuda_choice.cache_clear()
    try:
        assert [ak.attention_kernel("cuda:0") for _ in range(3)] == ["cudnn"] * 3
        assert ca.attention_backend("cuda") == "aten_cuda"  # the current device, 1: capability 8.6
        assert ca.attention_backend(torch.device("cuda", 1)) == "aten_cuda"
        assert sorted(probes) == [0, 1]
        assert ak.describe_kernel("cuda:0").as_dict()["available"] == ["cudnn", "aten_cuda"]
    finally:
        ak._cuda_choice.cache_clear()


def test_cpu_meta_and_bad_devices() -> None:
    assert ak.attention_kernel("cpu") == ak.attention_kernel("meta") == "aten_cpu"
    with pytest.raises(MemoError, match="no attention kernel for device type 'xla'"):
        ak.attention_kernel(torch.device("xla"))


def test_cudnn_takes() -> None:
    def q(d: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(4, 1, 2, d, dtype=dtype, device="meta")

    assert ak.cudnn_takes(q(64, torch.bfloat16)) and ak.cudnn_takes(q(128, torch.float16))
    assert not ak.cudnn_takes(q(256, torch.bfloat16)) and not ak.cudnn_takes(q(60, torch.bfloat16))
    assert not ak.cudnn_takes(q(64, torch.float32))


def test_cudnn_path_shapes_on_meta() -> None:
    # causal_attention's cuDNN calls, with torch's meta kernels for cuDNN's ops: memo's layouts in
    # ([s, b, n, d], lse [b, n, s]) and out, grouped-query heads summed back.
    s, b, n, n_kv, d = 64, 2, 4, 2, 32
    q = torch.empty(s, b, n, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(s, b, n_kv, d, dtype=torch.bfloat16, device="meta")
    o, lse = ca._forward_kernels("cudnn", q, k, k)
    assert o.shape == (s, b, n, d) and lse.shape == (b, n, s) and lse.dtype == torch.float32
    dq, dk, dv = ca._backward_kernels("cudnn", torch.empty_like(o), q, k, k, o, lse)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_the_training_report_records_the_kernel() -> None:
    from memo.train import TrainConfig, train
    from memo.train.report import build_report, validate_report
    from memo.train.strategies import StrategyOptions, make_strategy

    # No strategy to profile: the kernel is the model's, whatever runs it.
    result = train(TrainConfig(model="tiny", seq_len=16, steps=1, device="cpu"), progress=False,
                   strategy=make_strategy(StrategyOptions(strategy="none")), log=lambda _line: None)
    report = validate_report(build_report(result))
    assert report["attention_kernel"] == {"kernel": "aten_cpu", "available": ["aten_cpu"],
                                          "reason": "cpu: torch's CPU flash kernel"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_available_kernel_matches_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    s, b, n, n_kv, d = 1024, 2, 8, 2, 64
    q = torch.randn(s, b, n, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(s, b, n_kv, d, device="cuda", dtype=dtype) for _ in range(2))
    g = torch.randn(s, b, n, d, device="cuda", dtype=dtype)
    ref_o, ref_lse = ca._forward_kernels("aten_cuda", q.float(), k.float(), v.float())  # fp32: efficient
    ref_grads = ca._backward_kernels("aten_cuda", g.float(), q.float(), k.float(), v.float(), ref_o, ref_lse)
    errors = {}
    for kernel in ak.describe_kernel("cuda").available:
        o, lse = ca._forward_kernels(kernel, q, k, v)
        grads = ca._backward_kernels(kernel, g, q, k, v, o, lse)
        assert lse.shape[:2] == (b, n) and lse.shape[-1] >= s, kernel
        errors[kernel] = [(o.float() - ref_o).abs().max().item(),
                          (lse[..., :s].float() - ref_lse[..., :s]).abs().max().item(),
                          *[(x.float() - r).abs().max().item()
                            for x, r in zip(grads, ref_grads, strict=True)]]
    # flash-attn's rule: within twice what torch's flash kernel does at the same precision, plus rounding.
    eps = torch.finfo(dtype).eps
    for kernel, err in errors.items():
        for mine, base in zip(err, errors["aten_cuda"], strict=True):
            assert mine <= 2 * base + 4 * eps, (kernel, errors)
