"""The dispatch recorder: well-formed traces, hand-checked skeletal/transient sizes, real peak."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memo.adapters import ModelAdapter, ModelParts, register_model_adapter
from memo.phases import PhaseTracker, phase_kind
from memo.pipeline import profile as profile_api
from memo.profiler import record, record_trace
from tests.grads import small_model

# ---------------------------------------------------------------------------- models


class _Embedding(nn.Module):
    def __init__(self, vocab: int, h: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.word(ids.t())  # [b, s] -> [s, b, h]


class _SquareHead(nn.Module):
    """(x, labels) -> mean(x²): saves x only, allocates nothing the layer tests care about."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (x * x).mean()


class _ExpCore(nn.Module):
    """Parameter-free 'attention' whose saved output is known: exp saves its result."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return q.exp()


class _HandLayer(nn.Module):
    """A layer whose autograd bookkeeping is known op by op (h x h weight, x: [s, b, h]).

    a = x @ W      mm saves x and W, not a        -> a is transient
    e = exp(a)     core attention; exp saves e    -> skeletal, tagged attn
    b = relu(e)    relu saves its result b        -> skeletal
    c = -b         neg saves nothing              -> but sin saves its input c: skeletal
    d = sin(c)     returned                       -> skeletal, the layer output
    """

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h, h) / h)
        self.core_attention = _ExpCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x @ self.weight
        e = self.core_attention(a)
        c = e.relu().neg()
        return c.sin()


class _HandModel(nn.Module):
    def __init__(self, vocab: int = 16, h: int = 4, n_layers: int = 2) -> None:
        super().__init__()
        self.embedding = _Embedding(vocab, h)
        self.layers = nn.ModuleList(_HandLayer(h) for _ in range(n_layers))
        self.head = _SquareHead()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, labels)


class _CoreAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, n, d] -> [b, n, s, d]
        o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, True)[0]
        return o.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


class _GPTLayer(nn.Module):
    """A small pre-LN GPT layer with the pre / core / post anatomy."""

    def __init__(self, h: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.core_attention = _CoreAttention()

    def pre(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, ...]:
        s, b, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(s, b, 3, self.n, h // self.n)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def post(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x + self.proj(o)
        return y + self.fc2(F.gelu(self.fc1(self.ln2(y))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.core_attention(*self.pre(x)), x)


class _Head(nn.Module):
    def __init__(self, h: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.t().reshape(-1))


class _GPT(nn.Module):
    def __init__(self, vocab: int = 64, h: int = 32, n: int = 4, n_layers: int = 2) -> None:
        super().__init__()
        self.embedding = _Embedding(vocab, h)
        self.layers = nn.ModuleList(_GPTLayer(h, n) for _ in range(n_layers))
        self.head = _Head(h, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, labels)


class _ToyAdapter(ModelAdapter):
    """The test models keep memo's layout: ``.embedding``, ``.layers``, ``.head``, ``model(ids, labels)``."""

    name = "toy"

    def parts(self, model: nn.Module) -> ModelParts:
        return ModelParts(model.embedding, list(model.layers), [model.head])

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(ids, labels)

    def vocab_size(self, model: nn.Module) -> int:
        return model.embedding.word.num_embeddings


for _cls in (_HandModel, _GPT):
    register_model_adapter(_cls, _ToyAdapter())


def _ids(vocab: int, b: int, s: int, device: str = "cpu") -> torch.Tensor:
    if device == "meta":
        return torch.zeros(b, s, dtype=torch.long, device="meta")
    return torch.randint(0, vocab, (b, s))


def _expected_phases(n: int) -> list[str]:
    return (
        ["embed.fwd"]
        + [f"layer.fwd[{i}]" for i in range(n)]
        + ["head.fwd", "head.bwd"]
        + [f"layer.bwd[{i}]" for i in reversed(range(n))]
        + ["embed.bwd"]
    )


def _peak_live(events: list[dict]) -> int:
    live: dict[int, int] = {}
    total = peak = 0
    for ev in events:
        if ev["op"] == "malloc":
            live[ev["id"]] = ev["size"]
            total += ev["size"]
            peak = max(peak, total)
        elif ev["op"] == "free":
            total -= live.pop(ev["id"])
    return peak


# ----------------------------------------------------------------------------- tests


def test_trace_is_well_formed() -> None:
    model = _GPT(n_layers=3)
    ids = _ids(64, 2, 16)
    trace = record_trace(model, ids, ids)
    events = trace["events"]
    assert trace["version"] == 1 and trace["kind"] == "memo.trace"
    assert events[-1] == {"op": "end"}
    mallocs = [ev for ev in events if ev["op"] == "malloc"]
    ids_seen = [ev["id"] for ev in mallocs]
    assert len(ids_seen) == len(set(ids_seen)), "ids must be unique"
    assert all(ev["size"] > 0 for ev in mallocs)
    freed: set[int] = set()
    allocated: set[int] = set()
    for ev in events:
        if ev["op"] == "malloc":
            allocated.add(ev["id"])
        elif ev["op"] == "free":
            assert ev["id"] in allocated, "free before malloc"
            assert ev["id"] not in freed, "freed twice"
            freed.add(ev["id"])
    phases: list[str] = []
    for ev in mallocs:
        if "phase" in ev and (not phases or phases[-1] != ev["phase"]):
            phases.append(ev["phase"])
    assert phases == _expected_phases(3)
    assert trace["meta"]["n_layers"] == 3 and trace["meta"]["seq_len"] == 16
    assert trace["meta"]["micro_batch"] == 2 and trace["meta"]["dtype"] == "float32"
    # The planner reads it back, and agrees on the skeletal allocations of every layer forward.
    from memo.planner.trace import Trace

    parsed = Trace.from_dict(trace)
    assert parsed.phases == _expected_phases(3)
    sizes = trace["layers"]["per_layer"]
    for i in range(3):
        skeletal = sum(a.size for a in parsed.skeletal(f"layer.fwd[{i}]"))
        assert skeletal == sizes[i]["S_attn"] + sizes[i]["S_others"] + sizes[i]["output"]


def test_parameter_gradients_are_flagged() -> None:
    model = _GPT(n_layers=2)
    ids = _ids(64, 2, 8)
    trace = record_trace(model, ids, ids)
    flagged = [ev for ev in trace["events"] if ev.get("param_grad")]
    grads = {id(p.grad.untyped_storage()) for p in model.parameters()}
    # Every parameter has a gradient storage of its own (the tied-free toy has no shared weights).
    assert len(flagged) == len(grads) == len(list(model.parameters()))
    assert all(phase_kind(ev["phase"]).endswith(".bwd") for ev in flagged), flagged
    freed = {ev["id"] for ev in trace["events"] if ev["op"] == "free"}
    assert not freed & {ev["id"] for ev in flagged}, "gradients outlive the iteration"


def test_skeletal_and_transient_hand_checked() -> None:
    s, b, h = 8, 2, 4
    model = _HandModel(h=h, n_layers=2)
    ids = _ids(16, b, s)
    rec = record(model, ids, ids)
    unit = s * b * h * 4  # one [s, b, h] float32 tensor
    for stats in rec.layer_stats:
        assert stats.s_input == unit
        assert stats.s_attn == unit  # e = exp(a)
        assert stats.s_others == 2 * unit  # relu's result and neg's result (sin's input)
        assert stats.output == unit  # sin's result, the next layer's input
        assert stats.n_transient == 1 and stats.transient_bytes == unit  # a = x @ W
        assert [row[0] for row in stats.skeletal] == [
            "exp.default",
            "relu.default",
            "neg.default",
            "sin.default",
        ]
        assert [row[2] for row in stats.skeletal] == ["attn", "other", "other", "output"]
    assert rec.trace["layers"]["S_input"] == unit and rec.trace["layers"]["S_others"] == 2 * unit


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_trace_peak_equals_real_peak() -> None:
    """The trace's lower bound (largest live total) equals what the CPU allocator really held.

    The independent measure is torch.profiler's memory events, which come from the CPU
    allocator itself. The hand model's ops allocate no kernel-internal scratch and take no
    Python-number operands (``t * 2`` wraps 2 in a CPU scalar tensor before dispatch, which
    the recorder rightly never sees: on a GPU it is not device memory), so the two must
    agree byte for byte.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model = _HandModel(h=16, n_layers=3)
    ids = _ids(16, 4, 32)
    trace = record_trace(model, ids, ids)
    for p in model.parameters():
        p.grad = None
    tracker = PhaseTracker(model.embedding, list(model.layers), model.head)
    try:
        with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = model(ids, ids)
            loss.backward()
    finally:
        tracker.remove()
    mem = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    total = real_peak = 0
    for _t, nbytes in mem:
        total += nbytes
        real_peak = max(real_peak, total)
    assert real_peak > 0
    assert _peak_live(trace["events"]) == real_peak


def test_views_and_inplace_count_once() -> None:
    class _ViewLayer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 3  # one fresh storage
            y.add_(1)  # in place: no allocation
            z = y.view(-1).view(x.shape).transpose(0, 1).transpose(0, 1)  # views: no allocation
            return z.exp()  # one fresh storage (saved by exp)

    model = _HandModel(h=4, n_layers=1)
    model.layers = nn.ModuleList([_ViewLayer()])
    model.embedding.word.weight.data.normal_()
    ids = _ids(16, 2, 8)
    rec = record(model, ids, ids)
    ops = [a.op for a in rec.recorder.allocations.values() if a.phase == "layer.fwd[0]"]
    assert ops == ["mul.Tensor", "exp.default"]


def test_outside_tensors_are_not_recorded() -> None:
    model = _GPT(n_layers=1)
    ids = _ids(64, 2, 8)
    rec = record(model, ids, ids)
    assert rec.recorder.storage_record(ids) is None
    for p in model.parameters():
        assert rec.recorder.storage_record(p) is None


@pytest.mark.parametrize("name", ["gpt-1.3b"])
def test_meta_profile_long_sequence_is_exact(name: str) -> None:
    """A long sequence recorded on the meta device (memory-bounded tiles in every layer) has the exact
    sizes of its layer input, attention and output. How long recording takes is for a benchmark to
    measure, not a unit test: these machines are shared."""
    from memo.pipeline import build_profile_model

    s, b = 65536, 1
    model = build_profile_model(name, s, torch.bfloat16, torch.device("meta"))
    ids = _ids(0, b, s, "meta")
    rec = record(model, ids, ids)
    h = model.config.hidden
    for stats in rec.layer_stats:
        assert stats.s_input == b * s * h * 2
        assert stats.s_attn > stats.s_input  # output + log-sum-exp
        assert stats.output == b * s * h * 2


def _allocator_trace(model: nn.Module, ids: torch.Tensor) -> dict:
    from memo import allocator

    for p in model.parameters():
        p.grad = None
    tracker = PhaseTracker(model.embedding, list(model.layers), model.head, listeners=[allocator.set_phase])
    try:
        with allocator.logging() as trace, tracker.iteration():
            model(ids, ids).backward()
    finally:
        tracker.remove()
        allocator.set_phase(None)
    return trace


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("make", [lambda: _HandModel(h=16, n_layers=3), lambda: _GPT(n_layers=2)])
def test_trace_peak_equals_logging_allocator_peak(make) -> None:
    """Same peak live bytes as memo's logging allocator, which sees every real CPU request.

    The allocator also sees kernel scratch (the CPU flash-attention buffer) that the
    dispatch recorder cannot; on these models it never sits on the peak.
    """
    model = make()
    ids = _ids(16, 4, 32)
    trace = record_trace(model, ids, ids)
    real = _allocator_trace(model, ids)
    assert _peak_live(trace["events"]) == _peak_live(real["events"])
    # Skeletal sizes agree phase by phase (scratch is transient).
    from memo.planner.trace import Trace

    ours, theirs = Trace.from_dict(trace), Trace.from_dict(real)
    for phase in _expected_phases(len(model.layers)):
        if phase.startswith("layer.fwd"):
            assert sum(a.size for a in ours.skeletal(phase)) == sum(a.size for a in theirs.skeletal(phase))


def test_profile_api_meta_sizes_exact() -> None:
    from memo.pipeline import profile

    s, b = 65536, 2
    result = profile("gpt-350m", s, b, "bfloat16", "meta", solve=False)
    h = 1024
    assert [st.s_input for st in result.layer_stats] == [b * s * h * 2] * 24
    assert result.trace["meta"]["seq_len"] == s and result.trace["meta"]["micro_batch"] == b
    assert result.trace["meta"]["model"] == "gpt-350m" and result.trace["meta"]["dtype"] == "bfloat16"
    # gpt: 16 units of b·s·h plus the log-sum-exp (2n/h units) and LayerNorm statistics (8/h units).
    total = result.layer_stats[0].total / (b * s * h * 2)
    assert total == pytest.approx(16 + 2 * 16 / h + 8 / h)


_CPU_MACHINE = {"bandwidth_gbps": 1.0, "layer_ms": 0.1, "host_mem_gb": 64.0, "time_limit": 5.0}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("recorder", ["dispatch", "allocator"])
def test_two_pass_plans_from_the_wrapped_model(recorder: str) -> None:
    from memo.planner import Trace, lower_bound, validate_plan, without_unphased

    from memo.runtime import is_wrapped

    model = small_model("gpt", 4)  # four layers, so that memo's runtime offloads some (never the last two)
    result = profile_api(model, 512, 1, device="cpu", recorder=recorder, wrap_pass=True, **_CPU_MACHINE)
    assert result.wrapped and not is_wrapped(model), "pass 2 wraps, and unwraps afterwards"
    assert result.trace["meta"]["alpha"] == result.alpha.alpha == result.plan.alpha
    assert result.trace["meta"]["recorder"] == recorder
    # Offloading moves skeletal tensors off the device: the wrapped iteration needs less.
    plain, wrapped = Trace.from_dict(result.plain_trace), Trace.from_dict(result.trace)
    assert lower_bound(wrapped) < lower_bound(plain)
    validate_plan(result.plan, wrapped)
    # The arena covers phased requests only; the rest is the fallback allocator's.
    phased, left_out, _ = without_unphased(wrapped)
    assert result.plan.lower_bound <= lower_bound(phased) <= lower_bound(wrapped)
    assert result.plan.solver["unphased_left_to_fallback"]["allocations"] == left_out > 0
    # Of what outlives the iteration, the gradients (made in backward) share the arena and the rest
    # (made in forward) is the fallback's (NOTE [Allocations that outlive the iteration]).
    from memo.planner.core import outliving

    from memo.phase_names import is_backward_phase

    grads = [a for a in outliving(phased) if is_backward_phase(a.phase)]
    assert len(grads) >= sum(1 for p in model.parameters() if p.requires_grad) - 1  # a tied one is made once
    assert result.plan.solver["gradients_in_arena"] == {"allocations": len(grads),
                                                         "bytes": sum(a.size for a in grads)}
    left = result.plan.solver["persistent_left_to_fallback"]
    assert left["allocations"] == len(outliving(phased)) - len(grads)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_wrap_pass_switch(monkeypatch) -> None:
    from memo import runtime
    from memo.errors import MemoError

    def refuse(*_args, **_kwargs):
        raise MemoError("memo.wrap: this model cannot be wrapped (test)")

    monkeypatch.setattr(runtime, "wrap", refuse)
    result = profile_api(small_model("gpt", 4), 256, 1, device="cpu", plan=False, **_CPU_MACHINE)
    assert not result.wrapped and result.trace is result.plain_trace
    assert any("could not run the wrapped model" in note for note in result.notes)
    with pytest.raises(MemoError, match="wrap"):
        profile_api(small_model("gpt", 4), 256, 1, device="cpu", plan=False, wrap_pass=True, **_CPU_MACHINE)
    monkeypatch.undo()
    result = profile_api(small_model("gpt", 4), 256, 1, device="cpu", plan=False, wrap_pass=False,
                         **_CPU_MACHINE)
    assert not result.wrapped and not result.notes


def test_checkpointed_layers_keep_nothing_but_their_output() -> None:
    """Under full recomputation a layer saves nothing in forward; the recomputation in backward
    belongs to the backward phase (NOTE [Phase boundaries] in memo/phases.py)."""
    from memo.models import build_model

    model = build_model("tiny", dtype=torch.float32, recompute="full")
    ids = _ids(512, 1, 256)
    rec = record(model, ids, ids)
    for stats in rec.layer_stats:
        assert stats.s_attn == stats.s_others == 0
        assert stats.output == stats.s_input == 256 * 64 * 4
    recomputed = [a for a in rec.recorder.allocations.values() if a.op.startswith("_scaled_dot_product")]
    assert {phase_kind(a.phase) for a in recomputed} == {"layer.fwd", "layer.bwd"}
