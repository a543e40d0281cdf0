"""``torch.compile`` of a wrapped model (NOTE [memo under torch.compile] in memo/runtime/compiled.py).

A memo layer's call is opaque to the compiler: the model around the layers compiles, each layer
call is one graph break, the layers run eagerly, and the graphs do not grow with the number of
layers (no per-layer recompiles). Token-wise submodules compiled by the user run compiled inside
memo's tiles. Gradients equal the unwrapped eager model's either way.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import memo
from tests.grads import rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

V = 128


def _llama(layers: int) -> nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                      attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _worst_gradient(model: nn.Module, reference: nn.Module) -> float:
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return max(rel_err(p.grad, q.grad) for p, q in pairs)


def _compiled_steps(layers: int, steps: int = 2, **wrap: object) -> tuple[nn.Module, nn.Module, dict, list]:
    """A wrapped Llama compiled (aot_eager: dynamo and autograd tracing, no code generation) and its
    unwrapped eager twin, ``steps`` backwards on the same batch (gradients accumulate in both); ->
    both models, dynamo's counters, the losses (compiled, eager) of each step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _llama(layers)
    reference = copy.deepcopy(model)
    memo.wrap(model, **wrap)
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(0, V, (2, 96), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        ref = reference(input_ids=ids, labels=ids).loss
        ref.backward()
        losses.append((float(loss), float(ref)))
    seen = {key: dict(value) for key, value in counters.items()}
    return model, reference, seen, losses


def test_a_compiled_wrapped_model_breaks_once_per_layer_call_and_never_recompiles_per_layer() -> None:
    graphs = []
    for layers in (2, 4):
        model, reference, seen, losses = _compiled_steps(layers, alpha=0.5, policy=["memo"] * layers,
                                                         recompute_chunk_tokens=32)
        for compiled_loss, eager_loss in losses:
            assert compiled_loss == pytest.approx(eager_loss, rel=1e-6)
        assert _worst_gradient(model, reference) < 1e-5
        # Every break is at the opaque layer call; none inside memo (its native calls, copy worker,
        # saved-tensor hooks, generator forks were where dynamo broke before).
        reasons = " ".join(seen.get("graph_break", {}))
        for inside in ("memo._C", "CopyWorker", "saved_tensors_hooks", "fork_rng", "get_rng_state"):
            assert inside not in reasons
        assert "_layer_forward" in reasons
        assert not seen.get("recompiles")
        assert memo.runtime.runtime_of(model).stats.layer_backwards == 2 * layers  # memo ran every layer
        graphs.append(seen["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1], f"graphs grew with the layers: {graphs}"


def test_a_submodule_compiled_by_the_user_runs_compiled_inside_memo_s_tiles() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _llama(2)
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.mlp.compile(backend="aot_eager")
    memo.wrap(model, alpha=0.5, policy=["memo", "memo"], recompute_chunk_tokens=32)
    ids = torch.randint(0, V, (2, 96), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] >= 1  # the MLPs were compiled, not skipped
    assert _worst_gradient(model, reference) < 1e-5


def test_without_grad_the_compiler_traces_the_layers_as_unwrapped() -> None:
    """Evaluation and generation run the layers' own forward: no graph break at the layer calls."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _llama(2)
    reference = copy.deepcopy(model).eval()
    memo.wrap(model, alpha=0.5, policy=["memo", "memo"])
    model.eval()
    ids = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = torch.compile(model, backend="aot_eager")(input_ids=ids).logits
        want = reference(input_ids=ids).logits
    assert rel_err(got, want) < 1e-5
    assert "_layer_forward" not in " ".join(counters.get("graph_break", {}))
    assert memo.runtime.runtime_of(model).stats.layer_forwards == 0  # memo's path never ran
