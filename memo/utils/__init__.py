"""Utilities shared by the profiler, the training loop (memo.train) and benchmarks: FLOPs and MFU."""

from memo.utils.flops import GPU_PEAK_TFLOPS, detect_peak_flops, flops_per_sample, mfu

__all__ = ["GPU_PEAK_TFLOPS", "detect_peak_flops", "flops_per_sample", "mfu"]
