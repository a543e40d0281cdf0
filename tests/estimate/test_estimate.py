"""`memo estimate` (issue 15): the seed's closed form against hand-computed cases, the issue's JSON
command, one-line errors, the meta-profile method against whole-depth profiles, and against the
device peak `memo train --report` measures on CPU.

The expected formula numbers are written out here from the seed's equations
(../shared/seeds/000_memory_estimator.md, eqs. 6, 10, 17), not taken from memo's code: a change to
memo/estimate/formula.py that changes them fails here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from memo.cli.main import main
from memo.errors import MemoError
from memo.estimate import Estimator, Layout, Machine, estimate

GiB = 2**30

# Llama-3.1-8B's published shapes: 32 layers, h 4096, 32 heads, 8 key/value heads (GQA, k < a),
# MLP 14336, vocabulary 128256, untied LM head.
H, A, K, FFN, L, V = 4096, 32, 8, 14336, 32, 128256


def _llama_layer_params(t: int) -> float:
    """One layer's parameters per TP rank, eq. 3's bracket: 2h²((1 + k/a + 3/2·h_ffn/h)/t + 1/h)."""
    return 2 * H * H * ((1 + K / A + 1.5 * FFN / H) / t + 1 / H)


def _llama_activations(s: int, b: int, t: int, c: int, p: int) -> float:
    """Eq. 17: s·b·h/(t·c)·((12 + 4k/a + 8h_ffn/h)·L + 8p + δ(p,1)·4(1 + v/h))."""
    head = 4 * (1 + V / H) if p == 1 else 0
    return s * b * H / (t * c) * ((12 + 4 * K / A + 8 * FFN / H) * L + 8 * p + head)


def test_formula_p_greater_than_one_is_the_issue_case() -> None:
    # N 8 = t 4 x c 1 x p 2 x d 1, s 8192, b 1. First stage: the embedding and 16 layers (eq. 10).
    params = H * V / 4 + (L / 2) * _llama_layer_params(4)
    states = (6 + 12 / (1 * 1)) * params
    acts = _llama_activations(8192, 1, 4, 1, 2)
    # By hand: hv/t = 131,334,144; 16 layers x 2h²(1.625 + 1/4096) = 872,546,304.
    assert params == 1_003_880_448
    assert states == 18_069_848_064
    assert acts == 8_388_608 * (41 * 32 + 16) == 11_140_071_424
    e = estimate("llama-3.1-8b", 8192, gpus=8, tp=4, cp=1, pp=2, micro_batch=1, strategy="none",
                 method="formula")
    assert (e.parameters, e.model_states_bytes, e.activations_bytes) == (params, states, acts)
    assert e.layout.dp == 1 and e.fits  # 27.20 GiB of 80% of 80 GB


def test_formula_p_one_holds_embedding_and_untied_head() -> None:
    # p = 1 (eq. 6): the single stage holds the embedding, the untied LM head (a second h·v/t),
    # the final RMSNorm (h) and all L layers; its activations add the LM head's 4sbh(1 + v/h).
    t, s = 8, 4096
    params = 2 * H * V / t + H + L * _llama_layer_params(t)
    assert params == 131_334_144 + 4096 + 872_677_376 == 1_004_015_616
    acts = _llama_activations(s, 1, t, 1, 1)
    assert acts == 2_097_152 * (41 * 32 + 8 + 4 * (1 + 31.3125)) == 3_039_297_536
    e = estimate("llama-3.1-8b", s, gpus=8, tp=t, strategy="none", method="formula")
    assert e.parameters == params
    assert e.model_states_bytes == 18 * params
    assert e.activations_bytes == acts


def test_formula_context_parallel_splits_activations_and_zero_over_d_times_c() -> None:
    # N 16 = t 2 x c 4 x p 1 x d 2: optimizer states split over d·c = 8 (eq. 10), activations over t·c.
    t, c, d, s = 2, 4, 2, 32768
    params = 2 * H * V / t + H + L * _llama_layer_params(t)
    assert params == 4_015_263_744
    e = estimate("llama-3.1-8b", s, gpus=16, tp=t, cp=c, strategy="none", method="formula")
    assert e.layout.dp == d
    assert e.model_states_bytes == round((6 + 12 / (d * c)) * params) == 30_114_478_080
    assert e.activations_bytes == _llama_activations(s, 1, t, c, 1) == 24_314_380_288


def test_formula_gqa_counts_fewer_key_value_bytes() -> None:
    # k < a shrinks K and V: parameters 2h²(1 + k/a ...) and activations 4sbh·k/a. Same shapes with
    # k = a (a JSON config) must need exactly the difference.
    s = 8192
    gqa = estimate("llama-3.1-8b", s, gpus=1, strategy="none", method="formula")
    from memo.models import ModelConfig, register_config

    name = "llama-3.1-8b-mha-test"
    from memo.models import list_configs

    if name not in list_configs():
        register_config(ModelConfig(name=name, arch="llama", n_layers=L, hidden=H, n_heads=A, n_kv_heads=A,
                                    ffn_hidden=FFN, vocab_size=V))
    mha = estimate(name, s, gpus=1, strategy="none", method="formula")
    assert mha.parameters - gqa.parameters == L * 2 * H * H * (1 - K / A)
    assert mha.activations_bytes - gqa.activations_bytes == s * H * 4 * (1 - K / A) * L


def test_formula_for_gpt_counts_sixteen_elements_per_layer_and_a_tied_head() -> None:
    # memo's GPT: a GELU MLP of two matrices (skeletal: 2sbh + 4sb·h_ffn) and the LM head tied to
    # the embedding. With h_ffn = 4h a layer keeps 32 bytes = 16 bf16 elements per s·b·h, the
    # paper's count (DESIGN.md); p = 1 has one h·v/t, not two.
    h, v, layers, s, t = 4096, 50257, 32, 1 << 20, 8
    e = estimate("gpt-7b", s, gpus=8, tp=t, strategy="none", method="formula")
    assert e.parameters == round(h * v / t + h + layers * 2 * h * h * ((1 + 1 + 4) / t + 1 / h))
    assert e.activations_bytes == round(s * h / t * (32 * layers + 8 + 4 * (1 + v / h)))


def test_formula_full_recompute_keeps_layer_inputs_and_one_layer() -> None:
    s, t = 65536, 8
    e = estimate("llama-3.1-8b", s, gpus=16, tp=t, pp=2, strategy="full-recompute", method="formula")
    coefficient = 12 + 4 * K / A + 8 * FFN / H
    assert e.activations_bytes == s * H / t * (2 * L + coefficient + 8 * 2)


def test_issue_command_prints_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "llama-3.1-8b", "--seq-len", "8192", "--gpus", "8", "--tp", "4",
                 "--cp", "1", "--pp", "2", "--micro-batch", "1", "--strategy", "none", "--method", "formula",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "memo.estimate" and out["version"] == 1
    assert out["dp"] == 1 and out["fits"] is True
    assert out["model_states_gib"] == round(18_069_848_064 / GiB, 4)
    assert out["activations_gib"] == round(11_140_071_424 / GiB, 4)
    assert out["total_gib"] == round((18_069_848_064 + 11_140_071_424) / GiB, 4)
    assert out["limit_gib"] == round(0.8 * 80e9 / GiB, 4)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--model", "llama-3.1-8b", "--seq-len", "8192", "--gpus", "8", "--tp", "3"],
     "TP 3 x CP 1 x PP 1 = 3 GPUs does not divide the 8 GPUs"),
    (["--model", "llama-3.1-8b", "--seq-len", "8192", "--gpus", "16", "--tp", "16"],
     "TP 16 does not divide its 8 key/value heads"),
    (["--model", "llama-3.1-8b", "--seq-len", "8192", "--gpus", "6", "--pp", "3"],
     "PP 3 does not divide its 32 layers"),
    (["--model", "llama-3.1-8b", "--seq-len", "8190", "--gpus", "2", "--cp", "2"],
     "seq len 8,190 cannot be split over TP 1 x CP 2"),
    (["--model", "no-such-model", "--seq-len", "8192"], "unknown model 'no-such-model'"),
    (["--model", "llama-3.1-8b", "--seq-len", "1M", "--gpus", "8", "--search", "--method", "formula",
      "--strategy", "none", "--device-mem-gb", "1"], "no layout of 8 GPUs fits none at seq len 1,048,576"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--max-seq", "--method", "formula", "--device-mem-gb", "1"],
     "the smallest need is"),
    (["--model", "llama-3.1-8b", "--seq-len", "8192", "--method", "formula", "--strategy", "memo"],
     "use --method plan"),
    (["--model", "llama-3.1-8b"], "give --seq-len, or --max-seq"),
])
def test_errors_are_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # progress lines of a search come first
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    assert errors[0].startswith("error: memo") and expected in errors[0], errors


def test_the_smallest_need_is_named() -> None:
    from memo.estimate import search_layouts

    est = Estimator("llama-3.1-8b", method="formula", machine=Machine(device_mem_gb=10))
    with pytest.raises(MemoError, match=r"the smallest need is [\d.,]+ GiB per GPU \(TP"):
        search_layouts(est, 1 << 20, 8, "none")


def test_search_ranks_fitting_layouts_with_fewest_communicating_ranks_first(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "llama-3.1-8b", "--seq-len", "32K", "--gpus", "8", "--search",
                 "--method", "formula", "--strategy", "none", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    # t | 8 key/value heads, c, p | 32 layers: every (t, c, p) whose product divides 8 (10 of the 20 with
    # c > 1, each also as Ulysses all-to-all: 32 heads and 8 key/value heads take any c | 8) under
    # megatron's distributed optimizer; FSDP2's two shardings (NOTE [Sharded model states]) only where
    # memo train runs them (NOTE [Layouts memo train launches]): t = p = 1, c = 1 or Ulysses c in 2, 4, 8.
    assert len(rows) == (20 + 10) + 2 * 4
    states = {(r["tp"], r["cp"], r["pp"], r["cp_comm"], r["sharding"]): r["estimate"]["model_states_bytes"]
              for r in rows}
    for (t, c, p, comm, sharding), b in states.items():
        if sharding == "full":  # ZeRO-3 holds a share of every state: less than ZeRO-1 once d·c > 1
            assert (b < states[t, c, p, comm, "optimizer"]) == (8 // (t * p) > 1), (t, c, p, b)
            assert states[t, c, p, comm, "full-offload"] < b
    fits = [r["estimate"]["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # fitting layouts first
    fitting = [r for r in rows if r["estimate"]["fits"]]
    ranks = [r["tp"] * r["cp"] * r["pp"] for r in fitting]
    assert ranks == sorted(ranks)
    assert all(r["estimate"]["total_gib"] <= r["estimate"]["limit_gib"] for r in fitting)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("strategy", ["none", "full-recompute", "memo"])
@pytest.mark.parametrize("pp", [1, 2])
def test_two_depths_extended_are_the_whole_depth(strategy: str, pp: int) -> None:
    # NOTE [Estimate from a meta profile]: gpt-mini's 12 (or 6 per stage) layers from 3 and 4.
    est = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0))
    layout = Layout(pp, pp=pp)
    alpha = 0.3 if strategy == "memo" else None
    extended = est.profiler.numbers(strategy, layout, 2048, alpha)
    whole = est.profiler.numbers(strategy, layout, 2048, alpha, whole_depth=True)
    for name in ("iteration", "activations", "stage_activations", "held", "gradients"):
        a, b = getattr(extended, name), getattr(whole, name)
        assert abs(a - b) <= 0.005 * b, (name, a, b)


@pytest.mark.usefixtures("one_thread")
def test_the_first_stage_is_recorded_with_its_forwards_in_flight() -> None:
    """NOTE [First stage under 1F1B]: the first stage's 1F1B step is recorded, p forwards before the first
    backward, phases named per micro-batch. Without any saving, L/p layers of p micro-batches hold what
    L layers of one do: the first stage's activations hardly change with p, where one micro-batch's
    stage falls as 1/p."""
    from memo.estimate.plan_method import _rank_model, record_first_stage
    from memo.phase_names import phase_micro_batch

    est = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0))
    stage = {p: est.profiler.numbers("none", Layout(p, pp=p), 1024).activations for p in (2, 4)}
    one = {p: est.profiler._record("none", Layout(p, pp=p), 1024, 12 // p, None, stage=False)[0].activations
           for p in (2, 4)}
    assert abs(stage[4] - stage[2]) <= 0.01 * stage[2], stage
    assert one[4] < 0.6 * one[2] and stage[4] > 1.5 * one[4], (one, stage)
    model = _rank_model(est.config, 3, Layout(3, pp=3), 512, est.dtype, "none")
    trace = record_first_stage(model, Layout(3, pp=3), 512, {})
    phases = [e["phase"] for e in trace["events"] if e["op"] == "malloc" and e.get("phase")]
    assert {phase_micro_batch(ph) for ph in phases} == {0, 1, 2}
    first_backward = next(i for i, ph in enumerate(phases) if ph.startswith("layer.bwd"))
    assert {phase_micro_batch(ph) for ph in phases[:first_backward]} == {0, 1, 2}  # 3 forwards first
    assert phases[first_backward] == "layer.bwd[2]@0"


@pytest.mark.usefixtures("one_thread")
def test_a_pipeline_estimate_is_its_larger_stage() -> None:
    """NOTE [Last stage under 1F1B]: the activations of a p > 1 layout are the larger of the first stage's
    step (p forwards) and the last stage's iteration (its LM head)."""
    est = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0))
    layout = Layout(2, pp=2)
    first = est.profiler.numbers("memo", layout, 1024, 0.3)
    last = est.profiler.numbers("memo", layout, 1024, 0.3, stage=False)
    assert last.activations != first.activations
    assert est._activations("memo", layout, 1024, 0.3) == max(first.activations, last.activations)
    none = est.profiler.numbers("none", layout, 1024)
    assert est._activations("none", layout, 1024, None) == max(
        none.activations, est.profiler.numbers("none", layout, 1024, stage=False).activations)


@pytest.fixture(scope="module")
def gpt_7b_profiles() -> dict:
    """The meta profiles of gpt-7b's TP-8 rank at 1M tokens, shared by the Estimators below.

    A RankProfiler's cache is keyed by what a profile depends on (strategy, layout, length, depth,
    alpha); the machines below differ only in device memory, which no profile depends on (it
    decides which alpha is asked for, and alpha is in the key). Each profile takes seconds."""
    return {}


@pytest.mark.slow
def test_plan_method_orders_the_strategies_at_scale(gpt_7b_profiles: dict) -> None:
    # 7B at 1M tokens on one TP-8 rank in seconds (meta): none needs far more than full recompute,
    # and memo (every layer offloaded, alpha from the LP) less than full recompute.
    est = Estimator("gpt-7b", machine=Machine(host_mem_gb=2048, gpus_per_node=8))
    est.profiler.cache = gpt_7b_profiles  # run first in this file: the cache is empty here
    layout = Layout(8, tp=8)
    got = {s: est.estimate(1 << 20, layout, s) for s in ("none", "full-recompute", "memo")}
    assert got["none"].total_bytes > 5 * got["full-recompute"].total_bytes
    assert got["memo"].total_bytes < got["full-recompute"].total_bytes
    memo = got["memo"]
    assert memo.fits and 0 < memo.alpha < 1 and memo.alpha_binding == "host_memory"
    # Every GPU of the node pins its share: 8 x 0.8 x 2048 GB / 8, nearly all of it.
    assert 0.9 * 0.8 * 2048e9 <= memo.host_bytes_per_node <= 0.8 * 2048e9 + 8
    assert est.profiler.profiles <= 8


@pytest.mark.slow
def test_memo_alpha_is_lowered_until_it_fits(gpt_7b_profiles: dict) -> None:
    roomy = Estimator("gpt-7b", machine=Machine(device_mem_gb=200))
    tight = Estimator("gpt-7b", machine=Machine(device_mem_gb=46))
    roomy.profiler.cache = tight.profiler.cache = gpt_7b_profiles
    layout = Layout(8, tp=8)
    a, b = roomy.estimate(1 << 20, layout, "memo"), tight.estimate(1 << 20, layout, "memo")
    assert a.fits and a.alpha_binding == "host_memory"
    assert b.fits and b.alpha < a.alpha and b.alpha_binding == "device memory"
    assert b.total_bytes <= b.limit_bytes < a.total_bytes


def test_longest_sequence_search_is_monotone_and_exact(capsys: pytest.CaptureFixture[str]) -> None:
    # Formula method, so each estimate is arithmetic: the length found fits and one more step does not.
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--tp", "8", "--max-seq",
                 "--method", "formula", "--granularity", "8K", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in out["strategies"]}
    assert set(rows) == {"none", "full-recompute"}
    assert rows["full-recompute"]["longest"] > rows["none"]["longest"] > 0
    for name, row in rows.items():
        n = row["longest"]
        at = estimate("llama-3.1-8b", n, gpus=8, tp=8, strategy=name, method="formula")
        beyond = estimate("llama-3.1-8b", n + 8192, gpus=8, tp=8, strategy=name, method="formula")
        assert at.fits and not beyond.fits


def test_plot_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "memory.png"
    assert main(["estimate", "--model", "llama-3.1-8b", "--seq-len", "64K", "--gpus", "8", "--tp", "8",
                 "--method", "formula", "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert f"plot: {out}" in capsys.readouterr().out


def test_sharded_states_split_what_each_sharding_splits() -> None:
    # NOTE [Sharded model states], counted by the closed form: w, g, o = 2, 4, 12 bytes per parameter;
    # FSDP2's shard is the fp32 master within o, so it holds g + o = 16 of them.
    from memo.estimate import FormulaShape, formula_layer_parameters, formula_parameters

    est = Estimator("llama-3.1-8b", method="formula")
    shape = FormulaShape.of(est.config)
    for layout in (Layout(8, cp=8), Layout(8, tp=2, cp=2, pp=2)):
        params = formula_parameters(shape, Layout(layout.gpus, layout.tp, layout.cp, layout.pp))
        shards = layout.dp * layout.cp
        gathered = (2 * 2 + 4) * formula_layer_parameters(shape, layout)
        got = {sharding: est.state_bytes(dataclasses.replace(layout, sharding=sharding), 8192)
               for sharding in ("optimizer", "full", "full-offload")}
        assert got["optimizer"][1:] == (pytest.approx((6 + 12 / shards) * params, rel=1e-6), 0)
        assert got["full"][1:] == (pytest.approx(16 * params / shards + gathered, rel=1e-6), 0)
        assert got["full-offload"][1:] == (pytest.approx(gathered, rel=1e-6),
                                           pytest.approx(16 * params / shards, rel=1e-6))
    offloaded = Layout(8, cp=8, cp_comm="a2a", sharding="full-offload")  # FSDP2's CP is Ulysses
    e = est.estimate(8192, offloaded, "none")
    assert e.host_bytes_per_process == est.state_bytes(offloaded, 8192)[2] and "host memory" in e.notes[0]


def test_memo_rows_use_the_plan_budget_and_the_others_the_80_percent_rule() -> None:
    # NOTE [Fit limits]
    from memo.pipeline.device import usable_device_bytes

    est = Estimator("tiny", dtype="float32", machine=Machine(device_mem_gb=0.5, host_mem_gb=8))
    memo, fr = est.estimate(2048, Layout(1), "memo"), est.estimate(2048, Layout(1), "full-recompute")
    assert (memo.limit_rule, fr.limit_rule) == ("plan", "fraction")
    assert memo.limit_bytes == usable_device_bytes(int(0.5e9)) > fr.limit_bytes == int(0.4e9)
    assert memo.to_dict()["limit_rule"] == "plan" and memo.policy == "memo"


def test_memo_goes_input_only_where_the_host_binds() -> None:
    # NOTE [Memo's policy in an estimate]: a host that holds every layer's input but not its input and
    # attention output as well.
    probe = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0))
    s_in, s_attn, _ = probe.profiler.layer_sizes(Layout(1), 4096)
    layers = probe.config.n_layers
    per_process = layers * (s_in + s_attn // 2)  # between L·S_input and L·(S_input + S_attn)
    machine = Machine(device_mem_gb=1.0, host_mem_gb=per_process / 0.8 / 1e9, gpus_per_node=1)
    auto = Estimator("gpt-mini", dtype="float32", machine=machine)
    auto.profiler.cache = probe.profiler.cache
    e = auto.estimate(4096, Layout(1), "memo")
    assert (e.policy, e.alpha, e.alpha_binding) == ("input-only", None, "host memory")
    assert e.host_bytes_per_process == layers * s_in <= auto.machine.host_per_process()
    forced = Estimator("gpt-mini", dtype="float32", machine=machine, memo_policy="memo")
    with pytest.raises(MemoError, match="host memory too small"):
        forced.estimate(4096, Layout(1), "memo")
    # a host of one layer's input: that layer input-only with a segment layer after it, the others
    # recompute from the device (NOTE [Segments where the host binds], [Inputs on the device where the
    # host binds]); of half of one: nothing to offload
    small = Estimator("gpt-mini", dtype="float32",
                      machine=Machine(device_mem_gb=1.0, host_mem_gb=s_in / 0.8 / 1e9, gpus_per_node=1))
    small.profiler.cache = probe.profiler.cache
    one = small.estimate(4096, Layout(1), "memo")
    assert (one.segment_layers, one.recomputed_layers) == (1, layers - 2)
    smaller = Estimator("gpt-mini", dtype="float32",
                        machine=Machine(device_mem_gb=1.0, host_mem_gb=s_in / 2 / 0.8 / 1e9, gpus_per_node=1))
    with pytest.raises(MemoError, match="cannot hold even one layer's input"):
        smaller.estimate(4096, Layout(1), "memo")
    with pytest.raises(MemoError, match="--memo-policy must be one of auto, memo, input-only"):
        Estimator("gpt-mini", memo_policy="fastest")


def test_confirm_reports_only_lengths_that_fit() -> None:
    # NOTE [Fast longest-sequence search]: a total that bends upward (the line from short lengths
    # overshoots), and one that cannot run past a length (a host limit): the answer fits and one
    # granularity more does not, in a handful of probes.
    from memo.estimate.search import confirm

    limit, g = 1000, 8

    def bending(n: int) -> int:
        return 100 + n + n * n // 4000

    got = confirm(bending, limit, g, 10_000, [64, 128], 900)
    assert got["longest"] % g == 0 and bending(got["longest"]) <= limit < bending(got["longest"] + g)
    assert got["first_failure"] == got["longest"] + g
    assert len(got["tries"]) <= 6

    def host_bound(n: int) -> int | None:
        return None if n > 400 else 100 + n

    got = confirm(host_bound, limit, g, 10_000, [64, 128], 900)
    assert got["longest"] == 400 and got["first_failure"] == 408

    # a later layout that cannot go past the best one is settled by one probe
    got = confirm(bending, limit, g, 10_000, [64, 128], 700, beat=900)
    assert got["settled"] and got["tries"] == [904] and got["longest"] == 128


def test_plan_search_screens_families_and_confirms_its_answers(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 GPUs: six (TP, CP, PP) families, more than the search profiles; every length reported is one
    # an estimate at that length found to fit.
    from memo.estimate import longest_sequences, valid_layouts
    from memo.estimate.search import SCREENED_FAMILIES, strategy_limit

    est = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=0.08, host_mem_gb=1))
    layouts = [lay for lay in valid_layouts(est.config, 4, None, (1,), data_parallel_one=True,
                                            shardings=("optimizer", "full"))
               if not lay.problems(est.config, 1024)]
    rows = longest_sequences(est, layouts, ("full-recompute", "memo"), 1024, 64 << 10)
    for row in rows:
        searched = {(x["layout"].tp, x["layout"].cp, x["layout"].pp) for x in row["layouts"]
                    if not (x["pruned"] and x["guess"] is None)}
        assert len(searched) == SCREENED_FAMILIES
        best = row["best"]
        assert best is not None and best["longest"] > 0
        again = est.estimate(best["longest"], best["layout"], row["strategy"], least=True)
        assert again.total_bytes <= strategy_limit(est, row["strategy"]), row["strategy"]
    memo, fr = (r["best"]["longest"] for r in rows[::-1])
    assert memo >= fr


def test_ulysses_layouts_and_their_exchange() -> None:
    # NOTE [Context-parallel exchange in an estimate]: all-to-all holds ~4 of the rank's q, the
    # all-gather the whole sequence's K and V with float32 gradients; a2a needs heads the ranks share.
    from memo.estimate import attention_exchange_bytes, valid_layouts

    est = Estimator("llama-3.1-8b", method="formula")
    cfg, s = est.config, 1 << 20
    a2a, gather = Layout(8, cp=8, cp_comm="a2a"), Layout(8, cp=8)
    d = cfg.hidden // cfg.n_heads
    assert attention_exchange_bytes(cfg, a2a, s, 2) == 4 * s * d * 2 * (cfg.n_heads // 8 + 1)
    assert attention_exchange_bytes(cfg, gather, s, 2) == 2 * s * cfg.n_kv_heads * d * 6
    assert attention_exchange_bytes(cfg, Layout(8, tp=8), s, 2) == 0
    assert "Ulysses CP" in " ".join(Layout(6, cp=3, cp_comm="a2a").problems(cfg))
    comms = {(lay.cp, lay.cp_comm) for lay in valid_layouts(cfg, 8, cp_comms=("all_gather", "a2a"))}
    assert (1, "a2a") not in comms and (8, "a2a") in comms and (8, "all_gather") in comms
    with pytest.raises(MemoError, match="--cp-comm must be one of all_gather, a2a"):
        Layout(2, cp=2, cp_comm="ring")


def test_the_offloaded_checkpoint_peer_is_estimated_from_its_own_recording() -> None:
    # NOTE [The peer in an estimate]: full recompute with every layer's input in host memory instead,
    # and the MLP tiled: less device memory than full recompute, L · S_input of host memory.
    est = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0, host_mem_gb=4,
                                                                 gpus_per_node=1))
    layout = Layout(1)
    fr, peer = (est.estimate(4096, layout, s) for s in ("full-recompute", "offloaded-checkpoint"))
    s_in = est.profiler.layer_sizes(layout, 4096)[0]
    assert peer.host_bytes_per_process == est.config.n_layers * s_in
    assert peer.activations_bytes < fr.activations_bytes - (est.config.n_layers - 2) * s_in
    assert (peer.limit_rule, peer.policy, peer.alpha) == ("fraction", None, None)
    small = Estimator("gpt-mini", dtype="float32", machine=Machine(device_mem_gb=1.0, host_mem_gb=0.01,
                                                                   gpus_per_node=1))
    small.profiler.cache = est.profiler.cache
    with pytest.raises(MemoError, match="offloaded-checkpoint keeps every layer's input in host memory"):
        small.estimate(4096, layout, "offloaded-checkpoint")
