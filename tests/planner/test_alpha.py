"""The alpha LP: each constraint binding, clamping, infeasibility, input checks."""

from __future__ import annotations

import math

import pytest
from memo.planner import AlphaSolution, host_memory_per_process, solve_alpha

from memo.errors import MemoError

GiB = 2**30


def test_alpha_one_when_everything_fits():
    sol = solve_alpha(1 * GiB, 1 * GiB, 8 * GiB, bandwidth=20 * GiB, layer_time=1.0, n_layers=32,
                      host_memory=1000 * GiB)
    assert isinstance(sol, AlphaSolution)
    assert sol.alpha == 1.0 and sol.binding == "alpha<=1"
    assert sol.host_bytes == 30 * 10 * GiB and sol.copies_hidden


def test_bandwidth_binds():
    # 0.5 s at 10 GiB/s moves 5 GiB: 2 GiB base + alpha * 8 GiB -> alpha = 3/8.
    sol = solve_alpha(1 * GiB, 1 * GiB, 8 * GiB, bandwidth=10 * GiB, layer_time=0.5, n_layers=32,
                      host_memory=1000 * GiB)
    assert sol.binding == "bandwidth"
    assert math.isclose(sol.alpha, 3 / 8, rel_tol=1e-6)
    assert math.isclose(sol.copy_seconds, 0.5, rel_tol=1e-6)


def test_host_memory_binds():
    # 10 offloaded layers x (2 + 8 alpha) GiB <= 60 GiB -> alpha = 0.5.
    sol = solve_alpha(1 * GiB, 1 * GiB, 8 * GiB, bandwidth=100 * GiB, layer_time=1.0, n_layers=12,
                      host_memory=60 * GiB)
    assert sol.binding == "host_memory"
    assert math.isclose(sol.alpha, 0.5, rel_tol=1e-6)
    assert sol.host_bytes <= 60 * GiB


def test_host_memory_too_small_even_at_zero():
    with pytest.raises(MemoError, match=r"alpha=0: 30 offloaded layers.*= 60\.000 GiB > M_CPU 10\.000 GiB"):
        solve_alpha(1 * GiB, 1 * GiB, 8 * GiB, bandwidth=10 * GiB, layer_time=1.0, n_layers=32,
                    host_memory=10 * GiB)


def test_bandwidth_infeasible_at_zero_warns_and_returns_zero():
    with pytest.warns(UserWarning, match="offload will stall compute"):
        sol = solve_alpha(4 * GiB, 4 * GiB, 8 * GiB, bandwidth=1 * GiB, layer_time=1.0, n_layers=32,
                          host_memory=1000 * GiB)
    assert sol.alpha == 0.0 and sol.binding == "bandwidth" and not sol.copies_hidden


def test_no_others_and_two_layers():
    sol = solve_alpha(GiB, GiB, 0, bandwidth=10 * GiB, layer_time=1.0, n_layers=2, host_memory=0)
    assert sol.alpha == 1.0 and sol.host_bytes == 0


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"bandwidth": 0}, "bandwidth must be > 0"),
    ({"bandwidth": math.inf}, "bandwidth must be a finite number"),
    ({"layer_time": -1.0}, "layer_time must be > 0"),
    ({"s_input": math.nan}, "s_input must be a finite number"),
    ({"s_others": -5}, "s_others must be >= 0"),
    ({"n_layers": 0}, "n_layers must be a positive integer"),
    ({"n_layers": 3.5}, "n_layers must be a positive integer"),
    ({"host_memory": "lots"}, "host_memory must be a finite number"),
])
def test_bad_inputs(kwargs, needle):
    args = {"s_input": GiB, "s_attn": GiB, "s_others": GiB, "bandwidth": GiB, "layer_time": 1.0,
            "n_layers": 4, "host_memory": 100 * GiB}
    args.update(kwargs)
    with pytest.raises(MemoError, match=needle):
        solve_alpha(**args)


def test_host_memory_per_process():
    assert host_memory_per_process(1000 * GiB, 8) == 100 * GiB
    assert host_memory_per_process(1000 * GiB, 8, safety=0.5) == int(62.5 * GiB)
    with pytest.raises(MemoError, match="gpus_per_node"):
        host_memory_per_process(GiB, 0)
    with pytest.raises(MemoError, match="safety"):
        host_memory_per_process(GiB, 1, safety=1.5)


def test_evaluate_alpha_reports_a_given_alpha_against_the_constraints() -> None:
    from memo.planner import evaluate_alpha

    gib = 2**30
    # 4 layers -> 2 offloaded; 1 GiB input + 1 GiB attention + 8 GiB others per layer.
    sol = evaluate_alpha(0.25, gib, gib, 8 * gib, 10 * gib, 1.0, 4, 100 * gib)
    assert sol.binding == "given" and sol.alpha == 0.25
    assert sol.bytes_per_layer == 4 * gib and sol.host_bytes == 8 * gib
    assert sol.copies_hidden  # 4 GiB at 10 GiB/s = 0.4 s <= 1 s
    assert not evaluate_alpha(1.0, gib, gib, 8 * gib, 5 * gib, 1.0, 4, 100 * gib).copies_hidden
    with pytest.raises(MemoError, match=r"alpha=1.0 offloads 2 layers x 10.000 GiB = 20.000 GiB > M_CPU 12"):
        evaluate_alpha(1.0, gib, gib, 8 * gib, 10 * gib, 1.0, 4, 12 * gib)
    with pytest.raises(MemoError, match="in \\[0, 1\\]"):
        evaluate_alpha(1.5, gib, gib, 8 * gib, 10 * gib, 1.0, 4, 100 * gib)
