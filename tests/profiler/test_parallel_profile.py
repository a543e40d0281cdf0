"""What a rank of a parallel job needs from memo's profile, in one process.

NOTE [Decisions every rank shares] (memo/pipeline/policy.py): every recorded peak that decides the layer
policy goes through ``agree_max`` (a collective in a parallel job), so that every rank records the
same iterations. And a model instance can be profiled with its training loop's own loss
(memo.adapters.model.use_model_adapter), so that the recorded iteration is the step's.
"""

from __future__ import annotations

import torch

from memo.adapters.model import MemoModelAdapter, find_model_adapter, use_model_adapter
from memo.models import build_model
from memo.pipeline import profile

_MACHINE = {"bandwidth_gbps": 10.0, "layer_ms": 5.0, "host_mem_gb": 64.0}


def _profile(**kw):
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    return profile(model, 128, 1, device="cpu", plan=False, **_MACHINE, **kw)


def test_every_recorded_peak_that_decides_the_policy_is_agreed() -> None:
    seen: list[int] = []
    alone = _profile()
    agreed = _profile(agree_max=lambda v: seen.append(v) or v)
    # full recompute's and memo's calibration iterations (and the chosen policy's probe, with memo layers)
    assert len(seen) >= 2 and all(v > 0 for v in seen)
    assert agreed.policy.policy == alone.policy.policy and agreed.alpha.alpha == alone.alpha.alpha

    # another rank's larger peaks are every rank's: a full-recompute iteration that needs more makes the
    # estimate of full recompute larger here too
    more = _profile(agree_max=lambda v: v + (64 << 20))
    assert more.policy.full_recompute_bytes > alone.policy.full_recompute_bytes


def test_a_model_instance_can_have_its_own_loss() -> None:
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    calls = []

    class Doubled(MemoModelAdapter):
        def loss(self, model, ids, labels):
            calls.append(ids.shape)
            return 2 * super().loss(model, ids, labels)

    other = build_model("tiny", dtype=torch.float32, device="cpu")
    use_model_adapter(model, Doubled())
    try:
        assert isinstance(find_model_adapter(model), Doubled)
        assert type(find_model_adapter(other)) is MemoModelAdapter  # only that instance
        profile(model, 128, 1, device="cpu", plan=False, **_MACHINE)
        assert calls  # the profile's recorded iterations ran the instance's loss
    finally:
        use_model_adapter(model, None)
    assert type(find_model_adapter(model)) is MemoModelAdapter
