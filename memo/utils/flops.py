"""Model FLOPs per sample, accelerator peak throughput, and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import torch

from memo.errors import MemoError
from memo.models.config import ModelConfig, get_config
from memo.models.model import num_parameters

__all__ = ["GPU_PEAK_TFLOPS", "detect_peak_flops", "flops_per_sample", "mfu"]


def flops_per_sample(config: ModelConfig | str, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one sequence of ``seq_len`` tokens.

    The formula of the Memo paper (Zhao et al. 2024, "Efficiently Training 7B LLM with
    1 Million Sequence Length on 8 GPUs", Sec. 5 MFU): ``6·s·P + 6·n·h·s²``, where P is the
    parameter count, n the number of layers and h the hidden size. The first term is the
    dense matmuls (2 FLOPs per parameter per token forward, twice that backward), the
    second is attention's score and value matmuls under the causal mask.

    P counts every parameter except GPT's learned position table, which is a lookup and
    does no matmul work (and whose size depends on the build, not the architecture).
    Recomputation is not counted: MFU measures useful model FLOPs.
    """
    c = get_config(config) if isinstance(config, str) else config
    if seq_len < 1:
        raise MemoError(f"memo.utils.flops: seq_len must be >= 1, got {seq_len}")
    params = num_parameters(c, max_seq_len=0)
    return 6.0 * seq_len * params + 6.0 * c.n_layers * c.hidden * float(seq_len) ** 2


#: Dense (no sparsity) peak TFLOPS per GPU, from the vendors' datasheets (NVIDIA A100, A800,
#: H100, H800, H200, L40S and GeForce RTX 4090 datasheets / architecture whitepapers).
#: bfloat16/float16 are tensor-core rates; float32 is the plain (non-TF32) FP32 rate,
#: which is what torch uses for float32 matmuls unless TF32 is enabled. Keys are matched
#: against ``torch.cuda.get_device_name()`` as substrings, most specific first.
GPU_PEAK_TFLOPS: dict[str, dict[torch.dtype, float]] = {
    "H100 PCIe": {torch.bfloat16: 756.0, torch.float16: 756.0, torch.float32: 51.0},
    "H100 NVL": {torch.bfloat16: 835.0, torch.float16: 835.0, torch.float32: 60.0},
    "H100": {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0},
    "H800": {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0},
    "H200": {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0},
    "A100": {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5},
    "A800": {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5},
    "L40S": {torch.bfloat16: 362.0, torch.float16: 362.0, torch.float32: 91.6},
    "RTX 4090": {torch.bfloat16: 165.0, torch.float16: 165.0, torch.float32: 82.6},
}


def detect_peak_flops(
    device: torch.device | str, dtype: torch.dtype, override: float | None = None
) -> float | None:
    """Peak FLOP/s (not TFLOPS) of ``device`` for matmuls in ``dtype``.

    ``override`` (FLOP/s) wins when given. Otherwise CUDA devices are looked up in
    :data:`GPU_PEAK_TFLOPS` by name; unknown GPUs and every CPU give ``None`` (a CPU's peak
    depends on cores, clock and vector units that torch does not report; pass an override).
    """
    if override is not None:
        if override <= 0:
            raise MemoError(f"memo.utils.flops: peak FLOP/s override must be > 0, got {override}")
        return float(override)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in GPU_PEAK_TFLOPS.items():
        if key in name and dtype in table:
            return table[dtype] * 1e12
    return None


def mfu(flops_per_sample: float, samples: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved ``flops_per_sample · samples / seconds`` over ``peak`` FLOP/s.

    ``None`` when the peak is unknown.
    """
    if peak is None:
        return None
    if seconds <= 0:
        raise MemoError(f"memo.utils.flops: seconds must be > 0 to compute MFU, got {seconds}")
    return flops_per_sample * samples / seconds / peak
