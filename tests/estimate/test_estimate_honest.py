"""memo estimate held to what it claims (issue 41): the longest-sequence search returns the longest
length within its granularity; where host memory binds, memo keeps the inputs the host cannot hold on
the device and goes longer; Ulysses' exchange is recorded where it lives. Small models, meta profiles:
seconds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from memo.planner import LayerCosts, choose_policy

from memo.errors import MemoError
from memo.estimate import Estimator, Layout, Machine, longest_sequences
from memo.estimate.search import strategy_limit
from memo.units import GiB

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _host_for(layers: float, s_in: int) -> float:
    """``--host-mem-gb`` of a one-GPU node whose process may pin ``layers`` layer inputs (the 80% rule)."""
    return layers * s_in / 0.8 / 1e9


def test_the_search_answer_fits_and_one_granularity_more_does_not() -> None:
    # NOTE [Fast longest-sequence search]: the answer is the longest within the granularity, every
    # probe an estimate at its length.
    g = 1024
    est = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=0.2, host_mem_gb=1.0,
                                                                 gpus_per_node=1))
    (row,) = longest_sequences(est, [Layout(1)], ("full-recompute",), g, 256 << 10)
    best = row["best"]
    n = best["longest"]
    assert n > 4 * g and not best["capped_by_max_seq"] and best["first_failure"] == n + g, best
    limit = strategy_limit(est, "full-recompute")
    assert est.estimate(n, Layout(1), "full-recompute").total_bytes <= limit
    assert est.estimate(n + g, Layout(1), "full-recompute").total_bytes > limit


def test_where_the_host_binds_memo_keeps_inputs_on_the_device_and_goes_longer() -> None:
    # NOTE [Inputs on the device where the host binds], [Segments where the host binds]: a host that
    # holds 5 of gpt-mini's 12 layer inputs at 4K tokens: 5 pairs of layers share one input each (the
    # second a segment layer), and the 2 left recompute from an input kept on the device.
    seq, layers = 4096, 12
    probe = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0))
    s_in = probe.profiler.layer_sizes(Layout(1), seq)[0]
    machine = Machine(device_mem_gb=1.0, host_mem_gb=_host_for(5.5, s_in), gpus_per_node=1)
    est = Estimator("gpt-mini", dtype="float32", machine=machine)
    est.profiler.cache = probe.profiler.cache
    e = est.estimate(seq, Layout(1), "memo", least=True)
    assert (e.policy, e.segment_layers, e.recomputed_layers) == ("input-only", 5, layers - 10)
    assert e.host_bytes_per_process == 5 * s_in and e.fits
    assert "2 layers keep theirs on the device" in " ".join(e.notes)
    # the device pays for what the host cannot hold: no less than all-input-only (two recomputed layers
    # run their backward first, before the peak of the input-only ones), less than full recompute
    all_host = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0, host_mem_gb=64,
                                                                     gpus_per_node=1))
    all_host.profiler.cache = probe.profiler.cache
    lean = all_host.estimate(seq, Layout(1), "memo", least=True)
    assert lean.recomputed_layers == 0 and lean.total_bytes <= e.total_bytes
    assert e.total_bytes < all_host.estimate(seq, Layout(1), "full-recompute").total_bytes
    # the two counts extended linearly from 3- and 4-layer recordings agree with recording all 12
    extended = est.profiler.numbers("input-only", Layout(1), seq, recomputed=2, pairs=5)
    whole = est.profiler.numbers("input-only", Layout(1), seq, recomputed=2, pairs=5, whole_depth=True)
    assert abs(extended.activations - whole.activations) <= 0.01 * whole.activations, (extended, whole)
    # a host that holds 8 of the 12 inputs: 4 pairs, none on the device, and the device holds what it
    # holds with every input on the host (a segment layer's input is made in its own rounding buffer)
    eight = Estimator("gpt-mini", dtype="float32",
                      machine=Machine(device_mem_gb=1.0, host_mem_gb=_host_for(8.5, s_in), gpus_per_node=1))
    eight.profiler.cache = probe.profiler.cache
    paired = eight.estimate(seq, Layout(1), "memo", least=True)
    assert (paired.segment_layers, paired.recomputed_layers) == (4, 0)
    assert paired.host_bytes_per_process == 8 * s_in
    assert abs(paired.total_bytes - lean.total_bytes) <= 0.01 * lean.total_bytes, (paired, lean)



def test_where_the_host_binds_the_longest_sequence_goes_past_what_the_host_holds() -> None:
    # The 4-layer tiny model (recorded whole): a host that holds its 4 inputs at 2K tokens, one of them
    # at 8K; the longest sequence is past 2K (the device binds), some layers keeping their input there.
    g = 1024
    probe = Estimator("tiny", dtype="float32", machine=Machine(device_mem_gb=1.0))
    s_in = probe.profiler.layer_sizes(Layout(1), 2 * g)[0]
    machine = Machine(device_mem_gb=0.05, host_mem_gb=_host_for(4, s_in), gpus_per_node=1)
    est = Estimator("tiny", dtype="float32", machine=machine)
    (row,) = longest_sequences(est, [Layout(1)], ("memo",), g, 16 << 10)
    n, best = row["best"]["longest"], row["best"]["estimate"]
    assert n > 2 * g and best.recomputed_layers > 0 and best.policy == "input-only", (n, best)
    assert best.total_bytes <= strategy_limit(est, "memo") and row["best"]["first_failure"] == n + g


def test_a_host_that_holds_no_input_leaves_memo_nothing_to_offload() -> None:
    probe = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0))
    s_in = probe.profiler.layer_sizes(Layout(1), 8192)[0]
    est = Estimator("gpt-mini", dtype="float32",
                    machine=Machine(device_mem_gb=1.0, host_mem_gb=_host_for(0.5, s_in), gpus_per_node=1))
    est.profiler.cache = probe.profiler.cache
    with pytest.raises(MemoError, match="cannot hold even one layer's input"):
        est.estimate(8192, Layout(1), "memo", least=True)


def test_the_planner_fills_device_and_host_where_the_host_binds() -> None:
    # NOTE [Policy cost model], [Segments in the policy]: a host that holds 4 of 8 inputs; the device's
    # free bytes take the rest as recomputed layers (as fast as a segment's extra forward, and fewer
    # forwards in all); where the device has no room for them, pairs share an input (segment layers).
    c = LayerCosts(n_layers=8, s_input=100, s_attn=100, s_others=600, layer_time=1.0, attn_fraction=0.3,
                   base_bytes=1000, bandwidth=1e6, host_memory=400)
    roomy = choose_policy(c, 2500)
    assert roomy.counts["input-only"] + roomy.counts["memo"] >= 1 and roomy.counts["recompute"] >= 1
    assert roomy.counts["input-only"] * c.s_input + roomy.counts["memo"] * 200 <= c.host_memory
    assert roomy.parts["recomputed layers' inputs"] == roomy.counts["recompute"] * c.s_input
    tight = choose_policy(c, 2000)
    assert tight.policy == ["input-only", "segment"] * 4 and tight.device_bytes <= 2000
    # a host of 3 inputs: 3 pairs and 2 inputs on the device at least, which 2000 bytes cannot hold
    with pytest.raises(MemoError, match="no layer policy fits"):
        choose_policy(dataclasses.replace(c, host_memory=300), 2000)


def _llama(tmp_path: Path) -> str:
    """A Llama of eight layers, four query heads and two key/value heads (Ulysses over two ranks)."""
    path = tmp_path / "llama-8x128.json"
    path.write_text(json.dumps({"name": "llama-8x128", "arch": "llama", "n_layers": 8, "hidden": 128,
                                "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}))
    return str(path)


def test_ulysses_exchange_is_recorded_where_it_lives(tmp_path: Path) -> None:
    # NOTE [Ulysses in a meta estimate]: the head-sharded copies are in the recorded trace, so the
    # estimate lies between the rank's own-token profile and that profile with the whole exchange
    # counted on top of its peak (the old upper bound), and says so. The offloaded-checkpoint peer's
    # peak is in attention's backward here.
    from memo.estimate import attention_exchange_bytes
    from memo.estimate.plan_method import RankProfiler

    model, seq = _llama(tmp_path), 8192
    est = Estimator(model, dtype="float32", machine=Machine(device_mem_gb=1.0, host_mem_gb=64))
    ulysses = Layout(2, cp=2, cp_comm="a2a", sharding="full-offload")
    recorded = est.estimate(seq, ulysses, "offloaded-checkpoint")
    own = RankProfiler(est.config, model, est.dtype, est.machine).numbers(
        "offloaded-checkpoint", Layout(2, cp=2), seq).activations  # all-gather's meta rank: no exchange
    exchange = attention_exchange_bytes(est.config, ulysses, seq, 4)
    assert own + exchange / 2 < recorded.activations_bytes < own + exchange
    assert any("recorded where they live" in n for n in recorded.notes)


def test_qwen3_shape_is_counted_with_its_head_size() -> None:
    # NOTE [Estimator formula]: 64 heads of 128 at hidden 5120, QK-norm: Qwen's published 32.8B.
    from memo.estimate import FormulaShape, formula_parameters

    est = Estimator("qwen3-32b", method="formula")
    params = formula_parameters(FormulaShape.of(est.config), Layout(1))
    assert params == pytest.approx(32_762_123_264, rel=1e-9)
    assert est.estimate(8192, Layout(8, cp=8, cp_comm="a2a", sharding="full-offload"), "none").fits


def test_fit_limit_is_below_the_device() -> None:
    with pytest.raises(MemoError, match="--fit-limit-gib"):
        Estimator("gpt-mini", machine=Machine(device_mem_gb=1.0), fit_limit_bytes=int(2 * GiB))


def test_head_chunks_are_estimated_as_memo_train_runs_them(tmp_path: Path) -> None:
    # NOTE [Head chunks in an estimate]: chunks of whole key/value head groups (or of equal parts of one),
    # each one Ulysses can share; the estimate holds less, records the count and launches it.
    import dataclasses

    from memo.estimate import launch_command
    from memo.models.ulysses_attention import head_chunk_slices

    assert head_chunk_slices(32, 8, 8, 4) == [(slice(8 * j, 8 * j + 8), slice(2 * j, 2 * j + 2))
                                              for j in range(4)]
    with pytest.raises(MemoError, match="chunk of 2 query heads"):
        head_chunk_slices(32, 8, 8, 16)
    model, seq = _llama(tmp_path), 8192
    ulysses = Layout(2, cp=2, cp_comm="a2a", sharding="full-offload")
    machine = Machine(device_mem_gb=1.0, host_mem_gb=64)
    est = Estimator(model, dtype="float32", machine=machine)
    whole = est.estimate(seq, ulysses, "offloaded-checkpoint")
    chunked = est.estimate(seq, dataclasses.replace(ulysses, head_chunks=2), "offloaded-checkpoint")
    assert chunked.total_bytes < whole.total_bytes
    assert any("--ulysses-head-chunks 2" in n for n in chunked.notes)
    assert not any("--ulysses-head-chunks" in n for n in whole.notes)
    assert chunked.to_dict()["head_chunks"] == 2 and whole.to_dict()["head_chunks"] is None
    command = launch_command(est, chunked.layout, seq, "offloaded-checkpoint")
    assert "--cp-comm a2a --ulysses-head-chunks 2 " in command
    assert "--ulysses-head-chunks" not in launch_command(est, ulysses, seq, "offloaded-checkpoint")
    with pytest.raises(MemoError, match=r"do not split into 4 chunks \(legal counts: 1, 2\)"):
        est.estimate(seq, dataclasses.replace(ulysses, head_chunks=4), "offloaded-checkpoint")
    with pytest.raises(MemoError, match="head chunks are Ulysses'"):
        Layout(2, cp=2, head_chunks=2)
    with pytest.raises(MemoError, match="megatron runs Ulysses over its default chunks"):
        est.estimate(seq, Layout(2, cp=2, cp_comm="a2a", head_chunks=2), "offloaded-checkpoint")


def test_the_search_tries_memos_ulysses_layouts_at_the_finest_head_chunks(tmp_path: Path) -> None:
    # NOTE [Head chunks in the search]: memo's plans try the finest count beside the default; the default
    # ranks first where both fit, the peers and the formula keep the default only.
    from memo.estimate import longest_sequences
    from memo.estimate.search import with_head_chunks

    model = _llama(tmp_path)
    est = Estimator(model, dtype="float32", machine=Machine(device_mem_gb=1.0, host_mem_gb=64))
    ulysses = Layout(2, cp=2, cp_comm="a2a", sharding="full-offload")
    finer = Layout(2, cp=2, cp_comm="a2a", sharding="full-offload", head_chunks=2)
    assert with_head_chunks(est, [ulysses], "memo") == [ulysses, finer]
    assert with_head_chunks(est, [ulysses], "offloaded-checkpoint") == [ulysses]
    assert with_head_chunks(Estimator(model, method="formula"), [ulysses], "memo") == [ulysses]
    (found,) = longest_sequences(est, [ulysses], ("memo",), 4096, 1 << 20)
    rows = {r["layout"].head_chunks: r for r in found["layouts"]}
    assert set(rows) == {None, 2}
    best = found["best"]
    assert best["longest"] == max(r["longest"] for r in rows.values())
    if rows[2]["longest"] <= rows[None]["longest"]:
        assert best["layout"].head_chunks is None


def test_the_layer_input_is_counted_as_recorded() -> None:
    # RankProfiler.input_bytes (what host-bound estimates and search guesses read without recording) is
    # the S_input the rank's recorded layers hold, under tensor and context parallelism alike.
    est = Estimator("gpt-mini", dtype="float32")
    for layout in (Layout(1), Layout(2, tp=2), Layout(4, cp=2, pp=2)):
        assert est.profiler.input_bytes(layout, 4096) == est.profiler.layer_sizes(layout, 4096)[0]
