"""The peers as strategies: ``offloaded-checkpoint`` (ALST's recipe with PyTorch's APIs) and
``torchtune-offload`` (torchtune's activation offloading with its activation checkpointing).

Each is compared with the plain model it wraps (fp32 on CPU: loss and every gradient within 1e-5),
on memo's GPT and Llama layers and on a Hugging Face Llama with attention dropout; the host bytes
of the offloaded checkpoint are the layer inputs', the tiled MLP replays its dropout masks, its tile
count is ALST's ceil(s / hidden), and ``memo train`` runs both with the losses of ``none``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from memo.cli.main import main
from memo.errors import MemoError
from memo.models import build_model, get_config
from memo.models.layers import LlamaLayer
from memo.runtime.peers import CheckpointedLayers, find_mlp, mlp_tiles, tiled_mlp
from memo.train import (
    STRATEGIES,
    MemoryMeter,
    OffloadedCheckpoint,
    StrategyOptions,
    TorchtuneOffload,
    TrainConfig,
    make_strategy,
    train,
)
from memo.train.plan_checks import TrainRun
from tests.grads import grads_of, random_batch, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

PEERS = (OffloadedCheckpoint, TorchtuneOffload)
TOL = 1e-5


def _run_peer(cls: type, model: nn.Module, loss_fn, ids: torch.Tensor, labels: torch.Tensor,
              seed: int = 0) -> tuple[float, dict[str, torch.Tensor], object]:
    """One forward + backward of ``model`` under the peer ``cls``, measured and closed again."""
    model.zero_grad(set_to_none=True)
    strategy = cls(MemoryMeter())
    strategy.prepare(model, ids, labels, TrainRun(), log=lambda _line: None)
    try:
        torch.manual_seed(seed)
        with strategy.step():
            loss = loss_fn()
            loss.backward()
        strategy.stats = strategy.step_stats()
    finally:
        strategy.close()
    return float(loss.detach()), grads_of(model), strategy


def _assert_close(loss: float, grads: dict[str, torch.Tensor], ref_loss: float,
                  ref: dict[str, torch.Tensor], what: str) -> None:
    assert math.isclose(loss, ref_loss, rel_tol=TOL), (what, loss, ref_loss)
    assert grads.keys() == ref.keys(), what
    worst = max(ref, key=lambda n: rel_err(grads[n], ref[n]))
    assert rel_err(grads[worst], ref[worst]) <= TOL, (what, worst, rel_err(grads[worst], ref[worst]))


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_peers_give_the_plain_models_loss_and_gradients(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, max_seq_len=256) if get_config(name).arch == "gpt" else build_model(name)
    s = 131  # odd, and not a multiple of the MLP tile (hidden 64: ALST's 3 tiles of 44, 44, 43 tokens)
    ids, labels = random_batch(model, 1, s, seed=1)
    loss = model(ids, labels)
    loss.backward()
    ref_loss = float(loss.detach())
    ref = grads_of(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    layer_input_bytes = s * 1 * model.config.hidden * 4  # x: [s, b, h] fp32
    n = model.config.n_layers
    for cls in PEERS:
        loss, grads, strategy = _run_peer(cls, model, lambda: model(ids, labels), ids, labels)
        _assert_close(loss, grads, ref_loss, ref, f"{name} {cls.name}")
        host = strategy.stats["host_pinned_bytes"]
        if cls is OffloadedCheckpoint:
            # Only what checkpoint saves goes to host: every layer's input, all held at the end of forward.
            assert host == n * layer_input_bytes == strategy.host.peak, (host, n, layer_input_bytes)
            assert strategy.host.copies == n
            # Every MLP ran over ceil(131 / 64) = 3 tiles, in forward and in checkpoint's recompute.
            assert strategy.mlp_tiles() == [3] * (2 * n)
        else:
            # torchtune's rule: every saved tensor of >= 1 KiB but parameters; with the layers
            # checkpointed that is their inputs, and the token ids the embedding saved (131 x 8 bytes).
            assert host == n * layer_input_bytes + s * 8, (host, n, layer_input_bytes)
        assert strategy.stats["peak_device_bytes"] > 0
        # close() undid everything: no instance forward or MLP left, the same state dict.
        assert all("forward" not in vars(layer) and "mlp" not in vars(layer) for layer in model.layers)
        assert model.state_dict().keys() == state.keys()
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_peers_on_a_hugging_face_llama_with_attention_dropout() -> None:
    transformers = pytest.importorskip("transformers")
    from memo.adapters.model import model_adapter_for

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False,
                                   attention_dropout=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    adapter = model_adapter_for(model, "test")
    s, b = 71, 2
    ids, labels = random_batch(128, b, s, seed=2)
    torch.manual_seed(5)
    loss = adapter.loss(model, ids, labels)
    loss.backward()
    ref, ref_loss = grads_of(model), float(loss.detach())
    torch.manual_seed(6)
    with torch.no_grad():
        assert float(adapter.loss(model, ids, labels)) != ref_loss  # the dropout is live
    for cls in PEERS:
        loss, grads, strategy = _run_peer(cls, model, lambda: adapter.loss(model, ids, labels), ids, labels,
                                          seed=5)
        _assert_close(loss, grads, ref_loss, ref, f"hf llama {cls.name}")
        if cls is OffloadedCheckpoint:  # hidden_states [b, s, h] of both layers; ceil(71 / 32) = 3 tiles
            assert strategy.stats["host_pinned_bytes"] == 2 * b * s * 32 * 4
            assert strategy.mlp_tiles() == [3] * 4
    layers = model.model.layers
    assert all("forward" not in vars(layer) and "forward" not in vars(layer.mlp) for layer in layers)


def test_the_tiled_mlp_replays_its_dropout_masks() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Dropout(0.3), nn.Linear(48, 16))
    x = torch.randn(37, 2, 16, requires_grad=True)
    grad = torch.randn(37, 2, 16)
    # The reference: the same tiles under autograd, drawing the same masks from the same seed.
    torch.manual_seed(3)
    ref = torch.cat([mlp(t) for t in x.chunk(3, dim=0)], dim=0)
    ref.backward(grad)
    ref_grads = [x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(3)
    out = tiled_mlp(mlp, x, list(mlp.parameters()), token_dim=0, tiles=3)
    assert torch.equal(out, ref)
    torch.manual_seed(99)  # backward draws nothing new: it replays forward's RNG state
    out.backward(grad)
    for got, want in zip([x.grad, *(p.grad for p in mlp.parameters())], ref_grads, strict=True):
        assert rel_err(got, want) <= TOL
    # torch.autograd.grad works too: the parameters' gradients are returned, not written into .grad.
    mlp.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    got = torch.autograd.grad(tiled_mlp(mlp, x, list(mlp.parameters()), 0, 3), [x, *mlp.parameters()], grad)
    assert all(p.grad is None for p in mlp.parameters())
    assert all(rel_err(a, b) <= TOL for a, b in zip(got, ref_grads, strict=True))


def test_the_number_of_tiles_grows_with_the_sequence() -> None:
    assert [mlp_tiles(s, 64) for s in (1, 64, 65, 128, 131, 1000, 4096)] == [1, 1, 2, 2, 3, 16, 64]
    assert mlp_tiles(500_000, 4096) == 123  # ALST's Llama-3.1-8B at 500K tokens
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    counts = []
    for s in (40, 150):
        ids = torch.randint(0, model.config.vocab_size, (1, s))
        _, _, strategy = _run_peer(OffloadedCheckpoint, model, lambda ids=ids: model(ids, ids), ids, ids)
        counts.append(set(strategy.mlp_tiles()))
    assert counts == [{1}, {3}]


def test_a_model_without_an_mlp_to_tile_is_refused() -> None:
    with pytest.raises(MemoError, match="cannot tile the MLP of Linear: it has no registered layer adapter"):
        find_mlp(nn.Linear(4, 4))
    layers = [nn.Linear(4, 4)]
    with pytest.raises(MemoError, match="cannot tile the MLP"):
        CheckpointedLayers(layers, tile_mlp=True)
    assert "forward" not in vars(layers[0])  # refused before anything was replaced
    rank = LlamaLayer(get_config("llama-tiny"), tensor_parallel=2)
    with pytest.raises(MemoError, match="sequence_gather 2.*tensor_parallel=1"):
        find_mlp(rank)


def test_peers_are_memo_train_strategies_under_the_device_budget() -> None:
    assert {"offloaded-checkpoint", "torchtune-offload"} <= set(STRATEGIES)
    for name in ("offloaded-checkpoint", "torchtune-offload"):
        strategy = make_strategy(StrategyOptions(strategy=name, device_mem_gb=0.004))
        assert strategy.device_budget_bytes == 4_000_000
        # 4 MB: tiny's parameters (2 MB) and their gradients do not fit with the step's activations.
        with pytest.raises(MemoError, match="ran out of device memory.*--device-mem-gb"):
            train(TrainConfig(model="tiny", seq_len=64, steps=1), log=lambda _line: None, progress=False,
                  strategy=strategy)
        assert all("forward" not in vars(layer) for layer in strategy.model.layers)


def test_memo_train_runs_the_peers_with_the_losses_of_none(tmp_path, capsys) -> None:
    losses = {}
    for name in ("none", "offloaded-checkpoint", "torchtune-offload"):
        path = tmp_path / f"{name}.json"
        assert main(["train", "--model", "tiny", "--seq-len", "97", "--steps", "3", "--strategy", name,
                     "--device-mem-gb", "0.2", "--report", str(path), "--no-progress"]) == 0
        assert f"memo train: {name}:" in capsys.readouterr().out
        report = json.loads(path.read_text())
        assert report["strategy"] == name and report["alpha"] is None
        assert (report["host_pinned_bytes"] > 0) == (name != "none")
        assert report["peak_device_bytes"] > 0
        losses[name] = [s["loss"] for s in report["steps"]]
    for name in ("offloaded-checkpoint", "torchtune-offload"):
        pairs = zip(losses[name], losses["none"], strict=True)
        assert all(math.isclose(a, b, rel_tol=TOL) for a, b in pairs), (name, losses)
