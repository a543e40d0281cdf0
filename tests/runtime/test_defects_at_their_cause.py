"""Reliability, round three (issue 31): each test reproduces one defect at its cause."""

from __future__ import annotations

import copy
import gc
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import memo
from memo.errors import MemoError
from memo.models import attention, build_model
from memo.runtime import runtime_of


def _wrapped(name: str = "llama-tiny", alpha: float = 0.5) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memo.wrap(model, alpha=alpha, policy=["memo"] * len(model.layers))
    return model


def _batch(seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 100, (1, seq), generator=gen), torch.randint(0, 100, (1, seq), generator=gen)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


class _RaiseOnce:
    """A forward hook on a layer's last module that raises once, in forward or in backward (where
    memo runs the module again to recompute)."""

    def __init__(self, module: torch.nn.Module, in_backward: bool) -> None:
        self.armed = False
        self.in_backward = in_backward
        self.handle = module.register_forward_hook(self)

    def __call__(self, *_args: object) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        if self.armed and in_backward == self.in_backward:
            self.armed = False
            raise RuntimeError("simulated out of memory")


# ------------------------------------------------------------------ 1. functional_call
def _functional_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients with every parameter replaced by another tensor for the call only."""
    from torch.func import functional_call

    ids, labels = _batch()
    params = {k: (v.detach() * 1.1).requires_grad_() for k, v in model.named_parameters()}
    loss = functional_call(model, params, (ids, labels))
    return loss.detach(), dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


@pytest.mark.parametrize(("policy", "alpha"), [(["memo", "memo"], 0.5), (["memo", "recompute"], 1.0),
                                               (["input-only", "keep"], 0.0), (["memo", "memo"], 0.0)])
def test_functional_call_recomputes_with_the_substituted_parameters(policy: list[str], alpha: float) -> None:
    torch.manual_seed(0)
    reference = build_model("llama-tiny")
    model = build_model("llama-tiny")
    model.load_state_dict(reference.state_dict())
    memo.wrap(model, alpha=alpha, policy=policy)
    want_loss, want = _functional_grads(reference)
    got_loss, got = _functional_grads(model)
    assert torch.equal(got_loss, want_loss)
    for name, g in got.items():
        assert (g - want[name]).norm() <= 1e-5 * want[name].norm(), name
    # the module's own parameters are back after the backward
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


# ------------------------------------------------------------------ 2. an exception in forward or backward
@pytest.mark.parametrize("in_backward", [False, True], ids=["forward", "backward"])
def test_a_step_that_raises_leaves_the_model_usable(in_backward: bool) -> None:
    """A loop that catches the error and skips the batch goes on, with exact gradients after it."""
    reference = _wrapped()
    ids, labels = _batch()
    reference(ids, labels).backward()
    want = _grads(reference)

    model = _wrapped()
    hook = _RaiseOnce(list(model.layers[1].children())[-1], in_backward)
    hook.armed = True
    with pytest.warns(UserWarning, match="ended its iteration"):
        with pytest.raises(RuntimeError, match="simulated out of memory"):
            loss = model(ids, labels)  # `loss` stays bound, as in a training loop, when backward fails
            loss.backward()
    model.zero_grad(set_to_none=True)
    for _ in range(2):  # the next steps run, on the same buffers
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels)
        loss.backward()
    rt = runtime_of(model)
    assert rt.stats.failed_iterations == 1
    assert rt.buffers.n_flights == 1, "the failed forward's host region was reused, not a second one made"
    for g, w in zip(_grads(model), want, strict=True):
        assert torch.equal(g, w)


def test_a_backward_tried_again_on_a_dropped_forward_is_refused() -> None:
    model = _wrapped()
    ids, labels = _batch()
    hook = _RaiseOnce(list(model.layers[-1].children())[-1], in_backward=True)
    hook.armed = True
    loss = model(ids, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="simulated"):
            loss.backward(retain_graph=True)
        other = model(ids, labels)  # takes the dropped forward's flight
        with pytest.raises(MemoError, match="dropped"):
            loss.backward()
    other.backward()  # the forward that reused the flight is intact


# ------------------------------------------------------------------ 3. layers with state
def _with_a_counter(model: torch.nn.Module) -> torch.nn.Module:
    """Each layer's last module counts its calls in a buffer, and its output depends on the count."""
    def bump(module: torch.nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        module.calls.add_(1)
        return out * (1 + 0.01 * module.calls)

    for layer in model.layers:
        last = list(layer.children())[-1]
        last.register_buffer("calls", torch.zeros(()))
        last.register_forward_hook(bump)
    return model


def _calls(model: torch.nn.Module) -> list[float]:
    return [float(list(layer.children())[-1].calls) for layer in model.layers]


def test_a_layer_with_state_runs_once_per_forward_or_is_refused() -> None:
    torch.manual_seed(0)
    reference = _with_a_counter(build_model("llama-tiny"))
    model = copy.deepcopy(reference)
    memo.wrap(model, alpha=1.0, policy=["memo"] * 2)
    ids, labels = _batch()
    for _ in range(2):
        got, want = model(ids, labels), reference(ids, labels)
        got.backward()
        want.backward()
        assert torch.equal(got, want)
        assert _calls(model) == _calls(reference)  # the sizing pass advanced nothing
    for g, w in zip(_grads(model), _grads(reference), strict=True):
        assert (g - w).norm() <= 1e-5 * w.norm()
    recomputing = copy.deepcopy(reference)
    memo.wrap(recomputing, alpha=0.5, policy=["memo"] * 2)
    before = _calls(recomputing)
    with pytest.raises(MemoError, match=r"changes its buffers .*calls.* policy 'keep'"):
        recomputing(ids, labels)
    assert _calls(recomputing) == before  # refused with its state as it was


# ------------------------------------------------------------------ 4. unwrap while a backward is pending
def test_unwrap_with_a_backward_pending_is_refused_and_force_drops_it() -> None:
    model = _wrapped()
    ids, labels = _batch()
    loss = model(ids, labels)
    with pytest.raises(MemoError, match="await their backward"):
        memo.unwrap(model)
    loss.backward()  # still intact after the refusal
    loss = model(ids, labels)
    memo.unwrap(model, force=True)
    with pytest.raises(MemoError, match="dropped"):
        loss.backward()
    del loss
    gc.collect()
    model(ids, labels).backward()  # unwrapped now: plain autograd


# ------------------------------------------------------------------ 5. a frozen bottom
@pytest.mark.parametrize("policy", [["memo"] * 4, ["input-only", "memo", "memo", "recompute"]])
def test_frozen_bottom_layers_cost_what_they_cost_unwrapped(policy: list[str]) -> None:
    from tests.grads import assert_same_step, random_batch, small_model, train_step

    reference = small_model("llama")
    reference.embedding.requires_grad_(False)
    reference.layers[:2].requires_grad_(False)
    model = copy.deepcopy(reference)
    memo.wrap(model, alpha=0.5, policy=policy)
    rt = runtime_of(model)
    for step in range(2):
        batch = random_batch(512, 2, 16, step)
        assert_same_step(train_step(model, *batch), train_step(reference, *batch))
    assert rt.stats.frozen_layers == 2 * 2
    offloading = sum(p in ("memo", "input-only") for p in policy[2:])
    assert rt.stats.layer_backwards == 2 * offloading  # none for the frozen layers 0 and 1
    # a frozen layer's slot never left IDLE: nothing of it was offloaded or prefetched
    assert rt.stats.bytes_offloaded == rt.stats.bytes_prefetched == 2 * sum(rt.layer_sizes[2:])


def test_a_frozen_backbone_gives_hidden_states_that_need_no_grad() -> None:
    from tests.grads import random_batch, small_model

    model = small_model("llama")
    model.embedding.requires_grad_(False)
    model.layers.requires_grad_(False)
    memo.wrap(model, alpha=0.5, policy=["memo"] * 4)
    seen = []
    model.layers[-1].register_forward_hook(lambda _m, _a, out: seen.append(out.requires_grad))
    model(*random_batch(512, 2, 16, 0)).backward()  # the head still trains
    assert seen == [False]
    assert runtime_of(model).stats.layer_backwards == 0


# ------------------------------------------------------------------ 6. the planner's time limit
def _random_items(n: int, seed: int) -> list:
    import random

    from memo.planner.dsa import Item

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randrange(4 * n)
        out.append(Item(rng.randint(1, 64), a, a + rng.randint(1, 200)))
    return out


def _reference_greedy(items: list, order: list[int]) -> tuple[list[int], int]:
    """The rule the native greedy follows, the quadratic way: every placed item is compared."""
    import numpy as np
    from memo.planner.dsa import _tightest_gap

    size = np.array([it.size for it in items])
    start = np.array([it.start for it in items])
    end = np.array([it.end for it in items])
    offs, placed, peak = np.zeros(len(items), dtype=np.int64), np.zeros(len(items), dtype=bool), 0
    for i in order:
        idx = np.nonzero(placed & (start < end[i]) & (start[i] < end))[0]
        offs[i] = _tightest_gap(offs[idx], offs[idx] + size[idx], int(size[i]), 0) if len(idx) else 0
        placed[i] = True
        peak = max(peak, int(offs[i] + size[i]))
    return offs.tolist(), peak


@pytest.mark.parametrize("seed", range(4))
def test_the_native_greedy_places_as_the_quadratic_one(seed: int) -> None:
    import random

    from memo.planner.dsa import _arrays, _greedy_order, check_placement

    items = _random_items(400, seed)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    offsets, peak = _greedy_order(items, order, *_arrays(items))
    assert (offsets, peak) == _reference_greedy(items, order)
    assert check_placement(items, offsets, peak) is None
    clash = list(offsets)
    first = max(range(len(items)), key=lambda i: items[i].size)
    others = [j for j in range(len(items)) if j != first and items[j].start < items[first].end
              and items[first].start < items[j].end and items[j].size]
    clash[others[0]] = clash[first]  # two live items at one offset
    assert "overlap in time" in check_placement(items, clash, peak + max(it.size for it in items))


def test_the_greedy_tries_more_orderings_only_within_its_deadline() -> None:
    import time

    from memo.planner.dsa import check_placement, greedy

    items = _random_items(2000, 0)
    full = greedy(items)
    assert full.extra["orders"][0] == "size" and len(full.extra["orders"]) >= 2
    cut = greedy(items, deadline=time.perf_counter())  # already passed: one placement, no more
    assert cut.extra["orders"] == ["size"]
    assert check_placement(items, cut.offsets, cut.peak) is None
    assert cut.peak >= full.peak


def test_make_plan_skips_what_the_time_limit_leaves_no_room_for(monkeypatch) -> None:
    import time

    from memo.planner import core, make_plan
    from memo.planner.synthetic import layered_trace

    original = core.plan_bilevel

    def slow(*args, **kwargs):  # the bi-level plan takes the whole time limit
        plan = original(*args, **kwargs)
        time.sleep(0.6)
        return plan

    monkeypatch.setattr(core, "plan_bilevel", slow)
    plan = make_plan(layered_trace(6), time_limit=0.5, use_mip=False)
    assert plan.solver["flat_comparison"] == "skipped: the time limit was reached"


# ------------------------------------------------------------------ 7. memo plot of many allocations
def test_plot_draws_the_largest_allocations_past_what_a_picture_shows(tmp_path, monkeypatch) -> None:
    from memo.planner import make_plan
    from memo.planner.synthetic import layered_trace

    import memo.cli.plot as plot

    plan = make_plan(layered_trace(4), use_mip=False)
    placed = sum(off is not None for off in plan.offsets)
    monkeypatch.setattr(plot, "MAX_DRAWN", placed // 3)
    assert plot.plot_plan(plan, str(tmp_path / "p.png")) == placed // 3
    assert (tmp_path / "p.png").stat().st_size > 10_000
    monkeypatch.setattr(plot, "MAX_DRAWN", placed)
    assert plot.plot_plan(plan, str(tmp_path / "all.png")) == placed
    # memo plot imports no torch (it drew 10^5 allocations in 18 s, 3 of them importing torch)
    import subprocess
    import sys

    code = "import sys, memo.cli.plot; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


# ------------------------------------------------------------------ 7. memo show of many allocations
def test_show_reads_a_plans_summary_without_its_rows(tmp_path, monkeypatch) -> None:
    """NOTE [A plan's summary]: ``memo show`` prints what the whole plan gives, from the summary fields,
    building no allocation (10^7 of them took over 8 GB); the highest phases of a plan with many; a plan
    whose summary fields disagree with its rows is refused when it is loaded whole."""
    import json

    from memo.planner import Plan, load_plan, make_plan, read_plan_summary, save_plan
    from memo.planner.summary import PlanSummary
    from memo.planner.synthetic import layered_trace, write_layered_plan

    from memo.cli.show import MAX_PHASE_LINES, format_plan

    path = tmp_path / "big.json"
    n = write_layered_plan(path, layers=40, requests=50)
    whole = format_plan(load_plan(path))
    monkeypatch.setattr(Plan, "from_dict", lambda *_a, **_k: pytest.fail("memo show loaded every row"))
    summary = read_plan_summary(path)
    assert isinstance(summary, PlanSummary) and summary.allocation_count == n == 4000
    assert format_plan(summary) == whole
    assert f"allocations   {n:,}" in whole
    assert f"the {MAX_PHASE_LINES // 2} highest of 80 phases" in whole and whole.count("\n  layer.") == 32
    monkeypatch.undo()
    # a plan save_plan writes has them; one without them (older) is loaded whole
    plan = make_plan(layered_trace(3), use_mip=False)
    save_plan(plan, tmp_path / "p.json")
    assert format_plan(read_plan_summary(tmp_path / "p.json")) == format_plan(plan)
    data = json.loads((tmp_path / "p.json").read_text())
    for key in ("allocation_count", "phase_peaks"):
        data.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert isinstance(read_plan_summary(tmp_path / "old.json"), Plan)
    # the summary must be what the rows give
    data = plan.to_dict()
    data["allocation_count"] += 1
    with pytest.raises(MemoError, match="allocation_count must be the"):
        Plan.from_dict(data)
    text = path.read_text().replace('"allocation_count": 4000', '"allocation_count": 4001')
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(MemoError, match="allocation_count must be the 4,000 rows' count"):
        read_plan_summary(tmp_path / "bad.json")


# ------------------------------------------------------------------ 8. strings from files, escaped
def test_show_escapes_what_a_plan_file_says() -> None:
    from memo.planner import make_plan
    from memo.planner.synthetic import layered_trace

    from memo.cli.show import format_plan, safe_text

    plan = make_plan(layered_trace(2), use_mip=False)
    plan.meta["model"] = "evil\x1b[2J\npeak          0 B"
    plan.warnings.append("bell\x07")
    text = format_plan(plan)
    assert "\x1b" not in text and "\x07" not in text
    assert "\npeak          0 B" not in text
    assert "evil\\x1b[2J\\npeak" in text
    assert safe_text("naïve 東京") == "naïve 東京"  # printable text is left alone


# ------------------------------------------------------------------ 9. file modes follow the umask
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_get_the_mode_open_would_give(tmp_path, umask: int) -> None:
    from memo.jsonio import atomic_write

    old = os.umask(umask)
    try:
        with atomic_write(tmp_path / "plan.json", "test") as f:
            f.write("{}")
        with open(tmp_path / "plain.json", "w") as f:
            f.write("{}")
    finally:
        os.umask(old)
    mode = os.stat(tmp_path / "plan.json").st_mode & 0o777
    assert mode == 0o666 & ~umask == os.stat(tmp_path / "plain.json").st_mode & 0o777


# ------------------------------------------------------------------ 10. no token
def test_an_empty_sequence_is_refused_not_a_crash() -> None:
    model = build_model("tiny")
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(MemoError, match="hold no token"):
        model(empty, empty)
    with pytest.raises(MemoError, match="no token"):
        model(torch.zeros(0, 8, dtype=torch.long), torch.zeros(0, 8, dtype=torch.long))
    q = torch.zeros(0, 1, 2, 4)
    with pytest.raises(MemoError, match="at least one token"):
        attention(q, q, q)


# ------------------------------------------------------------------ 11. SIGTERM and two messages
def test_sigterm_is_one_line_like_ctrl_c(tmp_path) -> None:
    script = ("import os, signal, sys\n"
              "import memo.cli.show as show\n"
              "def run(args):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    import time; time.sleep(30)\n"
              "show.run = run\n"
              "from memo.cli.main import main\n"
              "sys.exit(main(['show', 'x.json']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM
    assert done.stderr == "memo: terminated (SIGTERM)\n"


def test_a_longer_forward_while_one_awaits_its_backward_says_what_to_do() -> None:
    model = _wrapped()
    model.eval()
    kept = model(*_batch(32))  # an evaluation output kept, with gradients enabled
    model.train()
    with pytest.raises(MemoError) as err:
        model(*_batch(64))
    text = str(err.value)
    assert "longest" in text and "warm-up" in text  # pre-size: the longest input first
    assert "torch.no_grad()" in text and "del" in text  # the kept evaluation output
    assert "run their backward first" not in text
    del kept
