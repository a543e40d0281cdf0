"""Utilities shared by examples, benchmarks and the CLI: FLOPs/MFU and training-loop pieces."""

from memo.utils.flops import GPU_PEAK_TFLOPS, detect_peak_flops, flops_per_sample, mfu

__all__ = ["GPU_PEAK_TFLOPS", "detect_peak_flops", "flops_per_sample", "mfu"]
