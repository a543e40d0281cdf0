"""The profile's setup cost (issue 45): a CPU recording after the job's first runs no warm-up
iteration, yet logs the same requests (NOTE [Warm-up before logging] in memo/pipeline/step.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memo import runtime
from memo.models import build_model
from memo.pipeline.step import ModelStep, record_step
from memo.profiler.record import model_parts

#: every kind of layer the runtime sizes buffers for, and two it does not
POLICY = ["input-only", "memo", "recompute", "keep"]


def _events(trace: dict) -> list[tuple]:
    return [(e["op"], e.get("id"), e.get("size"), e.get("phase")) for e in trace["events"]]


@pytest.fixture(scope="module")
def job(one_thread):
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 256))
    return model, (ids, torch.randint(0, 512, (1, 256)))


def test_prepared_recording_is_the_warmed_one(job):
    model, batch = job
    heads = []
    hook = model_parts(model).head[0].register_forward_hook(lambda *_: heads.append(1))
    try:
        traces = []
        for warmed in (False, True):
            runtime.wrap(model, alpha=0.25, policy=POLICY, recompute_chunk_tokens=64)
            try:
                heads.clear()
                traces.append(record_step(ModelStep(model, batch), torch.device("cpu"), {}, warmed=warmed))
                # the warm-up is a whole iteration; a prepared recording runs the head once, logged
                assert len(heads) == (1 if warmed else 2)
            finally:
                runtime.unwrap(model, force=True)
    finally:
        hook.remove()
    cold, prepared = traces
    assert len(cold["events"]) > 100
    assert _events(prepared) == _events(cold)
    assert all(p.grad is None for p in model.parameters())


# NOTE [A correction per tile] (planner/calibrate.py), without torch: gpt-mini at 4K, float32, CPU,
# within 0.08 GB, as recorded: memo at alpha 0 needs A + B / chunks (75,770,376 bytes in the default
# 2-chunk tile, 72,086,024 in 256-token tiles of 16 chunks) and 60.3 MB more per unit of alpha; the
# cost model says a 256-token tile saves 12.9 MB, the runtime saves 3.7 MB.
TILES = ((1024, 4), (512, 8), (256, 16))
BUDGET = 80 * 10**6


def _truth(policy: list[str], alpha: float, chunks: int) -> int:
    assert set(policy) == {"memo"}, policy  # the choice at 0.08 GB is every layer under memo
    return 71_560_000 + 8_420_000 // chunks + int(60_300_000 * alpha)


def _mini_4k(**calibrated: object):
    from memo.planner import LayerCosts

    costs = LayerCosts(n_layers=12, s_input=2097152, s_attn=2162688, s_others=29425664, layer_time=0.39,
                       attn_fraction=0.73, base_bytes=54856724, bandwidth=2.44e9, host_memory=20 << 30,
                       recompute_chunks=2, tile_choices=TILES, buffer_rounding=2 << 20)
    return dataclasses.replace(costs, **calibrated)


def _probe(costs):
    """probe_policy from the first choice of ``costs``: the recordings it made, (policy, alpha, tile)."""
    from memo.planner import AlphaInputs, PolicyRecording, choose_policy
    from memo.planner.calibrate import probe_policy

    from memo.pipeline import FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES

    made = []

    def record(chosen, alpha):
        chunks = costs.tile_costs(chosen.tile_tokens).recompute_chunks
        made.append((list(chosen.policy), alpha, chosen.tile_tokens))
        return PolicyRecording(_truth(list(chosen.policy), alpha, chunks))

    chosen = choose_policy(costs, BUDGET, None, FALLBACK_HEADROOM, FALLBACK_SEGMENT_BYTES)
    inputs = AlphaInputs(costs.s_input, costs.s_attn, costs.s_others, costs.bandwidth, costs.layer_time,
                         costs.n_layers, costs.host_memory)
    probed = probe_policy(chosen, costs, record, inputs=inputs, alpha=None, device_budget=BUDGET,
                          headroom=FALLBACK_HEADROOM, headroom_bytes=FALLBACK_SEGMENT_BYTES, may_probe=True,
                          say=lambda _line: None)
    last = made[-1]
    assert (last[1], last[2]) == (probed.alpha.alpha, probed.policy.tile_tokens)
    tile = costs.tile_costs(last[2]).recompute_chunks
    assert _truth(last[0], last[1], tile) <= probed.policy.device_cap  # what is planned fits when run
    return made, probed


def _calibrated(costs, tile):
    from memo.planner.calibrate import memo_calibration, with_recorded_memo

    policy, estimate = memo_calibration(costs, tile)
    recorded = _truth(policy, 0.0, costs.tile_costs(tile).recompute_chunks)
    return with_recorded_memo(costs, recorded, estimate, tile)


def test_a_smaller_tile_is_recorded_at_alpha_0_before_it_is_probed():
    # calibrated in the default tile alone (the calibration before issue 45): the choice runs 256-token
    # tiles, which are recorded at alpha 0 first; then two probes at most, not four
    made, probed = _probe(_calibrated(_mini_4k(), None))
    assert probed.policy.tile_tokens == 256 and probed.alpha.alpha > 0
    assert made[0] == (["memo"] * 12, 0.0, 256)
    assert len(made) <= 3, made


def test_calibrated_in_the_chosen_tile_the_probes_are_two_at_most():
    made, probed = _probe(_calibrated(_mini_4k(), 256))
    assert all(tile == 256 for _, _, tile in made)
    assert len(made) <= 2, made
    assert probed.alpha.alpha > 0.02


def test_a_tile_keeps_its_own_correction():
    from memo.planner.calibrate import memo_calibration, recorded_tile

    costs = _calibrated(_calibrated(_mini_4k(), None), 256)
    assert recorded_tile(costs, None) and recorded_tile(costs, 256) and not recorded_tile(costs, 512)
    for tile in (None, 256):
        policy, estimate = memo_calibration(costs, tile)
        assert estimate == _truth(policy, 0.0, costs.tile_costs(tile).recompute_chunks)
    # a tile not recorded takes the smallest recorded tile's correction
    assert costs.tile_costs(512).memo_overhead == costs.tile_costs(256).memo_overhead


def test_profile_runs_one_iteration_per_recording(one_thread, monkeypatch):
    """The profile's iterations on the CPU, counted: one per recording, none to warm up (NOTE [A
    calibration needs no warm-up] in memo/pipeline/policy.py); memo at alpha 0 is recorded first, in
    the tile the policy then runs (NOTE [A correction per tile])."""
    import memo.pipeline.policy as pipeline_policy
    from memo.pipeline import profile

    recorded, runs = [], []
    wrapped_pass = pipeline_policy.wrapped_pass

    def counted(job, net, ids, labels, alpha, progress, plain, policy, tile_tokens=None):
        recorded.append((list(policy), float(alpha), tile_tokens))
        return wrapped_pass(job, net, ids, labels, alpha, progress, plain, policy, tile_tokens)

    monkeypatch.setattr(pipeline_policy, "wrapped_pass", counted)
    run = ModelStep.run
    monkeypatch.setattr(ModelStep, "run", lambda self: (runs.append(1), run(self))[1])
    result = profile("tiny", 512, dtype="float32", device="cpu", layer_ms=5, bandwidth_gbps=10, host_mem_gb=4)
    n = len(result.policy.policy)
    assert recorded[0] == (["memo"] * n, 0.0, None) and recorded[1] == (["recompute"] * n, 0.0, None)
    assert 3 <= len(recorded) <= 4, recorded
    assert recorded[-1] == (list(result.policy.policy), result.alpha.alpha, result.policy.tile_tokens)
    assert len(runs) == len(recorded)  # pass 2 is the last probe, and nothing warms up


def test_full_recompute_recorded_after_memo_moves_no_memo_estimate():
    """NOTE [Full recompute where it can change the choice] (memo/pipeline/policy.py): recorded after
    memo's correction, full recompute moves the constant part and memo's correction the other way."""
    from memo.planner import full_recompute_need
    from memo.planner.calibrate import memo_calibration, with_recorded_full_recompute

    costs = _calibrated(_calibrated(_mini_4k(), None), 256)
    after = with_recorded_full_recompute(costs, 103_458_568)  # gpt-mini at 4K, recorded
    assert full_recompute_need(after) == 103_458_568 and after.base_bytes != costs.base_bytes
    for tile in (None, 1024, 256):
        assert memo_calibration(after, tile) == memo_calibration(costs, tile)
