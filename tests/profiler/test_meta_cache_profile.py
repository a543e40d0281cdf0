"""A profile on the meta device reuses meta kernels' outputs by their inputs' shapes (NOTE [Meta kernels by
their inputs' shapes] in memo/profiler/meta_cache.py): its trace and plan are the ones every kernel run
gives, event for event."""

from __future__ import annotations

import pytest

from memo.pipeline import profile
from memo.profiler import meta_cache

MACHINE = {"layer_ms": 5.0, "bandwidth_gbps": 10.0, "host_mem_gb": 4.0}


@pytest.mark.parametrize(("model", "seq_len", "alpha"), [("tiny", 2048, None), ("llama-tiny", 1024, 0.5)])
def test_a_meta_profile_with_reused_kernels_is_the_one_with_every_kernel_run(
        model: str, seq_len: int, alpha: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {"ops": 0}
    real = meta_cache.MetaKernelCache.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        seen["ops"] += 1
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(meta_cache.MetaKernelCache, "__torch_dispatch__", counted)
    reused = profile(model, seq_len, dtype="float32", device="meta", alpha=alpha, time_limit=2, **MACHINE)
    assert seen["ops"] > 1000  # the cache saw the profile's ops
    monkeypatch.setattr("memo.pipeline.MetaKernelCache", lambda: None)  # reused(None): every kernel runs
    every = profile(model, seq_len, dtype="float32", device="meta", alpha=alpha, time_limit=2, **MACHINE)
    assert reused.trace["events"] == every.trace["events"]
    assert reused.alpha.alpha == every.alpha.alpha and reused.policy == every.policy
    one, two = reused.plan.to_dict(), every.plan.to_dict()
    one.pop("solver"), two.pop("solver")
    assert one == two
