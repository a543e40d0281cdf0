"""memo.profiler: record one iteration's allocation trace and measure what the alpha LP needs.

- :func:`record_trace` / :func:`record`: the dispatch recorder around one forward + backward
  (:mod:`memo.profiler.recorder`), giving a ``memo.trace`` dict (docs/formats.md).
- :mod:`memo.profiler.measure`: the machine numbers (T_layer, B, host memory), given, measured
  or estimated; :mod:`memo.profiler.stats`: S_input, S_attn, S_others per layer.

The profiler only records and measures: it imports neither the runtime, nor the allocator, nor
the planner. :mod:`memo.pipeline` turns its recordings into a plan (``memo profile``).
See docs/profiling.md.
"""

from memo.profiler.context_parallel import check_context_parallel, rank_tokens, token_multiple
from memo.profiler.counts import parse_count
from memo.profiler.measure import (
    Quantity,
    check_machine,
    estimate_layer_ms,
    gpu_names,
    gpu_peak_flops,
    layer_forward_flops,
    measure_bandwidth,
    measure_machine,
    time_layer_forward,
)
from memo.profiler.record import (
    Recording,
    layer_inputs,
    meta_copy,
    model_parts,
    phase_tracker,
    record,
    record_trace,
)
from memo.profiler.recorder import RECORDER_NAME, Allocation, DispatchRecorder
from memo.profiler.stats import LayerStats, layer_stats, offloaded_bytes, summarise_layers

__all__ = [
    "RECORDER_NAME",
    "Allocation",
    "DispatchRecorder",
    "LayerStats",
    "Quantity",
    "Recording",
    "check_context_parallel",
    "check_machine",
    "estimate_layer_ms",
    "gpu_names",
    "gpu_peak_flops",
    "layer_forward_flops",
    "layer_inputs",
    "layer_stats",
    "measure_bandwidth",
    "measure_machine",
    "meta_copy",
    "model_parts",
    "offloaded_bytes",
    "parse_count",
    "phase_tracker",
    "rank_tokens",
    "record",
    "record_trace",
    "summarise_layers",
    "time_layer_forward",
    "token_multiple",
]
