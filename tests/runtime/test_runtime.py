"""memo.wrap against the unwrapped model: loss and every gradient, fp32 on CPU.

The copy worker runs with random delays (``debug_copy_delay_us``) so that a
missing wait in the rounding-buffer protocol shows up as a wrong gradient;
``test_removed_wait_is_caught`` proves that it does.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import memo.runtime as mr
from memo.adapters import AnatomyAdapter, find_adapter, register_adapter, unregister_adapter
from memo.errors import MemoError, PlanMismatchError
from memo.models import attention, build_model, get_config
from memo.runtime import BufferState
from tests.grads import RTOL, assert_same_step, random_batch, rel_err, small_model, train_step

DELAY_US = 300  # random 0..300 us before every copy


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("alpha", [0.0, 0.125, 0.25, 0.5, 1.0])
def test_loss_and_grads_match_unwrapped(arch: str, alpha: float) -> None:
    ref = small_model(arch, 5)
    model = copy.deepcopy(ref)
    mr.wrap(model, alpha=alpha, debug_copy_delay_us=DELAY_US)
    rt = mr.runtime_of(model)
    s, b = 13, 2  # alpha * 13 is never an integer for alpha in (0, 1)
    for it in range(3):  # the same buffers serve consecutive iterations
        ids, labels = random_batch(ref, b, s, seed=it)
        assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
        assert all(rt.buffers.state(i) is BufferState.IDLE for i in range(rt.n_offloaded))
    a = mr.offload_tokens(alpha, s)
    assert rt.n_offloaded == 3
    assert rt.stats.offloaded_tokens == 3 * 3 * a
    assert rt.stats.recomputed_tokens == 3 * 3 * (s - a)
    assert rt.stats.bytes_offloaded == rt.stats.bytes_prefetched == 3 * rt.host_bytes
    assert rt.stats.late_prefetches == 0


@pytest.mark.parametrize("s", [1, 7, 16])
def test_sequence_lengths(s: int) -> None:
    ref = small_model("llama", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.3, debug_copy_delay_us=DELAY_US)
    ids, labels = random_batch(ref, 3, s)
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))


@pytest.mark.parametrize("wait", ["offload", "prefetch"])
def test_removed_wait_is_caught(wait: str) -> None:
    """Without one wait of the protocol the copies race the compute thread and gradients go wrong."""
    ref = small_model("gpt", n_layers=6)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, debug_copy_delay_us=DELAY_US)
    rt = mr.runtime_of(model)
    ids, labels = random_batch(ref, 2, 12)
    ref_loss, ref_grads = train_step(ref, ids, labels)
    assert_same_step(train_step(model, ids, labels), (ref_loss, ref_grads))  # with the wait: right
    rt.debug_skip_wait(wait)
    rt.set_debug_copy_delay_us(200_000)  # copies now lag far behind a tiny layer's compute
    wrong = False
    for _ in range(2):
        _loss, grads = train_step(model, ids, labels)
        wrong = wrong or any(rel_err(grads[n], ref_grads[n]) > RTOL for n in ref_grads)
        rt.synchronize()
    assert wrong, f"skipping the {wait} wait went unnoticed"
    rt.debug_skip_wait(wait, skip=False)
    rt.set_debug_copy_delay_us(DELAY_US)
    assert_same_step(train_step(model, ids, labels), (ref_loss, ref_grads))


def test_state_dict_unchanged_and_unwrap_restores() -> None:
    ref = small_model("gpt", 5)
    model = copy.deepcopy(ref)
    before = model.state_dict()
    mr.wrap(model, alpha=0.5)
    after = model.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    model.load_state_dict(ref.state_dict())  # checkpoints load into the wrapped model
    ids, labels = random_batch(ref, 2, 9)
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    mr.unwrap(model)
    assert not mr.is_wrapped(model)
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    with pytest.raises(MemoError, match="not wrapped"):
        mr.unwrap(model)


def test_eval_without_grad_runs_plain_layers() -> None:
    ref = small_model("llama", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5)
    ids, labels = random_batch(ref, 2, 8)
    with torch.no_grad():
        assert torch.equal(model(ids, labels), ref(ids, labels))
    assert mr.runtime_of(model).buffers is None  # nothing was offloaded


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.5", True, None])
def test_alpha_is_validated(bad: object) -> None:
    with pytest.raises(MemoError, match="alpha"):
        mr.wrap(small_model("gpt", 5), alpha=bad)


def test_reset_drops_a_forward_still_referenced() -> None:
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.25)
    ids, labels = random_batch(ref, 2, 8)
    pending = model(ids, labels)  # its graph stays alive: a forward in flight
    mr.runtime_of(model).reset()
    assert not mr.runtime_of(model).buffers.busy_flights()
    del pending
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))


@pytest.mark.parametrize("how", ["discarded", "exception"])
def test_an_abandoned_forward_is_dropped_by_itself(how: str) -> None:
    """NOTE [Abandoned forward]: once the graph of a forward without backward is freed, the next
    forward drops it (counted, warned once) and training matches the unwrapped model."""
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.25)
    rt = mr.runtime_of(model)
    ids, labels = random_batch(ref, 2, 8)
    if how == "discarded":
        model(ids, labels)  # validation with autograd on: the loss is dropped at once
    else:
        def step_that_fails() -> None:
            loss = model(ids, labels)
            raise RuntimeError(f"a data error after forward ({loss.item():.3f})")

        with pytest.raises(RuntimeError, match="data error"):
            step_that_fails()
    with pytest.warns(UserWarning, match="freed without its backward"):
        assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    assert rt.stats.abandoned_iterations == 1
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    assert rt.stats.abandoned_iterations == 1


def test_a_shorter_last_batch_runs_in_the_buffers_and_a_longer_one_grows_them() -> None:
    """NOTE [Sizing the host arena]: a drop_last=False loader's last batch is shorter (fewer tokens or
    fewer sequences); it runs without unwrapping and matches the unwrapped model, as does a longer
    sequence after it (the buffers grow between iterations)."""
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.25, debug_copy_delay_us=DELAY_US)
    rt = mr.runtime_of(model)
    assert_same_step(train_step(model, *random_batch(ref, 2, 12)), train_step(ref, *random_batch(ref, 2, 12)))
    sized = rt.layer_bytes
    for b, s in [(2, 7), (1, 12), (2, 12)]:
        ids, labels = random_batch(ref, b, s, seed=s)
        assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
        assert rt.layer_bytes == sized and rt.layer_sizes[0] <= sized
    assert_same_step(train_step(model, *random_batch(ref, 2, 16)), train_step(ref, *random_batch(ref, 2, 16)))
    assert rt.layer_bytes > sized


def test_a_longer_input_is_refused_while_a_forward_awaits_its_backward() -> None:
    model = mr.wrap(small_model("gpt", 5), alpha=0.25)
    first = model(*random_batch(model, 2, 8))
    with pytest.raises(MemoError, match=r"this forward offloads [\d,]+ bytes per layer, more than the [\d,]+ "
                                        r"the rounding buffers hold \(the input went from \[8, 2, 64\] "
                                        r"torch.float32 \(autocast off\) to \[10, 2, 64\] torch.float32 "
                                        r"\(autocast off\)\), and they cannot grow now: 1 earlier "
                                        r"forward\(s\) still hold"):
        model(*random_batch(model, 2, 10))
    first.backward()
    train_step(model, *random_batch(model, 2, 10))  # between iterations the buffers grow


def test_a_plan_is_held_to_its_host_bytes_when_the_input_grows() -> None:
    ref = small_model("gpt", 5)
    probe = mr.wrap(copy.deepcopy(ref), alpha=0.5)
    train_step(probe, *random_batch(ref, 2, 8))
    model = mr.wrap(copy.deepcopy(ref), plan={"alpha": 0.5, "host_bytes": mr.runtime_of(probe).host_bytes})
    train_step(model, *random_batch(ref, 2, 8))
    train_step(model, *random_batch(ref, 2, 5))
    with pytest.raises(PlanMismatchError, match=r"it grew after the input went from \[5, 2, 64\]"):
        train_step(model, *random_batch(ref, 2, 9))


def test_plan_host_bytes_must_hold_what_is_offloaded() -> None:
    ref = small_model("gpt", 5)
    probe = mr.wrap(copy.deepcopy(ref), alpha=0.5)
    ids, labels = random_batch(ref, 2, 11)
    train_step(probe, ids, labels)
    host = mr.runtime_of(probe).host_bytes
    assert host == 3 * mr.runtime_of(probe).layer_bytes > 0
    model = mr.wrap(copy.deepcopy(ref), plan={"alpha": 0.5, "host_bytes": host})
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    assert mr.runtime_of(model).host_bytes == host
    roomy = mr.wrap(copy.deepcopy(ref), plan={"alpha": 0.5, "host_bytes": host + 8})
    train_step(roomy, ids, labels)
    assert mr.runtime_of(roomy).arena_bytes == host + 8 and mr.runtime_of(roomy).host_bytes == host
    wrong = mr.wrap(copy.deepcopy(ref), plan={"alpha": 0.5, "host_bytes": host - 8})
    with pytest.raises(PlanMismatchError, match="host_bytes"):
        train_step(wrong, ids, labels)
    with pytest.raises(PlanMismatchError, match="alpha"):
        mr.wrap(copy.deepcopy(ref), alpha=0.25, plan={"alpha": 0.5})


def test_host_memory_shortage_fails_before_any_offload() -> None:
    model = mr.wrap(small_model("gpt", 5), alpha=1.0, host_memory_limit=1000)
    with pytest.raises(MemoError, match=r"host arena needs [\d,]+ bytes .* only 1,000 bytes"):
        train_step(model, *random_batch(model, 2, 8))


class ToyLayer(nn.Module):
    """A layer of our own with the anatomy, unknown to memo until an adapter is registered."""

    def __init__(self, h: int = 16, n: int = 2) -> None:
        super().__init__()
        self.n, self.d = n, h // n
        self.norm = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.Tanh(), nn.Linear(2 * h, h))

    def pre(self, x: torch.Tensor, offset: int = 0):
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return tuple(t.reshape(s, b, self.n, self.d) for t in (q, k, v))

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x + self.proj(o)
        return y + self.mlp(y) * torch.sigmoid(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = attention(*self.pre(x))
        return self.post(o.flatten(2), x)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyLayer() for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_unsupported_layer_names_the_class_then_adapter_registry_wraps_it() -> None:
    ref = ToyModel()
    with pytest.raises(MemoError, match=r"ToyLayer.*register_adapter\(ToyLayer"):
        mr.wrap(copy.deepcopy(ref), alpha=0.5)
    register_adapter(ToyLayer, AnatomyAdapter())
    try:
        model = mr.wrap(copy.deepcopy(ref), alpha=0.4, debug_copy_delay_us=DELAY_US)
        x = torch.randn(11, 3, 16, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        for _ in range(2):
            for m, inp in ((model, x), (ref, x_ref)):
                m.zero_grad()
                inp.grad = None
                m(inp).backward()
            assert rel_err(x.grad, x_ref.grad) < RTOL
            for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert rel_err(p.grad, q.grad) < RTOL, n
    finally:
        unregister_adapter(ToyLayer)


def test_offloaded_bytes_are_activations_only() -> None:
    """alpha=0 offloads exactly x, o and lse (views of x/o saved by pre/post are not copied again);
    what alpha=1 adds grows with the tokens and has no constant part (no weights are offloaded)."""
    # Lengths at which every saved tensor is a whole number of slots (NOTE [Slot alignment]):
    # even a per-token fp32 scalar row (b * s * 4 bytes) fills 256-byte slots exactly.
    h, n, b = 64, 4, 2
    sizes = {}
    for s in (32, 64):
        for alpha in (0.0, 1.0):
            model = mr.wrap(small_model("gpt", 5), alpha=alpha)
            train_step(model, *random_batch(model, b, s))
            sizes[s, alpha] = mr.runtime_of(model).layer_bytes
    for s in (32, 64):
        assert sizes[s, 0.0] == 4 * (s * b * h + s * b * h + b * n * s)
    others = {s: sizes[s, 1.0] - sizes[s, 0.0] for s in (32, 64)}
    assert others[64] == 2 * others[32] > 0


def test_debug_delay_switch_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("MEMO_DEBUG_COPY_DELAY_US", "250")
    assert mr.MemoRuntime(0.5).debug_copy_delay_us == 250
    assert mr.MemoRuntime(0.5, debug_copy_delay_us=0).debug_copy_delay_us == 0
    monkeypatch.setenv("MEMO_DEBUG_COPY_DELAY_US", "soon")
    with pytest.raises(MemoError, match="MEMO_DEBUG_COPY_DELAY_US"):
        mr.MemoRuntime(0.5)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_bf16_error_is_that_of_plain_bf16(arch: str) -> None:
    """In bf16, memo's gradients are as close to the fp32 ones as plain bf16's (flash-attn's 2x rule)."""
    ref32 = small_model(arch, 5)
    plain = copy.deepcopy(ref32).to(torch.bfloat16)
    model = mr.wrap(copy.deepcopy(plain), alpha=0.37, debug_copy_delay_us=DELAY_US)
    ids, labels = random_batch(ref32, 2, 19)
    _, g32 = train_step(ref32, ids, labels)

    def error(m: nn.Module) -> float:
        _, grads = train_step(m, ids, labels)
        return max(rel_err(grads[n].float(), g32[n]) for n in g32)

    assert error(model) <= 2 * error(plain) + 1e-3


def test_model_level_recompute_is_refused() -> None:
    model = small_model("gpt", 5)
    model.recompute = "full"
    with pytest.raises(MemoError, match="recompute='full'"):
        mr.wrap(model, alpha=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [0.0, 0.375, 1.0])
def test_cuda_streams_match_unwrapped(alpha: float) -> None:
    """The CUDA path: offload/prefetch streams and events (runs only with a GPU)."""
    ref = small_model("llama", 5).cuda()
    model = mr.wrap(copy.deepcopy(ref), alpha=alpha)
    ids, labels = (t.cuda() for t in random_batch(ref, 2, 37))
    for _ in range(3):
        torch.cuda._sleep(1_000_000)  # a busy compute stream: copies must really be ordered by events
        assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    rt = mr.runtime_of(model)
    assert rt.host_bytes > 0 and rt.buffers.host.is_pinned()


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [0.0, 0.375, 1.0])
def test_cuda_bf16_error_is_that_of_plain_bf16(alpha: float) -> None:
    """bf16 on the GPU (flash kernels, copy streams): gradients as close to fp32 as plain bf16's."""
    ref32 = small_model("llama", 5).cuda()
    plain = copy.deepcopy(ref32).to(torch.bfloat16)
    model = mr.wrap(copy.deepcopy(plain), alpha=alpha)
    ids, labels = (t.cuda() for t in random_batch(ref32, 2, 37))
    _, g32 = train_step(ref32, ids, labels)

    def error(m: nn.Module) -> float:
        _, grads = train_step(m, ids, labels)
        return max(rel_err(grads[n].float(), g32[n]) for n in g32)

    for _ in range(2):
        torch.cuda._sleep(1_000_000)
        assert error(model) <= 2 * error(plain) + 1e-3


def test_explicit_runtime_object() -> None:
    ref = small_model("gpt", 5)
    rt = mr.MemoRuntime(0.25, debug_copy_delay_us=DELAY_US)
    model = mr.wrap(copy.deepcopy(ref), runtime=rt)
    assert mr.runtime_of(model) is rt and rt.n_layers == 5 and rt.n_offloaded == 3
    ids, labels = random_batch(ref, 2, 10)
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    assert rt.describe()["host_bytes"] == rt.host_bytes > 0
    with pytest.raises(MemoError, match="already serves a model"):
        mr.wrap(copy.deepcopy(ref), runtime=rt)
    with pytest.raises(MemoError, match="either to MemoRuntime or to wrap"):
        mr.wrap(copy.deepcopy(ref), alpha=0.5, runtime=mr.MemoRuntime(0.5))


def test_allocate_before_training() -> None:
    ref = small_model("gpt", 5)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5, host_memory_limit=1000)
    x = torch.zeros(9, 2, 64)
    with pytest.raises(MemoError, match="only 1,000 bytes"):
        mr.runtime_of(model).allocate(x)
    model = mr.wrap(copy.deepcopy(ref), alpha=0.5)
    rt = mr.runtime_of(model)
    rt.allocate(x)
    host = rt.host_bytes
    assert host > 0 and rt.stats.bytes_offloaded == 0
    ids, labels = random_batch(ref, 2, 9)
    assert_same_step(train_step(model, ids, labels), train_step(ref, ids, labels))
    assert rt.host_bytes == host


def test_a_model_whose_layers_all_stay_says_so() -> None:
    """A 2-layer model: the default policy keeps both layers, so alpha has no effect: said at wrap."""
    model = small_model("gpt", n_layers=2)
    with pytest.warns(UserWarning, match=r"memo.wrap: none of the model's 2 layers offloads: without a plan "
                                         r"or a policy memo keeps the last 2 layers whole .* so alpha=1.0 "
                                         r"has no effect .* Pass policy=\['memo'\] \* 2"):
        mr.wrap(model, alpha=1.0)
    assert mr.runtime_of(model).n_offloaded == 0
    mr.unwrap(model)
    mr.wrap(model, alpha=1.0, policy=["memo"] * 2)  # asked for: no warning
    assert mr.runtime_of(model).n_offloaded == 2


def test_layer_adapters_of_other_libraries_are_registered_by_name_and_loaded_on_first_use() -> None:
    # NOTE [Layer adapters]: importing memo.adapters imports neither megatron nor transformers nor
    # their adapters' modules; the registry names them, and find_adapter loads them when met.
    code = ("import sys, memo.adapters\n"
            "print(sorted(m for m in ('memo.adapters.megatron', 'memo.adapters.hf', 'megatron', "
            "'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from memo.adapters import base

    assert base._ADAPTERS["megatron.core.transformer.transformer_layer.TransformerLayer"] == \
        "memo.adapters.megatron:MegatronLayerAdapter"
    register_adapter("tests.nowhere.Layer", "memo.adapters.base:AnatomyAdapter")
    try:
        fake = type("Layer", (torch.nn.Module,), {"__module__": "tests.nowhere", "__qualname__": "Layer"})
        assert isinstance(find_adapter(fake()), AnatomyAdapter)
        assert find_adapter(fake()) is find_adapter(fake())
    finally:
        unregister_adapter("tests.nowhere.Layer")
    assert find_adapter(fake()) is None


def test_layer_call_uses_only_its_narrow_context() -> None:
    # NOTE [Layer context]: layer.py does not import runtime.py (not even for types), every
    # attribute LayerCall reads from its runtime is declared by LayerContext, and MemoRuntime has
    # them all.
    import ast
    import inspect
    import typing

    import memo.runtime.layer as layer_module
    from memo.runtime.layer import LayerContext

    tree = ast.parse(inspect.getsource(layer_module))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert "memo.runtime.runtime" not in imported and "MemoRuntime" not in {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    declared = set(typing.get_type_hints(LayerContext, localns={"RoundingBuffers": object,
                                                                  "RuntimeStats": object}))
    declared |= {name for name, value in vars(LayerContext).items() if callable(value)
                 and not name.startswith("_")}

    def runtime_expr(node: ast.AST) -> bool:  # rt, self.runtime, runtime, ctx.call.runtime
        return (isinstance(node, ast.Name) and node.id in ("rt", "runtime")) or (
            isinstance(node, ast.Attribute) and node.attr == "runtime")

    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and runtime_expr(node.value)}
    assert used and used <= declared, sorted(used - declared)
    model = mr.wrap(build_model(get_config("tiny")), alpha=0.5)
    rt = mr.runtime_of(model)
    assert all(hasattr(rt, name) for name in declared), sorted(n for n in declared if not hasattr(rt, n))
    assert all(call.runtime is rt for call in rt.calls)
