"""Device truth: host memory (the pinned arena, host copies) never appears in a device trace or plan."""

from __future__ import annotations

import pytest

from memo.pipeline import profile

MACHINE = {"bandwidth_gbps": 32, "layer_ms": 3.0, "host_mem_gb": 64, "time_limit": 2.0}


def _check_the_arena_is_not_in_the_trace(result) -> None:
    assert result.wrapped and result.plan.host_bytes > 0
    sizes = [e["size"] for e in result.trace["events"] if e["op"] == "malloc"]
    assert result.plan.host_bytes not in sizes
    # Nothing in the trace is as large as the arena: every allocation is device memory of one
    # layer pass, the head or a gradient, all smaller than the host bytes of all offloaded layers.
    assert max(sizes) < result.plan.host_bytes


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("model", "seq", "device", "recorder"), [
    ("tiny", 512, "cpu", "dispatch"),
    ("tiny", 512, "cpu", "allocator"),
    ("gpt-mini", 512, "cpu", "allocator"),
])
def test_the_host_arena_is_not_in_the_device_trace(model: str, seq: int, device: str, recorder: str) -> None:
    result = profile(model, seq, 1, device=device, recorder=recorder, dtype="float32", **MACHINE)
    _check_the_arena_is_not_in_the_trace(result)


# gpt-125m at 8K on meta, the trace the 159.6 GiB arena once appeared in, is checked in
# tests/profiler/test_offload_bytes.py, beside the other test of that profile (one profile per worker).


def test_a_meta_trace_holds_meta_storages_only() -> None:
    import torch

    from memo.models import build_model
    from memo.profiler import record

    model = build_model("tiny", device="meta", dtype=torch.bfloat16)
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")
    cpu_made = []

    def with_cpu_tensor(module, args):  # a layer that also makes a CPU tensor (an RNG state, say)
        cpu_made.append(torch.get_rng_state())

    model.layers[0].register_forward_pre_hook(with_cpu_tensor)
    rec = record(model, ids, ids)
    assert cpu_made and all(a.size != cpu_made[0].numel() for a in rec.recorder.allocations.values())
