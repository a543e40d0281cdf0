"""memo.profiler: record one iteration's allocation trace and measure what the alpha LP needs.

- :func:`record_trace` / :func:`record`: the dispatch recorder around one forward + backward
  (:mod:`memo.profiler.recorder`), giving a ``memo.trace`` dict (docs/formats.md).
- :func:`profile`: the whole flow of ``memo profile``: trace, S_* sizes, T_layer / B / host
  memory, alpha, wrapped second pass, plan (:mod:`memo.profiler.flow`).
See docs/profiling.md.
"""

from memo.profiler.context_parallel import check_context_parallel, rank_tokens, token_multiple
from memo.profiler.flow import DTYPES, ProfileResult, build_profile_model, profile, runtime_wrap
from memo.profiler.measure import (
    Quantity,
    estimate_layer_ms,
    gpu_names,
    gpu_peak_flops,
    layer_forward_flops,
    measure_bandwidth,
    time_layer_forward,
)
from memo.profiler.record import Recording, model_parts, record, record_trace
from memo.profiler.recorder import RECORDER_NAME, Allocation, DispatchRecorder
from memo.profiler.stats import LayerStats, layer_stats, offloaded_bytes, summarise_layers
from memo.profiler.units import parse_count

__all__ = [
    "DTYPES",
    "RECORDER_NAME",
    "Allocation",
    "DispatchRecorder",
    "LayerStats",
    "ProfileResult",
    "Quantity",
    "Recording",
    "build_profile_model",
    "check_context_parallel",
    "estimate_layer_ms",
    "gpu_names",
    "gpu_peak_flops",
    "layer_forward_flops",
    "layer_stats",
    "offloaded_bytes",
    "measure_bandwidth",
    "model_parts",
    "parse_count",
    "profile",
    "rank_tokens",
    "record",
    "record_trace",
    "runtime_wrap",
    "summarise_layers",
    "time_layer_forward",
    "token_multiple",
]
